"""主模型（各章的普通路径）：与 transformers 的 logits 对齐、增量解码、参数量、配置与读取。"""

import pytest
import torch

from qwen import Config, Model, State, load_config, load_weights
from qwen.layer import RECURRENT_MAX_T

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


def test_last_only_logits(tiny_model):
    ids = prompt(512, 20)
    with torch.no_grad():
        assert torch.allclose(tiny_model(ids, last=True), tiny_model(ids)[:, -1:], atol=1e-5)


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


def test_parameter_count_08b():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Config()  # 默认值就是 Qwen3.5-0.8B
    with torch.device("meta"):
        ours = Model(cfg)
        ref = Qwen3_5ForCausalLM(
            Qwen3_5TextConfig(
                vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                tie_word_embeddings=True,
            )
        )
    n_ours = sum(p.numel() for p in ours.parameters())  # 共用的嵌入只数一次
    n_ref = sum(p.numel() for p in ref.parameters())
    assert n_ours == n_ref == 752_393_024
    assert cfg.layer_types.count("full_attention") == 6
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [3, 7, 11, 15, 19, 23]


def test_config_flat_and_derived_layer_types():
    d = {"model_type": "qwen3_5_text", "num_hidden_layers": 8, "full_attention_interval": 4, "rope_theta": 5.0}
    cfg = Config.from_dict(d)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.rope_theta == 5.0


def test_nested_config_read(tiny):
    cfg = load_config(tiny[0])
    assert cfg.hidden_size == 128 and cfg.tie_word_embeddings and cfg.rotary_dim == 8
    assert cfg.rope_theta == 10_000_000.0


def test_load_weights_parts(tiny):
    path = tiny[0]
    text = load_weights(path, "model.", torch.bfloat16)
    assert "embed_tokens.weight" in text and not any(k.startswith(("visual", "language_model", "mtp")) for k in text)
    assert text["embed_tokens.weight"].dtype == torch.bfloat16
    assert text["layers.0.linear_attn.A_log"].dtype == torch.float32  # 一维参数保持 float32
    assert text["layers.0.linear_attn.conv1d.weight"].dtype == torch.float32  # 卷积核也是：它在 float32 里参与计算
    assert text["layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16  # 只有矩阵用计算 dtype
    mtp = load_weights(path, "mtp.")
    assert "fc.weight" in mtp and "layers.0.self_attn.q_proj.weight" in mtp and len(mtp) == 15




def test_compare_names_the_broken_layer(tiny, capsys):
    """python -m qwen.compare：原样的模型每一块都在容差之内；改坏第 2 层的一个权重，它指出的第一个坏块正是第 2 层。"""
    from qwen.compare import compare, main

    path, hf = tiny
    assert main(["--model", str(path), "--tokens", "20"]) == 0  # 自己从检查点建 transformers 的模型
    out = capsys.readouterr().out
    assert "每一块的相对差都在容差" in out and "第 2 层" in out
    model = Model.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.layers[2].mlp.down_proj.weight[:, 0] += 0.05  # 改坏一列
    rows, first = compare(model, hf, prompt(model.cfg.vocab_size, 20, seed=5))
    assert [r[0] for r in rows][first].startswith("第 2 层")
    assert all(r[1] <= 1e-4 * max(r[3], 1) for r in rows[:first])  # 之前的块仍然对得上
