"""第 6 章 attention.py：门控注意力（GQA、q/k 归一化、部分 RoPE、输出门），一次读完与 transformers 的 self_attn 相同；
带 KV 缓存一段一段地读，与一次读完相同。"""

import pytest
import torch

from qwen.attention import AttentionState
from qwen.rope import rope_tables


def layer_pair(tiny, tiny_model):
    i = next(i for i, t in enumerate(tiny_model.cfg.layer_types) if t == "full_attention")
    return tiny_model.layers[i].self_attn, tiny[1].model.layers[i].self_attn


@pytest.mark.parametrize("T", [1, 7])
def test_attention_equals_the_reference(tiny, tiny_model, T):
    ours, theirs = layer_pair(tiny, tiny_model)
    x = torch.randn(1, T, tiny_model.cfg.hidden_size, generator=torch.Generator().manual_seed(T))
    cos, sin = rope_tables(tiny_model.cfg, torch.arange(T))
    ref = theirs(x, tiny[1].model.rotary_emb(x, torch.arange(T)[None]), None)[0]
    got = ours(x, cos, sin)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_attention_with_a_cache_equals_reading_at_once(tiny, tiny_model):
    ours, _ = layer_pair(tiny, tiny_model)
    x = torch.randn(1, 9, tiny_model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = ours(x, *rope_tables(tiny_model.cfg, torch.arange(9)))
    state, parts = AttentionState(), []
    for a, b in [(0, 4), (4, 5), (5, 9)]:  # 4 个、1 个、4 个：每段只看缓存里它之前的位置
        parts.append(ours(x[:, a:b], *rope_tables(tiny_model.cfg, torch.arange(a, b)), state))
    assert state.length == 9 and torch.allclose(torch.cat(parts, 1), whole, atol=1e-5)
