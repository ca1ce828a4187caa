"""第 8 章 chunk.py：分块并行形式与逐 token 递推：输出与最终状态相同。"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen.chunk import chunk_gated_delta_rule
from qwen.deltanet import l2norm, recurrent_gated_delta_rule, state_after


def inputs(T, B=2, H=3, Dk=16, Dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, H, T, Dk, generator=g)) * Dk**-0.5
    k = l2norm(torch.randn(B, H, T, Dk, generator=g))
    v = torch.randn(B, H, T, Dv, generator=g)
    decay = -torch.rand(B, H, T, generator=g) * 2.0  # 对数衰减 ≤ 0，有的很强
    beta = torch.rand(B, H, T, generator=g)
    S0 = torch.randn(B, H, Dk, Dv, generator=g)  # 非零初始状态
    return q, k, v, decay, beta, S0


def check_chunked_equals_recurrent(T, seed):
    q, k, v, g, beta, S0 = inputs(T, seed=seed)
    o1, S1, _ = recurrent_gated_delta_rule(q, k, v, g, beta, S0)
    o2, S2, _ = chunk_gated_delta_rule(q, k, v, g, beta, S0)
    assert o1.shape == o2.shape == (2, 3, T, 8)
    assert (o1 - o2).abs().max().item() <= 1e-4
    assert (S1 - S2).abs().max().item() <= 1e-4


@pytest.mark.parametrize("T", [1, 2, 3, 63, 64, 65, 127, 128, 129, 300])
def test_chunked_equals_recurrent(T):
    """块边界两侧（块长 64）与一个长的序列。"""
    check_chunked_equals_recurrent(T, seed=T)


@settings(max_examples=25)
@given(T=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_chunked_equals_recurrent_any_length(T, seed):
    """hypothesis 挑的长度与随机数种子（测试的配置里每次挑同样的例子）。"""
    check_chunked_equals_recurrent(T, seed)


@pytest.mark.parametrize("rule", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
@pytest.mark.parametrize("T", [1, 2, 5, 9, 64])
def test_state_after_every_position(rule, T):
    """两种形式记下的量（递推：每个位置之后的 S；分块：(S₀, G, K, U)）都能给出每个位置之后的记忆：
    与只喂前 t 个 token 的最终状态相同。"""
    q, k, v, g, beta, S0 = inputs(T, seed=T)
    o, S, parts = rule(q, k, v, g, beta, S0, keep_all=True)
    for t in range(1, T + 1):
        _, S_t, _ = recurrent_gated_delta_rule(q[:, :, :t], k[:, :, :t], v[:, :, :t], g[:, :, :t], beta[:, :, :t], S0)
        assert (state_after(parts, t - 1) - S_t).abs().max().item() <= 1e-4
    assert (state_after(parts, T - 1) - S).abs().max().item() <= 1e-4
    if rule is chunk_gated_delta_rule:  # 就地重建：结果一样，写进 S₀ 的内存（提交时旧的 S₀ 不再要）
        expected, S0_memory = state_after(parts, T // 2), parts[0].data_ptr()
        got = state_after(parts, T // 2, in_place=True)
        assert torch.equal(got, expected) and got.data_ptr() == S0_memory


def test_chunk_keep_all_needs_one_chunk():
    q, k, v, g, beta, S0 = inputs(65)
    with pytest.raises(ValueError, match="不超过一块"):
        chunk_gated_delta_rule(q, k, v, g, beta, S0, keep_all=True)


def test_chunked_is_differentiable():
    q, k, v, g, beta, S0 = inputs(70)
    v.requires_grad_(True)
    o, S, _ = chunk_gated_delta_rule(q, k, v, g, beta, S0)
    (o.sum() + S.sum()).backward()
    assert v.grad is not None and torch.isfinite(v.grad).all()


def test_recurrent_is_differentiable():
    """逐 token 递推也能求导（每一步新建 S）：梯度与分块形式的相同。"""
    q, k, v, g, beta, S0 = inputs(3)
    grads = []
    for rule in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        kk, vv = k.clone().requires_grad_(True), v.clone().requires_grad_(True)
        o, S, _ = rule(q, kk, vv, g, beta, S0.clone())
        (o.sum() + S.sum()).backward()
        grads.append(torch.cat([kk.grad.flatten(), vv.grad.flatten()]))
    assert (grads[0] - grads[1]).abs().max().item() <= 1e-4
