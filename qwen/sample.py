"""第 12 章 · 采样：从 logits 到下一个 token，一个接一个地生成。

生成就是循环：预填充提示词（分块形式一次算完），取最后一个位置的 logits 选出下一个 token，
再把它喂回模型（逐 token 递推），直到停止符或达到 max_new_tokens。

怎么“选”：
- temperature = 0：贪心，取 argmax。确定性，投机解码的第 14 章以它为准。
- temperature > 0：按 softmax(logits / T) 抽样，T 越小越保守。
- top_k：只在分数最高的 k 个词里抽；top_p（核采样）：只在累计概率刚达到 p 的最小词集里抽。
  两者都是先截断、再把剩下的概率重新归一化。
"""

import torch

from .cache import State


def check_sampling(max_new_tokens=0, temperature=0.0, top_k=None, top_p=None) -> None:
    """采样参数不合法时给出清楚的 ValueError。"""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens 应为非负整数，收到 {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature 不能为负，收到 {temperature}（0 表示贪心）")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k 至少为 1，收到 {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p 应在 (0, 1] 内，收到 {top_p}")


def probabilities(logits: torch.Tensor, temperature: float, top_k=None, top_p=None) -> torch.Tensor:
    """logits [..., V] → 截断并重新归一化后的概率 [..., V]（temperature > 0）。"""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # 第 k 大的分数
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # 排在它前面的词的累计概率
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # 前面已经够 p 了，它就不要了
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def pick(logits: torch.Tensor, temperature=0.0, top_k=None, top_p=None, generator=None) -> torch.Tensor:
    """logits [B, V] → 下一个 token [B]。"""
    if temperature == 0:
        return logits.argmax(-1)
    probs = probabilities(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def choose(logits: torch.Tensor, temperature=0.0, top_k=None, top_p=None, generator=None):
    """一个位置的 logits [V] → (token, 抽样用的概率分布；贪心时为 None)。第 14 章的投机解码要这个分布。"""
    if temperature == 0:
        return int(logits.argmax()), None
    p = probabilities(logits, temperature, top_k, top_p)
    return int(torch.multinomial(p, 1, generator=generator)), p


def make_generator(seed, device="cpu"):
    return None if seed is None else torch.Generator(device).manual_seed(seed)


@torch.inference_mode()
def stream(model, ids, max_new_tokens=100, stop=(), temperature=0.0, top_k=None, top_p=None, seed=None):
    """逐个产出新 token 的 id（int）。命中停止符时产出它，然后结束。"""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if max_new_tokens == 0:
        return
    ids = model.check_ids(ids, None)
    if ids.shape[0] != 1:
        raise ValueError("stream/generate 一次处理一个提示词；多个提示词请用 qwen.batch.generate_batch")
    stop = set(stop)
    gen = make_generator(seed, ids.device)
    state = State(model)
    logits = model(ids, state, last=True)[:, -1]  # 预填充：只要最后一个位置的 logits
    for i in range(max_new_tokens):
        token = pick(logits, temperature, top_k, top_p, gen)  # [1]
        t = int(token)
        yield t
        if t in stop or i == max_new_tokens - 1:
            return
        logits = model(token[:, None], state)[:, -1]  # 解码：一次一个 token


def generate(model, ids, max_new_tokens=100, stop=(), temperature=0.0, top_k=None, top_p=None, seed=None) -> list:
    """生成并返回新 token 的列表（不含提示词；命中停止符时它是最后一个）。"""
    return list(stream(model, ids, max_new_tokens, stop, temperature, top_k, top_p, seed))
