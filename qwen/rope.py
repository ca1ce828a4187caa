"""第 5 章 · RoPE：旋转位置编码（只转一部分维度）。

注意力本身不知道 token 的先后。RoPE 把查询和键的每两个维度看成一个平面上的点，
按位置 p 旋转角度 p·θ_i，其中 θ_i = theta^(-2i/d)。两个向量旋转后的点积只取决于
位置之差，于是注意力分数自然带上了相对位置。

Qwen3.5 只旋转每个头的前 rotary_dim = head_dim × 0.25 = 64 维，其余 192 维原样保留；
theta 很大（1e7），适合超长上下文。布局是 NeoX 式：前一半与后一半配对（rotate_half）。

M-RoPE（Qwen2-VL）：位置可以有三个分量 (t, h, w)，32 个频率轮流分给它们（mrope_section [11, 11, 10]，交错：
第 i 个频率给 i % 3 那一轴）。三个分量相同时每个频率的角度都与普通 RoPE 逐位相同：只有一维的位置时 M-RoPE 就是
上面的普通 RoPE；三个分量不同的位置由第 15 章给出。
"""

import torch


def inverse_frequencies(d: int, theta: float, device=None) -> torch.Tensor:
    """θ_i = theta^(−2i/d)，i = 0 … d/2 − 1 → [d/2]。RoPE 的频率只在这里算（第 15 章的二维 RoPE 也用它）。"""
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))


def tables(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """角度 [..., d/2] → cos, sin [..., d]：前后两半用同一组角度（rotate_half 把第 i 维与第 i + d/2 维配成一对）。"""
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope_tables(cfg, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] 或 [B, T] → cos, sin，形状 [..., T, rotary_dim]，float32。"""
    inv_freq = inverse_frequencies(cfg.rotary_dim, cfg.rope_theta, positions.device)
    return tables(positions.float()[..., None] * inv_freq)  # 角度 p·θ_i：[..., T, d/2]


def mrope_tables(cfg, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """三个分量的位置 [3, T] 或 [3, B, T]（t, h, w）→ cos, sin [..., T, rotary_dim]：第 i 个频率用第 axis[i] 轴的位置。"""
    d, (_, h, w) = cfg.rotary_dim, cfg.mrope_section
    axis = torch.zeros(d // 2, dtype=torch.long)  # 0 = t：交错分配，h 取 1, 4, 7, …，w 取 2, 5, 8, …
    axis[1 : 3 * h : 3], axis[2 : 3 * w : 3] = 1, 2
    inv_freq = inverse_frequencies(d, cfg.rope_theta, positions.device)
    return tables(positions[axis.to(positions.device)].movedim(0, -1).float() * inv_freq)  # [..., T, d/2]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) → (-x2, x1)：把第 i 维与第 i + d/2 维组成的平面转 90°。"""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, head_dim]，cos/sin [T, d] 或 [B, T, d]：只旋转前 d 维。"""
    if cos.ndim == 3:
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, d]：每行自己的位置（批处理的左填充）
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    rot = (rot.float() * cos + rotate_half(rot.float()) * sin).to(x.dtype)  # x·cos + rotate_half(x)·sin
    return torch.cat([rot, rest], dim=-1)
