"""附录 · 快路径：解码一步（全部层）编译成一张图。

解码一个 token 时，每层是几十个只有几千个数的小运算；逐层编译之后每层仍是一次带守卫检查的编译函数调用，
注意力层还要在 attend 处断开（缓存长度每步都变）。这里把一步的全部层、RoPE 与最后的 norm 交给 torch.compile
一次追踪成一张图，与 gpt-fast 一样要解决的是“缓存每步都变长”：
- 位置不作为 Python 整数进图（那样每一步都是一个新常数、都要重新编译），而是一个 0 维张量 pos；
- KV 缓存的写入与读取是一个自定义算子 cached_attention：图把它当黑盒，它在图外照常按 pos 写入、读前 pos + T 个位置。
  缓存的缓冲区只在图外扩容（cache_offsets），长度那一维标成动态的，扩容也不重新编译。
每种 token 数（解码 1 个、验证 1～4 个草稿）、记不记历史各编译一次，之后每步就是一次调用。矩阵乘法在图里是 C++ 算子
qwen_fast::matvec（matvec.cpp）：图把它当外部调用，每张图里都是同一份代码，图里其余的运算也不与它融合，
一行的结果与图里有几行无关。
结构相同的 DeltaNet 层在图里是同一段可复用的代码（nested_compile_region），0.8B 的 18 层只编译一次。
"""

from contextlib import contextmanager

import torch

from ..attention import AttentionState
from ..deltanet import DeltaNetState
from ..layer import DecoderLayer
from ..rope import rope_tables
from .layers import FastDecoderLayer, FastDeltaNet, FastRMSNorm, PackedModel
from .linear import STEP_OPTIONS
from .share import can_share, current, layers_many


@torch.compiler.nested_compile_region
def deltanet_layer(layer, x, conv, S, keep: bool):
    """图里的一个 DeltaNet 层：同样结构的层只编译一次、各层重复调用（nested_compile_region）。这样的区域不能就地改输入，
    所以 S 先复制一份再交给就地更新的递推（读一遍旧 S、写一遍新 S，与不就地的写法一样多）；新的状态作为输出带出来。"""
    s = DeltaNetState()
    s.conv, s.S, s.keep_history = conv, S.clone(), keep
    x = DecoderLayer.forward(layer, x, None, None, s)
    return x, s.conv, s.S, s.history


@contextmanager
def cache_offsets(states, pos: int, T: int):
    """图外的准备与收尾，主模型与草稿头共用：各个 KV 缓存扩容到容得下 pos + T 个位置（第 6 章的 reserve，发生在图外），
    长度那一维标成动态的（图不按容量特化，扩容之后还是同一张图），挂上 0 维张量 offset = pos 给图里的
    cached_attention；产出这个张量。图正常返回后各缓存的长度前移 T；无论如何 offset 都摘掉。"""
    offset = torch.tensor(pos)
    for s in states:
        s.reserve(pos + T, s.k_buf)
        for buf in (s.k_buf, s.v_buf):
            if not hasattr(buf, "_dynamo_dynamic_indices"):
                torch._dynamo.mark_dynamic(buf, 2)
        s.offset = offset
    try:
        yield offset
    finally:
        for s in states:
            s.offset = None
    for s in states:
        s.length += T


class FastModel(PackedModel):
    """分块布局的模型。compile_steps 之后，解码与验证（一个提示词、不多于 5 个 token、状态已有预填充）走整步编译的图；
    其余（以及不编译时）照第 10 章，RoPE 表逐个位置地算（PackedModel）。"""

    step_lengths = ()  # 哪些 token 数走编译的一步（没编译时没有）

    def compile_steps(self, lengths) -> None:
        self.step_lengths = tuple(lengths)
        for m in self.modules():  # 图里的 DeltaNet 层、RMSNorm、MLP 用 PyTorch 的运算（C++ 的 deltanet_step、rms_norm、
            if isinstance(m, (FastDeltaNet, FastRMSNorm)):  # layer.cpp 进不了图）；图外也一样：同一个位置在图里、图外
                m.step_kernel = None  # 算的是同一串运算
            if isinstance(m, FastDecoderLayer):
                m.block = None
        # 每个模型每种长度、记不记历史各一张图，都挂在同一个函数（decode_step）上；torch 默认一个函数最多 8 张，
        # 超了就悄悄不编译、逐个算子地跑（结果不再逐位相同）。一个进程里加载几个模型（测试、笔记本）也够用
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.step = torch.compile(self.decode_step, dynamic=False, options=STEP_OPTIONS)

    def decode_step(self, x, pos, states, shift):
        """图里的一步：x [1, T, hidden] float32（已查过嵌入），pos、shift 是 0 维张量（RoPE 位置从 pos + shift 起，第 10 章），
        states 是各层的状态。"""
        cos, sin = rope_tables(self.cfg, pos + shift + torch.arange(x.shape[1], device=x.device))
        for layer, s in zip(self.layers, states):
            if isinstance(s, AttentionState):  # 注意力层直接追踪进图（自定义算子就地写缓存，不能放进可复用的区域）
                x = DecoderLayer.forward(layer, x, cos, sin, s)
            else:
                x, s.conv, s.S, s.history = deltanet_layer(layer, x, s.conv, s.S, s.keep_history)
        return self.norm(x)

    def run_layers(self, x, cos, sin, state=None, valid=None):
        """服务时能与别的请求拼在一起的一次前向（share.py 的 can_share）：全部解码层是一件事，交给这个线程的伙伴
        （RowBatcher：它的线程把这时在等的几个请求的全部层一次算完，layers_many）。默认（ALONE 不接）照 PackedModel 自己算。"""
        if (partner := current()).takes(self) and can_share(x, state, valid):
            return partner.share(self, layers_many, (x, cos, sin, state))
        return super().run_layers(x, cos, sin, state, valid)

    def hidden(self, ids, state=None, embeds=None, positions=None):
        ids = self.check_ids(ids, state)
        B, T = ids.shape
        if T not in self.step_lengths or state is None or B != 1 or state.valid is not None or state.pos == 0 \
                or embeds is not None or positions is not None:
            return super().hidden(ids, state, embeds, positions)
        attention = [s for s in state.layers if isinstance(s, AttentionState)]
        x = self.embed_tokens(ids)  # [1, T, hidden]
        with cache_offsets(attention, state.pos, T) as pos:
            h = self.step(x.float(), pos, state.layers, torch.tensor(state.shift))
        state.pos += T
        return h.to(x.dtype)
