"""随包附带的 demo 检查点（附录“训练”一章训出来的）：布局、加载、投机解码的接受率与正确性。"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwen import Chat, find_model, generate, load_config
from qwen.fast import load_draft, load_model
from qwen.mtp import speculate
from qwen.weights import DEMO_PATH, safetensors_files

# 留出的提示词：训练语料是标准库源码，这几段是我们自己写的、不在语料里的代码开头
PROMPTS = [
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    "class Stack:\n    \"\"\"A simple last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "import os\n\n\ndef walk_files(root):\n    \"\"\"Yield the path of every file below root.\"\"\"\n",
    "def read_config(path):\n    \"\"\"Read a JSON configuration file and return a dict.\"\"\"\n    with open(path",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
]


@pytest.fixture(scope="module")
def demo():
    model = load_model("demo", layout="packed", dtype=torch.float32)
    return model, load_draft(model), Chat(model)


def test_demo_has_the_released_layout():
    path = find_model("demo")
    assert path == DEMO_PATH
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["tie_word_embeddings"] is True
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_text" and text["mtp_num_hidden_layers"] == 1
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]  # 与 0.8B 同样的层型
    index = json.loads((path / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert all(n.startswith(("model.language_model.", "mtp.")) for n in names)
    assert "mtp.fc.weight" in names and "model.language_model.layers.0.linear_attn.A_log" in names
    assert (path / "tokenizer.json").is_file()
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 16 * 2**20, size
    cfg = load_config(path)
    assert cfg.num_hidden_layers == 4 and len(safetensors_files(path)) == 1


def test_demo_loads_with_the_same_checks(demo):
    model, mtp, chat = demo
    assert not chat.templated  # 没有对话模板：提示词原样喂进去
    assert chat.prompt([{"role": "user", "content": "def f(x):"}]) == "def f(x):"
    assert chat.tk.token_to_id("<|endoftext|>") == 0 and chat.stop
    a = model.layers[0].linear_attn.A_log
    assert a.dtype == torch.float32 and a.std() > 0  # 训练过的参数，不是初值


def test_demo_draft_head_accepts(demo):
    """k = 1：留出提示词上的接受率至少 40%（输出与贪心逐 token 相同由 test_chapter_script_on_demo 对四段提示词测）。"""
    model, mtp, chat = demo
    drafted = hits = 0
    for text in PROMPTS:
        r = speculate(model, mtp, chat.encode(text), 48, chat.stop, draft_tokens=1)
        drafted, hits = drafted + r.drafted, hits + r.hits
    assert hits / drafted >= 0.4, hits / drafted


def test_demo_auto_drafts_equal_greedy_in_bfloat16():
    model = load_model("demo", layout="packed", dtype=torch.bfloat16)
    mtp = load_draft(model)
    chat = Chat(model)
    ids = chat.encode(PROMPTS[0])
    r = speculate(model, mtp, ids, 40, chat.stop)
    assert r.tokens == generate(model, ids, 40, chat.stop) and r.hits > 0


def test_chapter_script_on_demo():
    script = Path(__file__).resolve().parent.parent / "ch14_mtp.py"
    out = subprocess.run([sys.executable, str(script), "--model", "demo", "--max-new-tokens", "24", "--prompt", "def f(x):"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # 没有对话模板：三段代码开头，再加上 --prompt 给的一个
    lines = out.stdout.splitlines()
    assert lines.count("  输出逐 token 相同：是") == 4 and out.stdout.count("  加速比：") == 4
    if "一个也不起草" in out.stdout:  # 这台机器上量得起草在 demo 上永远不划算：另按固定每轮 1 个跑，看看接受率
        assert out.stdout.count("固定每轮起草 1 个：") == 4 and out.stdout.count("输出逐 token 相同：是") == 8
    assert "MTP 草稿头" in out.stdout and "接受率" in out.stdout and "自动" in out.stdout
    # 为什么是这个加速比：demo 与 0.8B 的形状各自一轮的代价，同样的接受率下各自期望的加速比
    assert "为什么是这个加速比" in out.stdout and "0.8B 的形状：一次前向验证 1～5 行" in out.stdout
    assert out.stdout.count("期望") == 2


def test_cli_on_demo():
    """默认路径上的一次回答：有输出、有统计行，标准错误上没有任何警告。"""
    out = subprocess.run([sys.executable, "-m", "qwen", "def add(a, b):", "--model", "demo", "--max-new-tokens", "8"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "token/s" in out.stderr
    assert "Warning" not in out.stderr and "warn" not in out.stderr.lower(), out.stderr
