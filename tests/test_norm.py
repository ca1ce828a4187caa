"""第 3 章 norm.py：零中心的 RMSNorm（乘 1 + w）与 DeltaNet 的门控 RMSNorm，与 transformers 的两种归一化相同。"""

import torch


def test_rms_norm_equals_the_reference(tiny, tiny_model):
    x = torch.randn(2, 5, tiny_model.cfg.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    for ours, theirs in [(tiny_model.layers[0].input_layernorm, tiny[1].model.layers[0].input_layernorm),
                         (tiny_model.norm, tiny[1].model.norm)]:
        assert torch.allclose(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(tiny_model.norm.weight, torch.zeros(())), "权重是随机的：零中心（1 + w）真的被检查到了"


def test_gated_rms_norm_equals_the_reference(tiny, tiny_model):
    ours, theirs = tiny_model.layers[0].linear_attn.norm, tiny[1].model.layers[0].linear_attn.norm
    g = torch.Generator().manual_seed(1)
    o, z = (torch.randn(1, 4, 2, ours.weight.shape[0], generator=g) for _ in range(2))  # [B, T, Hv, Dv]：逐头
    assert torch.allclose(ours(o, z), theirs(o, z), rtol=1e-6, atol=1e-6)
