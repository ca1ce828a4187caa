"""基准测试模块：随机检查点的布局、带宽与字节数的算法、一次完整的小规模运行。"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwen import Config, load_config
from qwen.bench import bytes_per_token, ideal, merge_rounds, random_checkpoint, report
from qwen.fast import load, load_model
from qwen.weights import safetensors_files


def test_random_checkpoint_has_the_released_layout(tmp_path):
    cfg = Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
                 linear_key_head_dim=16, linear_value_head_dim=16)
    path = random_checkpoint(tmp_path / "ck", cfg)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["text_config"]["model_type"] == "qwen3_5_text"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert "model.language_model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert any(n.startswith("mtp.layers.0.") for n in names) and len(safetensors_files(path)) == 1
    assert load_config(path) == cfg
    model, mtp = load(path, layout="packed", dtype=torch.float32)
    assert mtp is not None
    with torch.no_grad():
        layer = model.layers[0].linear_attn
        assert (layer.A_log.exp() >= 1).all() and layer.dt_bias.abs().sum() > 0
        ids = torch.randint(0, 300, (1, 12))
        greedy = model(ids).argmax(-1)
    assert torch.equal(greedy[0, 1:], ids[0, 1:])  # 嵌入主导残差流：贪心续写就是重复当前 token，余量很大


def test_bytes_per_token_from_the_shapes(tiny):
    """解码一个 token 读的字节数，由配置里的形状独立算出：每个矩阵一遍（共用的嵌入与输出头算一次），嵌入表只查一行，
    一维参数与卷积核是 float32；与布局无关（打包的、分块的、普通的都一样）。"""
    c = load_config(tiny[0])
    h, qkv = c.hidden_size, 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    v = c.linear_num_value_heads * c.linear_value_head_dim
    deltanet = h * (qkv + v + 2 * c.linear_num_value_heads) + v * h  # in_proj_qkv、z、b、a 与 out_proj
    attention = h * 2 * c.num_attention_heads * c.head_dim + 2 * h * c.num_key_value_heads * c.head_dim + c.num_attention_heads * c.head_dim * h
    matrices = 3 * deltanet + attention + c.num_hidden_layers * 3 * h * c.intermediate_size + c.vocab_size * h
    small = 3 * (qkv * c.linear_conv_kernel_dim + 2 * c.linear_num_value_heads + c.linear_value_head_dim)  # 卷积核、A_log、dt_bias、门控 norm
    small += 2 * c.head_dim + c.num_hidden_layers * 2 * h + h  # q_norm、k_norm；每层两个 norm；最后的 norm
    for dtype, layout in ((torch.bfloat16, "packed"), (torch.float32, "plain"), (torch.float32, "graphs")):
        model = load_model(tiny[0], layout=layout, dtype=dtype)
        assert bytes_per_token(model) == (matrices + h) * dtype.itemsize + 4 * small


def test_an_moe_random_checkpoint_and_the_bytes_a_token_reads(tmp_path):
    """--size 35B-A3B 的随机检查点是专家混合的发布布局（model_type qwen3_5_moe，堆叠的专家，输出头不共用）；一个 token
    读的字节只算它的 k 个专家：由配置里的形状独立算出（这里窄：hidden 64、16 个专家里用 4 个）。"""
    from qwen.tools.checkpoint import SIZES

    c = Config(**{**SIZES["35B-A3B"], "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
                  "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                  "linear_value_head_dim": 16, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48})
    path = random_checkpoint(tmp_path / "moe", c)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and config["text_config"]["num_experts"] == 16
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in json.loads(
        (path / "model.safetensors.index.json").read_text())["weight_map"]
    h, qkv = c.hidden_size, 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    v = c.linear_num_value_heads * c.linear_value_head_dim
    deltanet = h * (qkv + v + 2 * c.linear_num_value_heads) + v * h
    attention = h * 2 * c.num_attention_heads * c.head_dim + 2 * h * c.num_key_value_heads * c.head_dim + c.num_attention_heads * c.head_dim * h
    ffn = (c.num_experts + 1) * h + 3 * h * c.shared_expert_intermediate_size + c.num_experts_per_tok * 3 * h * c.moe_intermediate_size
    matrices = 3 * deltanet + attention + c.num_hidden_layers * ffn + c.vocab_size * h
    small = 3 * (qkv * c.linear_conv_kernel_dim + 2 * c.linear_num_value_heads + c.linear_value_head_dim)
    small += 2 * c.head_dim + c.num_hidden_layers * 2 * h + h
    for dtype, layout in ((torch.bfloat16, "auto"), (torch.float32, "plain")):  # 快路径的专家与各章堆叠的专家
        assert bytes_per_token(load_model(path, layout=layout, dtype=dtype)) == (matrices + h) * dtype.itemsize + 4 * small


def test_merge_rounds_takes_the_fastest_decode_with_its_own_bandwidth():
    a = dict(decode_tok_s=10.0, bandwidth_gb_s=30.0, prefill_s=2.0, peak_rss_gb=2.3, spec=[1])
    b = dict(decode_tok_s=12.0, bandwidth_gb_s=50.0, prefill_s=2.5, peak_rss_gb=2.1)
    m = merge_rounds([a, b])
    assert (m["decode_tok_s"], m["bandwidth_gb_s"], m["prefill_s"], m["peak_rss_gb"]) == (12.0, 50.0, 2.0, 2.3)
    assert m["spec"] == [1] and m["decode_rounds"] == [10.0, 12.0]


def test_ideal_speedup():
    assert ideal(0.5, 1) == 1.5 and abs(ideal(0.9, 3) - 3.439) < 1e-9


FAKE_LLAMA_BENCH = """#!/bin/sh
# 假的 llama-bench：按 -n 是不是 0 报预填充或解码的速度（测 bench 怎么调它、怎么读它的 JSON）
case "$*" in *"-n 0"*) ts=400 ;; *) ts=20 ;; esac
echo '[{"model_type": "qwen35 test F32", "avg_ts": '$ts'}]'
"""


def test_bench_runs_end_to_end(lively, tmp_path):
    """一次小规模运行（float32：这时与 transformers、与 layout="packed" 的贪心输出都应逐 token 相同）：两个布局、
    transformers、llama.cpp（一个假的 llama-bench）、投机解码的全部组合，再加一种权重格式（int4 对第二个 GGUF），
    写出 JSON，并且报告能读。"""
    out = tmp_path / "b.json"
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH)
    fake.chmod(0o755)
    p = subprocess.run(
        [sys.executable, "-m", "qwen.bench", "--model", str(lively[0]), "--tokens", "6", "--prefill", "16",
         "--seeds", "2", "--rounds", "1", "--dtype", "float32", "--json", str(out), "--png", str(tmp_path / "b.png"),
         "--llama-cpp", str(tmp_path), "--quantize", "none", "int4", "--gguf", str(tmp_path / "x.gguf"),
         str(tmp_path / "y.gguf")],
        capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    run = res["runs"]["float32"]
    assert run["qwen"]["decode_tok_s"] > 0 and run["transformers"]["decode_tok_s"] > 0
    assert run["qwen"]["peak_rss_gb"] > 0 and run["qwen"]["bandwidth_gb_s"] > 0
    assert len(run["qwen"]["decode_rounds"]) == len(run["transformers"]["decode_rounds"]) == 1  # 多轮的合并另有测试
    assert len(run["qwen_packed"]["decode_rounds"]) == 1 and run["qwen_packed"]["decode_tok_s"] > 0
    assert run["qwen"]["layout"] == "分块布局、C++ 的 matvec"  # 默认：这台机器能编译 C++ 就用
    assert run["qwen_packed"]["layout"] == "oneDNN 打包的布局"
    assert run["qwen"]["round_cost"][0] == 1 and run["qwen"]["round_cost"] == sorted(run["qwen"]["round_cost"])  # 量出的
    ll = run["llama_cpp"]
    assert (ll["decode_tok_s"], ll["prefill_tok_s"], ll["decode_rounds"]) == (20, 400, [20])
    for key in ("qwen", "qwen_packed"):
        spec = run[key]["spec"]
        assert len(spec) == 9 + 4 + 3
        assert all(s["same_prefix"] == 6 for s in spec)  # 受控接受率的草稿器下，输出仍与贪心相同
        for s in spec:  # 每组设置测两次（自动挑 k 测四次）；加速比按解码阶段算，比含预填充的总秒数少
            assert len(s["speedups"]) == (4 if s["k"] == "auto" else 2)
            if s["k"] == 1:  # 每轮只起草一个：第一个草稿位置的接受率就是总的接受率
                assert s["first_acceptance"] == s["acceptance"]
            assert 0 < s["seconds"] < s["seconds_total"] and 0 < s["plain_seconds"] < s["plain_seconds_total"]
    assert run["packed_agreement"] == 1.0 and run["greedy_agreement"] == 1.0  # 两种布局、transformers 逐 token 相同
    assert "投机解码" in p.stdout and "| float32 |" in p.stdout and "| float32 packed |" in p.stdout
    assert f"| qwen float32 | {run['qwen']['decode_tok_s']:.1f}（{run['qwen']['decode_tok_s'] / 20:.2f}×） |" in p.stdout
    q4 = res["runs"]["float32 int4"]  # 第二种格式：只有默认布局与 llama.cpp（它的第二个 GGUF），不测投机解码
    assert set(q4) == {"qwen", "llama_cpp"} and q4["llama_cpp"]["file"].endswith("y.gguf") and "spec" not in q4["qwen"]
    assert q4["qwen"]["layout"] == "分块布局、C++ 的 matvec，int4 的矩阵" and q4["qwen"]["decode_tok_s"] > 0
    assert q4["qwen"]["bytes_per_token"] < 0.35 * run["qwen"]["bytes_per_token"]  # float32 的 4.5 / 32 加上小参数
    assert "| float32 int4 |" in p.stdout
    assert report(res).splitlines()[0].startswith("机器：")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="只在 Linux 上读 VmHWM")
def test_peak_rss_of_a_child_ignores_the_parent():
    """子进程的峰值内存只算它自己的：父进程先占过 1 GB，子进程（只导入 torch）报的仍远小于它。"""
    big = torch.ones(2**28)  # 1 GiB，写过一遍才真的常驻
    big += 1
    code = "from qwen.bench import peak_rss_gb; print(peak_rss_gb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    del big
    assert 0.05 < child < 0.9


def test_full_size_costs_are_measured_once(tmp_path, monkeypatch):
    """第 14 章在 demo 旁边打印的“0.8B 的形状”：造一组 4 层的随机权重、重复成整个模型的层数，量一次前向验证 1～5 行与起草一个，
    记在 round_cost.json 里；第二次直接读记下的，不再造权重。这里把形状换成小的（同一段代码，几秒之内）。"""
    from checkpoints import TINY

    from qwen.bench import scale
    from qwen.fast.warm import valid_round_cost

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(scale, "FULL", Config(**dict(TINY, num_hidden_layers=8)))
    monkeypatch.setattr(scale, "DRAFT_ROWS", 100)
    first = scale.full_size_costs(torch.float32)
    assert len(first["verify"]) == 5 and all(t > 0 for t in first["verify"]) and first["draft"] > 0
    assert valid_round_cost(first["round_cost"]) and first["step"] == first["verify"][0]

    def no_build(*args, **kw):
        raise AssertionError("记下的结果没被用上：又造了一遍权重")

    monkeypatch.setattr(scale, "random_checkpoint", no_build)
    assert scale.full_size_costs(torch.float32) == first
