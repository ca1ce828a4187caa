"""第 1 章 weights.py：配置（扁平的与嵌套的）、按名字读出各部分的权重、0.8B 的参数量。"""

import torch

from qwen import Config, Model, load_config, load_weights


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
