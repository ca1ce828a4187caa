"""第 8 章 · 分块并行：把 DeltaNet 的递推改写成矩阵乘法。

逐 token 递推在预填充时太慢：512 个 token 就是 512 步串行的小运算。
分块形式把序列切成 64 个 token 一块，块内用几次矩阵乘法一口气算完，
块与块之间才串行传递记忆 S。结果与递推完全相同（浮点误差以内），包括最终状态。

推导（一个头，一块之内，S₀ 为块开始时的记忆；G_t = Σ_{s≤t} g_s 为块内累计对数衰减）：
把递推展开，第 t 步真正写进 S 的向量 u_t = β_t (v_t − e^{G_t} S₀ᵀk_t − Σ_{j<t} e^{G_t−G_j}(k_tᵀk_j) u_j)。
它依赖更早的 u_j，写成矩阵就是一个下三角方程组：

    (I + A) U = βV − (βK ⊙ e^G) S₀,     A_tj = β_t e^{G_t−G_j} k_tᵀk_j  (j < t)

解一次三角方程得到 (I+A)⁻¹，乘出 U' = (I+A)⁻¹βV 与 W = (I+A)⁻¹(βK ⊙ e^G)，于是 U = U' − W S₀。然后

    输出  O   = (Q ⊙ e^G) S₀ + ((QKᵀ) ⊙ Γ) U          Γ_tj = e^{G_t−G_j}（j ≤ t，否则 0）
    新记忆 S_C = e^{G_C} S₀ + (K ⊙ e^{G_C−G})ᵀ U

U'、W、(QKᵀ)⊙Γ 只依赖本块的输入，可以对所有块同时算；只有最后两行要按块顺序走。
全部运算都可求导（附录的训练章用同一份代码）。

投机解码验证几个 token 时（第 14 章）也走这里：比一块短的输入就是一块，
几次矩阵乘法一口气算完，不必逐 token 走十几个小运算。回滚要的“每个位置之后的记忆”不必全算出来：
记下 (S₀, G, K, U)，第 7 章的 state_after 能按需重建任何一个位置之后的那一份。

出处：delta 规则的分块形式（WY 表示、块内解三角方程）见 Yang 等，“Parallelizing Linear Transformers with the Delta Rule
over Sequence Length”（NeurIPS 2024）；加上衰减门的版本见第 7 章的 Gated DeltaNet 论文。记号同第 7 章：S 存成 [Dk, Dv]。
"""

import math

import torch
import torch.nn.functional as F

CHUNK = 64
# 衰减 e^x 的下限：e^−40 ≈ 4e−18，在 float32 里（舍入误差 6e−8）与别的项相加毫无痕迹。更小的数乘来乘去会落进次正规数
# （subnormal，< 1.2e−38），x86 上乘加它们比正常的数慢十几倍；衰减快的头在一块 64 个 token 里累计的 G 能到 −1000。
# 两个都不小于 e^−40 的数相乘仍是正常的数；(I + A)⁻¹ 里小于它的项同样取 0
TINY = -40.0


def decay(x: torch.Tensor) -> torch.Tensor:
    """e^x，x < TINY 时取 0（先换成 −inf 再 exp）：结果在 float32 的舍入之内不变，却没有次正规数。"""
    return x.masked_fill(x < TINY, float("-inf")).exp()


def chunk_gated_delta_rule(q, k, v, g, beta, S, keep_all: bool = False, chunk: int = CHUNK):
    """与 recurrent_gated_delta_rule 同签名：q、k [B, H, T, Dk]，v [B, H, T, Dv]，g、beta [B, H, T]，
    S [B, H, Dk, Dv]，全部 float32。返回 (输出 [B, H, T, Dv], 最终 S, keep_all 时的 (S₀, G, K, U) 或 None)。

    比一块短的输入就是一块（不补齐）。keep_all 只支持这种单块输入：验证草稿时只有几个 token。
    """
    B, H, T, Dk = k.shape
    chunk = min(chunk, T)
    if keep_all and T > chunk:
        raise ValueError(f"逐位置状态只在不超过一块（{chunk} 个 token）的输入上计算")
    pad = (-T) % chunk  # 末尾补到 64 的倍数：补的位置 β = 0、g = 0，不改变记忆
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    N = (T + pad) // chunk
    q, k, v = (t.reshape(B, H, N, chunk, -1) for t in (q, k, v))  # [B, H, N, C, D]
    g, beta = g.reshape(B, H, N, chunk), beta.reshape(B, H, N, chunk)  # [B, H, N, C]

    G = g.cumsum(-1)  # 块内累计对数衰减
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()  # j ≤ t
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf"))  # 先遮再 exp，免得溢出
    Gamma = decay(diff)  # [B, H, N, C, C]：Γ_tj = e^{G_t − G_j}
    kb = k * beta[..., None]  # βK
    A = (kb @ k.transpose(-1, -2)) * Gamma  # A_tj = β_t e^{G_t−G_j} k_tᵀk_j；对角线与上三角下面不用
    eye = torch.eye(chunk, dtype=A.dtype, device=A.device)
    I_A = A.tril(-1) + eye  # I + A（单位下三角）
    # 先解出 (I + A)⁻¹（右端是单位阵，64 列），再乘两个右端 [βV | βK ⊙ e^G]（共 256 列）。直接对 256 列的右端
    # 解三角方程也行，但 LAPACK 把这些 64×64 的小方程组一个一个地解，右端越宽越慢
    inv = torch.linalg.solve_triangular(I_A, eye.expand_as(I_A), upper=False, unitriangular=True)  # [B, H, N, C, C]
    inv = inv.masked_fill(inv.abs() < math.exp(TINY), 0.0)  # 对角线是 1：这些项乘出来也毫无痕迹，只会带出次正规数
    rhs = torch.cat([v * beta[..., None], kb * decay(G)[..., None]], dim=-1)  # [B, H, N, C, Dv + Dk]
    U_, W = (inv @ rhs).split([v.shape[-1], Dk], -1)
    QK = (q @ k.transpose(-1, -2)) * Gamma  # [B, H, N, C, C]：块内注意力（含衰减）
    q_decayed = q * decay(G)[..., None]  # Q ⊙ e^G：读块开始时的记忆
    k_decayed = k * decay(G[..., -1:] - G)[..., None]  # K ⊙ e^{G_C − G}：写到块末
    chunk_decay = decay(G[..., -1])[..., None, None]  # [B, H, N, 1, 1]：e^{G_C}

    outs, parts = [], None
    for n in range(N):  # 块之间串行
        U = U_[:, :, n] - W[:, :, n] @ S  # [B, H, C, Dv]：本块真正写入的值
        outs.append(q_decayed[:, :, n] @ S + QK[:, :, n] @ U)  # [B, H, C, Dv]
        if keep_all:  # 只有一块：state_after 要的量
            parts = (S, G[:, :, 0], k[:, :, 0], U)
        S = chunk_decay[:, :, n] * S + k_decayed[:, :, n].transpose(-1, -2) @ U
    o = torch.cat(outs, dim=2)[:, :, :T]  # [B, H, T, Dv]：去掉补的位置
    return o, S, parts
