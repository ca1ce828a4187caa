"""附录 · 基准测试：子进程里测一次 qwen（解码、预填充、投机解码、带宽下限）或 transformers。"""

import json
import time
from pathlib import Path

import torch

from ..cache import State
from ..fast import describe, load, warm_up
from ..mtp import speculate
from ..sample import generate, stream
from ..weights import load_config, load_weights
from .oracle import OracleDrafter
from .probe import PROMPT_LEN, bytes_per_token, peak_rss_gb, probe_buffer, prompt_ids, read_bandwidth, timed

ACCEPTANCE = (0.5, 0.7, 0.9)
DRAFTS = (1, 2, 3)


def run_qwen(path, dtype, tokens, prefill_len, spec: bool, layout: str = "auto", seeds: int = 3,
             quantize: str | None = None) -> dict:
    model, mtp = load(path, layout, quantize, dtype, draft=spec)  # 草稿头先加载：像真实使用那样一开始就备好
    out = dict(bytes_per_token=bytes_per_token(model), layout=describe(model))
    prompt, long = prompt_ids(model.cfg, PROMPT_LEN), prompt_ids(model.cfg, prefill_len, seed=1)
    with torch.inference_mode():
        out["warm_up_s"] = warm_up(model, mtp)  # 编译各张图（不算进下面的计时）；有草稿头时量出这台机器上起草的代价
        out["round_cost"] = mtp.round_cost if mtp is not None else None
        generate(model, prompt, 4)
        model(long, State(model), last=True)
        out["prefill_s"] = min(timed(lambda: model(long, State(model), last=True))[0] for _ in range(2))
    plain = generate(model, prompt, tokens)  # 普通贪心的输出：投机解码要与它逐个相同
    out["plain_tokens"] = plain
    if model.cfg.num_experts:  # 专家混合：一次验证 k + 1 行碰到几个不同的专家（每层平均）
        out["experts_per_verify"] = experts_per_verify(model, torch.cat([prompt[0], torch.tensor(plain)])[None])
    if spec:
        out["spec"] = SpecBench(model, mtp, prompt, plain, tokens, seeds).all()
        out["draft_vocab"] = None if mtp.draft_ids is None else len(mtp.draft_ids)
    out["peak_rss_gb"] = peak_rss_gb()  # 模型运行的峰值：在下面建测带宽的缓冲区之前读
    out.update(decode_and_bandwidth(model, prompt, tokens))
    return out


def experts_per_verify(model, ids, rows=(1, 2, 3, 4, 5)) -> dict:
    """贪心续写的 token 上，相继 r 行（一次验证 k = r − 1 个草稿）平均碰到几个不同的专家（各层平均）：每层的路由照
    快路径的 route_rows 算（路由器的输入由钩子记下）→ {r: 个数}。"""
    from ..fast.experts import route_rows

    picks = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, i, o: picks.append(o.reshape(-1, o.shape[-1])))
             for layer in model.layers]
    with torch.enable_grad():  # 求导开着时快路径的专家混合层走 Python 的写法（router 是一个模块，钩子看得见）
        model(ids)
    for h in hooks:
        h.remove()
    idx = [route_rows(s[:, :-1].detach(), model.cfg.num_experts_per_tok)[1] for s in picks]  # 每层 [T, k]
    T = ids.shape[1]
    return {r: sum(len(set(i[t : t + r].flatten().tolist())) for i in idx for t in range(T - r)) / (len(idx) * (T - r))
            for r in rows}


def plain_run(model, prompt, n):
    """普通贪心生成 n 个 token → (总秒数, 解码阶段的秒数：第一个 token 产出之后)。"""
    t0 = time.perf_counter()
    it = stream(model, prompt, n)
    next(it)
    t1 = time.perf_counter()
    list(it)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def decode_and_bandwidth(model, prompt, tokens) -> dict:
    """解码速度与带宽下限：每次解码前后各测一次带宽，下限用同一时刻的带宽（取前后大的那个，下限更紧）。"""
    probe = probe_buffer()
    plain_run(model, prompt, tokens + 1)  # 预热
    reps = []
    for _ in range(3):
        before = read_bandwidth(probe)
        t = plain_run(model, prompt, tokens + 1)[1]  # 解码 tokens 个 token 的秒数（不含预填充）
        reps.append((tokens / t, max(before, read_bandwidth(probe))))
    best = max(reps)  # 最快的一次，与它同时测的带宽
    return dict(decode_tok_s=best[0], bandwidth_gb_s=best[1], decode_runs=reps)


class SpecBench:
    """受控接受率的投机解码，各组设置。共享的机器上速度会成段地变（同一组设置的普通贪心前后两次能差不少），所以每次
    投机解码前后各测一次普通贪心，加速比只与这两次的平均比。加速比按解码阶段算（第一个 token 选出之后，与解码 tok/s
    同一口径）：预填充两边是同一件事，单独报告；含预填充的加速比也记下（speedup_total）。"""

    def __init__(self, model, mtp, prompt, plain, tokens: int, seeds: int):
        self.model, self.mtp, self.prompt, self.plain, self.tokens, self.seeds = model, mtp, prompt, plain, tokens, seeds
        self.seq = prompt[0].tolist() + plain
        speculate(model, OracleDrafter(mtp, self.seq, 0.9), prompt, 16)  # 预热：提示词长度的草稿头前向
        self.before = plain_run(model, prompt, tokens)

    def all(self) -> list:
        runs = [self.run(a, k) for a in ACCEPTANCE for k in DRAFTS]
        runs += [self.run(a, None) for a in (0.3,) + ACCEPTANCE]
        return runs + [self.run(a, 1, recompute=True, full_vocab=True) for a in ACCEPTANCE]

    def run(self, a, k, recompute=False, full_vocab=False) -> dict:
        """一组设置测 seeds 次（草稿器的随机种子不同：几十个 token 里猜对几个本身就有起伏），每次前后紧挨着普通贪心；
        加速比 = 普通贪心的秒数 ÷ 投机解码的秒数（各次加起来），每次的单独记在 speedups 里。
        自动挑 k 测两倍的次数：接受率低时它起草得少，几个种子实际猜对的比例可能离 a 很远。"""
        vocab, tokens = self.mtp.draft_ids, self.tokens
        if full_vocab:
            self.mtp.draft_ids = None
        rows, results = [], []  # 每次：(投机解码总秒数, 其中解码阶段, 普通贪心总秒数, 其中解码阶段)
        for seed in range(self.seeds if k else 2 * self.seeds):
            t, r = timed(lambda: speculate(self.model, OracleDrafter(self.mtp, self.seq, a, seed), self.prompt, tokens,
                                           draft_tokens=k, recompute=recompute))
            after = plain_run(self.model, self.prompt, tokens)
            plain_total, plain_t = [(x + y) / 2 for x, y in zip(self.before, after)]
            self.before = after
            rows.append((t, t - r.prefill_seconds, plain_total, plain_t))
            results.append(r)
        self.mtp.draft_ids = vocab
        return summary(a, k, recompute, rows, results, self.plain)


def summary(a, k, recompute, rows, results, plain) -> dict:
    """一组设置的几次 → 一行结果。"""
    spec_total, spec_t, plain_total, plain_t = [sum(col) for col in zip(*rows)]
    same = min(next((i for i, (x, y) in enumerate(zip(r.tokens, plain)) if x != y), len(plain)) for r in results)
    ks = [d for r in results for d, _, _ in r.trace if d]
    return dict(a=a, k=k or "auto", course=recompute, seconds=spec_t, plain_seconds=plain_t,
                speedup=plain_t / spec_t, speedups=[row[3] / row[1] for row in rows],
                seconds_total=spec_total, plain_seconds_total=plain_total, speedup_total=plain_total / spec_total,
                acceptance=sum(r.hits for r in results) / max(sum(r.drafted for r in results), 1),
                first_acceptance=sum(r.accepted_at[0] for r in results) / max(sum(r.tried_at[0] for r in results), 1),
                rounds=sum(r.rounds for r in results) / len(results), mean_k=sum(ks) / max(len(ks), 1),
                same_prefix=same)


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
    prompt, long = prompt_ids(cfg, PROMPT_LEN), prompt_ids(cfg, prefill_len, seed=1)
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
