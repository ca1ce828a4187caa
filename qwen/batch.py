"""第 13 章附 · 批处理：几个长短不一的提示词一起生成。

解码一个 token 时，CPU 的时间几乎全花在把权重从内存读进来；一次算 4 行和算 1 行
读的是同样的权重，所以批处理几乎白送吞吐。难点是长度不一：我们在左边补齐（左填充），
让所有行的最后一个 token 对齐，之后每步都是整齐的 [B, 1]。

补进去的位置必须“不存在”：
- 注意力：掩码让真实 token 看不见填充位置（cache.State.valid）；
- DeltaNet：填充位置的输入置零，零向量既不写进记忆 S，也只在卷积窗口里留下初始的 0；
- RoPE：每行的位置从它自己的第一个真实 token 数起（State.pad）。
于是每行在数学上与单独生成它时相同；浮点上填充改变了矩阵的形状与求和的长度，普通模型上只差舍入。附录的快路径
不算填充的张量（每行照单独运行那样算），每行与单独生成逐位相同。带种子采样时每行各有一个以 seed 起头的随机数发生器：
一行的结果与用同一个 seed 单独生成它相同。每行命中停止符就停，其余行继续。
"""

import torch

from .cache import State
from .sample import Penalty, Sampling, Token, choose, stop_ids


@torch.inference_mode()
def generate_batch(model, prompts, max_new_tokens=100, stop=(), sampling: Sampling | None = None, images=None, **settings):
    """prompts：若干个 token id 列表（或一维张量）。返回每行的新 token 列表。每行各罚各的重复。
    images：每行的图（第 15 章的 ImageRows：每行一个 Images 或 None），或不给。"""
    s = Sampling.of(sampling, **settings)
    Sampling.check("max_new_tokens", max_new_tokens)
    if not len(prompts):
        raise ValueError("prompts 不能为空，每个提示词至少要有一个 token")
    prompts = [model.check_ids(p, None).flatten() for p in prompts]  # 每个提示词照常检查（空的、非整数的都报错）
    B, L = len(prompts), max(len(p) for p in prompts)
    device = model.norm.weight.device
    ids = torch.zeros(B, L, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = p  # 左填充：填充值是多少都行，反正看不见
        valid[b, L - len(p):] = True
    ids, valid = ids.to(device), valid.to(device)

    outs = [[] for _ in range(B)]
    if max_new_tokens == 0:
        return outs
    stop = stop_ids(stop)
    gens = [s.generator(device) for _ in range(B)]  # 每行一个：与单独生成时抽到同样的随机数
    state = State(model, valid)
    penalty = Penalty(prompts, model.cfg.vocab_size, s)  # 只算真实 token，不算填充
    if images is not None and not hasattr(images, "inputs"):
        raise ValueError(f"images 应是第 15 章的 ImageRows([每行一个 Images 或 None])，收到 {type(images).__name__}")
    inputs = images.inputs(model, ids, state) if images is not None else {}  # 图的向量与三维位置
    logits = model(ids, state, last=True, **inputs)[:, -1]  # [B, V]
    done = [False] * B
    for i in range(max_new_tokens):
        scores = penalty.mask(logits)  # [B, V]
        tokens = torch.tensor([choose(scores[b], s.temperature, s.top_k, s.top_p, g)[0] for b, g in enumerate(gens)])  # [B]
        for b, t in enumerate(tokens.tolist()):
            if not done[b]:
                outs[b].append(t if s.logprobs is None else Token(t, logits[b], s.logprobs))
                done[b] = t in stop
        if all(done) or i == max_new_tokens - 1:
            break
        penalty.add(tokens)
        logits = model(tokens[:, None].to(device), state)[:, -1]  # 已停的行照算，结果丢弃：不影响别的行
    return outs
