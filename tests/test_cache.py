"""第 11 章 cache.py：一段一段地读（增量解码）与一次读完相同，长的一段接在已读的之后走分块形式，状态的形状。"""

import pytest
import torch

from qwen import State
from qwen.layer import RECURRENT_MAX_T

from checkpoints import prompt


@pytest.mark.parametrize("split", [0, 1, 5, 63, 64, 70])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_equals_one_shot(tiny_model, split, step):
    """预填充一部分，再按 1、2、3 个 token 一次喂完剩下的：logits 与一次性前向相同。"""
    T = 80
    ids = prompt(512, T, seed=split * 10 + step)
    with torch.no_grad():
        full = tiny_model(ids)
        state = State(tiny_model)
        parts = [tiny_model(ids[:, :split], state)] if split else []
        for i in range(split, T, step):
            parts.append(tiny_model(ids[:, i : i + step], state))
    assert state.pos == T
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-4


def test_long_chunk_after_prefill_uses_chunked_form(tiny_model):
    """提示词之后再来一大段（> RECURRENT_MAX_T，走分块形式，带非零初始状态与卷积窗口）。"""
    ids = prompt(512, 150, seed=7)
    with torch.no_grad():
        full = tiny_model(ids)
        state = State(tiny_model)
        a = tiny_model(ids[:, :37], state)
        b = tiny_model(ids[:, 37 : 37 + RECURRENT_MAX_T + 1], state)
        c = tiny_model(ids[:, 37 + RECURRENT_MAX_T + 1 :], state)
    assert (torch.cat([a, b, c], dim=1) - full).abs().max().item() <= 1e-4


def test_state_shapes(tiny_model):
    cfg = tiny_model.cfg
    state = State(tiny_model)
    with torch.no_grad():
        tiny_model(prompt(512, 10), state)
        tiny_model(prompt(512, 1), state)
    for t, s in zip(cfg.layer_types, state.layers):
        if t == "full_attention":
            assert s.k.shape == (1, cfg.num_key_value_heads, 11, cfg.head_dim) == s.v.shape
        else:
            conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
            assert s.conv.shape == (1, cfg.linear_conv_kernel_dim - 1, conv_dim) and s.conv.dtype == torch.float32
            assert s.S.shape == (1, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            assert s.S.dtype == torch.float32
