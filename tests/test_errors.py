"""坏输入得到清楚的错误：说出问题在哪、该怎么办。"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen import Model, find_model, generate, load_config
from qwen.fast import load_model


def single_file_copy(src, dst, edit=None):
    """把分片检查点合成单个 model.safetensors（顺便测单文件布局），可选地改动张量。"""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    if edit:
        edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_single_file_checkpoint_loads(tiny, tmp_path):
    path = single_file_copy(tiny[0], tmp_path / "single")
    a = load_model(path, layout="packed", dtype=torch.float32)
    b = load_model(tiny[0], layout="packed", dtype=torch.float32)
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_other_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="'llama'"):
        load_config(tmp_path)


def test_missing_tensor(tiny, tmp_path):
    name = "model.language_model.layers.1.linear_attn.dt_bias"
    path = single_file_copy(tiny[0], tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"缺少 1 个：layers\.1\.linear_attn\.dt_bias"):
        load_model(path)


def test_unexpected_tensor(tiny, tmp_path):
    def add(t):
        t["model.language_model.layers.0.mlp.extra.weight"] = torch.zeros(3, 3)

    path = single_file_copy(tiny[0], tmp_path / "u", add)
    with pytest.raises(ValueError, match=r"多出 1 个：layers\.0\.mlp\.extra\.weight"):
        load_model(path)


def test_shape_mismatch(tiny, tmp_path):
    name = "model.language_model.layers.2.mlp.up_proj.weight"

    def bad(t):
        t[name] = torch.zeros(7, 128)

    path = single_file_copy(tiny[0], tmp_path / "s", bad)
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.up_proj\.weight.*\(7, 128\).*\(256, 128\)"):
        load_model(path)


def test_bin_only_refused(tiny, tmp_path):
    shutil.copy(tiny[0] / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)


def test_missing_shard(tiny, tmp_path):
    dst = tmp_path / "shards"
    shutil.copytree(tiny[0], dst)
    (dst / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_model(dst)


@pytest.fixture(scope="module")
def small():
    from checkpoints import small_model

    return small_model(64, embed_std=0.02, max_position_embeddings=16)


def test_empty_ids(small):
    with pytest.raises(ValueError, match="空"):
        small(torch.zeros(1, 0, dtype=torch.long))


def test_prompt_too_long(small):
    from qwen import State

    with pytest.raises(ValueError, match="max_position_embeddings = 16"):
        small(torch.zeros(1, 17, dtype=torch.long))
    state = State(small)
    with torch.no_grad():
        small(torch.zeros(1, 10, dtype=torch.long), state)
    with pytest.raises(ValueError, match="已有 10 个位置"):
        small(torch.zeros(1, 7, dtype=torch.long), state)


def test_token_out_of_vocab(small):
    with pytest.raises(ValueError, match="词表"):
        small(torch.tensor([[64]]))


def test_find_model_explicit_and_env(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN_MODEL", str(tiny[0]))
    assert find_model() == tiny[0]
    assert find_model(tmp_path) == tmp_path  # 显式路径优先
    with pytest.raises(FileNotFoundError, match="不存在"):
        find_model(tmp_path / "nope")


def test_find_model_offline_nothing_cached(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "QWEN_MODEL"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    code = "from qwen import find_model\ntry:\n    find_model()\nexcept FileNotFoundError as e:\n    print('ERR', e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR")
    assert "Qwen/Qwen3.5-0.8B" in out.stdout and "QWEN_MODEL" in out.stdout
    code = code.replace("find_model()", "find_model('Qwen/Qwen3.5-35B-A3B')")  # 仓库名（不是本地的文件夹）：同样先找缓存、再下载
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("ERR 找不到模型 Qwen/Qwen3.5-35B-A3B：它不是本地的文件夹"), out.stdout + out.stderr


def test_compile_without_a_working_compiler(tiny, monkeypatch):
    """layout="graphs"（旧的 compile=True）而这台机器编译不了 C++ 的 matvec（比如没有 C++ 编译器）：加载时就给出说明与办法，
    而不是从 torch 深处报错。"""
    import qwen.fast.kernel as kernel

    def broken(cxx):
        raise RuntimeError("编译 matvec.cpp 失败：g++: command not found")

    monkeypatch.setattr(kernel, "load_kernel", broken)
    with pytest.raises(RuntimeError, match="分块布局.*要用这台机器的 C\\+\\+ 编译器.*command not found.*layout=\"packed\""):
        load_model(tiny[0], layout="graphs", dtype=torch.float32)


def test_compile_with_an_unwritable_cache_says_so_before_compiling(tmp_path):
    """python -m qwen compile 而缓存的文件夹写不了（这里 XDG_CACHE_HOME 在一个文件下面，root 也写不了）：先说出是哪个
    文件夹、怎么办，退出码 1，不先花几分钟编一遍再悄悄丢掉。"""
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = dict(os.environ, XDG_CACHE_HOME=str(blocker / "cache"))
    done = subprocess.run([sys.executable, "-m", "qwen", "compile", "--model", "demo"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 1 and f"{blocker / 'cache' / 'qwen'} 写不了" in done.stderr and "XDG_CACHE_HOME" in done.stderr
    assert "Traceback" not in done.stderr


def test_cli_with_an_unusable_kernel_cache_says_it_in_one_line(tmp_path):
    """命令行一次回答，而内核的缓存用不了（XDG_CACHE_HOME 是个文件）：标准错误上说一行（缓存在哪儿、为什么用不了、这次编在
    哪儿、照样用 C++ 内核），不印 traceback，也不印警告出处的源码行；照样回答。"""
    (tmp_path / "file").write_text("")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "file"))
    done = subprocess.run([sys.executable, "-m", "qwen", "def f():", "--model", "demo", "--max-new-tokens", "2"],
                          capture_output=True, text=True, timeout=300, env=env)
    said = [line for line in done.stderr.splitlines() if "qwen：" in line or "kernels" in line or "return " in line]
    assert done.returncode == 0 and done.stdout.strip() and "Traceback" not in done.stderr, done.stderr
    assert len(said) == 1 and "用不了（Not a directory）" in said[0] and "照样用 C++ 内核" in said[0], done.stderr


@pytest.mark.parametrize("args,message", [
    (["--max-new-tokens", "-3"], "argument --max-new-tokens: 要在 \\[1, ∞\\) 里，收到 -3"),
    (["--top-p", "0"], "argument --top-p: 要在 \\(0, 1\\] 里，收到 0"),
    (["--top-k", "abc"], "argument --top-k: 要整数，收到 'abc'"),
    (["--temperature", "-1"], "argument --temperature: 要在 \\[0, ∞\\) 里"),
    (["--dtype", "int4"], "argument --dtype: invalid choice"),
])
def test_cli_argument_errors(args, message, capsys):
    """命令行参数由解析器检查：一行说明哪个参数、要什么、收到什么，退出码 2，没有 traceback。"""
    from qwen.__main__ import main

    with pytest.raises(SystemExit) as exit:
        main(["你好", *args])
    assert exit.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_stop_must_be_token_ids(small):
    """stop 给成字符串（或别的不是整数的东西）时报错，而不是悄悄地永不命中。"""
    from qwen.batch import generate_batch
    from qwen.mtp import speculate

    model = small
    ids = torch.tensor([[1, 2, 3]])
    for call in (lambda: generate(model, ids, 5, stop="<|im_end|>"), lambda: generate(model, ids, 5, stop=[1.5]),
                 lambda: generate_batch(model, [[1, 2]], 5, stop="x"), lambda: speculate(model, None, ids, 5, stop="x")):
        with pytest.raises(ValueError, match="stop 要一组 token id"):
            call()
    first = generate(model, ids, 5)[0]
    assert generate(model, ids, 5, stop=[torch.tensor(first)]) == [first]  # 0 维整数张量也是 id，命中就停


# ---------- 第 1、10 章：坏的文件、坏的配置、坏的 id ----------


def test_truncated_safetensors(tiny, tmp_path):
    """下载中断、只剩一半的分片：报出是哪个文件、该怎么办，而不是 safetensors 的原始错误。"""
    dst = tmp_path / "cut"
    shutil.copytree(tiny[0], dst)
    shard = dst / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model-00001-of-00002\.safetensors 不是完整的 safetensors 文件.*重新下载"):
        load_model(dst)


@pytest.mark.parametrize("text", ['{"model_type": "qwen3_5", "text_config": {', "", "not json"])
def test_config_not_json(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=r"config\.json 不是合法的 JSON"):
        load_config(tmp_path)


@pytest.mark.parametrize("field,value,kind", [("hidden_size", "256", "int"), ("num_hidden_layers", 4.0, "int"),
                                              ("tie_word_embeddings", "yes", "bool"), ("rms_norm_eps", "1e-6", "float"),
                                              ("hidden_size", -8, None)])
def test_config_field_of_the_wrong_type(tiny, tmp_path, field, value, kind):
    """写错类型的字段（比如 "hidden_size": "256"）在读配置时就报出文件与字段，不会走到 torch 里才出错。"""
    config = json.loads((tiny[0] / "config.json").read_text())
    config["text_config"][field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = f"应为 {kind}，收到 {value!r}" if kind else f"不能是 {value}"
    with pytest.raises(ValueError, match=rf"config\.json.*{field} {expected}"):
        load_config(tmp_path)


@pytest.mark.parametrize("ids,message", [
    ("你好", "整数 token id.*str"),  # 文字而不是 id
    ([["a", "b"]], "整数 token id.*list"),
    ([[1.5, 2.0]], "整数 token id.*float32.*不会替你取整"),  # 浮点 id 不会被悄悄截断
    (torch.tensor([[1.0, 2.0]], dtype=torch.float64), "float64.*不会替你取整"),
    ([[1, 2], [3]], "整数 token id.*list"),  # 参差不齐的行（批处理里这是两个合法的提示词）
])
def test_ids_that_are_not_integers(small, ids, message):
    from qwen import generate, generate_batch

    for call in (lambda: small(ids), lambda: generate(small, ids, 3)):
        with pytest.raises(ValueError, match=message):
            call()
    if not isinstance(ids, str) and len(ids[0]) == 2 and len(ids[-1]) == 2:  # 批处理的每个提示词同样检查
        with pytest.raises(ValueError, match="整数 token id"):
            generate_batch(small, list(ids), 3)


@pytest.mark.parametrize("text", ["{不是 JSON", '{"metadata": {}}', '{"weight_map": ["a"]}'])
def test_bad_shard_index_names_the_file(tiny, tmp_path, text):
    """model.safetensors.index.json 不是 JSON、没有 weight_map、weight_map 不是 {张量名: 分片}：ValueError 说出是哪个文件。"""
    ck = tmp_path / "ck"
    shutil.copytree(tiny[0], ck)
    (ck / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json.*weight_map"):
        Model.from_pretrained(ck, dtype=torch.float32)


def test_bad_tokenizer_and_text_are_clear_errors(tiny, tmp_path):
    """tokenizer.json 不是 JSON：ValueError 说出文件（第 14 章的脚本也是一行错误）；单独的代理字符（不是合法的 Unicode）：
    ValueError，不是分词器深处的 TypeError。"""
    from qwen import Chat

    model = Model.from_pretrained(tiny[0], dtype=torch.float32)
    with pytest.raises(ValueError, match="代理字符"):
        Chat(model).encode("你好\ud800")
    ck = tmp_path / "ck"
    shutil.copytree(tiny[0], ck)
    (ck / "tokenizer.json").write_text("{不是 JSON")
    with pytest.raises(ValueError, match=r"tokenizer\.json 读不了"):
        Chat(model, ck)
    done = subprocess.run([sys.executable, "ch14_mtp.py", "--model", str(ck), "--max-new-tokens", "2"], capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 1 and "tokenizer.json 读不了" in done.stderr + done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize("args", [["--max-new-tokens", "-5"], ["--draft-tokens", "0"], ["--threads", "-1"]])
def test_chapter_script_checks_its_arguments(args):
    """ch14_mtp.py 的数值参数在 argparse 里检查：一行错误说出是哪个参数，不是 traceback。"""
    done = subprocess.run([sys.executable, "ch14_mtp.py", *args], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 2 and f"argument {args[0]}" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("args,message", [
    (["--layout", "plain", "--quantize", "int8"], "不能与 layout='plain' 一起用"),
    (["--compile", "--layout", "packed"], "--compile 即 --layout graphs，与 --layout packed 矛盾"),
])
def test_cli_layout_conflicts_are_refused(args, message):
    """--layout 与 --quantize、旧的 --compile 矛盾时：一行说明，不是悄悄挑一个。"""
    from qwen.__main__ import main

    with pytest.raises(SystemExit) as exit:
        main(["你好", "--model", "demo", *args])
    assert message in str(exit.value.code)


def test_chapter_script_takes_the_clis_load_options():
    """ch14_mtp.py 的加载选项就是 python -m qwen 的那一份：int4 也收，--compile 与 --layout 矛盾时同样拒绝。"""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ch14_mtp", Path(__file__).resolve().parents[1] / "ch14_mtp.py")
    ch14 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ch14)
    args = ch14.arguments(["--quantize", "int4", "--layout", "blocked", "--dtype", "float32"])
    assert (args.quantize, args.layout, args.dtype) == ("int4", "blocked", "float32")
    assert ch14.arguments(["--compile"]).layout == "graphs"
    with pytest.raises(SystemExit, match="--compile 即 --layout graphs，与 --layout packed 矛盾"):
        ch14.arguments(["--compile", "--layout", "packed"])


def test_chapter_script_says_when_the_full_shape_cannot_be_measured(monkeypatch, capsys):
    """第 14 章最后要造约 700 MB 的 0.8B 形状的权重：临时文件夹放不下时一行说明原因与要多少，实验照样结束，没有 traceback；
    容器里只有 64 MB 的 /dev/shm 不用它。"""
    import importlib.util

    from qwen.bench import scale
    from qwen.fast import load

    spec = importlib.util.spec_from_file_location("ch14_mtp", Path(__file__).resolve().parents[1] / "ch14_mtp.py")
    ch14 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ch14)

    def full(*args, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ch14, "full_size_costs", full)
    model, mtp = load("demo")
    ch14.why(model, mtp, [(0.0007, 10, 9, 0.8)])
    out = capsys.readouterr().out
    assert "这个模型：解码一步 0.70 毫秒" in out and "量不了 0.8B 的形状（OSError: [Errno 28] No space left on device）" in out
    monkeypatch.setattr(scale.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(64 << 20, 0, 64 << 20))
    assert scale.memory_disk() is None
