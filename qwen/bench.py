"""附录 · 基准测试：解码有多快，离硬件的上限还有多远，投机解码值不值。

    python -m qwen.bench                     # 不用下载：按 0.8B 的形状造随机权重
    python -m qwen.bench --model demo        # 或任何检查点文件夹

同一次运行里、同样的权重、dtype 与线程数，依次测：
1. 普通贪心解码的 token/s：qwen（默认：能编译就用编译的路径；以及 compile=False 的打包布局）、transformers 的
   Qwen3_5ForCausalLM（装了的话）与 llama.cpp（--llama-cpp，给了 llama-bench 与 GGUF 文件时）；
2. 512 个 token 的预填充速度，两者；
3. 内存带宽的下限：解码一个 token 要读的权重字节数 ÷ 与那次解码同时实测的内存读带宽；
4. 受控接受率的投机解码：草稿器知道贪心续写，每个草稿以概率 a 猜对（真的 MTP 照样运行，
   它的代价照算），k = 1、2、3 与自动挑选，对照理想值 (1 − a^(k+1)) / (1 − a)，
   以及课程里的做法（快照、拒绝时重算、全词表起草）；
5. 峰值常驻内存。
每一项在单独的子进程里测，互不干扰；峰值内存因此只算那一项自己的。共享的机器忽快忽慢（实测内存带宽几分钟之内
在 25 与 63 GB/s 之间跳），所以 qwen 与 transformers 轮流测几轮、各取最快的一轮，带宽紧挨着解码测，
投机解码的加速比只与它前后紧挨着测的两次普通贪心（的平均）比；每组设置用草稿器的几个随机种子各测一次（--seeds，
自动挑 k 测两倍），加速比按解码阶段（第一个 token 之后）算，与解码 tok/s 同一口径。
结果打印成表，写成 JSON，并画出加速比对接受率的图（需要 matplotlib）。
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .cache import State
from .fast import layout, warm_up
from .model import Model
from .mtp import MTP, speculate
from .sample import generate, stream
from .train import save_checkpoint
from .weights import Config, find_model, load_config, load_weights

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ACCEPTANCE = (0.5, 0.7, 0.9)
DRAFTS = (1, 2, 3)
PROMPT_LEN = 32  # 解码与投机解码用的提示词长度


class OracleDrafter:
    """知道贪心续写的草稿器：真的 MTP 照样起草（代价照算），然后每个草稿以概率 a 换成正确的 token，
    否则换成一个错的。每个草稿独立地以概率 a 猜对，于是一轮期望产出 (1 − a^(k+1)) / (1 − a) 个 token。"""

    def __init__(self, mtp, sequence: list, a: float, seed: int = 0):
        self.mtp, self.seq, self.a = mtp, sequence, a  # sequence：提示词 + 贪心续写
        self.draft_cost = mtp.draft_cost  # 自动挑草稿数时按真的草稿头的代价算
        self.gen = torch.Generator().manual_seed(seed)

    def draft(self, model, tokens, hidden, start, k, state, *sampling):
        _, qs = self.mtp.draft(model, tokens, hidden, start, k, state, *sampling)
        first = start + tokens.shape[1] + 1  # 第一个草稿在整个序列里的位置
        drafts = []
        for i in range(k):
            target = self.seq[first + i] if first + i < len(self.seq) else 0
            if torch.rand((), generator=self.gen) >= self.a:
                target = (target + 1) % model.cfg.vocab_size  # 故意猜错
            drafts.append(target)
        return drafts, qs


# ---------- 随机权重的检查点 ----------


def random_checkpoint(path, cfg: Config, dtype=torch.bfloat16, seed: int = 0) -> Path:
    """按 cfg 的形状造随机权重，按发布检查点的布局写到 path（含 mtp.*）。

    嵌入的每个元素取 N(0, 1)（与 norm 之后的隐藏状态同一尺度），写回残差流的三个投影（o_proj、out_proj、
    down_proj）缩小到 0.1 倍，像训练过的模型那样每层只微调残差。这样贪心续写的 top-1 与 top-2 之间差得远，
    不会被 bfloat16 的舍入（以及验证时一次算几行带来的舍入差异）改变；否则 24 万个随机 logits 几乎打平，
    “贪心续写”本身都不稳定，受控接受率的实验也就无从谈起。速度与权重的取值无关。
    """
    gen = torch.Generator().manual_seed(seed)

    def fill(name, shape):
        if name.endswith("A_log"):
            return torch.empty(shape).uniform_(1, 16, generator=gen).log()
        if name.endswith("dt_bias"):
            return torch.randn(shape, generator=gen) * 0.5
        if name.endswith("linear_attn.norm.weight"):
            return 1 + 0.1 * torch.randn(shape, generator=gen)
        if len(shape) == 1:  # 零中心的 norm 权重
            return 0.1 * torch.randn(shape, generator=gen)
        if name.endswith("embed_tokens.weight"):
            return torch.randn(shape, generator=gen).to(dtype)
        scale = 0.1 if name.split(".")[-2] in ("o_proj", "out_proj", "down_proj") else 1.0
        return (torch.randn(shape, generator=gen) * (scale / math.sqrt(math.prod(shape[1:])))).to(dtype)

    tensors = {}
    for part, cls in (("model", Model), ("mtp", MTP)):
        with torch.device("meta"):
            module = cls(cfg)
        names = {k: v.shape for k, v in module.state_dict().items() if k != "lm_head.weight" or not cfg.tie_word_embeddings}
        tensors[part] = {k: fill(k, shape) for k, shape in names.items()}
    return save_checkpoint(path, cfg, tensors["model"], tensors["mtp"])


# ---------- 机器与模型的事实 ----------


PROBE_GIB = 1.0  # 测带宽用的缓冲区：远大于缓存（这台机器的 L3 是 32 MB）


def read_bandwidth(x: torch.Tensor | None = None, repeats: int = 5) -> float:
    """内存读带宽（GB/s）：对一块远大于缓存的 float32 张量求和，取最快的一次。x 不给就临时建一块 PROBE_GIB 的。"""
    x = torch.ones(int(PROBE_GIB * 2**30) // 4) if x is None else x
    best = min(timed(lambda: x.sum())[0] for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def bytes_per_token(model) -> int:
    """解码一个 token 要读的权重字节数：每个矩阵读一遍（换了布局的按它的原始形状算，分块布局补的零行不算）；
    嵌入表只查一行。"""
    from torch import nn

    from .fast.linear import BlockedLinear, PackedLinear

    total = 0
    for m in model.modules():
        if isinstance(m, (PackedLinear, BlockedLinear)):
            itemsize = 1 if getattr(m, "scales", None) is not None else m.dtype.itemsize  # int8 的块一个数一字节
            total += m.out_features * (m.in_features * itemsize + (itemsize == 1) * 4)  # int8 另有每个输出的比例
        elif m is not model.embed_tokens:  # nn.Linear 的权重、各种 norm 与 DeltaNet 的小参数
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total + model.cfg.hidden_size * model.dtype.itemsize


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def peak_rss_gb() -> float:
    """本进程的峰值常驻内存，单位 GB（10⁹ 字节）。

    Linux 上读 /proc/self/status 的 VmHWM。getrusage 的 ru_maxrss 不能用在子进程里：Linux 在 exec 时把父进程的峰值
    也记了进去（实测父进程占过 3.4 GB 之后，只导入了 torch 的子进程报 3.45 GB；本基准的父进程造随机权重、
    测带宽时峰值约 2.4 GB）。别的系统上退回 ru_maxrss。
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9  # 单位 kB
    except OSError:
        pass
    import resource  # 不是所有系统都有（Windows 没有），只在用到时导入

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9  # macOS 是字节，Linux 是 KiB


def prompt_ids(cfg, n, seed=0):
    return torch.randint(0, min(cfg.vocab_size, 30000), (1, n), generator=torch.Generator().manual_seed(seed))


# ---------- 两个子进程：qwen 与 transformers ----------


def run_qwen(path, dtype, tokens, prefill_len, spec: bool, compile: bool | None = None, seeds: int = 3,
             quantize: str | None = None) -> dict:
    model = Model.from_pretrained(path, dtype=dtype, compile=compile, quantize=quantize)
    mtp = MTP.from_pretrained(model.cfg, path, dtype=dtype, compile=compile, quantize=quantize) if spec else None  # 先加载：像真实使用那样一开始就备好
    cfg, out = model.cfg, {}
    out["bytes_per_token"] = bytes_per_token(model)
    out["layout"] = layout(model)
    prompt = prompt_ids(cfg, PROMPT_LEN)
    long = prompt_ids(cfg, prefill_len, seed=1)
    with torch.inference_mode():
        out["warm_up_s"] = warm_up(model, mtp)  # 编译各张图（不算进下面的计时）；有草稿头时量出这台机器上起草的代价
        out["draft_cost"] = mtp.draft_cost if mtp is not None else None
        generate(model, prompt, 4)
        model(long, State(model), last=True)
        out["prefill_s"] = min(timed(lambda: model(long, State(model), last=True))[0] for _ in range(2))

    def plain_run(n):  # 普通贪心生成 n 个 token → (总秒数, 解码阶段的秒数：第一个 token 产出之后)
        t0 = time.perf_counter()
        it = stream(model, prompt, n)
        next(it)
        t1 = time.perf_counter()
        list(it)
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    def decode():  # 解码 tokens 个 token 的秒数（不含预填充）
        return plain_run(tokens + 1)[1]

    plain = generate(model, prompt, tokens)  # 普通贪心的输出：投机解码要与它逐个相同
    out["plain_tokens"] = plain

    if spec:
        seq = prompt[0].tolist() + plain
        runs = []
        speculate(model, OracleDrafter(mtp, seq, 0.9), prompt, 16)  # 预热：提示词长度的草稿头前向

        # 共享的机器上速度会成段地变（实测内存带宽几分钟之内在 30 与 55 GB/s 之间跳，同一组设置的普通贪心
        # 前后两次能差三成），所以每次投机解码前后各测一次普通贪心，加速比只与这两次的平均比。
        # 加速比按解码阶段算（第一个 token 选出之后，与上面的解码 tok/s 同一口径）：预填充两边是同一件事，
        # 预填充的速度单独报告；含预填充的加速比也记下（speedup_total）
        before = plain_run(tokens)

        def run(a, k, recompute=False, full_vocab=False):
            """一组设置测 seeds 次（草稿器的随机种子不同：64 个 token 里猜对几个本身就有起伏），每次前后紧挨着普通贪心；
            加速比 = 普通贪心的总秒数 ÷ 投机解码的总秒数（各次加起来），每次的单独记在 speedups 里。
            自动挑 k 测两倍的次数：接受率低时它只起草十来个，3 个种子实际猜对的比例离 a 很远（a = 0.3 时测到过 15%）。"""
            nonlocal before
            vocab = mtp.draft_ids
            if full_vocab:
                mtp.draft_ids = None
            rows = []  # 每次：(投机解码总秒数, 其中解码阶段, 普通贪心总秒数, 其中解码阶段)
            results = []
            for seed in range(seeds if k else 2 * seeds):
                t, r = timed(lambda: speculate(model, OracleDrafter(mtp, seq, a, seed), prompt, tokens,
                                               draft_tokens=k, recompute=recompute))
                after = plain_run(tokens)
                plain_total, plain_t = [(x + y) / 2 for x, y in zip(before, after)]
                before = after
                rows.append((t, t - r.prefill_seconds, plain_total, plain_t))
                results.append(r)
            mtp.draft_ids = vocab
            spec_total, spec_t, plain_total, plain_t = [sum(col) for col in zip(*rows)]
            same = min(next((i for i, (x, y) in enumerate(zip(r.tokens, plain)) if x != y), len(plain)) for r in results)
            ks = [d for r in results for d, _, _ in r.trace if d]
            runs.append(dict(a=a, k=k or "auto", course=recompute, seconds=spec_t, plain_seconds=plain_t,
                             speedup=plain_t / spec_t, speedups=[row[3] / row[1] for row in rows],
                             seconds_total=spec_total, plain_seconds_total=plain_total, speedup_total=plain_total / spec_total,
                             acceptance=sum(r.hits for r in results) / max(sum(r.drafted for r in results), 1),
                             first_acceptance=sum(r.accepted_at[0] for r in results) / max(sum(r.tried_at[0] for r in results), 1),
                             rounds=sum(r.rounds for r in results) / len(results), mean_k=sum(ks) / max(len(ks), 1),
                             same_prefix=same))

        for a in ACCEPTANCE:
            for k in DRAFTS:
                run(a, k)
        for a in (0.3,) + ACCEPTANCE:
            run(a, None)
        for a in ACCEPTANCE:
            run(a, 1, recompute=True, full_vocab=True)
        out["spec"] = runs
        out["draft_vocab"] = None if mtp.draft_ids is None else len(mtp.draft_ids)
    out["peak_rss_gb"] = peak_rss_gb()  # 模型运行的峰值：在下面建测带宽的缓冲区之前读

    # 解码速度与带宽下限：每次解码前后各测一次带宽，下限用同一时刻的带宽（取前后大的那个，下限更紧）
    probe = torch.ones(int(PROBE_GIB * 2**30) // 4)
    decode()  # 预热
    reps = []
    for _ in range(3):
        before = read_bandwidth(probe)
        t = decode()
        reps.append((tokens / t, max(before, read_bandwidth(probe))))
    out["decode_tok_s"], out["bandwidth_gb_s"] = max(reps)  # 最快的一次，与它同时测的带宽
    out["decode_runs"] = reps
    return out


def run_transformers(path, dtype, tokens, prefill_len) -> dict:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = load_config(path)
    text = json.loads((Path(path) / "config.json").read_text())
    text = text.get("text_config", text)
    text["model_type"] = "qwen3_5_text"
    hf_cfg = Qwen3_5TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    hf = Qwen3_5ForCausalLM._from_config(hf_cfg, dtype=dtype).eval()
    sd = {"model." + k: v.to(dtype) for k, v in load_weights(path, "model.").items()}
    hf.load_state_dict(sd, strict=False)
    hf.tie_weights()
    prompt, long = prompt_ids(cfg, 32), prompt_ids(cfg, prefill_len, seed=1)
    out = {}
    with torch.inference_mode():
        hf(long[:, :8])
        out["prefill_s"] = min(timed(lambda: hf(long, use_cache=True, logits_to_keep=1))[0] for _ in range(2))

        def decode():
            o = hf(prompt, use_cache=True, logits_to_keep=1)
            past, tok = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
            toks = [int(tok)]
            t0 = time.perf_counter()
            for _ in range(tokens):
                o = hf(tok, past_key_values=past, use_cache=True)
                past, tok = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
                toks.append(int(tok))
            return time.perf_counter() - t0, toks[:tokens]  # 与 generate 同口径：从预填充给出的第一个算起

        best = min(decode() for _ in range(3))
    out["decode_tok_s"] = tokens / best[0]
    out["tokens"] = best[1]
    out["peak_rss_gb"] = peak_rss_gb()
    return out


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    if args.worker == "qwen":
        out = run_qwen(args.model, dtype, args.tokens, args.prefill, spec=not args.no_spec,
                       compile=False if args.packed else None, seeds=args.seeds, quantize=args.quantize)
    else:
        out = run_transformers(args.model, dtype, args.tokens, args.prefill)
    print("RESULT " + json.dumps(out))


def child(args, which: str, dtype: str, spec: bool = True, packed: bool = False) -> dict | None:
    cmd = [sys.executable, "-m", "qwen.bench", "--worker", which, "--model", str(args.model), "--dtype", dtype,
           "--threads", str(args.threads), "--tokens", str(args.tokens), "--prefill", str(args.prefill),
           "--seeds", str(args.seeds)]
    if args.quantize and not packed:
        cmd += ["--quantize", args.quantize]
    if not spec:
        cmd.append("--no-spec")
    if packed:
        cmd.append("--packed")
        which += " compile=False"
    print(f"  测 {which}（{dtype}）…", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        print(f"  {which}（{dtype}）失败：\n{p.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(line[len("RESULT "):])


def find_gguf(args) -> Path | None:
    """--gguf 给的文件；没给时在模型文件夹里找唯一的一个 .gguf。"""
    if args.gguf:
        return Path(args.gguf)
    found = sorted(Path(args.model).glob("*.gguf"))
    return found[0] if len(found) == 1 else None


def run_llama(args, gguf: Path) -> dict | None:
    """llama.cpp 的 llama-bench，与 qwen 同样的线程数：解码 tokens 个 token（前面已有 32 个 token 的上下文，
    与 qwen 的提示词一样长）与 prefill 个 token 的预填充。返回 tok/s；找不到程序或失败时打印原因、返回 None。"""
    exe = Path(args.llama_cpp) / "llama-bench"
    out = {}
    for key, flags in (("decode_tok_s", ["-p", "0", "-n", str(args.tokens), "-d", str(PROMPT_LEN)]),
                       ("prefill_tok_s", ["-p", str(args.prefill), "-n", "0"])):
        cmd = [str(exe), "-m", str(gguf), "-t", str(args.threads), "-r", "2", "-o", "json"] + flags
        print(f"  测 llama.cpp {key.split('_')[0]}（{gguf.name}）…", file=sys.stderr, flush=True)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True)
            out[key] = json.loads(p.stdout)[0]["avg_ts"]
            out["type"] = json.loads(p.stdout)[0]["model_type"]
        except (OSError, ValueError, IndexError, KeyError) as e:
            print(f"  llama.cpp 失败（{' '.join(cmd)}）：{type(e).__name__} {e}\n{getattr(p, 'stderr', '')[-1000:]}",
                  file=sys.stderr)
            return None
    return out


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


# ---------- 汇总：表格、JSON、图 ----------


def ideal(a: float, k: int) -> float:
    return (1 - a ** (k + 1)) / (1 - a)


VARIANTS = {"qwen": "", "qwen_packed": " compile=False"}  # 每种 dtype 测的 qwen：默认（能编译就编译）；oneDNN 打包的布局


def report(res: dict) -> str:
    lines = [f"机器：{res['machine']}；线程 {res['threads']}；模型：{res['model']}；"
             f"qwen 与 transformers 轮流测 {res['rounds']} 轮，各取最快的一轮"
             + ("；qwen 的矩阵是 int8（quantize=\"int8\"）" if res.get("quantize") else ""), ""]
    lines.append("| dtype | qwen 解码 tok/s | transformers 解码 tok/s | 倍数 | 同时测的带宽 GB/s | 带宽下限 tok/s | 占下限 | "
                 f"预填充 {res['prefill_len']} tok/s qwen / transformers | 峰值内存 GB |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
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
    lines += ["", f"整个运行里测到的最高读带宽 {res['machine_bandwidth_gb_s']:.1f} GB/s。"] + notes
    for dtype, r in res["runs"].items():
        ll = r.get("llama_cpp")
        if not ll:
            continue
        lines += ["", f"llama.cpp（{ll['type']}，{Path(ll['file']).name}，llama-bench，同样的线程数，与 qwen 轮流测，各取最快）：",
                  "| | 解码 tok/s（32 个 token 的上下文之后） | 预填充 tok/s |", "|---|---|---|",
                  f"| llama.cpp | {ll['decode_tok_s']:.1f} | {ll['prefill_tok_s']:.0f} |"]
        for key, label in VARIANTS.items():
            q = r.get(key)
            if q:
                pre = res["prefill_len"] / q["prefill_s"]
                lines.append(f"| qwen {dtype}{label} | {q['decode_tok_s']:.1f}（{q['decode_tok_s'] / ll['decode_tok_s']:.2f}×） | "
                             f"{pre:.0f}（{pre / ll['prefill_tok_s']:.2f}×） |")
    for dtype, r in res["runs"].items():
        for key, label in VARIANTS.items():
            spec = (r.get(key) or {}).get("spec")
            if not spec:
                continue
            lines += ["", f"投机解码（{dtype}{label}，{res['tokens']} 个 token，相对前后紧挨着测的两次普通贪心；加速比按解码阶段算，"
                      f"与解码 tok/s 同一口径，括号里是含预填充（{PROMPT_LEN} 个 token 的提示词）的；草稿词表 "
                      f"{r[key]['draft_vocab'] or '全部'}）", "| 接受率 a | k | 加速比（含预填充） | 理想值 | 平均 k | 平均轮数 | 第一个草稿实际猜对 |",
                      "|---|---|---|---|---|---|---|"]
            for s in spec:
                name = "课程做法 (k=1)" if s["course"] else str(s["k"])
                best = ideal(s["a"], s["mean_k"] if s["k"] == "auto" else s["k"])
                lines.append(f"| {s['a']} | {name} | {s['speedup']:.2f}×（{s['speedup_total']:.2f}×） | {best:.2f}× | "
                             f"{s['mean_k']:.1f} | {s['rounds']:.1f} | {s.get('first_acceptance', float('nan')):.0%} |")
    return "\n".join(lines)


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
        ax.plot([s["a"] for s in auto], [s["speedup"] for s in auto], "s--", color="C4", label="auto k, compile=False")
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
    name = "CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}，{os.cpu_count()} 核，torch {torch.__version__}"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m qwen.bench", description="解码、预填充、投机解码与内存的基准测试")
    p.add_argument("--model", default=None, help="检查点文件夹或 demo；默认按 0.8B 的形状造随机权重")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "both"], default="both")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--tokens", type=int, default=64, help="每次解码的新 token 数")
    p.add_argument("--prefill", type=int, default=512, help="预填充的提示词长度")
    p.add_argument("--no-transformers", action="store_true", help="不测 transformers")
    p.add_argument("--llama-cpp", metavar="DIR", default=None,
                   help="同时测 llama.cpp：DIR 里有 llama-bench（与第一种 dtype 的 qwen 轮流测，报告比值）")
    p.add_argument("--gguf", default=None, help="llama.cpp 用的 GGUF 文件（默认：模型文件夹里唯一的 .gguf）")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="qwen（默认的编译路径）的矩阵存成 int8；与 llama.cpp 的 Q8_0 比时用（--gguf 给 Q8_0 的文件）")
    p.add_argument("--no-packed", action="store_true", help="不另测 compile=False（oneDNN 打包的布局）的 qwen")
    p.add_argument("--seeds", type=int, default=3, help="投机解码的每组设置测几次（草稿器的随机种子不同；自动挑 k 测两倍），加起来算加速比")
    p.add_argument("--rounds", type=int, default=2, help="qwen 与 transformers 轮流测几轮（各取最快的一轮）")
    p.add_argument("--json", default="bench.json")
    p.add_argument("--png", default="bench.png")
    p.add_argument("--worker", choices=["qwen", "transformers"], help=argparse.SUPPRESS)
    p.add_argument("--no-spec", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="qwen-bench-")
        print("按 Qwen3.5-0.8B 的形状造随机权重（bfloat16）…", file=sys.stderr, flush=True)
        args.model = random_checkpoint(tmp.name, Config())
        name = "随机权重，Qwen3.5-0.8B 的形状"
    else:
        args.model = find_model(args.model)
        name = str(args.model)
    gguf = find_gguf(args) if args.llama_cpp else None
    if args.llama_cpp and gguf is None:
        sys.exit(f"错误：--llama-cpp 要一个 GGUF 文件：用 --gguf 指定（{args.model} 里没有唯一的 .gguf）")
    has_hf = not args.no_transformers
    if has_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            has_hf = False
    bandwidths = [read_bandwidth()]  # 父进程在开头、结尾各测一次：整个运行里机器的最高读带宽
    res = dict(machine=machine(), threads=args.threads, model=name, tokens=args.tokens, prefill_len=args.prefill,
               rounds=args.rounds, quantize=args.quantize, runs={})
    dtypes = ["bfloat16", "float32"] if args.dtype == "both" else [args.dtype]
    for dtype in dtypes:
        # qwen 与 transformers 轮流测 rounds 轮，各取最快的一轮：共享机器的快慢时段两边都有机会碰上。
        # 第一轮的 qwen 子进程还测投机解码与峰值内存
        # compile=False（打包的布局）的 qwen 也在同一轮里测（--no-packed 不测）
        qs, cs, hs, ls = [], [], [], []
        for r in range(args.rounds):
            spec = r == 0 and (dtype == "bfloat16" or len(dtypes) == 1)
            q = child(args, "qwen", dtype, spec=spec)
            qs += [q] if q is not None else []
            c = child(args, "qwen", dtype, spec=spec, packed=True) if not args.no_packed and (r == 0 or cs) else None
            cs += [c] if c is not None else []
            h = child(args, "transformers", dtype) if has_hf and (r == 0 or hs) else None
            hs += [h] if h is not None else []
            if gguf is not None and dtype == dtypes[0] and (r == 0 or ls):
                lr = run_llama(args, gguf)
                ls += [lr] if lr is not None else []
        if not qs:
            continue
        q = merge_rounds(qs)
        run = {"qwen": q}
        if cs:
            c = run["qwen_packed"] = merge_rounds(cs)
            run["packed_agreement"] = sum(a == b for a, b in zip(q["plain_tokens"], c["plain_tokens"])) / len(q["plain_tokens"])
            del c["plain_tokens"]
        if hs:
            h = merge_rounds(hs)
            run["transformers"] = h
            same = sum(a == b for a, b in zip(q["plain_tokens"], h["tokens"]))
            run["greedy_agreement"] = same / len(h["tokens"])
            del h["tokens"]
        if ls:  # 各轮里最快的那次
            run["llama_cpp"] = dict(type=ls[0]["type"], file=str(gguf), decode_tok_s=max(x["decode_tok_s"] for x in ls),
                                    prefill_tok_s=max(x["prefill_tok_s"] for x in ls),
                                    decode_rounds=[x["decode_tok_s"] for x in ls], prefill_rounds=[x["prefill_tok_s"] for x in ls])
        del q["plain_tokens"]
        res["runs"][dtype] = run
    bandwidths.append(read_bandwidth())
    res["machine_bandwidth_gb_s"] = max(bandwidths + [r[k]["bandwidth_gb_s"] for r in res["runs"].values()
                                                      for k in VARIANTS if k in r])
    if tmp is not None:
        tmp.cleanup()
    print(report(res))
    Path(args.json).write_text(json.dumps(res, indent=2, ensure_ascii=False))
    print(f"\n数字已写入 {args.json}", end="")
    if plot(res, Path(args.png)):
        print(f"，图已写入 {args.png}")
    else:
        print("（没有画图：需要 matplotlib，或没有 bfloat16 的投机解码结果）")


if __name__ == "__main__":
    main()
