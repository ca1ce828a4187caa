"""附录 · 基准测试的命令行：python -m qwen.bench。每一项在单独的子进程里测，各种测量轮流来（见 qwen/bench/__init__.py）。"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..fast import DTYPES
from ..weights import Config, find_model
from ..tools.checkpoint import SIZES, random_checkpoint
from .llama import find_gguf, run_llama
from .probe import read_bandwidth
from .report import VARIANTS, machine, merge_rounds, plot, report

FORMATS = {"none": None, "int8": "int8", "int4": "int4"}  # --quantize 的名字 → qwen.fast.load 的 quantize
from .runs import run_qwen, run_transformers


def arguments(argv):
    p = argparse.ArgumentParser(prog="python -m qwen.bench", description="解码、预填充、投机解码与内存的基准测试")
    p.add_argument("--model", default=None, help="检查点文件夹或 demo；默认按 --size 的形状造随机权重")
    p.add_argument("--size", choices=list(SIZES), default="0.8B", help="没给 --model 时随机权重的形状（9B、27B：几十 GB 的临时文件）")
    p.add_argument("--layers", type=int, default=None,
                   help="随机权重只造这么多层（每层同样的宽度）：整个模型的检查点放不下磁盘时；报告里写明层数")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "both"], default="both")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--tokens", type=int, default=64, help="每次解码的新 token 数")
    p.add_argument("--prefill", type=int, default=512, help="预填充的提示词长度")
    p.add_argument("--no-transformers", action="store_true", help="不测 transformers")
    p.add_argument("--llama-cpp", metavar="DIR", default=None,
                   help="同时测 llama.cpp：DIR 里有 llama-bench（与第一种 dtype 的 qwen 轮流测，报告比值）")
    p.add_argument("--quantize", nargs="+", choices=list(FORMATS), default=["none"], metavar="FORMAT",
                   help="qwen（默认布局）的权重格式，可以给几种、依次测：none（dtype 本身）、int8、int4；"
                        "例如 --quantize none int8 int4")
    p.add_argument("--gguf", nargs="+", default=None, metavar="FILE",
                   help="llama.cpp 用的 GGUF 文件，与 --quantize 一一对应（BF16、Q8_0、Q4_0……；默认：模型文件夹里"
                        "唯一的 .gguf，只有一种格式时）")
    p.add_argument("--no-packed", action="store_true", help="不另测 layout=\"packed\"（oneDNN 打包的布局）的 qwen")
    p.add_argument("--seeds", type=int, default=3, help="投机解码的每组设置测几次（草稿器的随机种子不同；自动挑 k 测两倍），加起来算加速比")
    p.add_argument("--rounds", type=int, default=2, help="qwen 与 transformers 轮流测几轮（各取最快的一轮）")
    p.add_argument("--json", default="bench.json")
    p.add_argument("--png", default="bench.png")
    p.add_argument("--worker", choices=["qwen", "transformers"], help=argparse.SUPPRESS)
    p.add_argument("--no-spec", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    """子进程：测一项，结果作为一行 RESULT {json} 打印给父进程。"""
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    if args.worker == "qwen":
        out = run_qwen(args.model, dtype, args.tokens, args.prefill, spec=not args.no_spec,
                       layout="packed" if args.packed else "auto", seeds=args.seeds, quantize=FORMATS[args.quantize[0]])
    else:
        out = run_transformers(args.model, dtype, args.tokens, args.prefill)
    print("RESULT " + json.dumps(out))


def child(args, which: str, dtype: str, spec: bool = True, packed: bool = False, quantize: str = "none") -> dict | None:
    cmd = [sys.executable, "-m", "qwen.bench", "--worker", which, "--model", str(args.model), "--dtype", dtype,
           "--threads", str(args.threads), "--tokens", str(args.tokens), "--prefill", str(args.prefill),
           "--seeds", str(args.seeds), "--quantize", quantize]
    if not spec:
        cmd.append("--no-spec")
    if packed:
        cmd.append("--packed")
        which += " packed"
    which += "" if quantize == "none" else f" {quantize}"
    print(f"  测 {which}（{dtype}）…", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        print(f"  {which}（{dtype}）失败：\n{p.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(line[len("RESULT "):])


def measure(args, dtype: str, first: bool, has_hf: bool, gguf, quantize: str = "none") -> dict | None:
    """一种 dtype 与权重格式：qwen（默认与打包的布局）、transformers、llama.cpp 轮流测 rounds 轮，各取最快的一轮——共享
    机器的快慢时段几方都有机会碰上。第一轮的 qwen 子进程还测投机解码与峰值内存。量化的格式只测默认布局与 llama.cpp
    （打包的布局与 transformers 没有量化）。"""
    qs, cs, hs, ls = [], [], [], []
    plain = quantize == "none"
    for r in range(args.rounds):
        spec = r == 0 and first
        qs += [q] if (q := child(args, "qwen", dtype, spec=spec, quantize=quantize)) is not None else []
        if plain and not args.no_packed and (r == 0 or cs):
            cs += [c] if (c := child(args, "qwen", dtype, spec=spec, packed=True)) is not None else []
        if plain and has_hf and (r == 0 or hs):
            hs += [h] if (h := child(args, "transformers", dtype)) is not None else []
        if gguf is not None and (r == 0 or ls):
            ls += [x] if (x := run_llama(args, gguf)) is not None else []
    return combine(qs, cs, hs, ls, gguf) if qs else None


def combine(qs, cs, hs, ls, gguf) -> dict:
    """几轮的结果合成一种 dtype 的一份，顺带比较贪心输出与打包布局、transformers 的是否相同。"""
    q = merge_rounds(qs)
    run = {"qwen": q}
    if cs:
        c = run["qwen_packed"] = merge_rounds(cs)
        run["packed_agreement"] = sum(a == b for a, b in zip(q["plain_tokens"], c["plain_tokens"])) / len(q["plain_tokens"])
        del c["plain_tokens"]
    if hs:
        h = run["transformers"] = merge_rounds(hs)
        run["greedy_agreement"] = sum(a == b for a, b in zip(q["plain_tokens"], h["tokens"])) / len(h["tokens"])
        del h["tokens"]
    if ls:  # 各轮里最快的那次
        run["llama_cpp"] = dict(type=ls[0]["type"], file=str(gguf), fallback=ls[0].get("fallback"),
                                decode_tok_s=max(x["decode_tok_s"] for x in ls),
                                prefill_tok_s=max(x["prefill_tok_s"] for x in ls),
                                decode_rounds=[x["decode_tok_s"] for x in ls], prefill_rounds=[x["prefill_tok_s"] for x in ls])
    del q["plain_tokens"]
    return run


def main(argv=None):
    args = arguments(argv)
    if args.worker:
        return worker(args)
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="qwen-bench-")
        print(f"按 Qwen3.5-{args.size} 的形状造随机权重（bfloat16）…", file=sys.stderr, flush=True)
        layers = {} if args.layers is None else {"num_hidden_layers": args.layers}
        args.model = random_checkpoint(tmp.name, Config(**{**SIZES[args.size], **layers}))
        name = f"随机权重，Qwen3.5-{args.size} 的形状" + ("" if args.layers is None else f"，只有 {args.layers} 层")
    else:
        args.model = find_model(args.model)
        name = str(args.model)
    ggufs = find_gguf(args) if args.llama_cpp else [None] * len(args.quantize)
    if args.llama_cpp and ggufs is None:
        sys.exit(f"错误：--llama-cpp 要 GGUF 文件：用 --gguf 给，与 --quantize 的 {len(args.quantize)} 种格式一一对应"
                 f"（{args.model} 里没有唯一的 .gguf）")
    has_hf = not args.no_transformers and has_transformers()
    bandwidths = [read_bandwidth()]  # 父进程在开头、结尾各测一次：整个运行里机器的最高读带宽
    res = dict(machine=machine(), threads=args.threads, model=name, tokens=args.tokens, prefill_len=args.prefill,
               rounds=args.rounds, runs={})
    dtypes = ["bfloat16", "float32"] if args.dtype == "both" else [args.dtype]
    for dtype in dtypes:  # 几种权重格式只测第一种 dtype，各自与对应的 GGUF 轮流；投机解码只测第一种格式
        first = dtype == "bfloat16" or len(dtypes) == 1
        for i, (quantize, gguf) in enumerate(zip(args.quantize, ggufs) if dtype == dtypes[0] else [("none", None)]):
            if (run := measure(args, dtype, first and i == 0, has_hf, gguf, quantize)) is not None:
                res["runs"][dtype if quantize == "none" else f"{dtype} {quantize}"] = run
    bandwidths.append(read_bandwidth())
    res["machine_bandwidth_gb_s"] = max(bandwidths + [r[k]["bandwidth_gb_s"] for r in res["runs"].values()
                                                      for k in VARIANTS if k in r])
    if tmp is not None:
        tmp.cleanup()
    write(res, args)


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def write(res: dict, args) -> None:
    print(report(res))
    Path(args.json).write_text(json.dumps(res, indent=2, ensure_ascii=False))
    print(f"\n数字已写入 {args.json}", end="")
    if plot(res, Path(args.png)):
        print(f"，图已写入 {args.png}")
    else:
        print("（没有画图：需要 matplotlib，或没有 bfloat16 的投机解码结果）")


if __name__ == "__main__":
    main()
