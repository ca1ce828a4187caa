"""第 9 章 layer.py：解码层（前置归一化的两个残差块：混合器与 MLP），两种混合器的层都与 transformers 的解码层相同。"""

import pytest
import torch

from qwen.rope import rope_tables


@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_decoder_layer_equals_the_reference(tiny, tiny_model, kind):
    i = tiny_model.cfg.layer_types.index(kind)
    x = torch.randn(1, 6, tiny_model.cfg.hidden_size, generator=torch.Generator().manual_seed(i))
    hf = tiny[1].model
    ref = hf.layers[i](x, position_embeddings=hf.rotary_emb(x, torch.arange(6)[None]))
    got = tiny_model.layers[i](x, *rope_tables(tiny_model.cfg, torch.arange(6)))
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
