"""第 4 章 · MLP：SwiGLU 前馈网络。

每层注意力之后是一个逐 token 的前馈网络。SwiGLU 用两条投影，一条过 SiLU 当“门”，
逐元素相乘后再投影回去：
    mlp(x) = down_proj(silu(gate_proj(x)) * up_proj(x))
0.8B 里 hidden 1024 → 3584 → 1024，三个矩阵合计 1100 万参数，每层都有一个。
"""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [B, T, hidden]
