"""第 12 章 · 采样：从 logits 到下一个 token，一个接一个地生成：预填充提示词，取最后一个位置的 logits 选出下一个 token，
再把它喂回模型，直到停止符或 max_new_tokens。怎么“选”（这些设置合起来是一个值 Sampling）：
- temperature = 0：贪心，取 argmax，投机解码的第 14 章以它为准；temperature > 0：按 softmax(logits / T) 抽样。
- top_k：只在分数最高的 k 个词里抽；top_p（核采样）：只在累计概率刚达到 p 的最小词集里抽。都是先截断、再重新归一化。
- 在这之前可以先改 logits（Penalty）：repetition_penalty 让出现过的变小（贪心也罚），presence_penalty、frequency_penalty 让生成
  过的减去一个常数、再按次数减，logit_bias 加给指定的 token；给了文法（grammar，附录 qwen/grammar.py）时不合它的取 −∞。
"""

from dataclasses import dataclass, fields, replace
from functools import reduce

import torch

from .cache import State

RULES = {  # 每项设置：(要整数?, 下限, 上限, 不含下限?, 说明)。命令行、服务、对话都用这一张表检查（Sampling.check）
    "max_new_tokens": (True, 0, None, False, "应为非负整数"),
    "temperature": (False, 0, None, False, "不能为负（0 表示贪心）"),
    "top_k": (True, 1, None, False, "至少为 1（或 None）"),
    "top_p": (False, 0, 1, True, "应在 (0, 1] 内（或 None）"),
    "repetition_penalty": (False, 0, None, True, "应为正数（1 表示不罚）"),
    "presence_penalty": (False, None, None, False, "应为数（0 表示不罚）"),
    "frequency_penalty": (False, None, None, False, "应为数（0 表示不罚）"),
    "seed": (True, -2**63, 2**63 - 1, False, "应为 64 位有符号整数（或 None）")}  # torch.Generator 的范围


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
    grammar: object = None  # 只许合乎它的 token：有 matcher() 的对象，每次生成取一份自己的状态（附录的 Grammar）
    logprobs: object = None  # 记下每个生成的 token 的对数概率：也有 matcher()，它的状态看原样的 logits（附录的 Logprobs）

    def __post_init__(self):
        for name in [f.name for f in fields(self) if f.name in RULES]:
            self.check(name, getattr(self, name))

    @staticmethod
    def check(name: str, v) -> None:  # 不合法（类型不对也算：不做默默的转换）时是一行清楚的 ValueError
        integer, low, high, low_open, what = RULES[name]
        bad = isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or v != v or (
            low is not None and (v < low or low_open and v == low)) or (high is not None and v > high)
        if bad and not (v is None and name in ("top_k", "top_p", "seed")):
            raise ValueError(f"{name} {what}，收到 {v!r}")

    @classmethod
    def of(cls, sampling=None, **settings) -> "Sampling":
        """在 sampling（默认贪心）之上改几项：generate(…, temperature=0.7) 即 generate(…, Sampling(temperature=0.7))。"""
        unknown = ", ".join(sorted(set(settings) - {f.name for f in fields(cls)}))
        if unknown or not isinstance(sampling, (Sampling, type(None))):
            raise ValueError(f"未知的采样参数 {unknown}" if unknown else f"sampling 应为一个 Sampling，收到 {sampling!r}")
        return replace(sampling or cls(), **settings)

    def generator(self, device="cpu"):
        return None if self.seed is None else torch.Generator(device).manual_seed(self.seed)


class Penalty:
    """改 logits：生成时带着走的一点状态（每行：提示词里有哪些 token、每个生成过几次 n）。repetition_penalty = r：出现过的
    logit 为正时除以 r、为负时乘以 r（CTRL）；减去 presence·[n > 0] + frequency·n（OpenAI）、加上 logit_bias；rules 见附录。"""

    def __init__(self, prompts, vocab_size: int, s: Sampling):  # prompts：每行真实 token 的一维 id 张量（不含填充）
        self.repetition, self.presence, self.frequency = s.repetition_penalty, s.presence_penalty, s.frequency_penalty
        if not isinstance(bias := s.logit_bias or {}, dict) or not all(type(t) is int and 0 <= t < vocab_size and type(v) in (int, float)
                                                                        and abs(v) <= 100 for t, v in bias.items()):
            raise ValueError(f"logit_bias 应为 {{词表里的 token id（0…{vocab_size - 1}）: [-100, 100] 内的数}}，收到 {bias!r}")
        self.bias = torch.zeros(vocab_size).index_put_((torch.tensor([*bias], dtype=torch.long),), torch.tensor([*bias.values()]).float())
        self.active = self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0 or bool(s.logit_bias)
        self.rules = [[r.matcher() for r in (s.logprobs, s.grammar) if r is not None] for _ in prompts]  # 每行：先记对数概率，再按文法
        self.seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool)  # [B, V]：提示词里有的
        self.made = torch.zeros(len(prompts), vocab_size)  # [B, V]：已生成了几次
        for b, p in enumerate(prompts):
            self.seen[b, torch.as_tensor(p).flatten().cpu()] = True

    def add(self, tokens) -> None:  # 每行新生成的一个或几个 token：[B] 或 [B, n]
        tokens = torch.as_tensor(tokens).reshape(self.seen.shape[0], -1).cpu()
        for rule, row in [(rule, row) for rules, row in zip(self.rules, tokens) for rule in rules]:
            rule.add(row)
        rows = torch.arange(self.seen.shape[0])[:, None].expand_as(tokens)  # 同一个 token 几次就加几
        self.made.index_put_((rows, tokens), torch.ones(tokens.shape), accumulate=True)

    def __call__(self, logits: torch.Tensor, extra=()) -> torch.Tensor:
        """logits [B, V']（V' 可小于词表：起草的子词表）→ 罚过的 logits。extra：第 0 行之前多出的 token（验证时前面的草稿）。"""
        if any(self.rules):  # 每行依次过它的 rules（文法：第 0 行先沿 extra 前进，算完退回）
            logits = torch.cat([reduce(lambda x, r: r.mask(x, extra if b == 0 else ()), rules, logits[b : b + 1])
                                for b, rules in enumerate(self.rules)])
        if not self.active:
            return logits
        V, extra = logits.shape[-1], torch.tensor([t for t in extra if t < logits.shape[-1]], dtype=torch.long)
        seen, made = self.seen[:, :V], self.made[:, :V].index_put((0 * extra, extra), torch.ones(len(extra)), accumulate=True)  # extra 只这次算
        if (r := self.repetition) != 1.0:
            seen = (seen | (made > 0)).to(logits.device)  # 提示词里的与生成过的
            logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        made, bias = made.to(logits.device, logits.dtype), self.bias[:V].to(logits.device, logits.dtype)
        return logits - self.presence * (made > 0).to(logits.dtype) - self.frequency * made + bias


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


def pick(logits: torch.Tensor, temperature=0.0, top_k=None, top_p=None, generator=None) -> torch.Tensor:  # [B, V] → [B]
    p = None if temperature == 0 else probabilities(logits, temperature, top_k, top_p)
    return logits.argmax(-1) if p is None else torch.multinomial(p, 1, generator=generator)[:, 0]


def choose(logits: torch.Tensor, temperature=0.0, top_k=None, top_p=None, generator=None):  # [V] → (token, 分布；贪心时 None)：第 14 章要它
    p = None if temperature == 0 else probabilities(logits, temperature, top_k, top_p)
    return int(logits.argmax() if p is None else torch.multinomial(p, 1, generator=generator)), p


def stop_ids(stop) -> set:  # 停止符是一组 token id：给的是字符串（或别的不是整数的东西）时报错，而不是悄悄地永不命中
    if isinstance(stop, (str, bytes)) or not all(hasattr(t, "__index__") for t in stop):
        raise ValueError(f"stop 要一组 token id（整数），收到 {stop!r}：文字请先用分词器转成 id")
    return {int(t) for t in stop}


@torch.inference_mode()
def stream(model, ids, max_new_tokens=100, stop=(), sampling: Sampling | None = None, state=None, history=None,
           images=None, **settings):
    """逐个产出新 token 的 id（int），命中停止符时产出它然后结束。sampling 默认贪心，settings 在它之上改几项。
    state 给定时接着它喂 ids（已见过 history，多轮对话不必重读；罚重复时也算上）。images：ids 里的图（第 15 章）。"""
    s = Sampling.of(sampling, **settings)
    Sampling.check("max_new_tokens", max_new_tokens)
    if max_new_tokens == 0:
        return
    if (ids := model.check_ids(ids, state)).shape[0] != 1:
        raise ValueError("stream/generate 一次处理一个提示词；多个提示词请用 qwen.batch.generate_batch")
    stop, gen, state = stop_ids(stop), s.generator(ids.device), state or State(model)
    seen = ids[0] if history is None else torch.cat([torch.as_tensor(history, dtype=torch.long, device=ids.device), ids[0]])
    penalty = Penalty([seen], model.cfg.vocab_size, s)
    logits = model(ids, state, last=True, images=images)[:, -1]  # 预填充：只要最后一个位置的 logits
    for i in range(max_new_tokens):
        t = int(token := pick(penalty(logits), s.temperature, s.top_k, s.top_p, gen))  # token [1]
        yield t
        if t in stop or i == max_new_tokens - 1:
            return
        penalty.add(token)
        logits = model(token[:, None], state)[:, -1]  # 解码：一次一个 token


def generate(model, ids, max_new_tokens=100, stop=(), sampling: Sampling | None = None, **settings) -> list:  # 新 token（含停止符）
    return list(stream(model, ids, max_new_tokens, stop, sampling, **settings))
