"""附录 · 基准测试：受控接受率的草稿器（每个草稿以概率 a 猜对）。"""

import torch


class OracleDrafter:
    """知道贪心续写的草稿器：真的 MTP 照样起草（代价照算），然后每个草稿以概率 a 换成正确的 token，
    否则换成一个错的。每个草稿独立地以概率 a 猜对，于是一轮期望产出 (1 − a^(k+1)) / (1 − a) 个 token。"""

    def __init__(self, mtp, sequence: list, a: float, seed: int = 0):
        self.mtp, self.seq, self.a = mtp, sequence, a  # sequence：提示词 + 贪心续写
        self.round_cost = mtp.round_cost  # 自动挑草稿数时按真的草稿头的代价算
        self.gen = torch.Generator().manual_seed(seed)

    def draft(self, model, run, k):
        first = run.drafter.start + run.drafter.tokens.shape[1] + 1  # 第一个草稿在整个序列里的位置
        _, qs = self.mtp.draft(model, run, k)  # 草稿头可能少起草几个（文法此刻许的 token 它都不打分时）：照它的个数
        drafts = []
        for i in range(len(qs)):
            target = self.seq[first + i] if first + i < len(self.seq) else 0
            if torch.rand((), generator=self.gen) >= self.a:
                target = (target + 1) % model.cfg.vocab_size  # 故意猜错
            drafts.append(target)
        return drafts, qs
