"""附录 · 基准测试：文档里的表由 bench.json 生成，数字只有一个来源。

    python -m qwen.bench.tables docs/performance.md            # 按 docs/bench.json 重写文件里的表
    python -m qwen.bench.tables docs/performance.md --check    # 只检查：有表与 bench.json 不符时退出码 1

markdown 里每张生成的表夹在一对标记之间：`<!-- bench: 名字 -->` 与 `<!-- /bench -->`，名字是 TABLES 的键。标记之外的
文字不动；标记之间的内容每次整个重写（手改的也会被覆盖）。换了一次完整运行（python -m qwen.bench --json docs/bench.json）
之后跑一遍第一条命令，文档里的表就是这次运行的数字；tests/test_docs.py 核对两者一致。bench.json 默认取文件旁边的那个。
"""

import argparse
import json
import re
import sys
from pathlib import Path

from .probe import PROMPT_LEN
from .report import VARIANTS

MARK = re.compile(r"(<!-- bench: ([\w-]+) -->\n)(.*?)(<!-- /bench -->)", re.S)


def label(key: str, variant: str) -> str:
    """表里一行的名字：bench.json 的 runs 的键（“bfloat16”“bfloat16 int8”：计算的 dtype 加权重的格式），打包的布局另加 packed。"""
    return f"`{key}{VARIANTS[variant]}`"


def measured(res: dict):
    """bench.json 里每一个测过的 qwen：(行的名字, 这种格式的一份结果, qwen 的结果)，按 bench.json 的顺序。"""
    for key, run in res["runs"].items():
        for variant in VARIANTS:
            if run.get(variant):
                yield label(key, variant), run, run[variant]


def run_table(res: dict) -> list:
    """这次运行是在哪台机器上、怎样测的：一句话。"""
    return [f"机器：{res['machine']}；{res['threads']} 个线程；模型 `{res['model']}`；各项与对照轮流测 {res['rounds']} 轮、"
            f"各取最快的一轮；解码是 {PROMPT_LEN} 个 token 的提示词之后的 {res['tokens']} 个 token，预填充 {res['prefill_len']} 个 token。"]


def decode_table(res: dict) -> list:
    """每种格式的解码速度、它离内存带宽的下限多远、预填充与峰值内存。"""
    lines = ["| 格式 | 解码 tok/s（各轮） | 每个 token 读的权重 GB | 同时测的读带宽 GB/s | 带宽下限 tok/s | 占下限 | "
             f"预填充 {res['prefill_len']} tok/s | 峰值内存 GB |", "|---|---|---|---|---|---|---|---|"]
    for name, _, q in measured(res):
        floor = q["bandwidth_gb_s"] * 1e9 / q["bytes_per_token"]  # 每秒最多能把权重读几遍
        rounds = "、".join(f"{x:.1f}" for x in q["decode_rounds"])
        lines.append(f"| {name} | {q['decode_tok_s']:.1f}（{rounds}） | {q['bytes_per_token'] / 1e9:.2f} | "
                     f"{q['bandwidth_gb_s']:.1f} | {floor:.1f} | {q['decode_tok_s'] / floor:.0%} | "
                     f"{res['prefill_len'] / q['prefill_s']:.0f} | {q['peak_rss_gb']:.2f} |")
    return lines


def others(res: dict, run: dict) -> list:
    """同一种格式测过的对照：[(名字, 解码 tok/s, 预填充 tok/s, 备注)]。"""
    found = []
    if h := run.get("transformers"):
        found.append(("transformers", h["decode_tok_s"], res["prefill_len"] / h["prefill_s"], ""))
    if ll := run.get("llama_cpp"):
        notes = "、".join(f"`{f}`" for f in sorted(set(ll.get("fallback") or [])))
        found.append((f"llama.cpp {ll['type'].split()[-1]}", ll["decode_tok_s"], ll["prefill_tok_s"], notes))
    return found


def compare_table(res: dict) -> list:
    """qwen 与同一次运行里轮流测的对照（llama.cpp、transformers）：同样的权重、线程数，只比同一行里的两个数。"""
    lines = ["| 格式 | 对照 | 解码 tok/s：qwen / 对照 | 倍数 | 预填充 tok/s：qwen / 对照 | 倍数 | 对照重测时加的参数 |",
             "|---|---|---|---|---|---|---|"]
    for name, run, q in measured(res):
        pre = res["prefill_len"] / q["prefill_s"]
        for who, dec, pre_other, notes in others(res, run):
            lines.append(f"| {name} | {who} | {q['decode_tok_s']:.1f} / {dec:.1f} | {q['decode_tok_s'] / dec:.2f}× | "
                         f"{pre:.0f} / {pre_other:.0f} | {pre / pre_other:.2f}× | {notes or '—'} |")
    return lines


def spec_cell(rows: list, k) -> str:
    """投机解码表的一格：这个 k 的加速比；自动挑 k 另写第一个草稿实际猜对的比例。"""
    if not rows:
        return "—"
    s = rows[0]
    return f"{s['speedup']:.2f}×" + (f"（猜对 {s['first_acceptance']:.0%}）" if k == "auto" else "")


def round_cost_note(q: dict) -> str:
    """量得的一轮的代价：起草 1～4 个的一轮各花几步普通解码（早先的结果只记了每个草稿的代价 draft_cost）。"""
    if q.get("round_cost"):
        return "，量得起草 1～{} 个的一轮各花 {} 步".format(len(q["round_cost"]) - 1, " / ".join(f"{r:.2f}" for r in q["round_cost"][1:]))
    return f"，量得的起草代价 {q['draft_cost']:.2f} 步" if q.get("draft_cost") is not None else ""


def spec_table(res: dict) -> list:
    """受控接受率的投机解码：每种接受率 a、每种 k 的加速比（按解码阶段算），测了投机解码的每种格式一张。"""
    lines = []
    for name, _, q in measured(res):
        spec = q.get("spec")
        if not spec:
            continue
        vocab = f"起草词表 {q['draft_vocab']} 个 token" if q.get("draft_vocab") else "起草给全词表打分"
        cost = round_cost_note(q)
        gaps = [abs(s["speedup"] - s["speedup_total"]) for s in spec]
        touched = q.get("experts_per_verify")
        experts = "" if not touched else "；一次验证 k + 1 行每层读到的不同专家：" + "、".join(
            f"{r} 行 {n:.1f} 个" for r, n in touched.items())
        lines += [f"{name}：{vocab}{cost}；连同 {PROMPT_LEN} 个 token 的预填充算的加速比与表里的差 {min(gaps):.2f}～{max(gaps):.2f}"
                  f"{experts}。",
                  "",
                  "| 接受率 a | k = 1 | k = 2 | k = 3 | 自动挑 k | 课程做法（k = 1） |", "|---|---|---|---|---|---|"]
        for a in sorted({s["a"] for s in spec}):
            at = [s for s in spec if s["a"] == a]
            cells = [spec_cell([s for s in at if s["k"] == k and not s["course"]], k) for k in (1, 2, 3, "auto")]
            cells.append(spec_cell([s for s in at if s["course"]], 1))
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines[:-1]


TABLES = {"run": run_table, "decode": decode_table, "compare": compare_table, "spec": spec_table}


def render(name: str, res: dict) -> str:
    """一张表（TABLES 里的名字）的 markdown，以换行结尾。"""
    if name not in TABLES:
        raise KeyError(f"没有叫 {name!r} 的表（有：{'、'.join(TABLES)}）")
    return "\n".join(TABLES[name](res)) + "\n"


def update(text: str, res: dict) -> str:
    """text 里每一对标记之间换成按 res（读出的 bench.json）生成的表，其余原样返回。"""
    return MARK.sub(lambda m: m.group(1) + render(m.group(2), res) + m.group(4), text)


def stale(text: str, res: dict) -> list:
    """text 里与 res 不符的表的名字（按出现的顺序）；都相符时是空表。"""
    return [m.group(2) for m in MARK.finditer(text) if m.group(3) != render(m.group(2), res)]


def main(argv=None) -> int:
    """python -m qwen.bench.tables：按 bench.json 重写（--check 时只核对）几个 markdown 文件里的表 → 退出码。"""
    p = argparse.ArgumentParser(prog="python -m qwen.bench.tables", description="按 bench.json 重写 markdown 里生成的表")
    p.add_argument("files", nargs="+", type=Path, help="markdown 文件（表夹在 <!-- bench: 名字 --> 与 <!-- /bench --> 之间）")
    p.add_argument("--json", type=Path, default=None, help="一次完整运行的结果；默认是每个文件旁边的 bench.json")
    p.add_argument("--check", action="store_true", help="不改文件：有表与 bench.json 不符时说出是哪几张，退出码 1")
    args = p.parse_args(argv)
    try:
        return rewrite(args.files, args.json, args.check)
    except KeyError as e:  # 标记里的名字不在 TABLES 里
        print(f"错误：{e.args[0]}", file=sys.stderr)
        return 2


def rewrite(files: list, bench: Path | None, check: bool) -> int:
    """main 的主体：每个文件按它的 bench.json 重写（check 时只核对）→ 退出码。"""
    bad = 0
    for file in files:
        res = json.loads((bench or file.with_name("bench.json")).read_text())
        text = file.read_text()
        if not MARK.search(text):
            print(f"{file}：没有 <!-- bench: 名字 --> 标记", file=sys.stderr)
            bad = 1
        elif check:
            if names := stale(text, res):
                print(f"{file}：这几张表与 bench.json 不符：{'、'.join(names)}（运行 python -m qwen.bench.tables {file}）",
                      file=sys.stderr)
                bad = 1
        elif (new := update(text, res)) != text:
            file.write_text(new)
            print(f"{file}：已按 bench.json 重写")
    return bad


if __name__ == "__main__":
    sys.exit(main())
