"""附录 · 权重放在哪儿：一大块用 2 MB 大页的内存，换好布局的矩阵一个挨一个地放进去。

解码一个 token 要把全部权重从内存读一遍（第 14 章），读得多快不只看内存条，还看 CPU 怎样要数据：
- 硬件预取沿着地址往前送，但不越过 4 KB 的页边界：每到一页的开头都要先失手一次、再重新跟上；
- 每一页的地址翻译占一个 TLB 项，几百 MB 的权重按 4 KB 一页要几万项，翻译本身也要读内存。
Linux 的透明大页（transparent huge pages）把 2 MB 当一页，两件事都少了 512 倍。常见的设置（madvise）只给明说要的内存
用大页，而且要在第一次写之前说：这里先申请、说好（madvise(MADV_HUGEPAGE)），再让 C++ 把换好布局的权重写进去。

一层的几个矩阵只有 1～5 MB，单独申请时大多盖不满一个按 2 MB 对齐的大页；一个挨一个地放进同一大块（Arena），整层、
整个模型的矩阵就是一条连续的流，大页也铺满了。大块里没用到的尾巴从不写，不占物理内存。一个 Arena 属于一个 Kernel
（每次加载模型各有一个）：模型释放了，它的矩阵与这些大块一起释放。

别的系统（没有 madvise、或不是 Linux）上照样一个挨一个地放，只是没有大页。参考：Linux 内核文档
Documentation/admin-guide/mm/transhuge.rst（透明大页与 madvise）。量得的差别见 docs/perf-history.md。
"""

import math
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20  # Linux 的透明大页：2 MB
CHUNK = 256 << 20  # 一大块多大（虚拟内存；没写到的部分不占物理内存）
ALIGN = 64  # 块里每个张量从 64 字节（一个缓存行）的边界起


class Chunk:
    """一段匿名映射的内存（mmap：还没有一页真的分配），从按 2 MB 对齐的 start 起的 size 个字节已请 Linux 用大页存放。"""

    def __init__(self, size: int):
        size = -(-max(size, 1) // HUGE_PAGE) * HUGE_PAGE
        private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # 私有的：共享的匿名内存（默认）不用透明大页
        self.map = mmap.mmap(-1, size + HUGE_PAGE, **private)  # fileno −1：匿名的（Unix 上 Python 自己加 MAP_ANONYMOUS）
        self.start, self.size = -torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE, size
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux；别的系统上只是一段普通的内存
            self.map.madvise(mmap.MADV_HUGEPAGE, self.start, size)

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """从 start + offset 起的 nbytes 个字节，一个 uint8 张量。每次是一份自己的 storage（torch.compile 的图不把挨着的
        两个矩阵当成同一块内存的别名），张量活着，这段映射就在。"""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=self.start + offset)


def huge_buffer(nbytes: int) -> torch.Tensor:
    """一段还没写过、按 2 MB 对齐、请 Linux 用大页存放的 uint8 内存 [nbytes]（nbytes > 0）。"""
    return Chunk(nbytes).tensor(0, nbytes)


class Arena:
    """一块块 CHUNK 大小的 Chunk，empty() 从当前这块顺序切出张量（不复用、不释放：切出的张量都活着，块就活着）。
    比 CHUNK / 4 大的张量（输出头）单独一块。几个线程同时加载也安全（一把锁）。"""

    def __init__(self):
        self.chunk, self.used, self.lock = None, 0, threading.Lock()

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """一个没有初始化的张量 [shape]，放在当前大块里紧接着上一个的地方（要在第一次写之前拿：大页才用得上）。"""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if nbytes > CHUNK // 4:
            return huge_buffer(nbytes).view(dtype).view(shape)
        with self.lock:
            if self.chunk is None or self.used + nbytes > self.chunk.size:
                self.chunk, self.used = Chunk(CHUNK), 0  # 旧块剩下的尾巴从没写过，不占物理内存
            t = self.chunk.tensor(self.used, nbytes)
            self.used += -(-nbytes // ALIGN) * ALIGN
        return t.view(dtype).view(shape)
