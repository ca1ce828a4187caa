"""第 12 章 · 采样：一个接一个地生成。预填充提示词，用最后一个位置的 logits 选出下一个 token，再把它喂回模型，直到停止符
或 max_new_tokens。怎么“选”是一个值 Sampling：temperature = 0 是贪心（取 argmax，第 14 章以它为准），> 0 按 softmax(logits / T)
抽样；top_k 只在分数最高的 k 个词里抽，top_p（核采样）只在累计概率刚达到 p 的最小词集里抽（都是先截断、再重新归一化）。
选之前可以先改 logits：罚重复（贪心也罚）、logit_bias（Penalty）、文法（附录 qwen/sampling/grammar.py）都是一条 Rule。
"""

from dataclasses import dataclass, fields, replace
from typing import Protocol

import torch

from .cache import State

RULES = {  # 每项设置：(要整数?, 下限, 上限, 不含下限?, 说明)。命令行、服务、对话都用这一张表检查（Sampling.check）
    "max_new_tokens": (True, 0, None, False, "应为非负整数"),
    "temperature": (False, 0, None, False, "不能为负（0 表示贪心）"),
    "top_k": (True, 1, None, False, "至少为 1（或 None）"),
    "top_p": (False, 0, 1, True, "应在 (0, 1] 内（或 None）"),
    "repetition_penalty": (False, 0, None, True, "应为正数（1 表示不罚）"),
    **dict.fromkeys(["presence_penalty", "frequency_penalty"], (False, None, None, False, "应为数（0 表示不罚）")),
    "seed": (True, -2**63, 2**63 - 1, False, "应为 64 位有符号整数（或 None）"),  # torch.Generator 的范围
    "logprobs": (True, 0, 20, False, "应为 0…20 的整数：另带最可能的几个（或 None：不要对数概率）")}  # 同 OpenAI 的上限


@dataclass(frozen=True)
class Sampling:
    """怎么选下一个 token：一个值，建的时候检查一次，之后到处传（nano-vllm 的 SamplingParams）。默认贪心。"""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict | None = None  # {token id: 加到它的 logit 上的数}（OpenAI 的 logit_bias；−100 几乎等于不许）
    grammar: object = None  # 只许合乎它的 token：它的 matcher() 给每次生成一条自己的 Rule（附录的 Grammar）
    logprobs: int | None = None  # 要对数概率：每个 token 带回它的（Token），另带那一行最可能的这么多个

    def __post_init__(self):
        for name in [f.name for f in fields(self) if f.name in RULES]:
            self.check(name, getattr(self, name))

    @staticmethod
    def check(name: str, v) -> None:  # 不合法（类型不对也算：不做默默的转换）时是一行清楚的 ValueError
        integer, low, high, low_open, what = RULES[name]
        bad = isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or v != v or (
            low is not None and (v < low or low_open and v == low)) or (high is not None and v > high)
        if bad and not (v is None and name in ("top_k", "top_p", "seed", "logprobs")):
            raise ValueError(f"{name} {what}，收到 {v!r}")

    @classmethod
    def of(cls, sampling=None, **settings) -> "Sampling":  # 在 sampling（默认贪心）之上改几项：generate(…, temperature=0.7)
        if (unknown := ", ".join(sorted(set(settings) - {f.name for f in fields(cls)}))) or not isinstance(sampling, (Sampling, type(None))):
            raise ValueError(f"未知的采样参数 {unknown}" if unknown else f"sampling 应为一个 Sampling，收到 {sampling!r}")
        return replace(sampling or cls(), **settings)

    def generator(self, device="cpu"):
        return None if self.seed is None else torch.Generator(device).manual_seed(self.seed)


class Rule(Protocol):  # 选 token 之前改 logits 的一条规则（Penalty、附录的文法）：每次生成一份，随选定的 token 前进
    def mask(self, logits: torch.Tensor, extra=()) -> torch.Tensor: ...  # [B, V'] → 改过的；extra：第 0 行之前多出的草稿
    def add(self, tokens) -> None: ...  # 每行新选定的 token：[B] 或 [B, n]


class Token(int):
    """生成的一个 token，就是它的 id。Sampling(logprobs=n) 时生成的是 Token(id, 选出它的那一行原样的 logits [V], n)：另带 logprob
    （那一行的 log_softmax 在它上的值：罚重复、文法、temperature 之前，同 vLLM 的默认）与 top（那一行最可能的 n 个 [(id, 对数概率)]）。"""
    def __new__(cls, token: int, logits: torch.Tensor | None = None, n: int = 0):  # logits 为 None：复制、pickle 时
        t, row = super().__new__(cls, token), None if logits is None else logits.float().log_softmax(-1)
        t.logprob, t.top = (None, None) if row is None else (float(row[token]), [(i, v) for v, i in zip(*map(torch.Tensor.tolist, row.topk(n)))])
        return t


class Penalty:
    """一条 Rule，带着每行的一点状态（提示词里有哪些 token、每个生成过几次 n）。repetition_penalty = r：出现过的 logit 为正时
    除以 r、为负时乘以 r（CTRL）；减去 presence·[n > 0] + frequency·n（OpenAI）、加上 logit_bias。每行的文法先过。"""

    def __init__(self, prompts, vocab_size: int, s: Sampling):  # prompts：每行真实 token 的一维 id 张量（不含填充）
        if not isinstance(bias := s.logit_bias or {}, dict) or not all(type(t) in (int, Token) and 0 <= t < vocab_size and
                                                                        type(v) in (int, float) and abs(v) <= 100 for t, v in bias.items()):
            raise ValueError(f"logit_bias 应为 {{词表里的 token id（0…{vocab_size - 1}）: [-100, 100] 内的数}}，收到 {bias!r}")
        self.bias = torch.zeros(vocab_size).index_put_((torch.tensor([*bias], dtype=torch.long),), torch.tensor([*bias.values()]).float())
        self.s, self.active = s, s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0 or bool(bias)
        self.rules = [s.grammar.matcher() for _ in prompts] if s.grammar is not None else []  # 每行一条文法的 Rule
        self.seen = torch.stack([torch.zeros(vocab_size, dtype=torch.bool).index_fill(0, torch.as_tensor(p).flatten().cpu(), True)
                                 for p in prompts])  # [B, V]：提示词里有的
        self.made = torch.zeros(len(prompts), vocab_size)  # [B, V]：已生成了几次

    def add(self, tokens) -> None:  # 每行新生成的一个或几个 token：[B] 或 [B, n]
        tokens = torch.as_tensor(tokens).reshape(self.seen.shape[0], -1).cpu()
        for rule, row in zip(self.rules, tokens):
            rule.add(row)
        self.made.scatter_add_(1, tokens, torch.ones(tokens.shape))  # 同一个 token 几次就加几

    def mask(self, logits: torch.Tensor, extra=()) -> torch.Tensor:
        """logits [B, V']（V' 可小于词表：起草的子词表）→ 罚过的 logits。extra：第 0 行之前多出的 token（验证时前面的草稿）。"""
        if self.rules:  # 每行先过它的文法（第 0 行先沿 extra 前进，算完退回）
            logits = torch.cat([r.mask(logits[b : b + 1], extra if b == 0 else ()) for b, r in enumerate(self.rules)])
        if not self.active:  # 没有罚、没有 logit_bias
            return logits
        V, extra = logits.shape[-1], torch.tensor([t for t in extra if t < logits.shape[-1]], dtype=torch.long)
        seen, made = self.seen[:, :V], self.made[:, :V].index_put((0 * extra, extra), torch.ones(len(extra)), accumulate=True)  # extra 只这次算
        if (r := self.s.repetition_penalty) != 1.0:
            seen = (seen | (made > 0)).to(logits.device)  # 提示词里的与生成过的
            logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        made, bias = made.to(logits.device, logits.dtype), self.bias[:V].to(logits.device, logits.dtype)
        return logits - self.s.presence_penalty * (made > 0).to(logits.dtype) - self.s.frequency_penalty * made + bias


def probabilities(logits: torch.Tensor, temperature: float, top_k=None, top_p=None) -> torch.Tensor:  # → 截断、重新归一化的 [..., V]
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # 第 k 大的分数
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # 排在它前面的词的累计概率
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # 前面已经够 p 了，它就不要了
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def choose(logits: torch.Tensor, temperature=0.0, top_k=None, top_p=None, generator=None):  # [V] → (token, 分布；贪心时 None)
    p = None if temperature == 0 else probabilities(logits, temperature, top_k, top_p)
    return int(logits.argmax() if p is None else torch.multinomial(p, 1, generator=generator)), p


def stop_ids(stop) -> set:  # 停止符是一组 token id：给的是字符串（或别的不是整数的东西）时报错，而不是悄悄地永不命中
    if isinstance(stop, (str, bytes)) or not all(hasattr(t, "__index__") for t in stop):
        raise ValueError(f"stop 要一组 token id（整数），收到 {stop!r}：文字请先用分词器转成 id")
    return {int(t) for t in stop}


@torch.inference_mode()
def stream(model, ids, max_new_tokens=100, stop=(), sampling: Sampling | None = None, state=None, history=(),
           images=None, **settings):
    """逐个产出新 token 的 id（要了对数概率时是 Token），命中停止符时产出它然后结束。sampling 默认贪心，settings 在它之上改几项。state 给定时
    接着它喂 ids（已见过 history，多轮对话不必重读；罚重复时也算上）。images：ids 里的图（第 15 章的 Images，给出 inputs）。"""
    s = Sampling.of(sampling, **settings)
    Sampling.check("max_new_tokens", max_new_tokens)
    if max_new_tokens == 0:
        return
    if (ids := model.check_ids(ids, state)).shape[0] != 1:
        raise ValueError("stream/generate 一次处理一个提示词；多个提示词请用 qwen.batch.generate_batch")
    stop, gen, state = stop_ids(stop), s.generator(ids.device), state or State(model)
    penalty = Penalty([torch.cat([torch.as_tensor(history, dtype=torch.long), ids[0].cpu()])], model.cfg.vocab_size, s)
    logits = model(ids, state, last=True, **(images.inputs(model, ids, state) if images else {}))[:, -1]  # 预填充：最后一个位置的
    for i in range(max_new_tokens):
        t, _ = choose(penalty.mask(logits)[0], s.temperature, s.top_k, s.top_p, gen)
        yield t if s.logprobs is None else Token(t, logits[0], s.logprobs)
        if t in stop or i == max_new_tokens - 1:
            return
        penalty.add([t])
        logits = model(torch.tensor([[t]], device=ids.device), state)[:, -1]  # 解码：一次一个 token


def generate(model, ids, max_new_tokens=100, stop=(), sampling: Sampling | None = None, **settings) -> list:  # 新 token（含停止符）
    return list(stream(model, ids, max_new_tokens, stop, sampling, **settings))
