"""第 14 章的承诺在每条快路径上逐位成立：验证 k 个草稿时每个位置的 logits 与逐个解码这几个 token 时的 torch.equal，
提交之后的状态也一样；所以 bfloat16、int8 与 int4 下投机解码的贪心输出与普通贪心逐 token 相同。

检查点的贪心续写要多样（写回残差流的投影尺度为 1）：续写总在重复一两个 token 时，“逐 token 相同”证明不了什么。
"""

import pytest
import torch

from qwen import State
from qwen.bench import OracleDrafter
from qwen.cache import AttentionState, commit, copy_state, keep_history
from qwen.fast import load as load_fast, warm_up
from qwen.fast.layers import GROUPED_FROM
from qwen.fast.linear import can_pack
from qwen.mtp import speculate
from qwen.sample import generate

from checkpoints import WIDTHS_08B, make_checkpoint, prompt

# 0.8B 的全部宽度，一个 DeltaNet 层加一个注意力层就够：每种层、每种矩阵的形状都有了，编译的图小一些
TWO_LAYERS = WIDTHS_08B | dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


@pytest.fixture(scope="module")
def lively08b(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("lively08b"), seed=4, out_scale=1.0, **TWO_LAYERS)[0]


PATHS = {  # 名字 → (检查点, qwen.fast.load 的参数)；默认：分块布局与 C++ 的 matvec，不编译图
    "packed-float32": ("lively", dict(dtype=torch.float32, layout="packed")),
    "default-float32": ("lively", dict(dtype=torch.float32)),
    "compiled-float32": ("lively", dict(dtype=torch.float32, layout="graphs")),
    "packed-bfloat16": ("lively08b", dict(dtype=torch.bfloat16, layout="packed")),
    "default-bfloat16": ("lively08b", dict(dtype=torch.bfloat16)),
    "compiled-bfloat16": ("lively08b", dict(dtype=torch.bfloat16, layout="graphs")),
    "int8": ("lively08b", dict(dtype=torch.bfloat16, quantize="int8")),
    "int4": ("lively08b", dict(dtype=torch.bfloat16, quantize="int4")),
    "int8-float32": ("lively", dict(dtype=torch.float32, quantize="int8")),
    "int4-float32": ("lively", dict(dtype=torch.float32, quantize="int4")),
    "compiled-int8": ("lively08b", dict(dtype=torch.bfloat16, layout="graphs", quantize="int8")),
    "compiled-int4": ("lively08b", dict(dtype=torch.bfloat16, layout="graphs", quantize="int4")),
    "moe-float32": ("lively_moe", dict(dtype=torch.float32)),  # 专家混合：256 个专家、每个 token 8 个
    "moe-packed-float32": ("lively_moe", dict(dtype=torch.float32, layout="packed")),
    "moe-bfloat16": ("lively_moe", dict(dtype=torch.bfloat16)),
    "moe-int8": ("lively_moe", dict(dtype=torch.bfloat16, quantize="int8")),
    "moe-int4": ("lively_moe", dict(dtype=torch.bfloat16, quantize="int4")),
}
MODELS = {}  # 同一条路径在本文件的几个测试里共用一个模型（编译的图只编译一次）


def load(request, name):
    if name not in MODELS:
        which, kw = PATHS[name]
        path = request.getfixturevalue(which)
        path = path[0] if isinstance(path, tuple) else path
        if kw["dtype"] == torch.bfloat16 and kw.get("layout") == "packed" and not can_pack(torch.empty(0).bfloat16()):
            pytest.skip("这台机器的 oneDNN 不支持 bfloat16：没有打包的 bfloat16 路径")
        MODELS[name] = load_fast(path, draft_vocab=300, **kw)
    return MODELS[name]


@pytest.mark.parametrize("name", PATHS)
def test_verified_rows_are_decoded_rows(request, name):
    """读完 254 个 token 之后，一次验证 [t₀, d₁…d_k]（k = 1…4）与逐个解码它们：每个位置的 logits torch.equal
    （缓存长度跨过 GROUPED_FROM：注意力的两种算法都用到）；提交全部之后 DeltaNet 的记忆、卷积窗口与 KV 缓存也相同。"""
    model, _ = load(request, name)
    V = model.cfg.vocab_size
    P = GROUPED_FROM - 2
    with torch.inference_mode():
        state = State(model)
        model(prompt(V, P, seed=1), state, last=True)
        feed = prompt(V, 5, seed=2)
        for k in range(1, 5):
            alone = copy_state(state)
            decoded = torch.cat([model(feed[:, i : i + 1], alone) for i in range(k + 1)], 1)
            together = copy_state(state)
            keep_history(together)
            verified = model(feed[:, : k + 1], together)
            assert torch.equal(verified, decoded), (k, (verified - decoded).abs().max().item())
            commit(together, P, k + 1)
            for a, b in zip(alone.layers, together.layers):
                if isinstance(a, AttentionState):
                    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
                else:
                    assert torch.equal(a.S, b.S) and torch.equal(a.conv, b.conv)


@pytest.mark.parametrize("name", PATHS)
def test_speculation_with_accepted_drafts_equals_greedy(request, name):
    """每条路径（布局 × dtype × 权重格式，graphs 与 int8/int4 的组合、float32 的模型上的 int8/int4 也在内）：投机解码（固定
    k = 1、2、3 与自动挑 k）与同一模型的普通贪心逐 token 相同，48 个 token。草稿由“知道答案”的草稿器给出（以 0.6 的概率对），
    接受与拒绝都常发生（hits > 0：被接受的草稿的提交真的走到了）；warm_up 之后不再编译任何图。"""
    from torch._dynamo.utils import counters

    model, mtp = load(request, name)
    warm_up(model, mtp, calibrate=False)
    mtp.round_cost = [1 + 0.1 * k for k in range(len(mtp.round_cost))]  # 自动挑 k 也要起草：4 层的 tiny 上初值说起草不划算
    before = counters["stats"]["unique_graphs"]
    for seed in (1,):
        ids = prompt(model.cfg.vocab_size, 20, seed=seed)
        plain = generate(model, ids, 48)
        assert len(set(plain)) >= 12  # 续写是多样的
        for k in (1, 2, 3, None):
            drafter = OracleDrafter(mtp, ids[0].tolist() + plain, 0.6, seed=seed)
            r = speculate(model, drafter, ids, 48, draft_tokens=k)
            assert r.tokens == plain, k
            assert r.drafted > r.hits > 0
    assert counters["stats"]["unique_graphs"] == before


def synthetic_image(model, ids, seed: int = 0):
    """不带视觉塔的检查点上的一张“图”：第 15 章的 Images，塔的输出换成随机向量（与嵌入同一尺度），网格 8×12 块 = 24 个 token。
    占位 id 取词表里的 7。测的是图之后的一切（三维位置、shift、验证与提交），与塔本身无关（塔见 test_vision.py）。"""
    from qwen.vision import Images, VisionConfig

    cfg = VisionConfig(image_token_id=7, out_hidden_size=model.cfg.hidden_size)
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(24, model.cfg.hidden_size, generator=gen) / model.cfg.hidden_size**0.5
    images = Images(embeds, [(1, 8, 12)], cfg, ["synthetic"])
    return images.expand(torch.cat([ids[:, :6], torch.tensor([[7]]), ids[:, 6:]], 1)), images


@pytest.mark.parametrize("name", ["default-bfloat16", "compiled-bfloat16", "int8", "int4"])
def test_speculation_with_an_image_equals_greedy(request, name):
    """提示词里有一张图（图之后的位置从 max + 1 接着数，State.shift < 0）：每条快路径上投机解码与普通贪心逐 token 相同，
    草稿既有接受也有拒绝；编译的图里 RoPE 的起点是 pos + shift（0 维张量），不为它重新编译。"""
    from torch._dynamo.utils import counters

    model, mtp = load(request, name)
    warm_up(model, mtp, calibrate=False)
    before = counters["stats"]["unique_graphs"]
    ids, images = synthetic_image(model, prompt(model.cfg.vocab_size, 20, seed=5))
    state = State(model)
    plain = generate(model, ids, 40, images=images, state=state)
    assert state.shift == 6 - 24 and len(set(plain)) >= 10  # 图占 24 个 token、6 个位置（合并后的网格 4×6 的 max）
    for k in (1, 3):
        drafter = OracleDrafter(mtp, ids[0].tolist() + plain, 0.6, seed=k)
        r = speculate(model, drafter, ids, 40, draft_tokens=k, images=images)
        assert r.tokens == plain, k
        assert r.drafted > r.hits > 0
        assert r.state.shift == state.shift
    assert counters["stats"]["unique_graphs"] == before
