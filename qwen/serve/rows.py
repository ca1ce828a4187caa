"""附录 · 服务（一）：几个请求共用一次读权重。

CPU 上解码一个 token 的时间几乎都花在读权重上（第 14 章）：读一遍权重乘 4 行输入，与乘 1 行差不多贵。连续批处理
（continuous batching：Yu 等 2022 的 Orca；vLLM、SGLang、llama-server 都这样做）让正在生成的几个请求每一步一起前向。

我们要它不改变任何一个请求的输出：一个请求与别的请求一起算时，每个 token 都与它单独运行时逐位相同。做法是：
- 每个请求在自己的线程里跑单个请求的代码（第 12 章的 stream、第 14 章的 stream_mtp），用自己的 State；
- 只有分块布局的矩阵乘法（附录 qwen/fast 的 C++ matvec）在线程之间对齐。它每一行各用自己的累加器、按同样的顺序求和，
  结果与一次乘几行无关（投机解码验证的行与单独解码的行逐位相同，靠的也是这一点）；
- 线程走到一个矩阵乘法时把自己的几行交给 RowBatcher 等着；所有线程都在等时（step），同一个矩阵的行拼成一次调用，
  算完按行分回去。其余的运算（范数、注意力、DeltaNet 的递推、采样……）各算各的，与单独运行时是同一串运算。
- 每一步只算前向顺序里最靠前的那个矩阵（order）：走在前面的请求等一等落在后面的，几步之后大家走到同一个矩阵，
  之后就一直一起走。若每步把各人等着的矩阵都算掉，中途加入的请求永远与别人错开几个矩阵，一次也拼不上。

所以谁在什么时候加入、离开都无所谓：新请求的预填充、别人的解码、投机解码验证 k+1 个 token，只要走到同一个矩阵，
就共用那一次读权重。长提示词的预填充由引擎放在对齐之外（engine.py 的 generate），不拼。
"""

import threading
from contextlib import contextmanager

import torch


class Waiting:
    """一个线程交上来、等着乘的几行：x [M, in] 乘 blocks（哪个矩阵），结果放进 out。"""

    def __init__(self, x, blocks, scales):
        self.x = x
        self.blocks = blocks
        self.scales = scales
        self.out = None
        self.error = None
        self.done = threading.Event()  # 算完了（或出错了）：只叫醒交这几行的线程


class RowBatcher:
    """让参与的线程（member 之内）的 matvec 对齐：所有参与者都在等时，同一个矩阵的行拼成一次 C++ 调用。
    接口与 qwen/fast 的 Kernel.matvec 相同，所以 SharedKernel 换进 BlockedLinear 就行，模型代码一行不改。"""

    def __init__(self, kernel, order=None):
        self.kernel = kernel
        self.order = order or {}  # id(blocks) → 它在前向里的先后（越小越先算）
        self.lock = threading.Lock()
        self.members = set()  # 参与对齐的线程
        self.waiting = []  # 正在等的 Waiting，每个参与者至多一个
        self.calls = 0  # 统计：拼起来的调用次数
        self.rows = 0  # 统计：这些调用一共乘了几行

    @contextmanager
    def member(self):
        """这个线程之内的 matvec 都参与对齐；离开时若别人都在等，替他们算。"""
        me = threading.get_ident()
        with self.lock:
            self.members.add(me)
        try:
            yield
        finally:
            with self.lock:
                self.members.discard(me)
                self.step()

    def matvec(self, x, blocks, scales):
        if threading.get_ident() not in self.members:  # 不参与的线程（比如加载、预热）：直接算
            return self.kernel.matvec(x, blocks, scales)
        job = Waiting(x, blocks, scales)
        with self.lock:
            self.waiting.append(job)
            self.step()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.out

    def step(self):
        """调度的一步（拿着锁时调用）：参与者都在等时，取前向顺序里最靠前的那个矩阵，等它的各行拼成一次调用，
        结果按行分回去，叫醒交了这几行的线程（等别的矩阵的接着等）。"""
        if not self.waiting or len(self.waiting) < len(self.members):
            return
        first = min(self.waiting, key=lambda j: self.order.get(id(j.blocks), len(self.order)))
        jobs = [j for j in self.waiting if j.blocks is first.blocks]
        self.waiting = [j for j in self.waiting if j.blocks is not first.blocks]
        try:
            x = jobs[0].x if len(jobs) == 1 else torch.cat([j.x for j in jobs])  # [ΣM, in]
            y = self.kernel.matvec(x, first.blocks, first.scales)  # [ΣM, out]
            for job, part in zip(jobs, y.split([j.x.shape[0] for j in jobs])):
                job.out = part
            self.calls += 1
            self.rows += x.shape[0]
        except Exception as e:  # 交给每个等着的线程自己抛出
            for job in jobs:
                job.error = e
        for job in jobs:  # 叫醒这几个线程（等别的矩阵的接着睡）
            job.done.set()


def share_rows(*models) -> RowBatcher | None:
    """把模型（和草稿头）里分块布局的矩阵换成经过同一个 RowBatcher 的 matvec；没有分块布局（打包的路径、
    普通模型）时返回 None：那时各请求照样各算各的，只是不共用读权重。"""
    from ..fast.linear import BlockedLinear

    linears = [m for model in models if model is not None for m in forward_order(model) if isinstance(m, BlockedLinear)]
    if not linears:
        return None
    if any(getattr(model, "step_lengths", None) for model in models if model is not None):
        raise ValueError("服务用默认的分块布局（不编译图）：编译的图里 matvec 是图的一部分，没法在请求之间对齐")
    kernel = linears[0].kernel
    batcher = kernel if isinstance(kernel, RowBatcher) else RowBatcher(kernel)
    batcher.order = {id(m.blocks): i for i, m in enumerate(linears)}
    for m in linears:
        m.kernel = batcher
    return batcher


def forward_order(model):
    """模型（或草稿头）里的矩阵，按一次前向用到它们的先后：各层的输入投影、输出投影、MLP 的两个矩阵，最后是输出头。"""
    out = [getattr(model, "fc", None)]  # 草稿头先乘 fc
    for layer in model.layers:
        mixer = getattr(layer, "linear_attn", None) or getattr(layer, "self_attn", None)
        out += [getattr(mixer, "in_proj", None), getattr(mixer, "qkv", None), getattr(mixer, "out_proj", None),
                getattr(mixer, "o_proj", None), getattr(layer.mlp, "gate_up", None), layer.mlp.down_proj]
    out += [getattr(model, "lm_head", None), getattr(model, "draft_head", None)]
    seen = {id(m) for m in out if m is not None}
    return [m for m in out if m is not None] + [m for m in model.modules() if id(m) not in seen]
