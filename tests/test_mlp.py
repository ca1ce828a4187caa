"""第 4 章 mlp.py：SwiGLU 前馈网络 down(silu(gate(x)) · up(x))，与 transformers 的 MLP 相同。"""

import torch


def test_mlp_equals_the_reference(tiny, tiny_model):
    x = torch.randn(1, 6, tiny_model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ours, theirs = tiny_model.layers[1].mlp(x), tiny[1].model.layers[1].mlp(x)
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
