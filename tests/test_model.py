"""第 10 章 model.py：整个模型（各章的普通路径）的 logits 与 transformers 对齐，批处理的行、只要最后一个位置的 logits。"""

import pytest
import torch

from qwen import Model

from checkpoints import prompt

LENGTHS = [1, 2, 63, 64, 65, 130]


@pytest.mark.parametrize("T", LENGTHS)
def test_logits_match_transformers_tiny(tiny, tiny_model, T):
    path, hf = tiny
    assert tiny_model.cfg.linear_num_value_heads > tiny_model.cfg.linear_num_key_heads
    ids = prompt(tiny_model.cfg.vocab_size, T, seed=T)
    with torch.no_grad():
        ref = hf(ids).logits
        ours = tiny_model(ids)
    assert ours.shape == ref.shape == (1, T, tiny_model.cfg.vocab_size)
    assert ref.abs().max() > 1.0  # logits 在 1 的量级，不是几乎全零
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("T", LENGTHS)
def test_logits_match_transformers_08b_widths(widths08b, T):
    path, hf = widths08b
    model = _w08b_model(path)
    cfg = model.cfg
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (1024, 8, 2, 256)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 16, 128)
    assert cfg.intermediate_size == 3584
    ids = prompt(cfg.vocab_size, T, seed=100 + T)
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model(ids)
    assert (ours - ref).abs().max().item() <= 1e-4


_cache = {}


def _w08b_model(path):
    if path not in _cache:
        _cache[path] = Model.from_pretrained(path, dtype=torch.float32)
    return _cache[path]


def test_batch_rows_match_transformers(tiny, tiny_model):
    path, hf = tiny
    ids = torch.cat([prompt(512, 70, seed=s) for s in range(3)])
    with torch.no_grad():
        assert (tiny_model(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_last_only_logits(tiny_model):
    ids = prompt(512, 20)
    with torch.no_grad():
        assert torch.allclose(tiny_model(ids, last=True), tiny_model(ids)[:, -1:], atol=1e-5)
