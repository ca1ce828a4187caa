"""第 2 章 · 词嵌入：把 token id 变成向量。

词嵌入就是一张 [vocab, hidden] 的表，第 i 行是 token i 的向量，查表即可。
Qwen3.5-0.8B 的输出头与它共用同一个矩阵（tie_word_embeddings）：
输入时按行查表，输出时用同一张表和隐藏状态做点积，得到每个词的分数（logits）。
这张表有 248320 × 1024 ≈ 2.5 亿个数，占全部参数的三分之一。
"""

import torch
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size).uniform_(-0.035, 0.035))  # [vocab, hidden]；从零训练时的初值（标准差约 0.02）

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]  # [B, T] → [B, T, hidden]
