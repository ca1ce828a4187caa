"""附录 · 服务（三）：引擎。请求进来、生成、离开；留下的对话状态给下一个请求接着用。

一个请求一个线程，跑的就是单个请求的代码：
    读已经留下的前缀（prefix.py）→ 把提示词读到最后一个用户问题的末尾、留一份状态 → 生成（Resume.generate：
    有草稿头时第 14 章的 Run，否则 stream）
读到哪里的状态是一个 Resume（附录 conversation/turns.py）：主模型的 State 与草稿头这一边，多轮对话与服务用的是同一个。
线程都在 RowBatcher 里（batcher.py）：各请求的前向由 RowBatcher 的一个线程一次算完，谁先来后到都不改变谁的输出；
谁什么时候加入、长提示词怎么读、起不起草，是 schedule.py 的决定。
同时生成的请求至多 slots 个，多出来的按先来后到排队（queue）。客户端断开时请求的 cancel() 被调用：排队的立刻离开
队列，正在生成的在下一个 token 之前停下（长提示词在下一段之前），线程、位置与状态随之释放。close()（服务关闭时）不再
接新请求，排队的与正在生成的都这样停下，它们的 error 是 Closed。

共用的模型不被改动：提示词由引擎按 piece 个 token 一段读（每段一次 Resume.feed，不多于 model.piece 个时模型不再分段），
生成时一次读进去的也不多于一段；同一个请求怎么读只看它自己的长度，输出就不因别的请求而变。
"""

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import torch

from ..conversation import Resume
from ..fast.share import ALONE, sharing
from ..sampling.logprobs import prompt_logprobs
from ..sample import Sampling
from .batcher import row_batcher, use_threads
from .prefix import PrefixCache
from .schedule import PROMPT_PIECE, batched_round_cost, last_piece, pieces, reads_apart


class Closed(RuntimeError):
    """引擎在关闭：不再接新的请求；没生成完的请求以它结束。"""


@dataclass(eq=False)  # 按身份比较与散列：排队、正在生成的集合里放的是请求本身
class Request:
    """一个生成请求。ids：提示词的 token；sampling：怎么选 token（第 12 章的 Sampling，种子也在里面，建的时候查过）；
    keep：读到第几个 token 时留一份状态（最后一个用户问题的末尾；None 不留）。
    生成的 token 一个个放进 out（最后放 None）；finish_reason：stop（停止符）、length（到了 max_tokens）或 cancelled。"""
    ids: list
    max_tokens: int
    stop: list = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    keep: int | None = None
    images: object = None  # 提示词里的图（第 15 章的 Images，占位已展开）；没有图时 None
    echo: int | None = None  # 也要提示词各位置的对数概率（completions 的 echo）：每个另带前几个；None 不要
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cached_tokens: int = 0  # 从留下的状态接着读、没有重读的提示词 token 数
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # sampling.logprobs 给了时：tokens 里每个的 Token（带对数概率，放进 out 之前记下）
    prompt_logprobs: list | None = None  # echo 时：提示词每个位置的 Token（qwen/sampling/logprobs.py 的 prompt_logprobs）
    finish_reason: str | None = None
    error: Exception | None = None
    submitted: float = 0.0  # 提交的时刻（time.monotonic()）：第一个 token 的延迟从它算起
    run: object = None  # 投机解码时这次的第 14 章 Run（起草、接受的统计）
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


class Engine:
    """用着模型的引擎（不改动它）：submit(Request) 之后从 request.events() 读 token。slots：同时生成的请求数；
    cache_mb：留下的对话状态至多占多少 MB；piece：提示词一段读几个 token（不多于 model.piece：模型不再把一段切开）。"""

    def __init__(self, model, mtp=None, slots: int = 8, cache_mb: int = 512, piece: int = PROMPT_PIECE):
        self.model = model
        self.mtp = mtp
        self.batcher = row_batcher(model, mtp)  # 不改动模型：请求线程在 batcher.member() 之内时前向自己来问
        self.threads = torch.get_num_threads()  # 对齐之外读长提示词时用几个 OpenMP 线程（与 RowBatcher 的线程一样）
        self.piece = piece  # 提示词按这么多个 token 一段读（schedule.py）
        self.slots = slots
        self.cache = PrefixCache(cache_mb * 2**20)
        self.queue = deque()  # 排队（还没拿到位置）的请求，先来先得
        self.running = set()  # 正在生成（拿到位置）的请求
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # 有位置空出来、有请求取消了
        self.closed = False
        self.metrics = None  # 服务的指标（metrics.py 的 Metrics，Server.ready 接上）：None 时不记

    def submit(self, request: Request) -> Request:
        """排进队列，开一个线程跑它（max_tokens 不对时 ValueError；采样的设置建 Sampling 时已经查过）。关闭之后 Closed。"""
        if not isinstance(request.sampling, Sampling):
            raise ValueError(f"request.sampling 应为一个 Sampling，收到 {request.sampling!r}")
        Sampling.check("max_new_tokens", request.max_tokens)
        request.wake, request.submitted = self.wake, time.monotonic()
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
        if self.batcher is not None:  # 矩阵乘法都在 RowBatcher 的线程上：请求线程不开自己的一队 OpenMP 帮手线程（见 in_own_team）
            use_threads(1)
        admitted = False
        try:
            if not (admitted := self.admit(request)):
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
            if self.metrics is not None and admitted:  # 放下最后的 None 之前记下：读完回答再抓取的，数已经动过了
                self.metrics.done(request, request.run)
            request.out.put(None)
            if self.batcher is not None:
                torch.set_num_threads(self.threads)  # 全进程的那个数（见 use_threads）放回原样：这个线程马上就结束了

    def close(self):
        """不再接新的请求；排队的立刻结束，正在生成的在下一个 token 之前停下（它们的 error 是 Closed）。"""
        with self.lock:
            self.closed = True
            pending = [*self.queue, *self.running]
        for request in pending:
            request.cancel()

    def generate(self, request: Request):
        """读提示词，再生成。长的提示词（schedule.reads_apart）在对齐之外读到倒数第二个 token，再加入对齐：若在对齐里，
        别的请求每一步都得等它那一大段；在对齐之外，它与别的请求的解码同时跑（分着 CPU），谁也不等谁。keep 之后也可能有
        一长段（比如很长的工具结果），也不该让别人等。短的提示词在对齐里读：几个同时来的请求读提示词也共用一次读权重，
        第一个 token 来得早；续写（没有 keep）的短提示词没有要留的状态，生成时一次读完。"""
        if request.echo is not None:  # 提示词的对数概率：另读一遍、每个位置的 logits 都要（在对齐之外）
            score = partial(prompt_logprobs, self.model, request.ids, request.echo)
            request.prompt_logprobs = score() if self.batcher is None else in_own_team(score, self.threads)
        if self.batcher is None:  # 没有分块布局：各请求各算各的
            return self.decode(request, self.prefill(request))
        if reads_apart(len(request.ids)):
            resume = in_own_team(lambda: self.prefill(request, rest=True), self.threads)  # 在对齐之外
            with self.batcher.member():
                return self.decode(request, resume)
        with self.batcher.member():
            return self.decode(request, self.prefill(request))

    def prefill(self, request: Request, rest: bool = False) -> Resume:
        """从留下的最长前缀接着，读到 keep（最后一个用户问题的末尾）并留一份；rest=True 时再读到倒数第二个 token。
        → 读到那里的 Resume。"""
        ids, keep = request.ids, request.keep
        resume = (self.cache.longest(ids, keep, request.images) if keep is not None else None) or Resume.start(self.model)
        request.cached_tokens = len(resume.tokens)
        if keep is not None and keep > len(resume.tokens):
            self.read(request, resume, keep)
            if not request.cancelled.is_set():
                self.cache.put(resume)
        if rest:
            self.read(request, resume, len(ids) - 1)
        return resume

    @torch.inference_mode()
    def read(self, request: Request, resume: Resume, end: int):
        """接着读 ids 到 end（不含），每段 piece 个 token、一次 Resume.feed；段与段之间请求取消了就不再读（它之后也不会
        再用这份状态）。"""
        ids, images = request.ids, request.images
        for a, b in pieces(len(resume.tokens), whole(request, end), self.piece):
            if request.cancelled.is_set():
                return
            a, b = len(resume.tokens), whole(request, b)  # 一张图整张地在一段里：切在图里的段并进下一段
            if b > a:
                resume.feed(self.model, self.mtp, ids[a:b], images and images.part(ids, a, b))

    def round_cost_now(self) -> list:
        """贪心的请求每轮按这组代价挑草稿数：随同时生成的请求数变（schedule.batched_round_cost）。"""
        return batched_round_cost(self.mtp.round_cost, len(self.running))

    def decode(self, request: Request, resume: Resume):
        """生成：剩下的提示词多于一段时先读掉前面的整段（生成时一次读进去的不多于一段），再接着 resume 生成。"""
        self.read(request, resume, last_piece(len(resume.tokens), len(request.ids), self.piece))
        if request.cancelled.is_set():  # 读提示词时取消了
            request.finish_reason = "cancelled"
            return
        greedy = request.sampling.temperature == 0  # 贪心：起不起草都是同样的 token，草稿数可以随批的大小变
        ids, images, begin = request.ids, request.images, len(resume.tokens)
        tokens, request.run = resume.generate(self.model, self.mtp, ids[begin:], request.max_tokens, request.stop, request.sampling,
                                    cost_now=self.round_cost_now if greedy else None,
                                    images=images and images.part(ids, begin, len(ids)))
        for t in tokens:
            if request.cancelled.is_set():
                request.finish_reason = "cancelled"
                return
            if request.sampling.logprobs is not None:  # 要对数概率时 t 是第 12 章的 Token：它带着自己的
                request.logprobs.append(t)
            if not request.tokens and self.metrics is not None:
                self.metrics.first_token(request.submitted)
            request.tokens.append(t)
            request.out.put(t)
        stopped = request.tokens and request.tokens[-1] in request.stop
        request.finish_reason = "stop" if stopped else "length"


def whole(request: Request, end: int) -> int:
    """读到 end 为止，但不把一张图切开：end 落在一张图的 token 中间时挪到那张图之后。"""
    ids, images = request.ids, request.images
    while images is not None and 0 < end < len(ids) and ids[end - 1] == ids[end] == images.cfg.image_token_id:
        end += 1
    return end


def in_own_team(fn, threads: int):
    """在一个只活这一次的线程里、用 threads 个 OpenMP 线程跑 fn() → 它的返回值（它抛的异常照样抛出）。

    libgomp 里每个发起并行区的线程各有一队帮手线程，线程活着它们就在；它管着的线程一旦多于 CPU 核数，所有队的帮手
    算完一件事都只空转一百来次就去睡，下一件再由系统叫醒——每个并行区多付两次唤醒。解码一步有一百多个并行区，
    一个空闲的线程开过一队，解码就慢很多（数字见 docs/performance.md）。所以请求线程不开自己的队（Engine.run 里设成
    一个线程）；长提示词要两个核一起读时在这个临时线程里读，读完线程结束，它的队也随之没了。"""
    box = {}

    def run():
        use_threads(threads)
        try:
            with sharing(ALONE):  # 在对齐之外：自己算（有的 Python 让新线程继承开它的线程的设置）
                box["out"] = fn()
        except BaseException as e:  # 交回调用的线程抛出
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="qwen-prefill")
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["out"]
