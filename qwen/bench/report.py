"""附录 · 基准测试：几轮的结果合成一份，打印成表，画出加速比对接受率的图。"""

import os
from pathlib import Path

import torch

from .probe import PROMPT_LEN
from .runs import DRAFTS


def merge_rounds(results: list) -> dict:
    """几轮子进程的结果合成一份：解码取最快的一轮（连同与它同时测的带宽），预填充取最快的，峰值内存取最大的，
    其余（投机解码、生成的 token）取第一轮的。每轮的解码速度留在 decode_rounds 里。"""
    out = dict(results[0])
    fastest = max(results, key=lambda r: r["decode_tok_s"])
    for key in ("decode_tok_s", "bandwidth_gb_s", "decode_runs"):
        if key in fastest:
            out[key] = fastest[key]
    out["prefill_s"] = min(r["prefill_s"] for r in results)
    out["peak_rss_gb"] = max(r["peak_rss_gb"] for r in results)
    out["decode_rounds"] = [r["decode_tok_s"] for r in results]
    return out


def ideal(a: float, k: int) -> float:
    return (1 - a ** (k + 1)) / (1 - a)


# 每种 dtype 测的 qwen：默认的 layout="auto"；oneDNN 打包的 layout="packed"（docs/perf-history.md 里较早的运行叫它 compile=False）
VARIANTS = {"qwen": "", "qwen_packed": " packed"}


def report(res: dict) -> str:
    lines = [f"机器：{res['machine']}；线程 {res['threads']}；模型：{res['model']}；"
             f"qwen 与 transformers、llama.cpp 轮流测 {res['rounds']} 轮，各取最快的一轮；"
             "“bfloat16 int8”这样的名字是 dtype 加 qwen 的权重格式（quantize=\"int8\"）", ""]
    return "\n".join(lines + decode_table(res) + llama_tables(res) + spec_tables(res))


def decode_table(res: dict) -> list:
    """解码、带宽下限、预填充与峰值内存：每种 dtype、每种布局一行；下面是各轮的数字。"""
    lines = ["| dtype | qwen 解码 tok/s | transformers 解码 tok/s | 倍数 | 同时测的带宽 GB/s | 带宽下限 tok/s | 占下限 | "
             f"预填充 {res['prefill_len']} tok/s qwen / transformers | 峰值内存 GB |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for dtype, r in res["runs"].items():
        h = r.get("transformers")
        for key, label in VARIANTS.items():
            q = r.get(key)
            if q is None:
                continue
            floor = q["bandwidth_gb_s"] * 1e9 / q["bytes_per_token"]  # 每秒最多能读几遍权重
            pre_q = res["prefill_len"] / q["prefill_s"]
            hf_dec = f"{h['decode_tok_s']:.1f}" if h else "—"
            ratio = f"{q['decode_tok_s'] / h['decode_tok_s']:.2f}×" if h else "—"
            pre_h = f"{res['prefill_len'] / h['prefill_s']:.0f}" if h else "—"
            lines.append(f"| {dtype}{label} | {q['decode_tok_s']:.1f} | {hf_dec} | {ratio} | {q['bandwidth_gb_s']:.1f} | "
                         f"{floor:.1f} | {q['decode_tok_s'] / floor:.0%} | {pre_q:.0f} / {pre_h} | {q['peak_rss_gb']:.2f} |")
            top = res["machine_bandwidth_gb_s"] * 1e9 / q["bytes_per_token"]
            rounds = " / ".join(f"{x:.1f}" for x in q["decode_rounds"])
            if h:
                rounds += "；transformers " + " / ".join(f"{x:.1f}" for x in h["decode_rounds"])
            notes.append(f"{dtype}{label}：各轮解码 tok/s：qwen {rounds}；按整个运行里最高的带宽算，下限 {top:.1f} tok/s，"
                         f"解码占 {q['decode_tok_s'] / top:.0%}")
    return lines + ["", f"整个运行里测到的最高读带宽 {res['machine_bandwidth_gb_s']:.1f} GB/s。"] + notes


def llama_tables(res: dict) -> list:
    lines = []
    for dtype, r in res["runs"].items():
        ll = r.get("llama_cpp")
        if not ll:
            continue
        lines += ["", f"llama.cpp（{ll['type']}，{Path(ll['file']).name}，llama-bench，同样的线程数，与 qwen 轮流测，各取最快）：",
                  f"| | 解码 tok/s（{PROMPT_LEN} 个 token 的上下文之后） | 预填充 tok/s |", "|---|---|---|",
                  f"| llama.cpp | {ll['decode_tok_s']:.1f} | {ll['prefill_tok_s']:.0f} |"]
        for key, label in VARIANTS.items():
            q = r.get(key)
            if q:
                pre = res["prefill_len"] / q["prefill_s"]
                lines.append(f"| qwen {dtype}{label} | {q['decode_tok_s']:.1f}（{q['decode_tok_s'] / ll['decode_tok_s']:.2f}×） | "
                             f"{pre:.0f}（{pre / ll['prefill_tok_s']:.2f}×） |")
        if ll.get("fallback"):
            lines.append(f"（llama.cpp 照常运行时被信号杀死——虚拟机上它重排过的权重读提示词用 AMX 的块指令——重测时加了 "
                         f"{'、'.join(sorted(set(ll['fallback'])))}：解码不带上下文，预填充关掉重排）")
    return lines


def spec_tables(res: dict) -> list:
    lines = []
    for dtype, r in res["runs"].items():
        for key, label in VARIANTS.items():
            spec = (r.get(key) or {}).get("spec")
            if not spec:
                continue
            lines += ["", f"投机解码（{dtype}{label}，{res['tokens']} 个 token，相对前后紧挨着测的两次普通贪心；加速比按解码阶段算，"
                      f"与解码 tok/s 同一口径，括号里是含预填充（{PROMPT_LEN} 个 token 的提示词）的；草稿词表 "
                      f"{r[key]['draft_vocab'] or '全部'}）",
                      "| 接受率 a | k | 加速比（含预填充） | 理想值 | 平均 k | 平均轮数 | 第一个草稿实际猜对 |", "|---|---|---|---|---|---|---|"]
            for s in spec:
                name = "课程做法 (k=1)" if s["course"] else str(s["k"])
                best = ideal(s["a"], s["mean_k"] if s["k"] == "auto" else s["k"])
                lines.append(f"| {s['a']} | {name} | {s['speedup']:.2f}×（{s['speedup_total']:.2f}×） | {best:.2f}× | "
                             f"{s['mean_k']:.1f} | {s['rounds']:.1f} | {s.get('first_acceptance', float('nan')):.0%} |")
    return lines


def plot(res: dict, file: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    spec = res["runs"]["bfloat16"]["qwen"].get("spec") if "bfloat16" in res["runs"] else None
    if not spec:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    grid = [i / 100 for i in range(30, 96)]
    for k, color in zip(DRAFTS, ("C0", "C1", "C2")):
        pts = [s for s in spec if s["k"] == k and not s["course"]]
        ax.plot([s["a"] for s in pts], [s["speedup"] for s in pts], "o-", color=color, label=f"k = {k}")
        ax.plot(grid, [ideal(a, k) for a in grid], ":", color=color, alpha=0.6)
    auto = [s for s in spec if s["k"] == "auto"]
    ax.plot([s["a"] for s in auto], [s["speedup"] for s in auto], "s-", color="k", label="auto k")
    packed = (res["runs"]["bfloat16"].get("qwen_packed") or {}).get("spec") or []
    auto = [s for s in packed if s["k"] == "auto"]
    if auto:
        ax.plot([s["a"] for s in auto], [s["speedup"] for s in auto], "s--", color="C4", label="auto k, packed")
    course = [s for s in spec if s["course"]]
    ax.plot([s["a"] for s in course], [s["speedup"] for s in course], "x--", color="C3", label="course (k=1)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("acceptance rate a")
    ax.set_ylabel("speed-up over plain greedy")
    ax.set_title(f"speculative decoding, bf16, {res['threads']} threads (dotted: ideal)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(file, dpi=120)
    return True


def machine() -> str:
    """CPU 的型号、核数与向量指令（/proc/cpuinfo 的 flags 里与矩阵乘法有关的几项：数字要连同它们一起报）、torch 的版本。"""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    field = lambda key: next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), "")  # noqa: E731
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16")
    flags = " ".join(f for f in wanted if f in field("flags").split()) or ("没有 AVX2" if lines else "向量指令未知")
    return f"{field('model name') or 'CPU'}，{os.cpu_count()} 核，{flags}，torch {torch.__version__}"
