"""附录 · 服务（二）：引擎。请求进来、生成、离开；留下的对话状态给下一个请求接着用。

一个请求一个线程，跑的就是单个请求的代码：
    读已经留下的前缀（PrefixCache）→ 把提示词读到最后一个用户问题的末尾、留一份状态 → 生成（stream_mtp 或 stream）
线程都在 RowBatcher 里（rows.py）：各请求的前向由 RowBatcher 的一个线程一次算完，谁先来后到都不改变谁的输出。
同时生成的请求至多 slots 个，多出来的按先来后到排队（queue）；长提示词在对齐之外按 chunk 个 token 一段喂，不拖住正在生成的请求。
客户端断开时请求的 cancel() 被调用：排队的立刻离开队列，正在生成的在下一个 token 之前停下（长提示词在下一段之前），
线程、位置与状态随之释放。close()（服务关闭时）不再接新请求，排队的与正在生成的都这样停下，它们的 error 是 Closed。

留下的状态（PrefixCache）与附录 conversation.py 的 Conversation 是同一个思路，只是跨请求、按 token 前缀查：
对话的下一轮一定原样包含“到上一个用户问题为止”的那段提示词，从那里接着读，与从头读输出逐 token 相同。
vLLM 的前缀缓存只能从块的边界接着读；混合模型的 DeltaNet 状态没法截短，所以我们只在一个个用户问题的末尾留份。
"""

import queue
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from ..attention import AttentionState
from ..cache import State, copy_state
from ..conversation import feed
from ..mtp import SpecResult, stream_mtp
from ..sample import check_sampling, stream
from ..fast.linear import KERNEL_ROWS
from .rows import share_rows

CHUNK = 64  # 长提示词按这么多个 token 一段喂：别的请求每一步至多等这一段
# 与别的请求一起生成时，多起草一个 token 的代价是单独时（mtp.draft_cost）的几倍：单独时矩阵乘法多一行几乎不花钱（读权重
# 的时间盖过了乘加），几个请求的行拼在一起之后多的行就不那么便宜了（实测见 docs/performance.md“服务：连续批处理”）
BATCHED_DRAFT_COST = 3.5
SEGMENT = 8  # 对齐之外读长提示词时，每读这么多个 chunk 看一次请求取消了没有（段长是 chunk 的整数倍：与一次读完逐位相同）
SEED_RANGE = (-2**63, 2**63)  # 种子是 64 位有符号整数（与 vLLM 相同；torch.Generator.manual_seed 接受的更宽，但负数与大数会重合）


class Closed(RuntimeError):
    """引擎在关闭：不再接新的请求；没生成完的请求以它结束。"""


@dataclass(eq=False)  # 按身份比较与散列：排队、正在生成的集合里放的是请求本身
class Request:
    """一个生成请求。ids：提示词的 token；keep：读到第几个 token 时留一份状态（最后一个用户问题的末尾；None 不留）。
    生成的 token 一个个放进 out（最后放 None）；finish_reason：stop（停止符）、length（到了 max_tokens）或 cancelled。"""
    ids: list
    max_tokens: int
    stop: list = field(default_factory=list)
    sampling: dict = field(default_factory=dict)  # temperature、top_k、top_p、repetition_penalty、presence_penalty
    seed: int | None = None
    keep: int | None = None
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cached_tokens: int = 0  # 从留下的状态接着读、没有重读的提示词 token 数
    tokens: list = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None
    wake: object = field(default=None, repr=False)  # 引擎设的：cancel() 时叫醒排队的请求

    def cancel(self):
        """不要了（客户端断开、命中停止字符串）：排队时立刻离开队列，生成时在下一个 token 之前停下。"""
        self.cancelled.set()
        if self.wake is not None:
            self.wake()

    def events(self, timeout=None):
        """逐个产出生成的 token，直到结束（出错时在这里抛出）。"""
        while True:
            t = self.out.get(timeout=timeout)
            if t is None:
                if self.error is not None:
                    raise self.error
                return
            yield t


def state_bytes(*objs) -> int:
    """留下的状态占多少字节：里面所有张量之和。"""
    total = 0
    for obj in objs:
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, (list, tuple)):
            total += state_bytes(*obj)
        elif hasattr(obj, "__dict__"):
            total += state_bytes(*vars(obj).values())
    return total


class PrefixCache:
    """留下的状态：token 前缀 → (State, 草稿头的 AttentionState, 最后一个位置的隐藏状态)，最近最少用的先丢，
    总大小不超过 limit 字节。取出的是复制：各请求改的是自己的那份。"""

    def __init__(self, limit: int):
        self.limit = limit
        self.items = OrderedDict()  # tuple(tokens) → (saved, 字节数)
        self.size = 0
        self.lock = threading.Lock()

    def put(self, tokens, state, mtp_state, hidden):
        saved = (copy_state(state), copy_state(mtp_state) if mtp_state is not None else None, hidden)
        size = state_bytes(saved)
        if size > self.limit:
            return
        with self.lock:
            key = tuple(tokens)
            if key in self.items:
                self.size -= self.items.pop(key)[1]
            self.items[key] = (saved, size)
            self.size += size
            while self.size > self.limit:
                self.size -= self.items.popitem(last=False)[1][1]

    def longest(self, tokens, upto: int):
        """tokens[:upto] 之内最长的留下的前缀 → (长度, 复制出的 State, 草稿头的缓存, 隐藏状态)；没有时长度 0。"""
        with self.lock:
            best = None
            for key in self.items:
                if len(key) <= upto and (best is None or len(key) > len(best)) and tuple(tokens[: len(key)]) == key:
                    best = key
            if best is None:
                return 0, None, None, None
            self.items.move_to_end(best)
            state, mtp_state, hidden = self.items[best][0]
        return len(best), copy_state(state), copy_state(mtp_state) if mtp_state is not None else None, hidden


class Engine:
    """拥有模型的引擎：submit(Request) 之后从 request.events() 读 token。slots：同时生成的请求数；
    cache_mb：留下的对话状态至多占多少 MB。"""

    def __init__(self, model, mtp=None, slots: int = 8, cache_mb: int = 512, chunk: int = CHUNK):
        self.model = model
        self.mtp = mtp
        self.batcher = share_rows(model, mtp)
        model.piece = chunk  # 长提示词分段喂的段长（单独运行时也是这个段长：输出不因别的请求而变）
        self.slots = slots
        self.cache = PrefixCache(cache_mb * 2**20)
        self.queue = deque()  # 排队（还没拿到位置）的请求，先来先得
        self.running = set()  # 正在生成（拿到位置）的请求
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # 有位置空出来、有请求取消了
        self.closed = False

    def submit(self, request: Request) -> Request:
        """检查采样参数与种子（不对时 ValueError），排进队列，开一个线程跑它。关闭之后 Closed。"""
        check_sampling(request.max_tokens, **request.sampling)
        seed = request.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not SEED_RANGE[0] <= seed < SEED_RANGE[1]):
            raise ValueError(f"seed 应为 [-2**63, 2**63) 之内的整数，收到 {seed!r}")
        request.wake = self.wake
        with self.lock:
            if self.closed:
                raise Closed("服务正在关闭：不再接新的请求")
            self.queue.append(request)
        threading.Thread(target=self.run, args=(request,), daemon=True, name="qwen-request").start()
        return request

    def wake(self):
        with self.changed:
            self.changed.notify_all()

    def admit(self, request: Request) -> bool:
        """排队：等到它排在队首、又有空位置（True），或它被取消了（False）。两种情况它都离开队列。"""
        with self.changed:
            while not request.cancelled.is_set() and (self.queue[0] is not request or len(self.running) >= self.slots):
                self.changed.wait()
            self.queue.remove(request)
            self.changed.notify_all()  # 下一个请求可能排到队首了
            if request.cancelled.is_set():
                return False
            self.running.add(request)
            return True

    def run(self, request: Request):
        try:
            if not self.admit(request):
                request.finish_reason = "cancelled"
                return
            try:
                self.generate(request)
            finally:
                with self.changed:
                    self.running.discard(request)
                    self.changed.notify_all()
        except Exception as e:  # 交给读结果的一方抛出：服务器不因一个请求而停
            request.error = e
        finally:
            if request.finish_reason == "cancelled" and self.closed and request.error is None:
                request.error = Closed("服务正在关闭：这个请求没有生成完")
            request.out.put(None)

    def close(self):
        """不再接新的请求；排队的立刻结束，正在生成的在下一个 token 之前停下（它们的 error 是 Closed）。"""
        with self.lock:
            self.closed = True
            pending = [*self.queue, *self.running]
        for request in pending:
            request.cancel()

    @torch.inference_mode()
    def prefill(self, request: Request, rest: bool = False):
        """从留下的最长前缀接着，读到 keep（最后一个用户问题的末尾）并留一份；没有 keep（续写）时读到倒数第二个 token。
        rest=True 时留完一份再接着读到倒数第二个 token。→ (State, 草稿头缓存, 隐藏状态, 读到哪)。
        长的提示词这一段在对齐之外读（见 generate）。"""
        ids, keep, model = request.ids, request.keep, self.model
        start, state, mtp_state, hidden = self.cache.longest(ids, keep) if keep is not None else (0, None, None, None)
        if start == 0:
            state, mtp_state, hidden = State(model), AttentionState() if self.mtp is not None else None, None
        request.cached_tokens = start
        end = keep if keep is not None else len(ids) - 1
        if end > start:
            hidden = self.read(request, start, end, state, mtp_state, hidden)
            if keep is not None and not request.cancelled.is_set():
                self.cache.put(ids[:keep], state, mtp_state, hidden)
            start = end
        if rest and len(ids) - 1 > start:
            hidden = self.read(request, start, len(ids) - 1, state, mtp_state, hidden)
            start = len(ids) - 1
        return state, mtp_state, hidden, start

    def read(self, request: Request, start: int, end: int, state, mtp_state, hidden):
        """读 ids[start:end]，每 SEGMENT 个 chunk 一段，段与段之间请求取消了就不再读（它之后也不会再用这份状态）。
        段长是 model.piece 的整数倍，模型本来就按 piece 分段读：与一次读完逐位相同。"""
        step = SEGMENT * self.model.piece
        for at in range(start, end, step):
            if request.cancelled.is_set():
                break
            hidden = feed(self.model, self.mtp, request.ids, at, min(at + step, end), state, mtp_state, hidden)
        return hidden

    def generate(self, request: Request):
        """读提示词，再生成。长的提示词（多于 KERNEL_ROWS 个 token）在对齐之外读：若在对齐里，别的请求每一步都得等它那一大段
        矩阵乘法；在对齐之外，它与别的请求的解码同时跑（分着 CPU），谁也不等谁。短的提示词在对齐里读：几个同时来的
        请求读提示词也共用一次读权重，第一个 token 来得早。读法只看这个请求自己的长度，与别的请求无关：输出不因别的请求而变。
        长的提示词在对齐之外一直读到倒数第二个 token：keep 之后也可能有一长段（比如很长的工具结果），也不该让别人等。
        续写（没有 keep）的短提示词没有要留的状态，解码时一次读完：不必先读到倒数第二个 token、再单读最后一个。"""
        fresh = (None, None, None, 0)  # 从头读：状态、草稿头的缓存、隐藏状态都是新的
        if self.batcher is None:
            return self.decode(request, *(fresh if request.keep is None else self.prefill(request)))
        if len(request.ids) > KERNEL_ROWS:
            begun = self.prefill(request, rest=True)  # 在对齐之外
            with self.batcher.member():
                return self.decode(request, *begun)
        with self.batcher.member():
            return self.decode(request, *(fresh if request.keep is None else self.prefill(request)))

    def draft_cost(self) -> float:
        """贪心的请求每轮按这个代价挑草稿数（第 14 章 best_draft_count）：只有它一个在生成时是 mtp.draft_cost，
        与别的请求一起时贵 BATCHED_DRAFT_COST 倍——接受率不够高时就不起草，这一轮就是成批的普通解码。
        采样的请求不用它：草稿数变了，同一个种子抽出的 token 也变，一个请求的输出就会随别的请求而变。"""
        return self.mtp.draft_cost * (BATCHED_DRAFT_COST if len(self.running) > 1 else 1.0)

    def decode(self, request: Request, state, mtp_state, hidden, start: int):
        if request.cancelled.is_set():  # 读提示词时取消了
            request.finish_reason = "cancelled"
            return
        rest, history, s = [request.ids[start:]], request.ids[:start], request.sampling
        if self.mtp is not None:
            greedy = not s.get("temperature")  # 贪心：起不起草都是同样的 token，草稿数可以随批的大小变
            rounds = stream_mtp(self.model, self.mtp, rest, request.max_tokens, request.stop, None, seed=request.seed,
                                result=SpecResult(), state=state, mtp_state=mtp_state, hidden=hidden, history=history,
                                draft_cost=self.draft_cost if greedy else None, **s)
            tokens = (t for emitted in rounds for t in emitted)
        else:
            tokens = stream(self.model, rest, request.max_tokens, request.stop, seed=request.seed, state=state,
                            history=history, **s)
        for t in tokens:
            if request.cancelled.is_set():
                request.finish_reason = "cancelled"
                return
            request.tokens.append(t)
            request.out.put(t)
        stopped = request.tokens and request.tokens[-1] in request.stop
        request.finish_reason = "stop" if stopped else "length"
