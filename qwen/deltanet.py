"""第 7 章 · Gated DeltaNet：用一个固定大小的矩阵记住全部历史。

Qwen3.5 四层里有三层不是 softmax 注意力，而是“线性注意力”Gated DeltaNet。它不保存所有历史的 k、v，
而是每个头维护一个 [128, 128] 的记忆矩阵 S，每来一个 token 就把 (k → v) 这对联想“写”进去：

    S ← exp(g) · S                    先整体衰减（g ≤ 0，门控遗忘）
    S ← S + k ⊗ β(v − Sᵀk)            delta 规则：只写入 S 还没预测对的那部分
    o = Sᵀq                           用查询读出

Sᵀk 是记忆对 k 的“预测”，v − Sᵀk 是误差，β ∈ (0, 1) 是写入强度（学习率）：S 像一个在线做梯度下降的
线性回归器。解码一个 token 的代价与上下文长度无关，状态大小也固定：这就是它比 KV 缓存省的地方。
出处：Yang、Kautz、Hatamizadeh，“Gated Delta Networks: Improving Mamba2 with Delta Rule”（ICLR 2025）。论文把 S 写成
[Dv, Dk]、读出 S q；这里存成 [Dk, Dv]（一行对应 k 的一维），读出就是 Sᵀq，公式里的 k ⊗ δ 是 [Dk, 1] 乘 [1, Dv]。

衰减 α = e^g = exp(−exp(A_log) · softplus(a + dt_bias))，同 Mamba2：softplus 让步长 Δ = softplus(…) > 0，
A = exp(A_log) > 0 存成对数（训练时不会变号），所以 g = −AΔ ≤ 0、α ∈ (0, 1]；a 由 in_proj_a 按 token 给出，
Δ 大就忘得多。进入递推之前：in_proj_qkv 投影出 q、k、v，经核宽 4 的因果深度卷积（每个通道只看自己最近 4 个输入）
加 SiLU；q、k 做 L2 归一化，q 再乘 1/sqrt(128)。输出经门控 RMSNorm（门是 in_proj_z 的投影）再 out_proj。
本章用逐 token 的递推（解码时用）；下一章是按 64 个 token 一块的并行形式，两者的输出与最终状态相同。
"""

import torch
import torch.nn.functional as F
from torch import nn

from .norm import GatedRMSNorm


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
    """x / sqrt(Σx² + eps)，即 rms(x, eps/D) / sqrt(D)（第 3 章的 rms 用的是均值）。"""
    D = x.shape[-1]
    return F.rms_norm(x, (D,), eps=eps / D) * D**-0.5


def recurrent_gated_delta_rule(q, k, v, g, beta, S, keep_all: bool = False):
    """逐 token 递推，正是开头的三行公式。q、k [B, H, T, Dk]，v [B, H, T, Dv]，g、beta [B, H, T]，S [B, H, Dk, Dv]。
    返回 (输出 [B, H, T, Dv], 最终 S, keep_all 时每个位置之后的 S 的列表，否则 None)，全部 float32。
    每一步都新建一份 S，不改传入的那份：调用者的旧 S 不受影响，keep_all 记下的各份也互不覆盖（投机解码回滚时取用）。
    """
    outs, states = [], []
    for t in range(q.shape[2]):
        kt, vt, qt = k[:, :, t, None], v[:, :, t, None], q[:, :, t, None]  # [B, H, 1, D]
        S = S * g[:, :, t, None, None].exp()  # S ← e^g S
        delta = beta[:, :, t, None, None] * (vt - kt @ S)  # δ = β(v − Sᵀk)，[B, H, 1, Dv]
        S = S + kt.transpose(-1, -2) @ delta  # S ← S + k ⊗ δ（[Dk, 1] 乘 [1, Dv]）
        outs.append(qt @ S)  # o = Sᵀq，[B, H, 1, Dv]
        states.append(S)
    return torch.cat(outs, dim=2), S, (states if keep_all else None)


def state_after(parts, t: int, in_place: bool = False) -> torch.Tensor:
    """第 t 个位置（从 0 数）之后的记忆 [B, H, Dk, Dv]。递推记下的就是每个位置之后的 S；分块形式（第 8 章）记下
    (S₀, G, K, U)，由它重建。递推展开：每一步先整体衰减，再写入 k_j ⊗ u_j（u_j 就是上面的 δ），所以
        S_t = e^{G_t} S₀ + Σ_{j≤t} e^{G_t − G_j} k_j ⊗ u_j,     G_t = g₀ + … + g_t
    投机解码拒绝草稿时按它取出最后一个被接受的位置之后的那份，不必重算；in_place=True：不再要 S₀，结果写进它。"""
    if isinstance(parts, list):  # 逐 token 递推记下的就是每个位置之后的 S
        return parts[t]
    S0, G, k, U = parts  # S₀ [B, H, Dk, Dv]；G [B, H, T]；k [B, H, T, Dk]；U [B, H, T, Dv]
    w = (G[:, :, t, None] - G[:, :, : t + 1]).exp()  # [B, H, t+1]：e^{G_t − G_j}
    kw = (k[:, :, : t + 1] * w[..., None]).transpose(-1, -2)  # [B, H, Dk, t+1]：e^{G_t − G_j} k_j
    decay = G[:, :, t, None, None].exp()  # [B, H, 1, 1]：e^{G_t}
    S = S0.mul_(decay) if in_place else decay * S0  # e^{G_t} S₀
    flat = S.view(-1, *S.shape[2:])  # [B·H, Dk, Dv]，与 S 共用内存
    flat.baddbmm_(kw.flatten(0, 1), U[:, :, : t + 1].flatten(0, 1))  # 加上 Σ_j e^{G_t − G_j} k_j ⊗ u_j
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
        self.in_proj_qkv = nn.Linear(h, conv_dim, bias=False)  # 行依次是 q、k、v
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)  # 输出门
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)  # β 的 logit
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)  # 衰减的输入
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kernel, groups=conv_dim, bias=False)  # 权重 [C, 1, 4]
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def project(self, x):
        """四个输入投影读同一个 x：q、k、v（一起卷积）、输出门 z、写入强度的 logit b、衰减的输入 a。"""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def gates(self, b, a):
        """写入强度 β = sigmoid(b) ∈ (0, 1)，对数衰减 g = −exp(A_log)·softplus(a + dt_bias) ≤ 0：b、a [B, T, Hv] → 同形状。"""
        return torch.sigmoid(b.float()), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

    def causal_conv(self, x: torch.Tensor, state: DeltaNetState | None):
        """因果深度卷积 + SiLU：x [B, T, C] → float32 [B, T, C]。返回 (输出, 拼上历史后的完整输入 [B, 3 + T, C])。
        每个通道 c：y_t = Σ_j w[c, j] · x_{t−3+j}（j = 0…3）。第 j 项就是 full 里错开 j 行的一段（连续的视图）乘第 j 个
        权重：四次逐元素乘加，不必转置成 F.conv1d 要的 [B, C, T]。"""
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
        rule 是核心递推的实现：本章的逐 token 递推，或下一章的分块并行形式（同样的签名）。"""
        B, T, _ = x.shape
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if valid is not None:
            # 左填充的位置输入为 0：投影后 k = v = 0，不会写进 S，卷积窗口里也只是初始的 0。
            x = torch.where(valid[..., None], x, torch.zeros((), dtype=x.dtype))
        qkv, z, b, a = self.project(x)
        qkv, full = self.causal_conv(qkv, state)  # [B, T, 6144]，float32
        qk, v = qkv.split([2 * self.key_dim, self.value_dim], dim=-1)
        q, k = l2norm(qk.view(B, T, 2 * Hk, Dk)).split(Hk, dim=2)  # q、k 的每个头一起做 L2 归一化：[B, T, Hk, Dk]
        q = q * Dk**-0.5
        v = v.view(B, T, Hv, Dv)
        if Hv > Hk:  # 值头多于键头：每个 q、k 头服务相邻的 Hv/Hk 个值头
            q = q.repeat_interleave(Hv // Hk, dim=2)
            k = k.repeat_interleave(Hv // Hk, dim=2)
        beta, g = self.gates(b, a)  # [B, T, Hv]：写入强度、对数衰减

        S = state.S if state is not None and state.S is not None else q.new_zeros(B, Hv, Dk, Dv)
        keep = state is not None and state.keep_history
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, H, T, D]：连续存放，后面的运算才快
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [B, H, T]
        o, S, parts = rule(q, k, v, g, beta, S, keep_all=keep)
        if state is not None:
            state.S = S
            # 新窗口：最后 3 个输入。复制成自己的一份，不把整段 full 留在内存里
            state.conv = full[:, -(self.kernel - 1):].clone(memory_format=torch.contiguous_format)
            if keep:
                state.history = (full, parts)  # 每个位置之后的窗口可从 full 切出，S 由 state_after 重建

        z = z.view(B, T, Hv, Dv)
        o = self.norm(o.transpose(1, 2), z)  # [B, T, Hv, Dv]：逐头门控 RMSNorm
        return self.out_proj(o.reshape(B, T, Hv * Dv).to(x.dtype))  # [B, T, hidden]
