"""第 4 章 · MLP：SwiGLU 前馈网络。

每层注意力之后是一个逐 token 的前馈网络。SwiGLU 用两条投影，一条过 SiLU 当“门”，
逐元素相乘后再投影回去：
    mlp(x) = down_proj(silu(gate_proj(x)) * up_proj(x))
0.8B 里 hidden 1024 → 3584 → 1024，三个矩阵合计 1100 万参数，每层都有一个。
"""

import torch
import torch.nn.functional as F
from torch import nn

from .weights import Fused, Linear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up = Fused(self.gate_proj, self.up_proj)  # 打包后两个矩阵一次乘完（第 1 章）

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)  # 就是 gate_proj(x)、up_proj(x)
        return self.down_proj(F.silu(gate) * up)  # [B, T, hidden]
