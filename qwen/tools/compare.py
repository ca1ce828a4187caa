"""附录 · 逐块对照 transformers：改了模型之后，哪一层开始不对？

最后的 logits 对不上时，只知道“错了”。本工具把同一段提示词同时喂给我们的普通模型（各章的普通模型，Model.from_pretrained）和
transformers 的 Qwen3.5（读同一个检查点），在两边的每一块（嵌入、每个解码层、最后的 norm）上各挂一个前向钩子，
记下它输出的隐藏状态（残差流），再逐块比较。错误会沿着残差流往后传，所以后面的块全都不对并不说明什么：
要找的是第一个不对的块，错误就在它里面（或它读的权重里）。思路来自 rasbt 的 LLMs-from-scratch 里 Qwen3.5
笔记附带的逐层调试器 qwen3_5_layer_debugger.py，想看原版就去那里找。

每一块得到一个状态：

    ok              两边形状相同，最大差 ÷ 参考那一块的最大绝对值（相对差）在容差之内
    differs         形状相同，相对差超过容差（或出现了 NaN）
    shape mismatch  形状不同：直接报出两边的形状，绝不让广播把 [1, 1, H] 与 [1, T, H] 悄悄“对上”
    missing         只有一边有这一块：钩子没有触发（前向跳过了它、或在它那里抛了异常），或者两边层数不同

    python -m qwen.tools.compare                      # 默认用随包的 demo 检查点，离线即可
    python -m qwen.tools.compare --random             # 在临时文件夹里造一个随机的小检查点（发布检查点的布局）再对照
    python -m qwen.tools.compare --model PATH         # 任意检查点文件夹；--model Qwen/Qwen3.5-0.8B：缓存里找或下载（约 1.7 GB）
    其他选项：[--prompt 文字] [--tokens 32] [--tol 1e-3]；要装测试依赖：pip install -e ".[test]"

两边都用 float32；各块只差浮点舍入时相对差在 1e-6 的量级。有块不对时退出码是 1。
"""

import argparse
import json
import math
import sys
import tempfile
import unicodedata
from pathlib import Path
from typing import NamedTuple

import torch

from ..model import Model
from ..weights import REPO_ID, Config, find_model, load_weights

TOL = 1e-3  # 相对差超过它就算这一块不对
OK, DIFFERS, SHAPE, MISSING = "ok", "differs", "shape mismatch", "missing"
NAN = float("nan")

# --random 的小检查点：4 层（3 个 DeltaNet + 1 个全注意力），值头多于键头，几秒内就能造好、对照完
RANDOM = Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=4096, eos_token_id=511)


class Row(NamedTuple):
    """对照表的一行。比不了（缺一边、形状不同）时差值是 NaN。"""

    name: str
    max_diff: float
    mean_diff: float
    scale: float  # 参考那一块的最大绝对值
    status: str  # OK、DIFFERS、SHAPE、MISSING 之一
    detail: str = ""  # 不对时的说明


def reference_model(path: Path):
    """按检查点的 config.json 建 transformers 的 Qwen3_5ForCausalLM（float32），读入同一份权重。"""
    try:
        import transformers
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    except ImportError:
        raise SystemExit("对照要用 transformers（测试依赖）：pip install -e \".[test]\"") from None
    transformers.logging.set_verbosity_error()  # 不提示“没装 flash-linear-attention，用参考实现”：我们要的正是参考实现
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    text = dict(config.get("text_config", config))
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text)).float().eval()
    weights = load_weights(path, "model.", torch.float32)
    state = {(k if k == "lm_head.weight" else "model." + k): v for k, v in weights.items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"{path} 的张量与 transformers 的模型对不上：缺少 {missing[:3]}，多出 {unexpected[:3]}")
    return hf


def block_outputs(blocks, run) -> tuple[list, str | None]:
    """在每个块上挂前向钩子，运行 run()（它返回 logits）。返回 ([各块的输出……, logits], 异常或 None)：
    钩子没有触发的块是 None（不是按触发的先后排，否则少一块时后面的全都错位）。一块跑了几次时留最后一次。
    run() 抛出的异常不往外抛，而是记下来：它之前的块照样能比，它所在的块就是 missing。"""
    outs = [None] * (len(blocks) + 1)

    def keeper(i):
        def keep(module, args, out):
            outs[i] = (out[0] if isinstance(out, tuple) else out).detach().float()
        return keep

    hooks = [b.register_forward_hook(keeper(i)) for i, b in enumerate(blocks)]
    error = None
    try:
        outs[-1] = run().detach().float()
    except Exception as e:  # noqa: BLE001 — 调试器要报告它，而不是跟着崩掉
        error = f"{type(e).__name__}: {e}"
    finally:
        for h in hooks:
            h.remove()
    return outs, error


def align(outs: list, layers: int) -> list:
    """[嵌入, 各层……, norm, logits] 按角色对齐到 layers 个解码层：层数少的一边在层的末尾补 None。"""
    return outs[:1] + outs[1:-2] + [None] * (layers - (len(outs) - 3)) + outs[-2:]


def block_names(layers: int, *layer_types: list[str]) -> list[str]:
    """各行的名字：嵌入、第 i 层（它的种类，先看我们的配置，没有再看参考的）、最后的 norm、logits。"""
    kinds = [next((t[i] for t in layer_types if i < len(t)), "") for i in range(layers)]
    return ["嵌入", *[f"第 {i} 层（{kind_name(k)}）" for i, k in enumerate(kinds)], "最后的 norm", "logits"]


def kind_name(layer_type: str) -> str:
    return {"linear_attention": "DeltaNet", "full_attention": "全注意力"}.get(layer_type, "?")


def missing(name: str, a, b, crash: dict) -> Row:
    """缺了一边（或两边）的块。crash 是 {哪边: 前向抛出的异常或 None}：异常只在那一边第一个缺失的块上报一次
    （报过就换成空串，之后的块说“前向已中断”）。"""
    why = []
    for side, out in (("我们", a), ("参考", b)):
        if out is not None:
            continue
        if crash.get(side):
            why.append(f"{side}的前向在这一块（或它之前）抛出了 {crash[side]}")
            crash[side] = ""
        elif crash.get(side) == "":
            why.append(f"{side}这边前向已中断")
        else:
            why.append(f"{side}这边没有这一块：钩子没有触发，或层数更少")
    return Row(name, NAN, NAN, NAN if b is None else b.abs().max().item(), MISSING, "；".join(why))


def judge(name: str, a, b, tol: float, crash: dict) -> Row:
    """比较一块：a 是我们的输出，b 是参考的（None 表示那边没有这一块，见 missing）。"""
    if a is None or b is None:
        return missing(name, a, b, crash)
    scale = b.abs().max().item() if b.numel() else 0.0
    if a.shape != b.shape:  # 先比形状：差值 a - b 会广播，[1, 1, H] 与 [1, T, H] 也“减得动”
        return Row(name, NAN, NAN, scale, SHAPE, f"形状不同：我们 {list(a.shape)}，参考 {list(b.shape)}")
    diff = (a - b).abs()
    top, mean = (diff.max().item(), diff.mean().item()) if diff.numel() else (0.0, 0.0)
    if top <= tol * max(scale, 1e-12):  # 有 NaN 时比较为假：NaN 也算不对
        return Row(name, top, mean, scale, OK)
    return Row(name, top, mean, scale, DIFFERS, f"相对差 {top / max(scale, 1e-12):.2e} 超过容差 {tol:g}")


@torch.inference_mode()
def compare(model: Model, hf, ids: torch.Tensor, tol: float = TOL) -> tuple[list[Row], int | None]:
    """ids [1, T] → (每一块一行 Row，第一个不是 ok 的行号或 None)。行依次是：嵌入、每个解码层、最后的 norm、logits；
    两边层数不同时按多的一边列，少的一边缺的层是 missing。"""
    ours, our_error = block_outputs([model.embed_tokens, *model.layers, model.norm], lambda: model(ids))
    theirs, ref_error = block_outputs([hf.model.embed_tokens, *hf.model.layers, hf.model.norm], lambda: hf(ids).logits)
    layers = max(len(model.layers), len(hf.model.layers))
    names = block_names(layers, model.cfg.layer_types, hf.config.layer_types)
    crash = {"我们": our_error, "参考": ref_error}
    rows = [judge(n, a, b, tol, crash) for n, a, b in zip(names, align(ours, layers), align(theirs, layers))]
    first = next((i for i, r in enumerate(rows) if r.status != OK), None)
    return rows, first


def pad(text: str, width: int) -> str:
    """补空格到 width 列（汉字占两列），让表格对齐。"""
    return text + " " * (width - sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text))


def number(x: float, width: int) -> str:
    return f"{'—':>{width}}" if math.isnan(x) else f"{x:>{width}.3e}"


def report(rows: list[Row], first: int | None, tol: float = TOL) -> str:
    """对照表，最后一行说结论：全部 ok，或第一个不对的块是哪个、为什么。"""
    lines = [pad("块", 22) + pad("状态", 16) + "      最大差      平均差  参考的最大值  说明"]
    for r in rows:
        lines.append(f"{pad(r.name, 22)}{pad(r.status, 16)}{number(r.max_diff, 12)}{number(r.mean_diff, 12)}"
                     f"{number(r.scale, 14)}  {r.detail}".rstrip())
    if first is None:
        lines.append(f"每一块的相对差都在容差 {tol:g} 之内")
    else:
        bad = sum(r.status != OK for r in rows)
        r = rows[first]
        lines.append(f"第一个不对的块：{r.name}——{r.status}：{r.detail}（错误在它里面，或者它读的权重里；"
                     f"共 {bad} 块不对，之后的块多半只是被它带偏）")
    return "\n".join(lines)


def prompt_ids(path: Path, text: str | None, tokens: int, vocab_size: int) -> torch.Tensor:
    """有分词器时把文字切成 id；没有时取固定种子的随机 id。"""
    if text is not None and (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids
        if ids:
            return torch.tensor([ids])
    return torch.randint(0, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))


def random_checkpoint(path) -> Path:
    """在 path 造一个 RANDOM 形状的随机检查点，布局与发布的一样（嵌套的 text_config、model.language_model.*、
    mtp.*、分片索引）。借用附录 qwen/bench 的造法：它给每个参数都填了不平凡的随机值。"""
    from .checkpoint import random_checkpoint as build  # 只在 --random 时用到

    return build(path, RANDOM)


def plain_model(path: Path) -> Model:
    """用各章的加载器读出我们的普通模型（float32）：要对照的正是课程里的那个模型，不是附录的快路径。"""
    return Model.from_pretrained(path, dtype=torch.float32).eval()


def run(path: Path, prompt: str | None, tokens: int, tol: float) -> int:
    """加载两边、对照、打印，返回退出码（全部 ok 时 0，否则 1）。"""
    model = plain_model(path)
    hf = reference_model(path)
    ids = prompt_ids(path, prompt, tokens, model.cfg.vocab_size)
    rows, first = compare(model, hf, ids, tol)
    print(f"对照 transformers：{path}，{ids.shape[1]} 个 token，float32")
    print(report(rows, first, tol))
    return 0 if first is None else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen.tools.compare", description="逐块对照 transformers，找出第一个不对的块")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", default="demo",
                       help=f"检查点文件夹；默认 demo（随包的小模型，离线）；{REPO_ID}：本地缓存里找或下载（QWEN_MODEL 优先）")
    where.add_argument("--random", action="store_true", help="在临时文件夹里造一个随机的小检查点来对照")
    p.add_argument("--prompt", default="def fibonacci(n):\n    ", help="提示词（检查点没有分词器时用随机 id）")
    p.add_argument("--tokens", type=int, default=32, help="没有分词器时随机 id 的个数")
    p.add_argument("--tol", type=float, default=TOL, help="相对差的容差")
    args = p.parse_args(argv)
    if args.tokens < 1 or not args.tol >= 0:
        p.error("--tokens 至少是 1，--tol 不能是负数或 NaN")
    if args.random:
        with tempfile.TemporaryDirectory(prefix="qwen-compare-") as tmp:
            return run(random_checkpoint(tmp), args.prompt, args.tokens, args.tol)
    try:  # 找不到检查点（离线又没有缓存）时说清楚，不打印调用栈
        path = find_model(None if args.model == REPO_ID and not Path(args.model).is_dir() else args.model)
    except FileNotFoundError as e:
        raise SystemExit(f"python -m qwen.tools.compare：{e}") from None
    return run(path, args.prompt, args.tokens, args.tol)


if __name__ == "__main__":
    sys.exit(main())
