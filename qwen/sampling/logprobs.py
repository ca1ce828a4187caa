"""附录 · 对数概率：提示词各位置的（completions 的 echo），与每个 token 的字节（OpenAI 的 bytes）。

生成的 token 自己的对数概率是第 12 章的事：Sampling(logprobs=n) 要，生成的每个 token 是一个 Token（就是它的 id，另带
logprob 与那一行最可能的 n 个 top），记的是模型原样的分布（罚重复、logit_bias、文法、temperature 之前，同 vLLM 默认的
raw_logprobs）。投机解码（第 14 章）输出的第 i 个 token 是验证那一轮第 i 行选的，承诺 1 说那一行与逐个解码时逐位相同，
所以记下的对数概率也逐位相同。这里补上提示词那一边：prompt_logprobs 一段段地读提示词，第 i 个 token 在第 i − 1 行上的值。
"""

import torch

from ..cache import State
from ..sample import RULES, Token

MAX_TOP = RULES["logprobs"][2]  # top_logprobs 至多这么多个（OpenAI 与 vLLM 的上限）


@torch.inference_mode()
def prompt_logprobs(model, ids: list, top: int = 0, piece: int = 64) -> list:
    """提示词每个位置的 token：第 0 个没有前文，是它的 id（int）；其余是 Token（第 12 章），logprob 是它在第 i − 1 行上的
    对数概率，top 是那一行最可能的 top 个。一段 piece 个位置地读，每段的 logits [piece, V] 用完就放掉。"""
    state, out = State(model), [ids[0]]
    for a in range(0, len(ids), piece):
        rows = model(torch.tensor([ids[a : a + piece]]), state)[0]  # [t, V]：第 j 行预测第 a + j + 1 个
        out += [Token(ids[a + j + 1], row, top) for j, row in enumerate(rows) if a + j + 1 < len(ids)]
    return out


def token_bytes(tk, vocab_size: int) -> list:
    """模型词表里的每个 id → 它的字节（OpenAI 的 bytes；分词器里没有的 id 是 b""）。字节级 BPE（GPT-2、Qwen）把每个字节写成一个
    可见的字（bytes_to_unicode：可打印的字节是它自己，其余挪到 256 之后），这里反过来查；加进来的记号（<|im_end|> 等）是它的文字。"""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in printable]
    byte_of = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(moved)}
    added = set(tk.get_added_tokens_decoder())
    out = []
    for i in range(vocab_size):
        text = tk.id_to_token(i) or ""
        plain = i in added or any(c not in byte_of for c in text)
        out.append(text.encode() if plain else bytes(byte_of[c] for c in text))
    return out
