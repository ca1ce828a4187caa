"""第 2 章 embedding.py：词嵌入就是按 id 取出表里的一行，与 transformers 的 embed_tokens 逐位相同。"""

import torch

from checkpoints import prompt


def test_embedding_rows_equal_the_reference(tiny, tiny_model):
    ids = prompt(tiny_model.cfg.vocab_size, 9, seed=2)
    ours = tiny_model.embed_tokens(ids)  # [1, 9, hidden]
    assert ours.shape == (1, 9, tiny_model.cfg.hidden_size)
    assert torch.equal(ours, tiny[1].model.embed_tokens(ids))
    assert torch.equal(ours[0, 3], tiny_model.embed_tokens.weight[ids[0, 3]])  # 第 i 个位置就是表的第 ids[i] 行
