"""附录 · 快路径：换上快布局的各层。

变换不新建模块、不动参数的名字：把已加载的普通模块换成这里的子类（module.__class__ = 子类，对象还是那个对象），
再把它的 nn.Linear 换成 linear.py 的布局。子类只改写章节里留好的小方法：
- project：读同一输入的几个投影拼成一个矩阵，一次乘完再切开；
- delta_rule：解码与验证草稿（不多于 VERIFY_ROWS 个 token）时 DeltaNet 用就地更新的递推（recurrent_in_place），更长的用
  第 8 章的分块形式、块长 DELTA_CHUNK（chunk_rule）；
  分块布局上（有 C++ 内核时）DeltaNet 层的这一段整个交给 deltanet.cpp，一个位置一次调用（FastDeltaNet.step）；
- attend：解码一个 token、缓存又不短时按键值头分组成一次矩阵乘法（attend_cache），验证几个草稿时逐个查询地算；在 step.py
  编译的图里，KV 缓存的写入与读取是自定义算子 cached_attention（图把它当黑盒，缓存每步变长也不重新编译）；
- gates、rope：不编译时验证几个草稿的 β、g 与 RoPE 表逐行算（row_by_row）；
- RMSNorm：1 + w 算好一次，有 C++ 内核时一次调用算完（FastRMSNorm，norm.cpp）；
- 几个请求（服务时）、几行（左填充的批处理）的同一层一次算完：share.py 的 layer_many，拼起来的行只读一遍权重；
- 分块布局（不编译图）上不多于 STEP_ROWS 个 token 时一层一次 C 调用（layer.cpp、attention.cpp：layer_params 填好一层的
  常量）：share.py 的 layer_many 逐个运算地调用同样的内核，两者逐位相同。
验证时逐个位置的这些写法，都是为了让每一行与单独解码那个 token 时逐位相同（第 14 章）。
"""

import ctypes

import torch
import torch.nn.functional as F

from ..attention import Attention
from ..chunk import CHUNK, chunk_gated_delta_rule
from ..deltanet import GatedDeltaNet, recurrent_gated_delta_rule
from ..layer import DecoderLayer
from ..mlp import MLP
from ..norm import RMSNorm, rms
from ..model import Model
from ..moe import SparseMoE
from .experts import FastMoE, speed_up_moe  # noqa: F401  FastMoE 也从这里取
from .kernel import AttentionParams, DeltaNetParams, LayerParams, Lin, MoeParams
from .linear import BlockedLinear, fast_linear
from .padded import PaddedRows
from .share import can_share, current, layer_many
from .sizes import COMPILED_PIECE, DECODE_LENGTHS, DELTA_CHUNK, GROUPED_FROM, STEP_ROWS, VERIFY_ROWS  # noqa: F401  别处从这里取

# 一次前向有几个 token 时走哪条路（DECODE_LENGTHS、VERIFY_ROWS、STEP_ROWS、GROUPED_FROM、COMPILED_PIECE）：sizes.py 的表。
# STEP_ROWS：DeltaNet 层由 C++ 的 deltanet_step 逐个位置地走（FastDeltaNet.step）：验证草稿必须这样算（与解码逐位相同）；
# 短的提示词也这样读，这么短时不比分块形式（第 8 章）慢，而且调用时放开 GIL


def recurrent_in_place(q, k, v, g, beta, S, keep_all: bool = False):
    """与第 7 章的 recurrent_gated_delta_rule 同签名、同结果，只是更快：

    S 是每层 1 MB 的 float32 矩阵，解码一步有不少时间花在读写它上面。把三行公式重排成只读一遍旧 S：
        [Sᵀk, Sᵀq] = 旧 S 一次乘两个向量
        δ = β(v − e^g Sᵀk)                  衰减之后的 S 对 k 的预测就是 e^g Sᵀk
        o = e^g Sᵀq + (qᵀk) δ               新 S 对 q 的读出：衰减的旧记忆 + 刚写进去的 k ⊗ δ
        S ← e^g S + k ⊗ δ                   推理时（不求导）就地更新传入的 S：少分配、少写一块新内存
    传入的 S 要么是状态里马上被替换的那份，要么是新建的零矩阵，所以可以覆盖。keep_all 时只有第一步就地：
    投机解码回滚时至少留下第一个 token，S₀ 用不着；之后每步新建一份，前一个位置之后的 S 才留得住。
    每一步只用这一步的切片（delta_step），做的运算与一次只喂一个 token 时完全一样：验证几个草稿时每个位置的
    输出与记忆，与逐个解码这几个 token 时逐位相同。
    """
    outs, states = [], []
    grad = torch.is_grad_enabled()  # 训练时不能就地改：反向传播要用每一步的旧 S
    for t in range(q.shape[2]):
        o, S = delta_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], g[:, :, t : t + 1],
                          beta[:, :, t : t + 1], S, in_place=(t == 0 or not keep_all) and not grad)
        outs.append(o)
        states.append(S)
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [B, H, T, Dv]
    return o, S, (states if keep_all else None)


def delta_step(q, k, v, g, beta, S, in_place: bool):
    """一个 token 的一步：q、k [B, H, 1, Dk]，v [B, H, 1, Dv]，g、beta [B, H, 1] → (o [B, H, 1, Dv], 新 S)。"""
    d = g.exp()[..., None]  # [B, H, 1, 1]：e^g
    pred, read = (torch.cat([k, q], dim=2) @ S).split(1, dim=2)  # Sᵀk、Sᵀq，各 [B, H, 1, Dv]
    delta = (v - d * pred) * beta[..., None]  # δ = β(v − e^g Sᵀk)
    o = d * read + (q * k).sum(-1, keepdim=True) * delta  # o = e^g Sᵀq + (qᵀk) δ
    k_col = k.transpose(-1, -2)  # [B, H, Dk, 1]：与 δ [B, H, 1, Dv] 广播成外积
    S = S.mul_(d).addcmul_(k_col, delta) if in_place else (S * d).addcmul_(k_col, delta)
    return o, S


def attend_cache(q, k_all, v_all):
    """q [B, H, T, D] 对缓存的前 L 个位置 k_all、v_all [B, Hkv, L, D] 做因果注意力（新 token 在最后 T 个位置）→ [B, T, H·D]。
    一个查询、缓存又不短时，同一个键值头的 g 个查询头排成 g 行，一次矩阵乘法读一遍这一头的缓存：CPU 上的
    scaled_dot_product_attention 对一个查询读长缓存读得慢（见 docs/performance.md）。
    几个查询（验证草稿，不多于 VERIFY_ROWS 个）时逐个查询地算，每个只看它自己之前的位置：与逐个解码时的运算完全
    一样，结果逐位相同（一次算几个查询的 SDPA 按另一种顺序求和）。更多的查询（预填充）一次算完。"""
    B, H, T, D = q.shape
    Hkv, L = k_all.shape[1], k_all.shape[2]
    if 1 < T <= VERIFY_ROWS:
        rows = [attend_cache(q[:, :, t : t + 1], k_all[:, :, : L - T + t + 1], v_all[:, :, : L - T + t + 1])
                for t in range(T)]
        return torch.cat(rows, dim=1)  # [B, T, H·D]
    if T == 1 and L >= GROUPED_FROM:
        scores = (q.reshape(B, Hkv, -1, D) @ k_all.transpose(-1, -2)) * D**-0.5  # [B, Hkv, g, L]
        return (torch.softmax(scores, dim=-1) @ v_all).reshape(B, T, H * D)  # [B, Hkv, g, D] → [B, 1, H·D]
    # 缓存里只有这 T 个（提示词的第一段）：is_causal 不必读掩码张量，整块都遮住的部分直接跳过（数字见 docs/performance.md）
    causal = T == L > 1
    mask = None if T == 1 or causal else torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)  # [T, L]
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, is_causal=causal, scale=D**-0.5, enable_gqa=H != Hkv)
    return out.transpose(1, 2).reshape(B, T, H * D)


@torch.library.custom_op("qwen_fast::cached_attention", mutates_args=("k_buf", "v_buf"))
def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     pos: torch.Tensor) -> torch.Tensor:
    """新的 k、v [B, Hkv, T, D] 写进缓冲区的 pos…pos+T−1，再对前 pos + T 个位置做注意力 → [B, T, H·D]。"""
    start = int(pos)
    end = start + k.shape[2]
    k_buf[:, :, start:end] = k
    v_buf[:, :, start:end] = v
    return attend_cache(q, k_buf[:, :, :end], v_buf[:, :, :end])


@cached_attention.register_fake
def _(q, k, v, k_buf, v_buf, pos):
    B, H, T, D = q.shape
    return q.new_empty(B, T, H * D)


class FastRMSNorm(RMSNorm):
    """零中心 RMSNorm，scale = 1 + w 换布局时算好一次；有 C++ 内核时一次调用算完（norm.cpp），否则照第 3 章的 rms。"""
    step_kernel = None
    scale = None

    def forward(self, x):
        if torch.is_grad_enabled():  # 求导时照第 3 章（scale 是算好的常量，梯度传不回 w）
            return super().forward(x)
        if self.step_kernel is None or torch.compiler.is_compiling():
            return rms(x, self.eps, self.scale).to(x.dtype)
        return self.step_kernel.rms_norm(x, self.scale, self.eps).to(x.dtype)


def speed_up_norms(module, kernel=None) -> None:
    """module 里的每个零中心 RMSNorm 换成 FastRMSNorm（权重已加载之后调用）。"""
    for m in module.modules():
        if type(m) is RMSNorm:
            m.__class__ = FastRMSNorm
            m.step_kernel = kernel
            m.scale = (1.0 + m.weight.detach().float()).contiguous()


class FastMLP(MLP):
    def forward(self, x):
        return self.down_proj(self.act(self.gate_up(x)))

    def act(self, gate_up):
        """silu(gate) · up。长的提示词（多于 STEP_ROWS 行，分块布局、不求导、不在编译的图里）一次 C 调用（layer.cpp 的
        act_rows，各行分给两个线程），其余照第 4 章（gate_proj、up_proj 拼成了一个矩阵）。"""
        kernel = getattr(self.down_proj, "kernel", None)
        long = gate_up.numel() > STEP_ROWS * gate_up.shape[-1]
        if kernel is not None and long and gate_up.dtype in (torch.bfloat16, torch.float32) and not torch.is_grad_enabled() \
                and not torch.compiler.is_compiling():
            return kernel.act(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FastAttention(Attention):
    def project(self, x):
        return self.qkv(x).split(self.qkv_sizes, dim=-1)  # q_proj、k_proj、v_proj 拼成一个矩阵

    def attend(self, q, k, v, state, valid):
        """在整步编译的图里（step.py 给状态挂上 offset）：写缓存、读缓存都交给自定义算子 cached_attention；
        图外没有左填充时：长的提示词用 attention.cpp 的 attention_prefill，其余用 attend_cache（解码一个 token、缓存又不短时
        按键值头分组）；其余照第 6 章。"""
        if getattr(state, "offset", None) is not None:
            return torch.ops.qwen_fast.cached_attention(q, k, v, state.k_buf, state.v_buf, state.offset)
        if valid is not None or state is None:
            return super().attend(q, k, v, state, valid)
        if (kernel := self.prefill_kernel(q, state)) is not None:  # 长的提示词：attention.cpp 的预填充注意力
            state.append(k, v)
            return kernel.attention_prefill(q, state.k_buf, state.v_buf, state.length)
        return attend_cache(q, *state.append(k, v))

    def prefill_kernel(self, q, state):
        """长的提示词（多于 STEP_ROWS 个查询）走 attention.cpp 时的内核（分块布局、不求导、不在编译的图里、缓存是连续的
        float32，头的维数是 16 的倍数）；否则 None。"""
        kernel = getattr(self.qkv, "kernel", None)
        if kernel is None or q.shape[2] <= STEP_ROWS or q.shape[3] % 16 or torch.is_grad_enabled() \
                or torch.compiler.is_compiling() or q.dtype != torch.float32:
            return None
        if state.k_buf is not None and not (state.k_buf.dtype == torch.float32 and state.k_buf.is_contiguous()):
            return None
        return kernel

    def can_step(self, state, valid) -> bool:
        """attention.cpp 接不接得下：有缓存、没有左填充，缓存是连续存放的 float32（章节里的缓存本来就是）。"""
        return state is not None and valid is None and getattr(state, "offset", None) is None and \
            (state.k_buf is None or state.k_buf.dtype == torch.float32 and state.k_buf.is_contiguous()
             and state.v_buf.is_contiguous())

    def step(self, params, qkv, cos, sin, state):
        """投影之后、o_proj 之前的一段一次 attention.cpp 的调用（服务时拼在一起的请求各调用一次）：与 layer.cpp 的
        attention_layer 里的那一段是同一个函数。"""
        return self.in_cache(qkv.shape, state, lambda: self.qkv.kernel.attention_step(params, qkv, cos, sin, state))

    def whole_layer(self, layer, x, cos, sin, state):
        """整个解码层（归一化、qkv、这一段、o_proj、残差，再加上 MLP 那一半）一次 layer.cpp 的调用：x [B, T, hidden]
        float32 → 这一层的输出。与 share.py 的 layer_many 逐个运算地调用同样的内核逐位相同。"""
        return self.in_cache(x.shape, state, lambda: self.qkv.kernel.attention_layer(layer.block, x, cos, sin, state))

    def in_cache(self, shape, state, run):
        """缓存先留够 T 个位置（扩容在 Python 里），run() 把这 T 个写在 state.length 之后，之后长度加 T。"""
        B, T = shape[0], shape[1]
        state.reserve(state.length + T, torch.empty(B, self.num_kv_heads, 0, self.head_dim))
        out = run()
        state.length += T
        return out


class FastDeltaNet(GatedDeltaNet):
    step_kernel = None  # 分块布局的层（speed_up_layer 挂上 Kernel）：解码、验证草稿时用 deltanet.cpp 逐个位置地算
    step_consts = None  # 它要的四个常量，换布局时算好一次：卷积核 [K, C]、−exp(A_log)、dt_bias、门控 RMSNorm 的权重
    step_params = None  # deltanet.cpp 的 DeltaNet：指向这四个常量（换 step_consts 就要一起换），再加 eps 与形状

    def forward(self, x, state=None, valid=None, rule=recurrent_gated_delta_rule):
        """有 C++ 内核、有状态、不求导、没有左填充时：解码、验证草稿、短的提示词（不多于 STEP_ROWS 个 token）交给 step，
        更长的（不记历史时）交给 chunks；其余照第 7 章。"""
        if self.step_kernel is None or state is None or valid is not None or torch.is_grad_enabled():
            return super().forward(x, state, valid, rule)
        if x.shape[1] <= STEP_ROWS:
            return self.step(x, state)
        if state.keep_history or self.head_k_dim % 16 or self.head_v_dim % 16:
            return super().forward(x, state, valid, rule)
        return self.chunks(x, state)

    def chunks(self, x, state):
        """长的提示词：投影与门照第 7 章；卷积 + SiLU、q 与 k 的归一化、第 8 章的分块形式（块长 DELTA_CHUNK）、门控 RMSNorm
        交给 deltanet.cpp 的 delta_chunks：一个头一次调用走完所有块，卷积的结果不写回内存，不必每块十几个小运算。"""
        B, T, _ = x.shape
        proj = self.in_proj(x)  # [B, T, P]：qkv、z、b、a
        C = 2 * self.key_dim + self.value_dim
        b, a = proj[..., -2 * self.num_v_heads :].split(self.num_v_heads, dim=-1)
        beta, g = self.gates(b, a)  # [B, T, Hv]
        past = state.conv.float().contiguous() if state.conv is not None else torch.zeros(B, self.kernel - 1, C)
        S = state.S.float().contiguous() if state.S is not None else \
            torch.zeros(B, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        o = self.step_kernel.delta_chunks(self.step_params, proj, past, beta, g, S, DELTA_CHUNK)  # [B, T, Hv·Dv]；S 就地更新
        window = torch.cat([past, proj[:, -(self.kernel - 1):, :C].float()], dim=1)[:, -(self.kernel - 1):]  # 最近 K−1 个输入
        state.S, state.conv = S, window.contiguous()
        return self.out_proj(o.to(x.dtype))

    def causal_conv(self, x, state):
        """长的提示词（分块形式）：卷积与 SiLU 在 deltanet.cpp 里一遍算完（不拼接、不先转 float32）；与第 7 章差在
        float32 的舍入之内。求导、记历史（要完整的输入）或没有 C++ 内核时照第 7 章。"""
        if self.step_kernel is None or torch.is_grad_enabled() or (state is not None and state.keep_history):
            return super().causal_conv(x, state)
        B, T, C = x.shape
        has_past = state is not None and state.conv is not None
        past = state.conv.float().contiguous() if has_past else x.new_zeros(B, self.kernel - 1, C, dtype=torch.float32)
        y = self.step_kernel.causal_conv(x, past, self.step_consts[0])  # [B, T, C]
        return y, torch.cat([past, x[:, -(self.kernel - 1):].float()], dim=1)  # 只用到最后 K−1 个输入

    def step(self, x, state):
        """x [B, T, hidden]，T ≤ STEP_ROWS：投影一次，deltanet.cpp 逐个位置地走（mix），最后 out_proj。"""
        o = self.mix(self.in_proj(x).float().contiguous(), state)  # [B, T, Hv·Dv]
        return self.out_proj(o.to(x.dtype))

    def mix(self, proj, state):
        """投影之后、out_proj 之前的一段：proj [B, T, C + Hv·Dv + 2Hv]（qkv、z、b、a，连续存放的 float32）→ [B, T, Hv·Dv]。
        一次 deltanet.cpp 的调用走完这 T 个位置：每个位置的卷积、归一化、门、递推、门控 RMSNorm 与单独解码它时一样。"""
        B, T, _ = proj.shape
        past, S, history = self.step_state(state, B, T)
        out, conv = self.step_kernel.deltanet_step(self.step_params, proj, past, S, history)
        self.keep_state(state, past, proj, S, history, conv)
        return out  # [B, T, Hv·Dv]

    def whole_layer(self, layer, x, state):
        """整个解码层（归一化、in_proj、这一段、out_proj、残差，再加上 MLP 那一半）一次 layer.cpp 的调用：x [B, T, hidden]
        float32 → 这一层的输出。与 share.py 的 layer_many 逐个运算地调用同样的内核逐位相同。"""
        B, T, _ = x.shape
        past, S, history = self.step_state(state, B, T)
        proj = torch.empty(B, T, self.in_proj.out_features) if state.keep_history else None
        out, conv = self.step_kernel.delta_layer(layer.block, x, past, S, history, proj)
        self.keep_state(state, past, proj, S, history, conv)
        return out

    def step_state(self, state, B: int, T: int):
        """C++ 读写的状态（章节里的状态本来就是连续存放的 float32，这里不过是保证）：(卷积窗口 [B, K−1, C], 记忆 S，
        记历史时前 T−1 个位置之后的 S 各一块缓冲区，否则 None)。"""
        C = 2 * self.key_dim + self.value_dim
        past = state.conv.float().contiguous() if state.conv is not None else torch.zeros(B, self.kernel - 1, C)
        S = state.S.float().contiguous() if state.S is not None else \
            torch.zeros(B, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        return past, S, [torch.empty_like(S) for _ in range(T - 1)] if state.keep_history else None

    def keep_state(self, state, past, proj, S, history, conv) -> None:
        """与第 7 章同样的状态：卷积窗口、记忆 S；记历史（keep_history）时每个位置之后的 S 各留一份（最后一个位置的就是
        新的 S），窗口从完整的卷积输入里切。"""
        if state.keep_history:
            C = past.shape[-1]
            state.history = (torch.cat([past, proj[..., :C]], dim=1), [*history, S])  # (完整卷积输入, 每个位置之后的 S)
        state.conv, state.S = conv, S

    def project(self, x):
        return self.in_proj(x).split(self.in_proj_sizes, dim=-1)  # 四个输入投影拼成一个矩阵

    def gates(self, b, a):
        """验证几个草稿时逐个位置地算 β、g（见 row_by_row）。"""
        return row_by_row(super().gates, b, a)


def chunk_rule(q, k, v, g, beta, S, keep_all: bool = False):
    """第 8 章的分块形式，块长 DELTA_CHUNK（sizes.py）；要逐位置状态（keep_all，只支持一块）时照第 8 章的块长。"""
    return chunk_gated_delta_rule(q, k, v, g, beta, S, keep_all, chunk=CHUNK if keep_all else DELTA_CHUNK)


def row_by_row(fn, *xs, dim: int = -2):
    """fn 作用在 xs（沿 dim 维有 T 行，输出的行在倒数第二维）上。1 < T ≤ VERIFY_ROWS 时一行一行地算再拼起来：不编译时
    PyTorch 的逐元素运算按张量的总元素数把前面的部分交给向量化的代码、剩下的尾巴交给标量代码，两者的 exp 差一点舍入；
    每行只有几个到几十个数（每个头一个 β、g，RoPE 的几十维）时，同一行在 1 行与 T 行的张量里可能一次走向量、一次走尾巴。
    逐行算就总是同一种。"""
    T = xs[0].shape[dim]
    if not 1 < T <= VERIFY_ROWS:
        return fn(*xs)
    rows = [fn(*(x.narrow(dim, t, 1) for x in xs)) for t in range(T)]
    return tuple(torch.cat(parts, dim=-2) for parts in zip(*rows))


class PackedModel(PaddedRows, Model):
    """换了布局（打包；分块的 FastModel 是它的子类）的模型：解码、验证几个 token 时 RoPE 表逐个位置地算（见 row_by_row），
    左填充的批处理每行照它单独运行那样算（padded.py），其余照第 10 章。"""

    def rope(self, positions):
        return row_by_row(super().rope, positions, dim=-1)  # 位置 [..., T] → cos、sin [..., T, rotary_dim]


class FastDecoderLayer(DecoderLayer):
    block = None  # 分块布局、不编译图时：layer.cpp 要的这一层的常量（layer_params 填的 LayerParams）

    @property
    def dtype(self) -> torch.dtype:
        return self.ffn.down_proj.dtype

    def delta_rule(self, T: int):
        return recurrent_in_place if T <= VERIFY_ROWS else chunk_rule  # 验证草稿时也递推：与解码逐位相同

    def forward(self, x, cos, sin, state=None, valid=None):
        """解码、验证草稿、短的提示词（不多于 STEP_ROWS 个 token、不求导）且有 layer.cpp 的常量时：有缓存、没有左填充就整层
        一次 C 调用（两种混合器的 whole_layer），否则混合器照第 9 章、MLP 那一半一次 C 调用（mlp_block）；其余照第 9 章。
        专家混合层更长的输入（预填充）：混合器照第 9 章，专家混合那一半也是一次 mlp_block（两个线程各拿一些专家）。"""
        if (partner := current()).takes(self) and can_share(x, state, valid):  # 服务时草稿头的一层：与别人拼（share.py）
            return partner.share(self, layer_many, (x, cos, sin, state))
        short = x.shape[1] <= STEP_ROWS  # 长的只有专家混合层走下面（预填充）
        if self.block is None or torch.is_grad_enabled() or not short and self.block.moe is None:
            return super().forward(x, cos, sin, state, valid)
        if short and self.layer_type == "linear_attention" and state is not None and valid is None:
            return self.linear_attn.whole_layer(self, x, state)
        if short and self.layer_type == "full_attention" and self.block.attn.H and self.self_attn.can_step(state, valid):
            return self.self_attn.whole_layer(self, x, cos, sin, state)
        x = x + self.mixer(self.input_layernorm(x).to(self.dtype), cos, sin, state, valid).float()
        return self.ffn.down_proj.kernel.mlp_block(self.block, x)


def fuse(module, name: str, parts: list[str], kernel, quantize=None, dtype=None) -> None:
    """module 的几个投影（parts，读同一输入）拼成一个矩阵 module.<name>，记下各自的宽度以便切开；原来的投影删掉。"""
    linears = [getattr(module, p) for p in parts]
    setattr(module, name, fast_linear(linears, kernel, quantize, dtype))
    setattr(module, name + "_sizes", [m.out_features for m in linears])
    for p in parts:
        delattr(module, p)


def speed_up_layer(layer: DecoderLayer, kernel=None, quantize=None, dtype=None) -> None:
    """把一个已加载的解码层就地换成快的版本（kernel 给定时用分块布局、矩阵转成 dtype，quantize="int8" 时存成 int8；
    否则打包的布局）。"""
    layer.__class__ = FastDecoderLayer
    if isinstance(layer.mlp, SparseMoE):  # 专家混合层：路由器与每个专家两个矩阵（experts.py）；共享专家照稠密的 MLP 换
        speed_up_moe(layer.mlp, kernel, quantize, dtype)
    ffn = layer.ffn
    ffn.__class__ = FastMLP
    fuse(ffn, "gate_up", ["gate_proj", "up_proj"], kernel, quantize, dtype)
    ffn.down_proj = fast_linear([ffn.down_proj], kernel, quantize, dtype)
    if layer.layer_type == "linear_attention":
        mixer, name, parts, out = layer.linear_attn, "in_proj", ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"], "out_proj"
        mixer.__class__ = FastDeltaNet
    else:
        mixer, name, parts, out = layer.self_attn, "qkv", ["q_proj", "k_proj", "v_proj"], "o_proj"
        mixer.__class__ = FastAttention
    fuse(mixer, name, parts, kernel, quantize, dtype)
    setattr(mixer, out, fast_linear([getattr(mixer, out)], kernel, quantize, dtype))
    if kernel is not None and layer.layer_type == "linear_attention":
        mixer.step_kernel = kernel
        mixer.step_consts = tuple(t.detach().float().contiguous() for t in (
            mixer.conv1d.weight[:, 0].t(), -mixer.A_log.exp(), mixer.dt_bias, mixer.norm.weight))
        mixer.step_params = DeltaNetParams(*(t.data_ptr() for t in mixer.step_consts), mixer.norm.eps, mixer.num_k_heads,
                                           mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim, mixer.kernel)


def layer_params(layer: FastDecoderLayer) -> LayerParams | None:
    """layer.cpp 要的这一层的常量；矩阵不全是分块布局、带偏置、模型不是 bfloat16 或 float32，或归一化不走 C++ 时 None
    （这一层照逐个运算的路径走）。专家混合层的前馈也在里面（moe_params）。"""
    mixer = layer.linear_attn if layer.layer_type == "linear_attention" else None
    moe = layer.mlp if isinstance(layer.mlp, SparseMoE) else None
    ffn = layer.ffn  # 稠密的 MLP，或专家混合层的共享专家
    linears = [ffn.gate_up, ffn.down_proj] + ([mixer.in_proj, mixer.out_proj] if mixer is not None else []) \
        + ([moe.router, *moe.gate_up, *moe.down] if moe is not None else [])
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.dtype not in (torch.bfloat16, torch.float32) or any(getattr(n, "step_kernel", None) is None for n in norms) \
            or any(not isinstance(m, BlockedLinear) or m.bias is not None or m.blocks.dim() == 4 and m.in_features % 2
                   for m in linears):
        return None
    p = LayerParams(bf16=layer.dtype == torch.bfloat16, hidden=ffn.down_proj.out_features,
                    inter=ffn.down_proj.in_features, eps1=norms[0].eps, eps2=norms[1].eps,
                    norm1=norms[0].scale.data_ptr(), norm2=norms[1].scale.data_ptr(),
                    gate_up=lin(ffn.gate_up), down=lin(ffn.down_proj))
    if moe is not None:
        p.moe = ctypes.addressof(moe_params(moe))
    if mixer is not None:
        p.in_proj, p.out_proj = lin(mixer.in_proj), lin(mixer.out_proj)
        p.delta = mixer.step_params
    elif attention_fits(layer.self_attn):
        a = layer.self_attn
        p.in_proj, p.out_proj = lin(a.qkv), lin(a.o_proj)
        p.attn = AttentionParams(a.q_norm.scale.data_ptr(), a.k_norm.scale.data_ptr(), a.q_norm.eps, a.num_heads,
                                 a.num_kv_heads, a.head_dim)
    return p


def moe_params(moe: FastMoE) -> MoeParams:
    """layer.cpp 的 Moe，挂在 moe.params 上（LayerParams 只存它的地址：层在，它就在）。"""
    keep = [(Lin * len(ms))(*map(lin, ms)) for ms in (moe.gate_up, moe.down)]
    moe.params = MoeParams(len(moe.gate_up), moe.top_k, moe.down[0].in_features, lin(moe.router),
                           *(ctypes.addressof(a) for a in keep))
    moe.params.keep = keep
    return moe.params


def attention_fits(a: FastAttention) -> bool:
    """attention.cpp 接得下这一层的注意力：矩阵是分块布局、不带偏置，q_norm、k_norm 走 C++，头的维数是 16 的倍数。"""
    return all(isinstance(m, BlockedLinear) and m.bias is None for m in (a.qkv, a.o_proj)) and a.head_dim % 16 == 0 \
        and a.q_norm.eps == a.k_norm.eps and all(getattr(n, "step_kernel", None) is not None for n in (a.q_norm, a.k_norm))


def lin(m: BlockedLinear) -> Lin:
    """layer.cpp 的 Lin：种类（0 float32 块、1 bfloat16 块、2 一对一对的 bfloat16、3 int8、4 int4）、块数、形状与指针。"""
    kind = {torch.float32: 0, torch.int8: 3, torch.uint8: 4}.get(m.blocks.dtype, 2 if m.blocks.dim() == 4 else 1)
    return Lin(kind, m.blocks.shape[0], m.in_features, m.out_features, m.blocks.data_ptr(),
               None if m.scales is None else m.scales.data_ptr())


def attach_blocks(module) -> None:
    """module 里分块布局的每个解码层填上 layer.cpp 的常量（换完布局、归一化之后调用；编译图时不调用）。"""
    for m in module.modules():
        if isinstance(m, FastDecoderLayer):
            m.block = layer_params(m)
