"""附录 · 逐块对照 transformers：改了模型之后，哪一层开始不对？

最后的 logits 对不上时，只知道“错了”。本工具把同一段提示词同时喂给我们的普通模型（各章的 pack=False 模型）和
transformers 的 Qwen3.5（读同一个检查点），在每个解码块的输出（残差流）上各挂一个钩子，逐块打印两边隐藏状态的最大差
与平均差，并指出第一个相对差超过容差的块：错误就在它里面（或它之前的嵌入）。思路同 rasbt 的 LLMs-from-scratch 里
Qwen3.5 笔记的 qwen3_5_layer_debugger.py。

    python -m qwen.compare --model PATH [--prompt 文字] [--tokens 32] [--tol 1e-3]   # 要装测试依赖：pip install -e ".[test]"

两边都用 float32；相对差 = 最大差 ÷ 参考那一块的最大绝对值。各块只差浮点舍入时在 1e-6 的量级。
"""

import argparse
import json
import sys
from pathlib import Path

import unicodedata

import torch

from .model import Model
from .weights import find_model, load_weights

TOL = 1e-3  # 相对差超过它就算这一块不对


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


def block_outputs(blocks, run) -> list[torch.Tensor]:
    """在每个块上挂前向钩子，运行 run()，返回各块输出的隐藏状态（float32）。"""
    outs = []

    def keep(module, args, out):
        outs.append((out[0] if isinstance(out, tuple) else out).detach().float())

    hooks = [b.register_forward_hook(keep) for b in blocks]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return outs


@torch.inference_mode()
def compare(model: Model, hf, ids: torch.Tensor, tol: float = TOL) -> tuple[list[tuple], int | None]:
    """ids [1, T] → (每一行 (名字, 最大差, 平均差, 参考的最大绝对值), 第一个超过容差的块的行号或 None)。
    行依次是：嵌入、每个解码块、最后的 norm、logits。"""
    blocks = [model.embed_tokens, *model.layers, model.norm]
    ref_blocks = [hf.model.embed_tokens, *hf.model.layers, hf.model.norm]
    logits = []  # 两边的 logits（不在钩子里，另取）
    ours = block_outputs(blocks, lambda: logits.append(model(ids)))
    theirs = block_outputs(ref_blocks, lambda: logits.append(hf(ids).logits))
    names = ["嵌入", *[f"第 {i} 层（{kind_name(t)}）" for i, t in enumerate(model.cfg.layer_types)], "最后的 norm", "logits"]
    rows, first = [], None
    for i, (name, a, b) in enumerate(zip(names, ours + logits[:1], theirs + logits[1:])):
        diff = (a.float() - b.float()).abs()
        scale = b.abs().max().item()
        rows.append((name, diff.max().item(), diff.mean().item(), scale))
        if first is None and diff.max().item() > tol * max(scale, 1e-12):
            first = i
    return rows, first


def kind_name(layer_type: str) -> str:
    return "DeltaNet" if layer_type == "linear_attention" else "全注意力"


def pad(text: str, width: int) -> str:
    """补空格到 width 列（汉字占两列），让表格对齐。"""
    return text + " " * (width - sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text))


def report(rows, first, tol: float = TOL) -> str:
    lines = [pad("块", 22) + "      最大差      平均差  参考的最大值"]
    for name, top, mean, scale in rows:
        lines.append(f"{pad(name, 22)}{top:>12.3e}{mean:>12.3e}{scale:>14.3e}")
    if first is None:
        lines.append(f"每一块的相对差都在容差 {tol:g} 之内")
    else:
        lines.append(f"第一个相对差超过 {tol:g} 的块：{rows[first][0]}（错误在它里面，或者它读的权重里）")
    return "\n".join(lines)


def prompt_ids(path: Path, text: str | None, tokens: int, vocab_size: int) -> torch.Tensor:
    """有分词器时把文字切成 id；没有时取固定种子的随机 id。"""
    if text is not None and (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids
        if ids:
            return torch.tensor([ids])
    return torch.randint(0, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen.compare", description="逐块对照 transformers，找出第一个不对的块")
    p.add_argument("--model", default=None, help="检查点文件夹；demo 是随包的小模型；不给时找 Qwen3.5-0.8B")
    p.add_argument("--prompt", default="def fibonacci(n):\n    ", help="提示词（检查点没有分词器时用随机 id）")
    p.add_argument("--tokens", type=int, default=32, help="没有分词器时随机 id 的个数")
    p.add_argument("--tol", type=float, default=TOL, help="相对差的容差")
    args = p.parse_args(argv)
    path = find_model(args.model)
    model = Model.from_pretrained(path, dtype=torch.float32, pack=False).eval()
    hf = reference_model(path)
    ids = prompt_ids(path, args.prompt, args.tokens, model.cfg.vocab_size)
    rows, first = compare(model, hf, ids, args.tol)
    print(f"对照 transformers：{path}，{ids.shape[1]} 个 token，float32")
    print(report(rows, first, args.tol))
    return 0 if first is None else 1


if __name__ == "__main__":
    sys.exit(main())
