"""第 3 章 · 归一化：零中心 RMSNorm 与门控 RMSNorm。

RMSNorm 把向量除以它的均方根，使每个 token 的尺度一致：
    y = x / sqrt(mean(x²) + eps) * (1 + w)
Qwen3.5 存的是 w 而不是 1 + w（“零中心”）：权重初始化为 0，训练学的是相对 1 的偏移。
所以加载时不能把它当普通的缩放权重，测试里的 norm 权重也必须是随机的，否则分不出 w 和 1 + w。
计算一律在 float32 里做，再转回输入的 dtype（bfloat16 的平方和会损失精度）。

门控 RMSNorm 只用在 DeltaNet 的输出上（每个 128 维的头各自归一化）：
    y = w * rmsnorm(o) * silu(z)
这里 w 是普通权重（初始化为 1），先归一化再乘门 z。
"""

import torch
import torch.nn.functional as F
from torch import nn


def rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps)，再乘 weight（给了的话），在 float32 里算。

    就是 x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * weight；F.rms_norm 把这几步
    合成一个运算（结果相同），解码一个 token 要做上百次归一化，省下的是每次运算的固定开销。
    """
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)


class RMSNorm(nn.Module):
    """零中心 RMSNorm：y = rms(x) * (1 + w)。"""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))  # 存的是相对 1 的偏移

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.eps, 1.0 + self.weight.float()).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """门控 RMSNorm：y = w * rms(o) * silu(z)，w 是普通权重。"""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = rms(o, self.eps, self.weight.float()) * F.silu(z.float())  # 先归一化（乘 w），再乘门
        return y.to(o.dtype)
