"""第 4 章附 · 专家混合（MoE）：每个 token 只用 256 个 SwiGLU 里的 8 个。

Qwen3.5-35B-A3B 的每一层没有第 4 章那一个大 MLP，而是 E = 256 个小的 SwiGLU（“专家”，中间宽 512），外加一个人人都用的
“共享专家”。路由器为每个 token 挑出分数最高的 k = 8 个专家，按分数加权求和（Shazeer 等 2017 的稀疏门控专家混合；
共享专家见 DeepSeekMoE，Dai 等 2024）：

    p = softmax(gate(x))                   gate：[E, hidden] 的矩阵，softmax 在 float32 里、对全部 E 个专家
    w, idx = top-k(p)；w = w / Σw          只留最高的 k 个，重新归一到和为 1
    moe(x) = Σ_j w_j · expert_{idx_j}(x) + sigmoid(shared_expert_gate(x)) · shared_expert(x)

每个专家是第 4 章的 SwiGLU：expert_e(x) = down_e(silu(gate_e(x)) * up_e(x))。参数一共 35B，一个 token 只读到约 3B：
CPU 上解码的速度看读了多少字节，所以它跑得像 3B 的稠密模型，答得却像大得多的模型。

检查点里一层的专家是“堆叠”的两个三维张量（没有 .weight）：experts.gate_up_proj [E, 2I, hidden]（每个专家先是 gate 的
I 行、再是 up 的 I 行）和 experts.down_proj [E, hidden, I]。有的发布（35B-A3B 的 MTP 层、FP8 版）按专家分开存：
experts.{e}.gate_proj.weight 等；stack_experts 把它们拼成堆叠的样子，两种布局读出来是同一个模块。

这里写的是最好读的形式：对被选中的每个专家，取出选了它的那些行，一次矩阵乘法（transformers 也是这样写的）。
"""

import re

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import MLP


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """路由器的分数 logits [N, E] → (权重 [N, k]（logits 的 dtype，和为 1）, 专家编号 [N, k])。"""
    p = torch.softmax(logits, dim=-1, dtype=torch.float32)  # 对全部 E 个专家
    w, idx = torch.topk(p, k, dim=-1)  # 最高的 k 个，从高到低
    w = w / w.sum(dim=-1, keepdim=True)  # 重新归一：k 个权重和为 1
    return w.to(logits.dtype), idx


class Experts(nn.Module):
    """E 个 SwiGLU 专家，参数按检查点堆叠存放。"""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]，weight、idx [N, k] → Σ_j weight_j · expert_{idx_j}(x)，[N, hidden]。"""
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():  # 只有被选中的专家要算
            rows, slot = torch.where(idx == e)  # 哪些行选了专家 e，是它们的第几个选择
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)  # 各 [n, I]
            y = F.linear(F.silu(gate) * up, self.down_proj[e])  # [n, hidden]
            out.index_add_(0, rows, y * weight[rows, slot, None])  # 加回各自的行
        return out


class SparseMoE(nn.Module):
    """一层的前馈：路由器 gate、专家 experts、共享专家 shared_expert 与它的门 shared_expert_gate。"""

    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # 路由器：每个专家一个分数
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)  # 共享专家用多少：一个数过 sigmoid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] → [B, T, hidden]（x 的 dtype）。"""
        h = x.reshape(-1, x.shape[-1])  # [N, hidden]：专家混合逐 token，不看别的位置
        weight, idx = route(self.gate(h), self.top_k)  # [N, k]、[N, k]
        shared = torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)  # [N, 1] · [N, hidden]
        return (self.experts(h, weight, idx) + shared).view_as(x)


EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(sd: dict, cfg, where: str) -> dict:
    """按专家分开存的张量（experts.{e}.gate_proj.weight 等）拼成堆叠的 experts.gate_up_proj、experts.down_proj；
    已经堆叠的原样留着。缺了哪个专家的哪个张量、形状不对，报出它的名字。where：说是哪个检查点。"""
    check_kind(sd, cfg, where)
    groups, E, H, I = {}, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for key in [k for k in sd if EXPERT.match(k)]:
        base, e, kind = EXPERT.match(key).groups()
        groups.setdefault(base, {})[(int(e), kind)] = sd.pop(key)
    for base, parts in groups.items():
        for e in range(E):
            for kind, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                name = f"{base}.{e}.{kind}.weight"
                if (e, kind) not in parts:
                    raise ValueError(f"{where} 缺少张量 {name}：按专家分开存时 {E} 个专家（config.json 的 num_experts）"
                                     "每个都要有 gate_proj、up_proj、down_proj")
                if tuple(parts[e, kind].shape) != shape:
                    raise ValueError(f"{where} 的张量 {name} 形状不对：检查点里是 {tuple(parts[e, kind].shape)}，"
                                     f"按 config.json 应为 {shape}")
        if len(parts) > 3 * E:
            raise ValueError(f"{where} 的 {base} 多出专家：config.json 的 num_experts = {E}，检查点里编号到 "
                             f"{max(e for e, _ in parts)}")
        sd[base + ".gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]])
                                                  for e in range(E)])  # [E, 2I, hidden]
        sd[base + ".down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(E)])  # [E, hidden, I]
    return sd


def check_kind(sd: dict, cfg, where: str) -> None:
    """稠密的 config.json 配上专家的张量，或反过来：说出是哪个张量、config.json 应该怎样。"""
    experts = next((k for k in sd if ".mlp.experts." in k or k.endswith("mlp.gate.weight")), None)
    dense = next((k for k in sd if re.search(r"\.mlp\.(gate|up|down)_proj\.weight$", k)), None)
    if experts and not cfg.num_experts:
        raise ValueError(f"{where} 有专家混合的张量 {experts}，config.json 却是稠密的（没有 num_experts）："
                         "检查点与 config.json 是否来自同一个模型？")
    if dense and cfg.num_experts:
        raise ValueError(f"{where} 有稠密 MLP 的张量 {dense}，config.json 却说每层 {cfg.num_experts} 个专家"
                         "（num_experts）：检查点与 config.json 是否来自同一个模型？")
