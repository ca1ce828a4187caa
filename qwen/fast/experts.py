"""附录 · 快路径：专家混合层（第 4 章附）换上快的布局。

一个 token 只读它的 k 个专家和共享专家：E 个专家各自是分块布局的两个矩阵（gate 与 up 拼成一个 gate_up，down），
解码时只乘被选中的那 k 个。路由器与共享专家的门读同一个输入，拼成一个 [E + 1, hidden] 的矩阵；它们很小，
却决定选哪些专家，所以不量化（保持模型的 dtype）。

几行一起算（预填充、验证草稿、服务时拼在一起的请求）时按专家分组：每个被选中的专家对选了它的那些行乘一次，权重只读
一遍。分块布局上这一半是 layer.cpp 的 moe_half（整层一次 C 调用，两个线程各拿一些专家）；这里的 FastMoE.forward 是
同样的做法的 PyTorch 写法（打包的布局、求导时用）。投机解码要求验证的一行与单独解码它时逐位相同（第 14 章），所以
两种写法的每一步都与“同时还有哪些行”无关：
- 矩阵乘法是每行各用各的累加器的 C++ matvec（linear.py；打包的布局不足 4 行时补零行）；
- 一行的 k 个专家按专家编号从小到大加进它的输出（逐元素相加）：顺序只取决于这一行选了谁；
- top-k 权重的和按固定的顺序一个一个地加（一次归约在行多行少时可能换一种求和顺序）；
- 共享专家的门 sigmoid 在补宽到 64 列的张量上算：逐元素运算总走向量化的代码，不会一次走向量、一次走标量的尾巴。
"""

import torch
from torch import nn

from ..moe import SparseMoE
from .linear import fast_linear

GATE_WIDTH = 64  # 共享专家的门补宽到这么多列再过 sigmoid（见上）


class Linear:
    """只有 weight 的占位：fast_linear 收 nn.Linear 的样子（.weight、.bias），专家的切片不必先建成 nn.Linear。"""

    def __init__(self, weight):
        self.weight, self.bias, self.out_features = weight, None, weight.shape[0]


def route_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """第 4 章附的 route，只是每行的结果与行数无关：Σw 按固定顺序相加。→ (权重 [N, k] float32, 专家编号 [N, k])。"""
    p = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(p, k, dim=-1)
    total = w[:, 0].clone()
    for j in range(1, k):
        total += w[:, j]
    return (w / total[:, None]).to(logits.dtype).float(), idx


class FastMoE(SparseMoE):
    """换了布局的专家混合层：router（路由器 + 共享专家的门）、shared_expert（FastMLP）、gate_up、down（每个专家一个）。"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])  # [N, hidden]
        scores = self.router(h)  # [N, E + 1]
        E = scores.shape[1] - 1
        weight, idx = route_rows(scores[:, :E], self.top_k)  # [N, k]
        gate = torch.sigmoid(scores[:, E:].float().expand(-1, GATE_WIDTH).contiguous())[:, :1]  # [N, 1]
        out = self.shared_expert(h).float() * gate  # [N, hidden] float32
        for e in idx.unique().tolist():  # 从小到大
            rows, slot = torch.where(idx == e)
            y = self.down[e](self.shared_expert.act(self.gate_up[e](h[rows])))  # [n, hidden]
            out.index_add_(0, rows, y.float() * weight[rows, slot, None])
        return out.to(x.dtype).view_as(x)


def speed_up_moe(moe: SparseMoE, kernel=None, quantize=None, dtype=None) -> None:
    """已读出的专家混合层就地换成 FastMoE：路由器与共享专家的门拼成一个矩阵，每个专家两个分块（或打包）的矩阵。
    共享专家是一个普通的 SwiGLU，由调用的人（layers.py 的 speed_up_layer）像稠密的 MLP 那样换掉。"""
    moe.__class__ = FastMoE
    moe.router = fast_linear([moe.gate, moe.shared_expert_gate], kernel, None, dtype)  # 不量化
    del moe.gate, moe.shared_expert_gate
    experts = moe.experts
    del moe.experts
    reader = getattr(experts, "reader", None)  # 快路径的加载：专家还在文件里（rows.py 的 ExpertReader），一个一个地读
    moe.gate_up, moe.down = nn.ModuleList(), nn.ModuleList()
    for e in range(experts.num_experts):
        gate_up, down = reader(e) if reader is not None else (experts.gate_up_proj[e].detach(), experts.down_proj[e].detach())
        moe.gate_up.append(fast_linear([Linear(gate_up)], kernel, quantize, dtype))
        moe.down.append(fast_linear([Linear(down)], kernel, quantize, dtype))
