"""附录 · 服务（二）：调度。谁加入一步、一步算哪一件、提示词怎么读、起不起草——服务的这些决定都在这一页；
怎么交接（线程、锁、拼行）在 batcher.py，请求的一生在 engine.py。

一步（batcher.py 的 RowBatcher.step）：
- 什么时候走：参与对齐的线程（正在生成的请求）都交上了一件事（everyone_waits）。没交的请求还在算自己的嵌入、采样这些
  每个 token 一次的小事，等它一下，它的行就能拼进来；
- 算哪一件：前向顺序里最靠前的那一件（next_tasks；顺序见 forward_order），交了它的几个请求一起算。走在前面的请求等一等
  落在后面的，几步之后大家走到同一处，之后就一直一起走。若每步把各人等着的都算掉，中途加入的请求永远与别人错开几层，
  一次也拼不上。草稿头的几件事排在主模型之前：起草的请求先把草稿头算完，再与别人在主模型会合、一起验证；排在主模型之后
  的话，只要别的请求还在一个接一个 token 地解码（总在主模型那里等着），起草的请求就一直轮不到。
谁加入：正在生成的请求（Engine 的 slots 个位置，多的按先来后到排队）解码时都在对齐里。提示词多于 STEP_ROWS 个 token 的
请求先在对齐之外读（reads_apart），读完再加入：一次前向多于 STEP_ROWS 个 token 时本来就拼不进一步（与 qwen/fast 的
fast/share.py 的 can_share 是同一个数），在对齐里读的话，别的请求每一步都得等它那一大段矩阵乘法。
提示词按 PROMPT_PIECE 个 token 一段读（pieces）：段与段之间看一次请求取消了没有。
"""

from ..fast.sizes import PROMPT_PIECE, STEP_ROWS
from ..fast.linear import BlockedLinear
from ..fast.step import FastModel
from ..mtp import MTP

# 与别的请求一起生成时，贪心的请求一轮比一步多花的是单独时（mtp.round_cost）的这么多倍：单独时矩阵乘法多一行几乎
# 不花钱（读权重的时间盖过了乘加），几个请求的行拼在一起之后多的行就不那么便宜了。怎么定的见 docs/performance.md 的
# “服务：连续批处理”
BATCHED_DRAFT_COST = 3.5


def reads_apart(tokens: int) -> bool:
    """这么长的提示词在对齐之外读（拼不进一步：一次前向至多 STEP_ROWS 个 token 能与别人拼在一起）。只看这个请求自己的
    长度、与别的请求无关：读法不变，输出就不因别的请求而变。"""
    return tokens > STEP_ROWS


def pieces(start: int, end: int, size: int = PROMPT_PIECE) -> list[tuple[int, int]]:
    """[start, end) 切成 size 个 token 一段：[(a, b), …]，最后一段可以短些。"""
    return [(a, min(a + size, end)) for a in range(start, end, size)]


def last_piece(start: int, end: int, size: int = PROMPT_PIECE) -> int:
    """[start, end) 按 size 一段切开时，最后一段从哪里开始（一段之内时就是 start）。"""
    return start + size * ((end - start - 1) // size) if end > start else start


def batched_round_cost(alone: list, running: int) -> list:
    """贪心的请求每轮按这组代价挑草稿数（第 14 章 best_draft_count）：只有它一个在生成时是 alone（mtp.round_cost），
    与别的请求一起时一轮比一步多花的贵 BATCHED_DRAFT_COST 倍——接受率不够高时就不起草，这一轮就是成批的普通解码。
    采样的请求不用它：草稿数变了，同一个种子抽出的 token 也变，一个请求的输出就会随别的请求而变。"""
    return [1 + (r - 1) * (BATCHED_DRAFT_COST if running > 1 else 1.0) for r in alone]


def everyone_waits(waiting: list, members: set) -> bool:
    """一步可以走了：有事在等，而且参与对齐的每个线程都交上了一件（每个至多一件）。"""
    return bool(waiting) and len(waiting) >= len(members)


def next_tasks(waiting: list, order: dict) -> list:
    """这一步算哪几件：前向顺序（order：id(key) → 先后）里最靠前的那一件，连同别的请求交的同一件（同一个 key）。"""
    first = min(waiting, key=lambda j: order.get(id(j.key), len(order)))
    return [j for j in waiting if j.key is first.key]


def forward_order(models) -> dict:
    """几个模型（主模型与草稿头）的一次前向经过的各件事 → 先后（id → 序号）。草稿头的在前（见本页开头）。"""
    steps = [m for model in sorted(models, key=lambda m: not isinstance(m, MTP)) for m in forward_steps(model)]
    return {id(m.blocks if isinstance(m, BlockedLinear) else m): i for i, m in enumerate(steps)}


def forward_steps(model) -> list:
    """模型（或草稿头）一次前向经过的：主模型是全部解码层（模型本身交过来），再是输出头；草稿头先乘 fc，再是它的
    解码层，最后是起草词表的那几行。"""
    if isinstance(model, FastModel):
        return [model, model.lm_head]
    out = [getattr(model, "fc", None), *model.layers, getattr(model, "draft_head", None)]
    return [m for m in out if m is not None]
