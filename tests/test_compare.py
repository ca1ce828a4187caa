"""python -m qwen.tools.compare：默认离线（随包的 demo）每一块 ok；埋下的错误各自报成 differs、shape mismatch、missing，
并且指出的第一个坏块正是埋错误的那一块。"""

import copy

import pytest
import torch

from qwen import Model
from qwen.tools import compare as cmp
from qwen.weights import DEMO_PATH

from checkpoints import prompt


@pytest.fixture(scope="module")
def demo():
    """demo 检查点上的 (我们的普通模型, transformers 的参考, 提示词的 id)；各测试改的是它的副本。"""
    model = cmp.plain_model(DEMO_PATH)  # 与 compare 用同一个加载器
    hf = cmp.reference_model(DEMO_PATH)
    ids = cmp.prompt_ids(DEMO_PATH, "def fibonacci(n):\n    ", 32, model.cfg.vocab_size)
    return model, hf, ids


def run(demo, plant):
    """在我们模型的副本上埋下 plant(model)，对照 → (rows, first, 报告)。"""
    model, hf, ids = demo
    model = copy.deepcopy(model)
    plant(model)
    rows, first = cmp.compare(model, hf, ids)
    return rows, first, cmp.report(rows, first)


def test_default_is_offline_demo_and_all_ok(capsys):
    """不给任何参数：用随包的 demo（不找 0.8B、不联网），每一块 ok，退出码 0。"""
    assert cmp.main([]) == 0
    out = capsys.readouterr().out
    assert str(DEMO_PATH) in out and "每一块的相对差都在容差" in out
    table = out.splitlines()[2:-1]  # 标题、表头之后，结论之前
    assert len(table) == 1 + 4 + 2 and all(line.split()[-4] == "ok" for line in table)


def test_all_ok_in_process(demo):
    rows, first, text = run(demo, lambda m: None)
    assert first is None and [r.status for r in rows] == [cmp.OK] * 7
    assert [r.name for r in rows][1:5] == ["第 0 层（DeltaNet）", "第 1 层（DeltaNet）", "第 2 层（DeltaNet）", "第 3 层（全注意力）"]
    assert all(r.max_diff <= 1e-5 * r.scale for r in rows)


def test_planted_bug_differs_at_that_layer(demo):
    def plant(m):
        with torch.no_grad():
            m.layers[2].mlp.down_proj.weight[:, 0] += 0.05  # 改坏第 2 层的一列

    rows, first, text = run(demo, plant)
    assert rows[first].name.startswith("第 2 层") and rows[first].status == cmp.DIFFERS
    assert all(r.status == cmp.OK for r in rows[:first])
    assert "第一个不对的块：第 2 层（DeltaNet）——differs" in text.splitlines()[-1]


def test_shape_mismatch_is_not_broadcast(demo):
    """最后的 norm 只留最后一个位置：[1, 1, H] 与参考的 [1, T, H] 能广播相减，但必须报成形状不同。"""
    def plant(m):
        m.norm.register_forward_hook(lambda mod, args, out: out[:, -1:])

    rows, first, text = run(demo, plant)
    T, H = demo[2].shape[1], demo[0].cfg.hidden_size
    assert rows[first].name == "最后的 norm" and rows[first].status == cmp.SHAPE
    assert f"我们 [1, 1, {H}]，参考 [1, {T}, {H}]" in rows[first].detail
    assert rows[-1].status == cmp.SHAPE  # logits 也是 [1, 1, V] 对 [1, T, V]
    assert "shape mismatch" in text.splitlines()[-1]


def test_layer_count_mismatch_is_missing(demo):
    rows, first, text = run(demo, lambda m: m.layers.__delitem__(3))  # 我们少了最后一层
    assert len(rows) == 7 and rows[first].name == "第 3 层（全注意力）" and rows[first].status == cmp.MISSING
    assert "我们这边没有这一块" in rows[first].detail and all(r.status == cmp.OK for r in rows[:first])


def test_hook_that_never_fired_is_missing(demo):
    """前向跳过了第 1 层：它的钩子没有触发，它是 missing（后面的块不因此错位）。"""
    def plant(m):
        def skip(x, cos, sin, state=None, valid=None):
            for i, layer in enumerate(m.layers):
                x = x if i == 1 else layer(x, cos, sin, None, valid)
            return x
        m.run_layers = skip

    rows, first, text = run(demo, plant)
    assert rows[first].name.startswith("第 1 层") and rows[first].status == cmp.MISSING
    assert rows[3].status == cmp.DIFFERS  # 第 2 层照样比了（读的是没被第 1 层加工的输入，所以不对）


def test_forward_that_raises_is_missing_with_the_error(demo):
    def plant(m):
        def boom(*args, **kwargs):
            raise RuntimeError("埋下的错误")
        m.layers[2].forward = boom

    rows, first, text = run(demo, plant)
    assert rows[first].name.startswith("第 2 层") and rows[first].status == cmp.MISSING
    assert "RuntimeError: 埋下的错误" in rows[first].detail and all(r.status == cmp.OK for r in rows[:first])
    assert all(r.status == cmp.MISSING for r in rows[first:])


def test_nan_differs():
    a, b = torch.full((1, 2, 3), float("nan")), torch.zeros(1, 2, 3)
    assert cmp.judge("x", a, b, cmp.TOL, {}).status == cmp.DIFFERS


def test_exit_code_nonzero_when_wrong(capsys):
    assert cmp.main(["--tol", "0"]) == 1  # 容差 0：浮点舍入也算不对
    assert "第一个不对的块：第 0 层" in capsys.readouterr().out


def test_random_checkpoint(capsys):
    """--random：临时文件夹里造的随机检查点（发布的布局）两边也每一块 ok。"""
    assert cmp.main(["--random"]) == 0
    assert "每一块的相对差都在容差" in capsys.readouterr().out


def test_compare_names_the_broken_layer(tiny, capsys):
    """python -m qwen.tools.compare：原样的模型每一块都在容差之内；改坏第 2 层的一个权重，它指出的第一个坏块正是第 2 层。"""
    from qwen.tools.compare import compare, main

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
