"""附录 · 对数概率：每个生成的 token 在决定它的那一行 logits 上的 log-softmax，和那一行最可能的前 N 个（OpenAI 的
logprobs / top_logprobs）。

记的是模型原样的分布：罚重复、logit_bias、文法、temperature、top_k / top_p 之前（vLLM 默认的 raw_logprobs 也是这样）。
它挂在第 12 章 Penalty 的 rules 里、排在文法之前：每一行 logits 选 token 之前先经过 mask(logits, extra)——这里记下
log_softmax，原样交回——选定的 token 再经过 add(tokens)。投机解码（第 14 章）验证第 i 个草稿的那一行时 extra 是它前面
的 i 个草稿，所以按 len(extra) 记：一轮里第 i 个输出的 token 正是第 i 行选的；起草时也经过这里（草稿头的分数），
记在同样的位置上，验证时被主模型的那一行换掉——输出的 token 都验证过。承诺 1 说验证的一行与逐个解码的同一行逐位
相同，所以投机解码记下的对数概率也与普通解码的逐位相同。

用法：lp = Logprobs(top=5)；tokens = generate(model, ids, 20, logprobs=lp)；lp.read(tokens) → 每个 token 一个 Entry。
提示词各位置的对数概率（completions 的 echo）：prompt_logprobs。
"""

from dataclasses import dataclass

import torch

from .cache import State

MAX_TOP = 20  # top_logprobs 至多这么多个（OpenAI 与 vLLM 的上限）


@dataclass
class Entry:
    """一个 token 的：它的 id、对数概率，与那一行最可能的前 N 个 [(id, 对数概率)]（从大到小）。"""
    token: int
    logprob: float | None
    top: list | None


class Logprobs:
    """要记对数概率：第 12 章 Sampling 的 logprobs。top：每个 token 另记那一行最可能的几个（0…MAX_TOP）。
    每次生成的每一行由 matcher() 取一份 Record（records 里按行的顺序）；一个 Logprobs 给一次生成用。"""

    def __init__(self, top: int = 0):
        if type(top) is not int or not 0 <= top <= MAX_TOP:
            raise ValueError(f"top 应为 0…{MAX_TOP} 的整数，收到 {top!r}")
        self.top, self.records = top, []

    def matcher(self) -> "Record":
        self.records.append(Record(self.top))
        return self.records[-1]

    def read(self, tokens, row: int = 0) -> list:
        """生成完了：第 row 行生成的 tokens → 每个一个 Entry。"""
        return [self.records[row].at(i, t) for i, t in enumerate(tokens)]


class Record:
    """一行、一次生成：entries 是已经定下（add 过）的 token；rows[i] 是这一轮第 i 个位置的 log_softmax（还没 add 的）。"""

    def __init__(self, top: int):
        self.top, self.rows, self.entries = top, {}, []

    def mask(self, logits: torch.Tensor, extra=()) -> torch.Tensor:
        self.rows[len(extra)] = logits[0].float().log_softmax(-1)  # 新的张量：logits 的缓冲区之后可能被改写
        return logits

    def add(self, tokens) -> None:
        for i, t in enumerate(torch.as_tensor(tokens).flatten().tolist()):
            self.entries.append(entry(self.rows[i], t, self.top))
        self.rows = {}

    def at(self, i: int, token: int) -> Entry:
        """第 i 个生成的 token（它是 token）的 Entry：定下了的直接取，这一轮的（产出之后才 add）从 rows 里算。"""
        return self.entries[i] if i < len(self.entries) else entry(self.rows[i - len(self.entries)], token, self.top)


@torch.inference_mode()
def prompt_logprobs(model, ids: list, top: int = 0, piece: int = 64) -> list:
    """提示词每个位置的 Entry（第 0 个没有前文：logprob 与 top 是 None）：第 i 个 token 在第 i − 1 行上的对数概率。一段 piece 个位置地读，
    每段的 logits [piece, V] 用完就放掉（整个提示词一次算出来要 T × V 个数）。"""
    state, out = State(model), [Entry(ids[0], None, None)]
    for a in range(0, len(ids), piece):
        rows = model(torch.tensor([ids[a : a + piece]]), state)[0].float().log_softmax(-1)  # [t, V]：第 j 行预测第 a + j + 1 个
        out += [entry(row, ids[a + j + 1], top) for j, row in enumerate(rows) if a + j + 1 < len(ids)]
    return out


def entry(row: torch.Tensor, token: int, top: int) -> Entry:  # 一行 log_softmax [V] → token 的 Entry（另带前 top 个）
    best = row.topk(top) if top else None
    return Entry(token, float(row[token]), [] if best is None else list(zip(best.indices.tolist(), best.values.tolist())))


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
