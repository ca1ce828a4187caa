"""第 13 章 batch.py：左填充的批处理，每行与它单独运行逐 token 相同（快路径上逐位相同），各行按自己的停止符停下。"""

import pytest
import torch

from qwen.batch import generate_batch
from qwen.fast import load_model
from qwen.sample import generate


def ids_of(T, seed=0, vocab=512):
    return torch.randint(3, vocab, (1, T), generator=torch.Generator().manual_seed(seed))


BATCH_LAYOUTS = {"bf16": {}, "packed": dict(layout="packed"), "int8": dict(quantize="int8"), "int4": dict(quantize="int4")}


@pytest.mark.parametrize("layout", BATCH_LAYOUTS)
def test_batch_rows_equal_separate_runs_bit_for_bit(lively, layout):
    """快路径上（bfloat16 的默认分块布局、oneDNN 打包的布局、int8、int4）批处理的每一行与单独生成它逐位相同：贪心的，与带种子
    采样的（每行一个以 seed 起头的随机数发生器）。提示词长短不一（1～100 个 token，左填充；100 个的超过一层能拼的 32 个），
    续写多样（每行至少 5 种 token），bfloat16 下差一个舍入就会换掉 token——左填充着算的时候就是这样。"""
    model = load_model(lively[0], dtype=torch.bfloat16, **BATCH_LAYOUTS[layout])
    prompts = [ids_of(n, seed=n)[0] for n in (1, 7, 40, 100, 23)]
    alone = [generate(model, p[None], 24) for p in prompts]
    assert all(len(set(out)) >= 5 for out in alone), alone
    assert generate_batch(model, prompts, 24) == alone
    kw = dict(temperature=0.9, top_p=0.95, seed=3, repetition_penalty=1.2)
    assert generate_batch(model, prompts[1:4], 16, **kw) == [generate(model, p[None], 16, **kw) for p in prompts[1:4]]


def test_batch_equals_separate_runs_on_the_plain_model(lively_model):
    """各章的普通模型（float32，左填充）：每行与单独运行只差舍入，float32 的续写 10 个 token 不受影响。"""
    prompts = [ids_of(n, seed=n)[0] for n in (1, 7, 64, 100)]
    assert generate_batch(lively_model, prompts, 10) == [generate(lively_model, p[None], 10) for p in prompts]


def test_batch_rows_stop_on_their_own(model):
    prompts = [ids_of(n, seed=10 + n)[0] for n in (3, 50, 20)]
    alone = [generate(model, p[None], 12) for p in prompts]
    # 停止符：第 0 行较早出现、又不让所有行都在 3 步内停下的一个 token
    stop = next(t for t in alone[0][1:] if any(t not in out[:4] for out in alone[1:]))
    expected = []
    for out in alone:
        cut = out.index(stop) + 1 if stop in out else len(out)
        expected.append(out[:cut])
    got = generate_batch(model, prompts, 12, stop=[stop])
    assert got == expected
    n0 = alone[0].index(stop) + 1
    assert len(got[0]) == n0 < 12 and any(len(g) > 4 for g in got[1:])


def test_batch_errors(model):
    with pytest.raises(ValueError, match="空"):
        generate_batch(model, [[1, 2], []], 3)
    with pytest.raises(ValueError, match="top_k"):
        generate_batch(model, [[1, 2]], 3, temperature=1.0, top_k=0)
