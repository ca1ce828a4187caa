"""附录 · 快路径：左填充的批处理（第 13 章的 generate_batch）每行照它单独运行那样算。

第 13 章把几个提示词左填充成 [B, T]，用掩码让填充位置“不存在”：数学上每行与单独运行相同，浮点上却不同——填充改变了
分块形式的块界、矩阵乘法的行数与注意力求和的长度，bfloat16 下差一个舍入就可能换掉一个贪心 token。快路径上一行必须与
它单独运行逐位相同（第 14 章对验证的行许下的承诺，对批处理的行也一样），所以这里不算填充过的张量。每行有自己的 State
（挂在左填充的 State 的 row_states 上，那个 State 只是外壳，记着 pos 与 valid）：
- 预填充：每行只读自己的真实 token；
- 之后每一步：分块布局（不编译图）上几行的全部层一次算完（share.py 的 layers_many，与服务时拼在一起的请求是同一段
  代码：权重只读一遍，每行与它单独前向逐位相同）；一行的 token 多于一层能拼的（share.py 的 can_share）、或别的布局（打包的、
  编译成图的），那一行就单独调用 hidden，与单独运行是同一个调用；
- 输出头：分块布局的 matvec 每行各用各的累加器，几行一起乘；打包的布局一行一行地乘。
"""

import torch

from ..cache import State
from .linear import BlockedLinear
from .share import can_join, can_share, layers_many


class PaddedRows:
    """混进 PackedModel（分块的 FastModel 是它的子类）：状态是左填充的（state.valid 不是 None）时走这里，其余照第 10 章。"""

    def hidden(self, ids, state=None, embeds=None, positions=None):
        if state is None or state.valid is None:
            return super().hidden(ids, state, embeds, positions)
        return padded_hidden(self, ids, state, embeds, positions)

    def forward(self, ids, state=None, last: bool = False, embeds=None, positions=None):
        if state is None or state.valid is None:
            return super().forward(ids, state, last, embeds, positions)
        h = padded_hidden(self, ids, state, embeds, positions)
        return head_rows(self.lm_head, h[:, -1:] if last else h)


def padded_hidden(model, ids, state, embeds=None, positions=None) -> torch.Tensor:
    """ids [B, T]（左填充）→ 最后一次 norm 之后的隐藏状态 [B, T, hidden]：每行的真实 token 照它单独运行那样算，
    填充的位置是 0（没有人读它们）。embeds、positions：第 10 章 hidden 的输入（第 15 章放进了图），每行取自己的那一段。"""
    ids = model.check_ids(ids, state)
    B, T = ids.shape
    if getattr(state, "row_states", None) is None:
        state.row_states = [State(model) for _ in range(B)]  # 每行自己的状态
    real = state.extend_valid(T)[:, state.pos :]  # [B, T]：这次的 T 个位置里哪些是真实 token（左填充：总在末尾）
    state.pos += T
    todo = [(b, ids[b : b + 1, T - int(n) :]) for b, n in enumerate(real.sum(1).tolist()) if n]
    if not todo:
        raise ValueError("左填充的 valid 里这几个位置全是填充：每个提示词至少要有一个真实 token")
    given = [None if embeds is None else (embeds[b : b + 1, T - x.shape[1] :], positions[..., b : b + 1, T - x.shape[1] :])
             for b, x in todo]  # 每行真实 token 的那一段
    outs = hidden_many(model, [(x, state.row_states[b], g) for (b, x), g in zip(todo, given)])
    if positions is not None:  # 同第 10 章：外壳的 shift 也记下每行的（之后的位置从它数）
        state.shift = torch.tensor([int(state.row_states[b].shift) for b in range(B)])
    h = outs[0].new_zeros(B, T, outs[0].shape[-1])
    for (b, x), out in zip(todo, outs):
        h[b, T - x.shape[1] :] = out[0]
    return h


def hidden_many(model, rows) -> list[torch.Tensor]:
    """rows：[(ids [1, T_i], State, (embeds, positions) 或 None)] → 各自的 hidden [1, T_i, hidden]，与 model.hidden 逐位相同。
    能拼的几行（分块布局、不编译图、一层拼得下、只有 ids）的全部层一次算完；其余一行一行地调用 model.hidden。"""
    joins = can_join(model)
    joined, out = [], [None] * len(rows)
    for i, (ids, state, given) in enumerate(rows):
        x = model.embed_tokens(ids)  # [1, T_i, hidden]，权重的 dtype（同第 10 章的 hidden）
        if joins and given is None and can_share(x, state, None):
            cos, sin = model.rope(model.positions(ids.shape[1], state, ids.device))
            joined.append((i, (x.float(), cos, sin, state), x.dtype))
        else:
            out[i] = model.hidden(ids, state, *(given or ()))
    if joined:
        xs = layers_many(model, [part for _, part, _ in joined])
        for (i, (_, _, _, state), dtype), x in zip(joined, xs):
            state.pos += x.shape[1]
            out[i] = model.norm(x).to(dtype)
    return out


def head_rows(head, h) -> torch.Tensor:
    """输出头乘 h [B, T, hidden] → float32 的 logits，每行与它单独乘时逐位相同：分块布局的 matvec 本来如此（不论几行）；
    打包的布局（oneDNN 按行数挑算法）一行一行地乘。"""
    if isinstance(head, BlockedLinear):
        return head.matvec(h).float()
    return torch.cat([head(h[b : b + 1]) for b in range(h.shape[0])]).float()
