"""附录 · 基准测试：同一台机器上，0.8B 的形状起草 k 个的一轮花几步普通解码（第 14 章在小小的 demo 旁边打印它）。

投机解码省下的是“读权重”：CPU 上解码一步的时间主要花在把权重从内存读进来，验证 k+1 个 token 时每个权重读一次、乘 k+1 行，
所以多验证一行几乎不要钱；草稿头只有一层加输出头里起草词表的那几行，是一步的零头。demo 只有 4 层、宽 256，一步读的权重
只有几 MB，装得进缓存：一步的时间几乎全是固定开销（Python 的调用、几十个小运算），多验证一行、起草一个 token 都和一步
差不多贵，投机解码省不下什么。0.8B 一步要读约 1.5 GB 权重，情形就反过来了。这里在这台机器上量出来，而不是推算：

- 按 0.8B 的宽度造一组 4 层（三层 DeltaNet 加一层门控注意力）与草稿头的随机权重（qwen/tools/checkpoint.py，tiled：只测速度，
  取值无关紧要），输出头是完整的 248320 行；
- 这一组重复 6 次当作 24 层：每层照样从内存里读自己的权重（一组 4 层约 100 MB，远大于缓存），各层的状态各是各的；
- 起草词表取真的 0.8B 自动挑的那么多行（DRAFT_ROWS）；
- 量一次前向验证 1～5 行、草稿头起草一个各要多久（各取几次里最快的），一轮 ≈ 验证 k+1 行 + 起草 k 个。
  一步几十毫秒，每轮 Python 里不到一毫秒的固定开销可以不计（demo 上不行：那里量的是真实的循环，qwen.fast.warm）。
结果按线程数、dtype 与 torch 的版本记在 record_file("round_cost.json") 里：只有第一次要量（造权重、加载、量，几秒）。
"""

import os
import shutil
import tempfile
import time
from dataclasses import replace

import torch
from torch import nn

from ..cache import copy_state, keep_history
from ..fast import load
from ..fast.records import read_record, write_record
from ..fast.warm import valid_round_cost
from ..mtp import MAX_DRAFTS, Run
from ..tools.checkpoint import random_checkpoint
from ..weights import Config

FULL = Config()  # Qwen3.5-0.8B 的形状（Config 的默认值）
GROUP = 4  # 造几层：一组三层 DeltaNet 加一层门控注意力，重复 FULL.num_hidden_layers / GROUP 次
ROUNDS = 3  # 轮流量几遍
DRAFT_ROWS = 74925  # 真的 0.8B 上 draft_vocab="auto" 挑的行数：前 49152 个 id 加上后面含汉字的（qwen/tools/vocab.py）


@torch.inference_mode()
def full_size_costs(dtype: torch.dtype | None = None) -> dict:
    """0.8B 的形状在这台机器上：{"step": 解码一步的秒数, "verify": [一次前向 1…MAX_DRAFTS+1 行的秒数], "draft": 起草一个的秒数,
    "round_cost": 起草 k 个的一轮花几步}。一轮 ≈ 验证 k+1 行的一次前向 + 起草 k 个（每轮 Python 里的固定开销不到一毫秒，
    比起几十毫秒的一步可以不计）。量过就读记下的。"""
    key = f"0.8B 形状 · {dtype} · {torch.get_num_threads()} 线程 · torch {torch.__version__}"
    saved = read_record("round_cost.json", key)
    if isinstance(saved, dict) and valid_round_cost(saved.get("round_cost")):
        return saved
    with tempfile.TemporaryDirectory(prefix="qwen-0.8b-shape-", dir=memory_disk()) as folder:
        random_checkpoint(folder, replace(FULL, num_hidden_layers=GROUP, layer_types=[]), tiled=True)
        model, mtp = load(folder, dtype=dtype, draft_vocab=DRAFT_ROWS)
    model.layers = nn.ModuleList(model.layers[i % GROUP] for i in range(FULL.num_hidden_layers))  # 24 层：每组读同样的 4 层
    model.cfg = FULL
    run = Run.start(model, torch.arange(1, 9)[None])  # 读 8 个 token 的提示词
    verify, draft = [float("inf")] * (MAX_DRAFTS + 1), float("inf")
    for i in range(ROUNDS):  # 轮流量（带宽一会儿快一会儿慢：各行数在同样的时段里比），各取最快的一次
        verify = [min(v, verify_seconds(model, run.state, run.tokens[-1], T)) for T, v in enumerate(verify, 1)]
        draft = min(draft, fastest(lambda: replace(run, drafter=run.drafter.copy()), lambda r: mtp.draft(model, r, 1), warm=i == 0))
    cost = [1.0] + [max((verify[k] + k * draft) / verify[0], 1.0) for k in range(1, MAX_DRAFTS + 1)]
    out = {"step": verify[0], "verify": verify, "draft": draft, "round_cost": sorted(cost)}
    write_record("round_cost.json", key, out)
    return out


def memory_disk(need: int = 1 << 30) -> str | None:
    """/dev/shm（内存盘）能写、还空着 need 字节时用它：约 700 MB 的权重只为量一次，写磁盘要多等几秒。容器里的 /dev/shm
    常常只有 64 MB：那时用默认的临时文件夹。"""
    try:
        return "/dev/shm" if os.access("/dev/shm", os.W_OK) and shutil.disk_usage("/dev/shm").free >= need else None
    except OSError:
        return None


def verify_seconds(model, state, token: int, T: int) -> float:
    """验证 T 行（解码 T = 1）：接着 state 的一次前向与输出头，像 spec_round 那样记历史，要几秒；在 state 的副本上算
    （复制不计时）。不先空跑：读提示词（Run.start）已经付过一次性的开销，每个行数第一次跑并不更慢。"""
    def setup():
        s = copy_state(state)
        if T > 1:
            keep_history(s)
        return s

    return fastest(setup, lambda s: model.lm_head(model.hidden(torch.full((1, T), token), s)), times=1, warm=False)


def fastest(setup, f, times: int = 3, warm: bool = True) -> float:
    """f(setup()) 的秒数（setup 不计时）：warm 时先跑一次（一次性的开销），再取 times 次里最快的（内存带宽一会儿快一会儿慢）。"""
    if warm:
        f(setup())
    best = float("inf")
    for _ in range(times):
        x = setup()
        t0 = time.perf_counter()
        f(x)
        best = min(best, time.perf_counter() - t0)
    return best
