"""第 7 章 · Gated DeltaNet：用一个固定大小的矩阵记住全部历史。

Qwen3.5 四层里有三层不是 softmax 注意力，而是“线性注意力”Gated DeltaNet。
它不保存所有历史的 k、v，而是每个头维护一个 [128, 128] 的记忆矩阵 S，
每来一个 token 就把 (k → v) 这对联想“写”进去：

    S ← exp(g) · S                    先整体衰减（g ≤ 0，门控遗忘）
    S ← S + k ⊗ β(v − Sᵀk)            delta 规则：只写入 S 还没预测对的那部分
    o = Sᵀq                           用查询读出

Sᵀk 是记忆对 k 的“预测”，v − Sᵀk 是误差，β ∈ (0, 1) 是写入强度（学习率）。
所以 S 像一个在线做梯度下降的线性回归器。解码一个 token 的代价与上下文长度无关，
状态大小也固定：这就是它比 KV 缓存省的地方。

进入递推之前还有几步：in_proj_qkv 一次投影出 q、k、v；一个核宽 4 的因果深度卷积
（每个通道只看自己最近 4 个输入）加 SiLU；q、k 做 L2 归一化，q 再乘 1/sqrt(128)；
β = sigmoid(b)，g = −exp(A_log) · softplus(a + dt_bias)。输出经过门控 RMSNorm
（门是 in_proj_z 的投影）再 out_proj。

本章用逐 token 的递推（解码时用）；下一章把同样的计算改写成按 64 个 token 一块的并行形式
（预填充与投机解码验证时用）。两者的输出与最终状态相同。
"""

import torch
import torch.nn.functional as F
from torch import nn

from .norm import GatedRMSNorm
from .weights import Fused, Linear


class DeltaNetState:
    """一层 DeltaNet 的状态：卷积窗口与记忆矩阵。

    conv: [B, 核宽 − 1, 通道]，最近 3 个 in_proj_qkv 输出（卷积要往回看 3 步），float32
    S:    [B, v_heads, 128, 128]，float32 的记忆矩阵
    keep_history: 为真时，前向顺手记下 history = (完整卷积输入, 重建每个位置之后 S 所需的量)，
                  投机解码靠它零代价回滚（第 14 章，见 state_after）
    """

    def __init__(self):
        self.conv = None
        self.S = None
        self.keep_history = False
        self.history = None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps)。等于 rms(x, eps/D) / sqrt(D)（第 3 章的 rms 用的是均值），借用它的合并运算。"""
    D = x.shape[-1]
    return F.rms_norm(x, (D,), eps=eps / D) * D**-0.5


def recurrent_gated_delta_rule(q, k, v, g, beta, S, keep_all: bool = False, in_place: bool = False):
    """逐 token 递推。q、k [B, H, T, Dk]，v [B, H, T, Dv]，g、beta [B, H, T]，S [B, H, Dk, Dv]。
    返回 (输出 [B, H, T, Dv], 最终 S, keep_all 时每个位置之后的 S 的列表（给 state_after），否则 None)。全部 float32。
    in_place=True 表示调用者不再需要传入的 S，推理时（不求导）可以就地覆盖。keep_all 时只有第一步就地：
    投机解码回滚时至少留下第一个 token（last），S₀ 用不着；之后每步新建一份，前一个位置之后的 S 才留得住。
    验证几个草稿时逐步的 S 本来就要算出来，留下它们（每层每个位置多写 1 MB）比拒绝时再重建便宜。

    S 是每层 1 MB 的 float32 矩阵，解码一步的时间有不少花在读写它上面，所以把上面三行公式重排成只读一遍旧 S：
        [Sᵀk, Sᵀq] = 旧 S 一次乘两个向量
        δ = β(v − e^g Sᵀk)                  衰减之后的 S 对 k 的预测就是 e^g Sᵀk
        o = e^g Sᵀq + (qᵀk) δ               新 S 对 q 的读出：衰减的旧记忆 + 刚写进去的 k ⊗ δ
        S ← e^g S + k ⊗ δ
    """
    T = q.shape[2]
    outs, states = [], []
    grad = torch.is_grad_enabled()  # 训练时不能就地改：反向传播要用每一步的旧 S
    decay = g.exp()[..., None]  # [B, H, T, 1]：e^g
    kq = torch.stack([k, q], dim=3)  # [B, H, T, 2, Dk]
    qk = (q * k).sum(-1, keepdim=True)  # [B, H, T, 1]：qᵀk
    for t in range(T):
        d = decay[:, :, t : t + 1]  # [B, H, 1, 1]
        pred, read = (kq[:, :, t] @ S).split(1, dim=2)  # Sᵀk、Sᵀq，各 [B, H, 1, Dv]
        delta = (v[:, :, t : t + 1] - d * pred) * beta[:, :, t : t + 1, None]  # δ = β(v − e^g Sᵀk)
        outs.append(d * read + qk[:, :, t : t + 1] * delta)  # o = e^g Sᵀq + (qᵀk) δ
        if (in_place if t == 0 else not keep_all) and not grad:  # S 是自己的：就地更新。少分配、少写一块 1 MB 的新内存，解码一步快约 2%
            S.mul_(d).addcmul_(k[:, :, t, :, None], delta)
        else:  # 调用者还要旧 S、要留下上一个位置之后的 S，或者要求导（求导要留着旧 S）：新建一份
            S = (S * d).addcmul_(k[:, :, t, :, None], delta)  # S ← e^g S + k ⊗ δ（[Dk, 1] 乘 [1, Dv] 广播成外积）
        states.append(S)
    o = outs[0] if T == 1 else torch.cat(outs, dim=2)  # [B, H, T, Dv]
    return o, S, (states if keep_all else None)


def state_after(parts, t: int, in_place: bool = False) -> torch.Tensor:
    """第 t 个位置（从 0 数）之后的记忆，形状 [B, H, Dk, Dv]。逐 token 递推记下的是每个位置之后的 S，直接取；
    分块形式（第 8 章）只算出块末的 S，记下的是 (S₀, G, K, U)，由它重建：

    把递推展开：每一步先整体衰减，再写入 k_j ⊗ u_j（u_j 就是上面的 δ），所以
        S_t = e^{G_t} S₀ + Σ_{j≤t} e^{G_t − G_j} k_j ⊗ u_j,     G_t = g₀ + … + g_t
    投机解码拒绝草稿时，只需按这个式子算出被接受的最后一个位置之后的那一份，不必重算前向。
    in_place=True 时结果直接写进 S₀（调用者不再需要它）：不分配、不多读写一块 1 MB 的新内存；
    递推记下的那份则直接交出，不复制（in_place=False 时复制一份，调用者改它不会动到记下的历史）。
    """
    if isinstance(parts, list):  # 逐 token 递推记下的就是每个位置之后的 S：直接取，不用重建
        return parts[t] if in_place else parts[t].clone()
    S0, G, k, U = parts  # S₀ [B, H, Dk, Dv]；G [B, H, T]；k [B, H, T, Dk]；U [B, H, T, Dv]
    B, H, Dk, Dv = S0.shape
    w = (G[:, :, t, None] - G[:, :, : t + 1]).exp()  # [B, H, t+1]：e^{G_t − G_j}
    kw = (k[:, :, : t + 1] * w[..., None]).transpose(-1, -2)  # [B, H, Dk, t+1]：e^{G_t − G_j} k_j
    S = S0.mul_(G[:, :, t, None, None].exp()) if in_place else G[:, :, t, None, None].exp() * S0  # e^{G_t} S₀
    U = U[:, :, : t + 1].reshape(B * H, t + 1, Dv)
    S.view(B * H, Dk, Dv).baddbmm_(kw.reshape(B * H, Dk, t + 1), U)  # 加上 Σ_{j≤t} e^{G_t − G_j} k_j ⊗ u_j
    return S


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_k_heads = cfg.linear_num_key_heads
        self.num_v_heads = cfg.linear_num_value_heads
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim  # 0.8B：16 × 128 = 2048
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.kernel = cfg.linear_conv_kernel_dim
        conv_dim = 2 * self.key_dim + self.value_dim  # q、k、v 拼在一起卷积：6144
        h = cfg.hidden_size
        self.in_proj_qkv = Linear(h, conv_dim, bias=False)  # 行依次是 q、k、v
        self.in_proj_z = Linear(h, self.value_dim, bias=False)  # 输出门
        self.in_proj_b = Linear(h, self.num_v_heads, bias=False)  # β 的 logit
        self.in_proj_a = Linear(h, self.num_v_heads, bias=False)  # 衰减的输入
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kernel, groups=conv_dim, bias=False)  # 权重 [C, 1, 4]
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)
        self.in_proj = Fused(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)  # 打包后一次乘完

    def causal_conv(self, x: torch.Tensor, state: DeltaNetState | None):
        """因果深度卷积 + SiLU：x [B, T, C] → float32 [B, T, C]。返回 (输出, 拼上历史后的完整输入 [B, 3 + T, C])。

        每个通道 c：y_t = Σ_j w[c, j] · x_{t−3+j}（j = 0…3）。拼上历史之后，第 j 项对所有位置就是 full 里错开 j 行的
        一段 [B, T, C]（连续的视图），乘上第 j 个权重（每个通道一个）加起来：四次逐元素乘加，不必在 [B, T, C] 与
        F.conv1d 要的 [B, C, T] 之间来回转置。（先用 unfold 给每个位置切出 4 个输入的窗口再乘、求和也行，但那个窗口
        在内存里是跳着的：预填充 256 个 token 时慢 6 倍、512 个时慢 15 倍。）
        """
        B, T, C = x.shape
        past = state.conv if state is not None and state.conv is not None else x.new_zeros(B, self.kernel - 1, C)
        full = torch.cat([past.float(), x.float()], dim=1)  # [B, 3 + T, C]：前面接上最近 3 个输入
        w = self.conv1d.weight[:, 0].float().t().contiguous()  # [4, C]：第 j 行是各通道的第 j 个权重（加载时已是 float32）
        y = full[:, :T] * w[0]  # j = 0：每个位置往前数第 3 个输入
        for j in range(1, self.kernel):
            y.addcmul_(full[:, j : j + T], w[j])  # y += w_j · x_{t−3+j}：就地加，不再新建 [B, T, C]
        return F.silu(y), full

    def forward(self, x, state: DeltaNetState | None = None, valid=None, rule=recurrent_gated_delta_rule):
        """x [B, T, hidden] → [B, T, hidden]。valid [B, T]：填充位置的输入置零，不写进状态。

        rule 是核心递推的实现：本章的逐 token 递推，或下一章的分块并行形式（同样的签名）。
        """
        B, T, _ = x.shape
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if valid is not None:
            # 左填充的位置输入为 0：投影后 k = v = 0，不会写进 S，卷积窗口里也只是初始的 0。
            x = torch.where(valid[..., None], x, torch.zeros((), dtype=x.dtype))
        qkv, z, b, a = self.in_proj(x)  # 就是 in_proj_qkv(x)、in_proj_z(x)、in_proj_b(x)、in_proj_a(x)
        qkv, full = self.causal_conv(qkv, state)  # [B, T, 6144]，float32
        qk, v = qkv.split([2 * self.key_dim, self.value_dim], dim=-1)
        q, k = l2norm(qk.view(B, T, 2 * Hk, Dk)).split(Hk, dim=2)  # q、k 的每个头一起做 L2 归一化：[B, T, Hk, Dk]
        q = q * Dk**-0.5
        v = v.view(B, T, Hv, Dv)
        if Hv > Hk:  # 值头多于键头：每个 q、k 头服务相邻的 Hv/Hk 个值头
            q = q.repeat_interleave(Hv // Hk, dim=2)
            k = k.repeat_interleave(Hv // Hk, dim=2)
        beta = torch.sigmoid(b.float())  # [B, T, Hv]：写入强度
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # 对数衰减 ≤ 0

        S = state.S if state is not None and state.S is not None else q.new_zeros(B, Hv, Dk, Dv)
        keep = state is not None and state.keep_history
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, H, T, D]：连续存放，后面的运算才快
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [B, H, T]
        o, S, parts = rule(q, k, v, g, beta, S, keep_all=keep, in_place=state is not None)  # 旧 S 马上被替换：可以就地改
        if state is not None:
            state.S = S
            # 新窗口：最后 3 个输入，复制成自己的一份标准连续存放的张量：不把整段 full 留在内存里，
            # 步长也与这一步喂了几个 token 无关（compile=True 时编译的解码步按步长特化，见第 9 章）
            state.conv = full[:, -(self.kernel - 1):].clone(memory_format=torch.contiguous_format)
            if keep:
                state.history = (full, parts)  # 每个位置之后的窗口可从 full 切出，S 由 state_after 重建

        z = z.view(B, T, Hv, Dv)
        o = self.norm(o.transpose(1, 2), z)  # [B, T, Hv, Dv]：逐头门控 RMSNorm
        return self.out_proj(o.reshape(B, T, Hv * Dv).to(x.dtype))  # [B, T, hidden]
