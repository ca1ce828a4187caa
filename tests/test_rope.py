"""第 5 章 rope.py：RoPE 的 cos/sin 表（只转前 rotary_dim 维）与 transformers 的 rotary_emb 相同，转过的 q、k 也相同。"""

import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

from qwen.rope import apply_rope, rope_tables


def test_rope_tables_and_rotation_equal_the_reference(tiny, tiny_model):
    cfg, positions = tiny_model.cfg, torch.tensor([0, 1, 2, 63, 64, 4095])
    cos, sin = rope_tables(cfg, positions)  # [T, rotary_dim]
    ref_cos, ref_sin = tiny[1].model.rotary_emb(torch.zeros(1, 1), positions[None])
    assert torch.allclose(cos, ref_cos[0], atol=1e-6) and torch.allclose(sin, ref_sin[0], atol=1e-6)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, len(positions), cfg.head_dim, generator=g) for _ in range(2))  # [B, H, T, D]
    theirs = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip((apply_rope(q, cos, sin), apply_rope(k, cos, sin)), theirs))
    assert torch.equal(apply_rope(q, cos, sin)[..., cos.shape[-1]:], q[..., cos.shape[-1]:])  # 后面的维度不转
