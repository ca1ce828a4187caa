"""第 11 章 · 缓存：生成过程中要带着走的全部状态。

自回归生成时，每一步只喂新 token，其余信息都在状态里：
- 全注意力层：KV 缓存 AttentionState，k、v 沿长度维增长（第 6 章）；
- DeltaNet 层：卷积窗口与记忆矩阵 S，大小固定，与上下文长度无关（第 7 章）；
- pos：已经处理过多少个位置；新 token 的 RoPE 位置是 pos + shift（位置一般就是 pos；第 10 章的 hidden 收过给定的
  位置之后两者可以不同，它记下差 shift）。

0.8B 里 18 个 DeltaNet 层的状态一共 18 × 16 × 128 × 128 × 4 字节 ≈ 19 MB，
6 个注意力层每个 token 只存 2 × 2 × 256 个数：这就是混合架构长上下文便宜的原因。

批处理时各行长度不同，我们在左边补齐（左填充）：valid 标出哪些位置是真实 token，
pad 是每行补了几个，用来让每行的 RoPE 位置从它自己的第一个真实 token 数起。

状态可以复制（copy_state，多轮对话留下读完历史的那一份），也可以撤销最近喂进去的 token（第 14 章的投机解码
要撤销被拒绝的草稿），两种做法：
- 存档与回退（snapshot / rollback）：拷下 DeltaNet 层那几块固定大小的状态，注意力的 KV 缓存只需记住长度、回退时截断；
  之后要把该留下的 token 重新喂一遍。
- 记下历史再提交（keep_history / commit）：前向顺手记下每个位置之后的记忆怎么得到（第 7 章的 state_after），
  提交时只保留前几个 token 的效果，不必重算。
"""

import torch

from .attention import AttentionState
from .deltanet import DeltaNetState, state_after

__all__ = ["State", "AttentionState", "DeltaNetState", "copy_state", "snapshot", "rollback", "keep_history", "commit"]


class State:
    def __init__(self, model, valid: torch.Tensor | None = None):
        """valid [B, T₀]（可选）：左填充的提示词里哪些位置是真实 token。"""
        self.pos = 0
        self.shift = 0  # RoPE 位置 − pos（一般是 0；左填充的批处理里可以是每行一个数的张量 [B]）
        self.layers = [
            AttentionState() if t == "full_attention" else DeltaNetState() for t in model.cfg.layer_types
        ]
        self.valid = None if valid is None else valid.bool()  # [B, 已见长度]
        self.pad = None if valid is None else (~self.valid).sum(1)  # [B]：每行左边补了几个

    def extend_valid(self, T: int) -> torch.Tensor:
        """新来 T 个位置：提示词之外的新 token 都是真实的。返回覆盖 pos + T 个位置的 valid。"""
        need = self.pos + T - self.valid.shape[1]
        if need > 0:
            ones = torch.ones(self.valid.shape[0], need, dtype=torch.bool, device=self.valid.device)
            self.valid = torch.cat([self.valid, ones], dim=1)
        return self.valid[:, : self.pos + T]


def snapshot(state: State):
    """存档：pos 与每个 DeltaNet 层的状态的拷贝（注意力层记 None：KV 缓存回退时截断即可，无需拷贝）。"""
    return state.pos, [(s.conv.clone(), s.S.clone()) if isinstance(s, DeltaNetState) else None for s in state.layers]


def rollback(state: State, snap) -> None:
    """回到 snapshot 时的样子：之后喂进来的 token 全部作废。"""
    state.pos, saved = snap
    for s, kept in zip(state.layers, saved):
        if kept is None:
            s.truncate(state.pos)
        else:
            s.conv, s.S = kept


def copy_state(state):
    """State（或单独一层的 AttentionState）的一份独立拷贝：之后各喂各的，互不影响。"""
    if isinstance(state, AttentionState):
        new = AttentionState()
        if state.length:
            new.append(state.k.clone(), state.v.clone())
        return new
    new = State.__new__(State)
    new.pos, new.shift = state.pos, state.shift
    new.valid = state.valid
    new.pad = state.pad
    new.layers = []
    for s in state.layers:
        if isinstance(s, AttentionState):
            new.layers.append(copy_state(s))
        else:
            new.layers.append(DeltaNetState())
            new.layers[-1].conv, new.layers[-1].S = s.conv.clone(), s.S.clone()
    return new


def keep_history(state: State) -> None:
    """让 DeltaNet 层在下一次前向里记下回滚所需的量（完整卷积输入与 state_after 要的量），commit 时清掉。"""
    for s in state.layers:
        if not isinstance(s, AttentionState):
            s.keep_history = True


def commit(state: State, start: int, keep: int) -> None:
    """上一次前向（记了历史）从位置 start 喂了若干 token，只保留前 keep 个的效果，不需要任何重算。
    DeltaNet：窗口是完整输入里紧接第 keep 个 token 之前的 3 列，S 取第 keep 个位置之后的那份；注意力：截断缓存。"""
    for s in state.layers:
        if isinstance(s, AttentionState):
            s.truncate(start + keep)
            continue
        full, parts = s.history  # full [B, 3 + T, C]：窗口从这里切；parts 给 state_after
        width = s.conv.shape[1]  # 核宽 − 1
        s.conv = full[:, keep : keep + width].clone(memory_format=torch.contiguous_format)  # 同第 7 章：自己的一份
        if keep < full.shape[1] - width:  # 有被拒绝的（全部接受时 S 已是前向算到最后的那份）；旧的 S₀ 不再要
            s.S = state_after(parts, keep - 1, in_place=True)
        s.keep_history, s.history = False, None
    state.pos = start + keep
