"""附录 · 用之前：把各张图编译好，并量出这台机器上起草 k 个的一轮花几步普通解码（自动挑草稿数用）。"""

import time

import torch

from ..attention import AttentionState
from ..cache import State, copy_state, keep_history
from ..mtp import MAX_DRAFTS, Run
from ..sample import stream
from .draft import FastMTP
from .layers import DECODE_LENGTHS
from .load import describe
from .records import read_record, write_record

SETTLE = 4  # 量一轮的代价时，最初几次产出之后的间隔也不算：刚开始的几步慢一些（数字见 docs/perf-history.md）
# 量出的代价的下限：起草一个 token 至少要草稿头的一层与多验证一行，比这还低只能是量错了（量得的值见 docs/perf-history.md）
MIN_DRAFT_COST = 0.05


@torch.inference_mode()
def warm_up(model, mtp=None, calibrate: bool | str = True) -> float:
    """把解码与投机解码要用的图都编译好（第一次在这台机器上要一会儿，之后从磁盘缓存读），返回用了几秒。
    calibrate 且有草稿头时，再量一量起草 k 个的一轮投机解码在这台机器上花几步普通解码，设给 mtp.round_cost（见 measure_round_cost）；
    量出的值按模型的配置、dtype、布局、线程数记在 record_file("round_cost.json") 里，之后直接用（删掉这个文件就重新量）。
    calibrate="recorded"：只用记下的值，没有就保留初值，不当场量（命令行：第一个回答不等这十几秒）。
    不编译的布局（打包、普通）没有图要编译，只做校准。"""
    t0 = time.perf_counter()
    ids = torch.arange(1, 9)[None] % model.cfg.vocab_size  # 随便 8 个 token
    state = State(model)
    hidden = model.hidden(ids, state)  # 预填充（8 行的 matvec）
    if getattr(model, "layout", None) == "graphs":
        for T in model.step_lengths:  # 解码 1 个 token；验证 1～4 个草稿（记历史的那一版）
            s = copy_state(state)
            if T > 1:
                keep_history(s)
            model(ids[:, :T], s)
    if mtp is not None and isinstance(mtp, FastMTP) and mtp.step is not None:
        cache = AttentionState()
        mtp(model.embed_tokens(ids), hidden, 0, cache)  # 草稿头读提示词（不编译）
        for T in DECODE_LENGTHS:  # 起草一个 token；送进上一轮留下的几对
            c = copy_state(cache)
            mtp(model.embed_tokens(ids[:, :T]), hidden[:, :T], 8, c)
        mtp.draft_logits(model, hidden[:, :1])
    if mtp is not None and calibrate:
        key = (f"量法 5 · {model.cfg} · {model.dtype} · {describe(model)} · 草稿词表 {getattr(mtp, 'draft_note', '全词表')} · "
               f"{torch.get_num_threads()} 线程 · torch {torch.__version__}")
        cost = read_record("round_cost.json", key)
        if not valid_round_cost(cost) and calibrate != "recorded":  # 没量过这种设置：量一次，记下来（之后的运行用同一组值，带种子的采样才可复现）
            cost = measure_round_cost(model, mtp, torch.arange(1, 33)[None] % model.cfg.vocab_size)  # 32 个 token 的提示词
            write_record("round_cost.json", key, cost)
        mtp.round_cost = cost if valid_round_cost(cost) else mtp.round_cost
    return time.perf_counter() - t0


def valid_round_cost(cost) -> bool:
    """记下的 round_cost 能用：MAX_DRAFTS + 1 个数，第一个是 1（不起草的一轮就是一步），随 k 不减。"""
    return (isinstance(cost, list) and len(cost) == MAX_DRAFTS + 1 and all(isinstance(c, float) for c in cost) and cost[0] == 1.0
            and cost == sorted(cost))


def measure_round_cost(model, mtp, ids, rounds: int = 3, per: int = 6) -> list[float]:
    """这台机器上起草 k 个的一轮投机解码花几步普通解码：[1, r₁, …, r_MAX_DRAFTS]（第 14 章 best_draft_count 的 round_cost）。
    量的是真实的循环：固定起草 k = 1…4 个时每一轮（起草、验证、提交）的间隔 t，紧挨着它再量普通解码每个 token 的间隔 t₀，
    一对一对地比 t / t₀（这一轮真的起草了几个记下来，预算快用完时会少）。内存带宽一会儿快一会儿慢，分开量的 t₀
    与 t 不能比：量得太低时服务以为起草不要钱，就一直起草。每个起草数取这几对的中位数，各算各的：一轮的固定开销（草稿头读
    上一轮留下的几对、记历史、提交）与每个草稿的代价都在里面，不假设它随 k 线性地长（验证的行数跨过某个门槛时一下子贵起来，
    直线会把它摊给别的 k）。多起草不会更便宜：量得的起伏取前一个；也至少 1 + MIN_DRAFT_COST·k。头两次产出不算：一次是
    预填充，一次是草稿头第一次读提示词；再往后的 SETTLE 个间隔也不算：普通解码最初的几步比之后慢，把它们当 t₀，一轮的
    代价就量低了，小模型上会去起草其实不划算的草稿。rounds：量几遍；per：每遍每个起草数量几轮。"""
    def gaps(generator):
        times, t = [], None
        for _ in generator:
            now = time.perf_counter()
            times.append(None if t is None else now - t)
            t = now
        return times[2 + SETTLE :]  # 第 0 个是预填充结束，第 1 个间隔含草稿头读提示词，再往后 SETTLE 个还没稳下来

    def median(values):
        return sorted(values)[len(values) // 2]

    by_count = {}  # 起草数 → 各对的 t / t₀
    for _ in range(rounds):
        for k in range(1, MAX_DRAFTS + 1):
            r = Run.start(model, ids)
            times = gaps(r.stream(model, mtp, 2 + (SETTLE + per) * (k + 1), draft_tokens=k))
            t0 = median(gaps(stream(model, ids, 6 + SETTLE)))  # 紧挨着量的普通解码
            for (drafted, _, _), t in zip(r.trace[1 + SETTLE :], times):
                by_count.setdefault(drafted, []).append(t / t0)
    cost = [1.0]
    for k in range(1, MAX_DRAFTS + 1):  # 哪个起草数没量到（极少见）：取前一个，再由下限托住
        cost.append(float(max(median(by_count[k]) if by_count.get(k) else cost[-1], cost[-1], 1 + MIN_DRAFT_COST * k)))
    return cost
