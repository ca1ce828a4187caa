"""附录 · 基准测试：机器与模型的事实——内存读带宽、解码一个 token 读的字节、峰值常驻内存。"""

import sys
import time

import torch

from ..fast.arena import huge_buffer
from ..fast.experts import FastMoE
from ..fast.linear import BlockedLinear, PackedLinear
from ..moe import SparseMoE

PROMPT_LEN = 32  # 解码与投机解码用的提示词长度
PROBE_GIB = 1.0  # 测带宽用的缓冲区：远大于缓存（L3 一般几十 MB）


def probe_buffer() -> torch.Tensor:
    """测带宽用的 PROBE_GIB GiB 的 float32（全是 1），与快路径的权重一样放在大页上（arena.py）：下限是这台机器顺序读得到的
    最快，不因为测的那块是 4 KB 的页而偏低（差多少见 docs/perf-history.md）。"""
    return huge_buffer(int(PROBE_GIB * 2**30)).view(torch.float32).fill_(1.0)


def read_bandwidth(x: torch.Tensor | None = None, repeats: int = 5) -> float:
    """内存读带宽（GB/s）：对一块远大于缓存的 float32 张量求和，取最快的一次。x 不给就临时建一块（probe_buffer）。"""
    x = probe_buffer() if x is None else x
    best = min(timed(lambda: x.sum())[0] for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def bytes_per_token(model) -> int:
    """解码一个 token 要读的权重字节数：每个矩阵读一遍（换了布局的按它的原始形状算，分块布局补的零行不算）；
    嵌入表只查一行；专家混合层的专家只读 k 个（一个 token 平均读全部专家的 k / E）。"""
    total = sum(matrix_bytes(m) for m in model.modules() if m is not model.embed_tokens)
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):  # 各章的（堆叠的参数）或快路径的（每个专家两个矩阵）
        experts = [*moe.gate_up, *moe.down] if isinstance(moe, FastMoE) else [moe.experts]
        E = len(moe.gate_up) if isinstance(moe, FastMoE) else moe.experts.num_experts
        total -= round(sum(matrix_bytes(m) for m in experts) * (1 - moe.top_k / E))
    return total + model.cfg.hidden_size * model.dtype.itemsize


def matrix_bytes(m) -> int:
    """一个模块自己的权重字节（不含子模块的）。"""
    if isinstance(m, BlockedLinear) and m.scales is not None:  # 量化的块：q 与比例，按存的算（补的零行除外）
        share = m.out_features / (m.blocks.shape[0] * 32)
        return round(share * (m.blocks.numel() * m.blocks.element_size() + m.scales.numel() * m.scales.element_size()))
    if isinstance(m, (PackedLinear, BlockedLinear)):
        return m.out_features * m.in_features * m.dtype.itemsize
    return sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))  # nn.Linear、norm、DeltaNet 的小参数


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def peak_rss_gb() -> float:
    """本进程的峰值常驻内存，单位 GB（10⁹ 字节）。

    Linux 上读 /proc/self/status 的 VmHWM。getrusage 的 ru_maxrss 不能用在子进程里：Linux 在 exec 时把父进程的峰值
    也记了进去（本基准的父进程造随机权重、测带宽时占得不少，见 docs/perf-history.md）。别的系统上退回 ru_maxrss。
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
