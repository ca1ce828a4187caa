"""附录 · 服务（一）：几个请求共用一次读权重（RowBatcher；调度的决定在 schedule.py）。

CPU 上解码一个 token 的时间几乎都花在读权重上（第 14 章）：读一遍权重乘 4 行输入，与乘 1 行差不多贵。连续批处理
（continuous batching：Yu 等 2022 的 Orca；vLLM、SGLang、llama-server 都这样做）让正在生成的几个请求每一步一起前向。

我们要它不改变任何一个请求的输出：一个请求与别的请求一起算时，每个 token 都与它单独运行时逐位相同。做法是：
- 每个请求在自己的线程里跑单个请求的代码（第 12 章的 stream、第 14 章的 Run.stream），用自己的 State；
- 线程走到主模型的解码层（全部 24 层是一件事：FastModel.run_layers）、草稿头的解码层，或层外的一个矩阵乘法（输出头、
  草稿头的 fc 与起草词表）时，问这个线程和谁一起算（附录 qwen/fast/share.py 的约定：默认自己算）。请求线程在
  `with batcher.member():` 之内，回答是 RowBatcher：把这一件事交给它（share）等着；所有线程都在等时，RowBatcher 自己的
  线程（step，调度的一步）把同一件事的几份一次算完（share.py 的 layers_many 逐层调用 layer_many），算完按请求分回去。
  模型不被改动：约定是 fast/ 的，RowBatcher 只是它的一种回答。一层之内范数与矩阵乘法对拼起来的行算一次（C++ 的内核
  每行各算各的，结果与一次算几行无关：投机解码验证的行与单独解码的行逐位相同，靠的也是这一点），各请求的状态（注意力的
  缓存、DeltaNet 的记忆）各算各的；
- 一步（step）算哪一件、什么时候算，是 schedule.py 的事：参与者都在等时，前向顺序里最靠前的那一件。

各层由一个线程算：线程之间不必为 24 层里的几百个小运算抢 GIL（Python 一次只让一个线程跑），每个请求只剩嵌入、RoPE
表、采样这些每个 token 一次的小事；主模型的全部层是一件事，一步只交接一次（一层一件时，每层都要叫醒各请求的线程、再等它们
交上下一层）。所以谁在什么时候加入、离开都无所谓：新请求的预填充、别人的解码、投机解码验证 k+1 个 token，只要走到同一处，
就共用那一次读权重。长提示词的预填充由引擎放在对齐之外（engine.py 的 generate），不拼。
"""

import threading
from contextlib import contextmanager

import torch

from ..fast.share import can_join, matvecs, sharing
from .schedule import everyone_waits, forward_order, next_tasks


def use_threads(n: int) -> None:
    """调用的线程此后用 n 个 OpenMP 线程，而且只改这个线程。torch.set_num_threads 同时记一个全进程的数：一个线程第一次
    做并行的运算时照那个数设自己（PyTorch 的 at::init_num_threads），所以只 set 的话，别的线程后来 set 的数会在这个线程
    第一次并行时盖掉它（请求线程设成 1 时，RowBatcher 的线程就这样成了一个线程）。先让这个线程做完那次初始化，再设。"""
    torch.get_num_threads()  # 这个线程的初始化（只做一次）
    torch.set_num_threads(n)


class Task:
    """一个线程交上来、等着算的一件事：key 是哪个矩阵（它的 blocks）、哪一层或哪个模型的全部层，args 是输入；
    many(key, [args, …]) 把同一个 key 的几件事一次算完，返回各自的结果；结果放进 out。"""

    def __init__(self, key, many, args):
        self.key = key
        self.many = many
        self.args = args
        self.out = None
        self.error = None
        self.done = threading.Event()  # 算完了（或出错了）：只叫醒交这件事的线程


class RowBatcher:
    """让参与的线程（member 之内）的解码层与层外的 matvec 对齐：所有参与者都在等时，同一层（或同一个矩阵）的几件事
    由 RowBatcher 自己的一个线程一次算完（loop 一步一步地走：step）。它回答 qwen/fast/share.py 的约定（takes、share、
    matvec，与默认的 ALONE 同样的三样）；order：id(模型、层或矩阵的 blocks) → 它在前向里的先后（forward_order）。

    总由同一个线程来算：C++ 内核与 PyTorch 的多线程（OpenMP）每个发起的线程各有一队帮手线程，算完还要空转一会儿等下一件；
    谁最后到谁来算的话，几个请求线程的几队帮手在两个核上互相抢。"""

    def __init__(self, order=None):
        self.order = order or {}  # id(blocks 或层) → 它在前向里的先后（越小越先算）
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)  # 参与者都在等了：叫醒 step
        self.members = set()  # 参与对齐的线程
        self.waiting = []  # 正在等的 Task，每个参与者至多一个
        self.calls = 0  # 统计：算了几次
        self.tasks = 0  # 这几次一共算了几件事（几个请求的）
        # OpenMP 的线程数是每个线程各自的设定：照创建它的线程（torch.set_num_threads 设过的）来
        threading.Thread(target=self.loop, args=(torch.get_num_threads(),), daemon=True, name="qwen-rows").start()

    @contextmanager
    def member(self):
        """这个线程之内的前向都问 RowBatcher（share.py 的 sharing），它也算进参与对齐的线程。"""
        me = threading.get_ident()
        with self.lock:
            self.members.add(me)
        try:
            with sharing(self):
                yield
        finally:
            with self.lock:
                self.members.discard(me)
                self.ready.notify()  # 少了一个参与者：别人可能都在等了

    def takes(self, key) -> bool:
        """主模型的全部层、草稿头的层：前向顺序（order）里有的才接（别的模型、打包的层照常自己算）。"""
        return id(key) in self.order

    def share(self, key, many, args):
        """参与对齐的线程交上一件事（主模型的全部层、草稿头的一层、层外的一个矩阵），等 step 把它与别人的同一件一起算完。"""
        return self.wait(Task(key, many, args))

    def matvec(self, kernel, x, blocks, scales):
        """层外的矩阵（在 order 里：输出头、草稿头的 fc、起草词表）与别的请求拼行；层里的（这一层没能拼时）照常乘。"""
        if id(blocks) not in self.order:
            return kernel.matvec(x, blocks, scales)
        return self.share(blocks, matvecs, (kernel, x, blocks, scales))

    def wait(self, task: Task):
        with self.lock:
            self.waiting.append(task)
            self.ready.notify()
        task.done.wait()
        if task.error is not None:
            raise task.error
        return task.out

    def loop(self, threads: int):
        use_threads(threads)  # OpenMP 的线程数是每个线程各自的设定
        while True:
            self.step()

    def step(self):
        """调度的一步：等到参与者都交上了一件事，取前向顺序里最靠前的那一件的几份（schedule.py），一次算完，结果按请求
        分回去，叫醒交了这几件的线程（等别的的接着等）。出错时每个等着的线程自己抛出。"""
        with self.lock:
            while not everyone_waits(self.waiting, self.members):
                self.ready.wait()
            tasks = next_tasks(self.waiting, self.order)
            self.waiting = [t for t in self.waiting if t.key is not tasks[0].key]
        try:
            with torch.inference_mode():
                outs = tasks[0].many(tasks[0].key, [t.args for t in tasks])
            for task, out in zip(tasks, outs):
                task.out = out
            self.calls += 1
            self.tasks += len(tasks)
        except Exception as e:
            for task in tasks:
                task.error = e
        for task in tasks:
            task.done.set()


def row_batcher(model, mtp=None) -> RowBatcher | None:
    """服务这个模型（和草稿头）的 RowBatcher；没有分块布局（打包的路径、普通模型）时 None：那时各请求照样各算各的，
    只是不共用读权重。模型不被改动：请求线程在 member() 之内时，它的前向自己来问（qwen/fast/share.py）。"""
    if not hasattr(model.layers[0].ffn.down_proj, "blocks"):
        return None
    if not can_join(model):
        raise ValueError("服务用默认的分块布局（不编译图）：编译的图里 matvec 是图的一部分，没法在请求之间对齐")
    return RowBatcher(forward_order([m for m in (model, mtp) if m is not None]))
