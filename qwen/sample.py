"""第 12 章 · 采样：从 logits 到下一个 token，一个接一个地生成。

生成就是循环：预填充提示词（分块形式一次算完），取最后一个位置的 logits 选出下一个 token，
再把它喂回模型（逐 token 递推），直到停止符或达到 max_new_tokens。

怎么“选”：
- temperature = 0：贪心，取 argmax。确定性，投机解码的第 14 章以它为准。
- temperature > 0：按 softmax(logits / T) 抽样，T 越小越保守。
- top_k：只在分数最高的 k 个词里抽；top_p（核采样）：只在累计概率刚达到 p 的最小词集里抽。
  两者都是先截断、再把剩下的概率重新归一化。
- 在这之前可以先罚重复（Penalty）：repetition_penalty 让出现过的 token 的 logit 变小（贪心也罚），
  presence_penalty 让生成过的 token 的 logit 减去一个常数。
"""

import torch

from .cache import State


def check_sampling(max_new_tokens=0, temperature=0.0, top_k=None, top_p=None, repetition_penalty=1.0,
                   presence_penalty=0.0) -> None:
    """采样参数不合法时给出清楚的 ValueError（类型不对也一样：不做默默的转换）。"""
    rules = [("max_new_tokens", max_new_tokens, True, lambda v: v >= 0, "应为非负整数"),
             ("temperature", temperature, False, lambda v: v >= 0, "不能为负（0 表示贪心）"),
             ("top_k", top_k, True, lambda v: v >= 1, "至少为 1（或 None）"),
             ("top_p", top_p, False, lambda v: 0 < v <= 1, "应在 (0, 1] 内（或 None）"),
             ("repetition_penalty", repetition_penalty, False, lambda v: v > 0, "应为正数（1 表示不罚）"),
             ("presence_penalty", presence_penalty, False, lambda v: True, "应为数（0 表示不罚）")]
    for name, v, integer, ok, what in rules:
        if v is None and name in ("top_k", "top_p"):
            continue
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or not ok(v):
            raise ValueError(f"{name} {what}，收到 {v!r}")


class Penalty:
    """罚重复：哪些 token 出现过，是生成时要带着走的一点状态（每行一个 [V] 的布尔掩码）。

    repetition_penalty = r（CTRL 的做法，与 transformers 相同）：提示词或已生成里出现过的 token，logit 为正时除以 r、
    为负时乘以 r；presence_penalty = c（OpenAI、vLLM 的做法）：已生成过的 token 的 logit 减去 c，只减一次。
    """

    def __init__(self, prompts, vocab_size: int, repetition_penalty=1.0, presence_penalty=0.0):
        """prompts：每行一个一维的 id 张量（批处理时只放真实 token，不放填充）。"""
        self.repetition, self.presence = float(repetition_penalty), float(presence_penalty)
        self.seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool)  # [B, V]：提示词与已生成的
        self.made = torch.zeros_like(self.seen)  # [B, V]：已生成的
        for b, p in enumerate(prompts):
            self.seen[b, torch.as_tensor(p).flatten().cpu()] = True

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0

    def add(self, tokens) -> None:
        """每行新生成了一个或几个 token：tokens [B] 或 [B, n]。"""
        if not self.active:
            return
        rows = torch.arange(self.seen.shape[0])[:, None]
        tokens = torch.as_tensor(tokens).reshape(self.seen.shape[0], -1).cpu()
        self.seen[rows, tokens] = self.made[rows, tokens] = True

    def __call__(self, logits: torch.Tensor, extra=()) -> torch.Tensor:
        """logits [B, V']（V' 可以小于词表：起草时的子词表）→ 罚过的 logits。extra：第 0 行在这之前又多出的几个 token
        （投机解码验证第 i 个位置时，它前面的 i 个草稿）。"""
        if not self.active:
            return logits
        V, extra = logits.shape[-1], [t for t in extra if t < logits.shape[-1]]
        seen, made = self.seen[:, :V], self.made[:, :V]
        if extra:  # 只在这一次算进去，不改动记下的状态
            seen, made = seen.clone(), made.clone()
            seen[0, extra] = made[0, extra] = True
        r = self.repetition
        if r != 1.0:
            logits = torch.where(seen.to(logits.device), torch.where(logits > 0, logits / r, logits * r), logits)
        return logits - self.presence * made.to(logits.device, logits.dtype) if self.presence else logits


def probabilities(logits: torch.Tensor, temperature: float, top_k=None, top_p=None) -> torch.Tensor:
    """logits [..., V] → 截断并重新归一化后的概率 [..., V]（temperature > 0）。"""
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


def pick(logits: torch.Tensor, temperature=0.0, top_k=None, top_p=None, generator=None) -> torch.Tensor:
    """logits [B, V] → 下一个 token [B]。"""
    if temperature == 0:
        return logits.argmax(-1)
    probs = probabilities(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def choose(logits: torch.Tensor, temperature=0.0, top_k=None, top_p=None, generator=None):
    """一个位置的 logits [V] → (token, 抽样用的概率分布；贪心时为 None)。第 14 章的投机解码要这个分布。"""
    if temperature == 0:
        return int(logits.argmax()), None
    p = probabilities(logits, temperature, top_k, top_p)
    return int(torch.multinomial(p, 1, generator=generator)), p


def stop_ids(stop) -> set:
    """停止符是一组 token id。给的是字符串（或别的不是整数的东西）时报错，而不是悄悄地永不命中。"""
    if isinstance(stop, (str, bytes)) or not all(hasattr(t, "__index__") for t in stop):
        raise ValueError(f"stop 要一组 token id（整数），收到 {stop!r}：文字请先用分词器转成 id")
    return {int(t) for t in stop}


def make_generator(seed, device="cpu"):
    return None if seed is None else torch.Generator(device).manual_seed(seed)


@torch.inference_mode()
def stream(model, ids, max_new_tokens=100, stop=(), temperature=0.0, top_k=None, top_p=None, seed=None,
           repetition_penalty=1.0, presence_penalty=0.0, state=None, history=None):
    """逐个产出新 token 的 id（int）。命中停止符时产出它，然后结束。

    state 给定时接着它喂 ids（它已经见过 history 这些 token，多轮对话不必重读历史；罚重复时也算上 history）。"""
    check_sampling(max_new_tokens, temperature, top_k, top_p, repetition_penalty, presence_penalty)
    if max_new_tokens == 0:
        return
    ids = model.check_ids(ids, state)
    if ids.shape[0] != 1:
        raise ValueError("stream/generate 一次处理一个提示词；多个提示词请用 qwen.batch.generate_batch")
    stop, gen, state = stop_ids(stop), make_generator(seed, ids.device), state or State(model)
    seen = ids[0] if history is None else torch.cat([torch.as_tensor(history, dtype=torch.long, device=ids.device), ids[0]])
    penalty = Penalty([seen], model.cfg.vocab_size, repetition_penalty, presence_penalty)
    logits = model(ids, state, last=True)[:, -1]  # 预填充：只要最后一个位置的 logits
    for i in range(max_new_tokens):
        token = pick(penalty(logits), temperature, top_k, top_p, gen)  # [1]
        t = int(token)
        yield t
        if t in stop or i == max_new_tokens - 1:
            return
        penalty.add(token)
        logits = model(token[:, None], state)[:, -1]  # 解码：一次一个 token


def generate(model, ids, max_new_tokens=100, stop=(), temperature=0.0, top_k=None, top_p=None, seed=None,
             repetition_penalty=1.0, presence_penalty=0.0) -> list:
    """生成并返回新 token 的列表（不含提示词；命中停止符时它是最后一个）。"""
    return list(stream(model, ids, max_new_tokens, stop, temperature, top_k, top_p, seed, repetition_penalty,
                       presence_penalty))
