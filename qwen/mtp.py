"""第 14 章 · MTP 草稿头与投机解码。

`mtp.*` 是一层“草稿头”（多 token 预测：Gloeckle 等 2024；DeepSeek-V3），由主模型在位置 t 的隐藏状态 h_t 和 e_{t+1} 预测 t+2：
    x = fc([pre_fc_norm_embedding(e_{t+1}), pre_fc_norm_hidden(h_t)]) → 一个门控全注意力层 → norm → 共用的 lm_head
投机解码（Leviathan 等 2023；Chen 等 2023）：草稿头便宜地猜出 d₁…d_k，主模型把 [last, d₁, …, d_k] 一次前向验证（CPU 上读权重最花时间，
验证 k+1 个与算 1 个差不多贵），收下一致的前缀再加一个自己的 token：贪心时输出不变。采样时用拒绝采样：x ~ q 以 min(1, p(x)/q(x)) 接受，
拒绝时从 normalize(max(0, p − q)) 重抽，分布不变。回滚是难点：被拒绝的草稿已经改过 DeltaNet 的记忆 S 和卷积窗口。简单的做法是第 11 章的
snapshot / rollback（存档、回退、重喂）；我们用 keep_history / commit（与 vLLM、SGLang 相同）：验证时记下每个位置之后的 S，提交时取出最后接受的那份。
"""

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .attention import AttentionState
from .cache import State, commit, copy_state, keep_history, rollback, snapshot
from .layer import DecoderLayer
from .model import load_pretrained
from .norm import RMSNorm
from .rope import rope_tables
from .sample import Penalty, Sampling, Token, choose, probabilities, stop_ids

MAX_DRAFTS = 4  # 自动挑选时每轮最多起草几个
PROBE_EVERY = 8  # 自动挑选选了不起草（接受率太低）时，每隔这么多轮仍起草一个：看看接受率有没有回升


class MTP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg, h = cfg, cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention")])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.round_cost = [1 + 0.9 * k for k in range(MAX_DRAFTS + 1)]  # 起草 k 个的一轮花几步普通解码（含每轮的固定开销）：取得保守

    def forward(self, emb_next, hidden, start: int, state: AttentionState | None = None, shift: int = 0):
        """emb_next、hidden [B, T, h] → [B, T, h]（mtp.norm 之后）：第 i 行是位置 start + i 的 (h_t, e_{t+1})，预测 t + 2。"""
        x = torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x.to(emb_next.dtype))  # [B, T, h]：嵌入在前，隐藏状态在后（emb_next 是权重的 dtype）
        cos, sin = rope_tables(self.cfg, start + shift + torch.arange(x.shape[1], device=x.device))  # 同主模型：位置 + shift
        return self.norm(self.layers[0](x.float(), cos, sin, state)).to(emb_next.dtype)

    def draft(self, model, run, k: int):
        """读掉 run.drafter 里成对的 (e_{t+1}, h_t)，再起草 k 个 → (草稿, 分布 q 或 None)；run：Run（k = 0 时附录的 Resume 也行）。"""
        d, shift = run.drafter, run.state.shift  # 位置的平移在主模型的 State 里（第 10 章）
        d.cache.truncate(d.start)  # 丢掉上一轮递归起草留下的推测条目
        n, drafts, qs = d.tokens.shape[1], [], []
        x = self(model.embed_tokens(d.tokens), d.hidden[:, :n], d.start, d.cache, shift)[:, -1:] if n else None
        d.hidden, d.tokens, d.start = d.hidden[:, n:], d.tokens[:, :0], d.start + n
        for i in range(k):
            t, q = run.choose(self.draft_logits(model, x)[0, -1:], drafts)  # 起草的分数 [1, V]
            if t is None:  # 一个也不许（起草词表里没有文法此刻许的 token）：这一轮就起草这几个
                break
            drafts, qs = drafts + [t], qs + [q]
            if i + 1 < k:
                x = self(model.embed_tokens(torch.tensor([[t]], device=x.device)), x, d.start + i, d.cache, shift)
        return drafts, qs

    def draft_logits(self, model, x):  # x [B, 1, h] → 全词表的 float32 logits [B, 1, V]
        return model.lm_head(x).float()

    @classmethod
    def from_pretrained(cls, cfg, path=None, dtype: torch.dtype = torch.float32, **old) -> "MTP":
        """读检查点里的 mtp.*，与第 10 章的 Model 一样加载。快的布局与起草词表：附录的 qwen.fast.load。"""
        return load_pretrained(cls, cfg, path, "mtp.", dtype, " MTP 草稿头，不能做投机解码", old)


@dataclass
class Drafter:
    """草稿头这一边：它的 KV 缓存，和它还没读的 (h_t, e_{t+1}) 对，从位置 start 起（最后一个 h 可能还在等下一个 token）。"""
    cache: AttentionState
    hidden: torch.Tensor  # [1, P, h]：主模型在这些位置的隐藏状态
    tokens: torch.Tensor  # [1, P] 或 [1, P − 1]：每个位置的下一个 token
    start: int

    def add(self, hidden, tokens: list):
        self.hidden, self.tokens = torch.cat([self.hidden, hidden], 1), torch.cat([self.tokens, self.tokens.new_tensor([tokens])], 1)

    def copy(self) -> "Drafter":  # 生成时就地往前走：留着的那份先复制一份
        return Drafter(copy_state(self.cache), self.hidden, self.tokens, self.start)


def prefill(model, ids, state: State, drafter: Drafter | None = None, images=None):
    """预填充 ids [1, T]（接着 state；images：其中的图）→ (隐藏状态 [1, T, h], 草稿头这一边：每个 h 配上下一个 token 等它来读)。"""
    h = model.hidden(ids, state, **(images.inputs(model, ids, state) if images else {}))
    d = drafter or Drafter(AttentionState(), h[:, :0], ids[:, :0], 0)
    d.add(h, ids[0, int(drafter is None) :].tolist())
    return h, d


@dataclass
class Run:
    """一次投机生成：怎么选（sampling、generator、penalty）、停止符、回滚的做法、主模型的 State、草稿头这一边、已输出的 token
    与边生成边记的统计。Run.start 预填充、选出第一个 token；run.stream 逐轮产出 token。"""
    sampling: Sampling
    generator: torch.Generator | None
    penalty: Penalty
    stop: set
    recompute: bool
    state: State  # 主模型的状态：结束时与普通解码喂完同样 token 之后的相同
    drafter: Drafter
    tokens: list = field(default_factory=list)  # 新 token（不含提示词）：第一个是预填充选的，最后一个下一轮跟在草稿前
    rounds: int = 0  # 验证前向的次数
    hits: int = 0  # 被接受并输出的草稿数
    drafted: int = 0  # 起草的总数
    accepted_at: list = field(default_factory=list)  # accepted_at[i]：第 i+1 个草稿位置通过验证的次数
    tried_at: list = field(default_factory=list)  # tried_at[i]：第 i+1 个草稿位置被验证的次数（前面的都通过了）
    trace: list = field(default_factory=list)  # 每轮 (起草数, 接受数, 本轮输出的 token)
    forwards: int = 0  # 主模型前向次数（含预填充与重算）
    prefill_seconds: float = 0.0  # 从调用到第一个 token 选出（预填充）的秒数：解码阶段的速度要扣掉它
    acceptance: float = 0.0  # hits / drafted：起草的 token 被接受的比例

    @classmethod
    @torch.inference_mode()
    def start(cls, model, ids, sampling=None, stop=(), recompute=False, resume=None, images=None, **settings) -> "Run":
        """预填充 ids、选出第一个 token。recompute：存档 + 重算；resume：接着读到某处的状态（附录的 Resume）；images：ids 里的图。"""
        t0, stop, sampling = time.perf_counter(), stop_ids(stop), Sampling.of(sampling, **settings)
        if (ids := model.check_ids(ids, resume and resume.state)).shape[0] != 1:
            raise ValueError("投机解码一次处理一个提示词")
        state, history = (resume.state, resume.tokens) if resume else (State(model), [])
        penalty = Penalty([torch.cat([torch.as_tensor(history, dtype=torch.long), ids[0].cpu()])], model.cfg.vocab_size, sampling)
        h, drafter = prefill(model, ids, state, resume and resume.drafter, images)
        run = cls(sampling, sampling.generator(ids.device), penalty, stop, recompute, state, drafter)
        t = run.choose(logits := model.lm_head(h[:, -1]).float())[0]  # logits [1, V]
        run.tokens = [t if sampling.logprobs is None else Token(t, logits[0], sampling.logprobs)]  # 要对数概率时（第 12 章）
        drafter.add(h[:, :0], [t])  # 最后一个 h 等到了它的下一个 token
        run.prefill_seconds = time.perf_counter() - t0
        return run

    def choose(self, logits, extra=()):  # 一个位置的 logits [1, V] → (token, 分布 q；贪心时 None)，一个也不许时 (None, None)
        row, s = self.penalty.mask(logits, extra)[0], self.sampling  # extra 见 Penalty
        return choose(row, s.temperature, s.top_k, s.top_p, self.generator) if row.isfinite().any() else (None, None)

    @torch.inference_mode()
    def stream(self, model, mtp, max_new_tokens: int, draft_tokens=None, cost_now=None):
        """逐轮产出新 token，边产出边记统计。draft_tokens=None：按接受率挑；cost_now：每轮问一次一轮的代价（默认 mtp.round_cost）。"""
        Sampling.check("max_new_tokens", max_new_tokens)
        if draft_tokens is not None and (not isinstance(draft_tokens, int) or draft_tokens < 1):
            raise ValueError(f"draft_tokens 至少为 1（或 None：自动），收到 {draft_tokens!r}")
        self.accepted_at, self.tried_at, idle = [0] * (draft_tokens or MAX_DRAFTS), [0] * (draft_tokens or MAX_DRAFTS), 0
        self.tokens, self.forwards = self.tokens[: int(max_new_tokens > 0)], 1
        if not self.tokens:
            return
        yield list(self.tokens)
        self.penalty.add(self.tokens)
        while self.tokens[-1] not in self.stop and len(self.tokens) < max_new_tokens:
            cost, a = cost_now() if cost_now else mtp.round_cost, (self.accepted_at[0] + 1) / (self.tried_at[0] + 2)  # 先验“2 次里对 1 次”
            k = draft_tokens or best_draft_count(a, cost) or int(idle >= PROBE_EVERY and best_draft_count(1, cost) > 0)  # 久没起草：试一个
            k = min(k, max_new_tokens - len(self.tokens) - 1)  # 不超出预算；a = 1 也不划算时不试（起草在这里永远不划算）
            k, n, emitted, forwards = spec_round(model, mtp, self, k, max_new_tokens - len(self.tokens))
            idle = idle + 1 if k == 0 else 0  # 连续几轮没有起草（真的起草了几个）
            self.tried_at = [t + (i < min(n + 1, k)) for i, t in enumerate(self.tried_at)]  # 第 i+1 个草稿真的被检验过（前面的都通过了）
            self.accepted_at = [a + (i < n) for i, a in enumerate(self.accepted_at)]  # 前 n 个通过
            self.rounds, self.forwards, self.drafted = self.rounds + 1, self.forwards + forwards, self.drafted + k
            self.hits, self.tokens = self.hits + min(n, len(emitted)), self.tokens + emitted
            self.acceptance = self.hits / self.drafted if self.drafted else 0.0
            self.trace.append((k, min(n, len(emitted)), emitted))  # 这一轮：起草 k 个，前 n 个通过，输出 emitted（可能被截短）
            self.penalty.add(emitted)
            yield emitted


def verify(drafts, qs, logits, run: Run):
    """主模型的 logits [k+1, V] 检验 k 个草稿 → (接受数 n, d₁…d_n 加一个主模型的 token)；罚重复时前面的草稿也算生成过。
    “贪心时输出不变”要求第 i 行与逐个解码时逐位相同：换个求和顺序就可能翻转持平的 argmax（普通模型只差在舍入之内）。"""
    for i, d in enumerate(drafts):
        row, s = run.penalty.mask(logits[i : i + 1], drafts[:i])[0], run.sampling
        if s.temperature == 0:  # 贪心：草稿必须正是主模型的 argmax
            if d != (target := int(row.argmax())):
                return i, drafts[:i] + [target]
            continue
        p, q = probabilities(row, s.temperature, s.top_k, s.top_p), qs[i]
        if torch.rand((), generator=run.generator) >= min(1.0, float(p[d] / q[d])):  # 以 min(1, p/q) 接受
            residual = (p - q).clamp(min=0)  # 拒绝：从 max(0, p − q) 里重抽
            return i, drafts[:i] + [int(torch.multinomial(residual / residual.sum(), 1, generator=run.generator))]
    bonus, _ = run.choose(logits[-1:], drafts)  # 全部接受：主模型再送一个
    return len(drafts), drafts + [bonus]


def best_draft_count(a: float, round_cost) -> int:
    """接受率 a 时每轮起草几个：最大化一轮期望产出的 (1 − a^(k+1)) / (1 − a) 个 token ÷ 这一轮的代价 round_cost[k]；0 是不起草。"""
    a = min(a, 0.99)
    return max(range(len(round_cost)), key=lambda k: (1 - a ** (k + 1)) / (1 - a) / round_cost[k])


def spec_round(model, mtp, run: Run, k: int, budget: int):
    """一轮：起草 k 个 → 一次前向验证 [last, d₁…] → 接受一致的前缀 → 提交（或回滚）→ (起草数, 通过数, 本轮的 token, 前向次数)。"""
    drafts, qs = mtp.draft(model, run, k) if k > 0 or run.drafter.tokens.shape[1] > PROBE_EVERY else ([], [])  # 1. 起草
    k = len(drafts)  # 草稿头可能少起草几个（文法此刻许的 token 它都不打分时）；k = 0 时攒下的对太多了也先读掉，不越攒越多
    # 2. 验证：[last, d₁, …, d_k] 一次前向。要回滚时先存档，或让前向记下每个位置之后的状态
    state, start, snap = run.state, run.state.pos, snapshot(run.state) if run.recompute else None
    feed = torch.tensor([[run.tokens[-1]] + drafts], device=run.drafter.tokens.device)  # [1, k+1]
    if not run.recompute and k > 0:
        keep_history(state)
    h = model.hidden(feed, state)  # [1, k+1, h]：最后一次 norm 之后的，草稿头要它
    logits = model.lm_head(h).float()  # [1, k+1, V]：验证要它
    # 3. 接受最长的一致前缀，再加一个主模型的 token；停止符（含）之后的、超出预算（budget 个）的不要
    n, new = verify(drafts, qs, logits[0], run)
    m = min(next((i + 1 for i, t in enumerate(new) if t in run.stop), len(new)), budget)
    n_top = run.sampling.logprobs  # 要对数概率时：第 i 个 token 是第 i 行选的（第 12 章的 Token）
    emitted = [t if n_top is None else Token(t, logits[0, i], n_top) for i, t in enumerate(new[:m])]  # 保留前 m 个
    # 4. 提交：只留下前 m 个位置之后的状态
    if run.recompute and m < k + 1:  # 有被丢弃的 token：恢复存档，再把保留的重新喂一遍
        rollback(state, snap)
        h = model.hidden(feed[:, :m], state)
    elif not run.recompute and k > 0:
        commit(state, start, m)  # 取出第 m 个位置之后的 S 和卷积窗口，KV 缓存截到 start + m
    run.drafter.add(h[:, :m], emitted)  # 这一轮留下的 m 对 (h_t, e_{t+1})：草稿头下次起草时一并读掉
    return k, n, emitted, 1 + int(run.recompute and m < k + 1)  # 重算过的一轮是两次前向


def stream_mtp(model, mtp, ids, max_new_tokens=100, stop=(), sampling=None, draft_tokens=None, cost_now=None, **more):
    """逐轮产出新 token：Run.start 再 run.stream（要统计时自己这样写，或用 speculate）。more：Run.start 的其余参数。"""
    yield from Run.start(model, ids, sampling, stop, **more).stream(model, mtp, max_new_tokens, draft_tokens, cost_now)


def speculate(model, mtp, ids, max_new_tokens=100, stop=(), sampling=None, draft_tokens=None, cost_now=None, **more) -> Run:
    """投机解码到底，返回这次的 Run（tokens 与各项统计；参数同 stream_mtp）。"""
    run = Run.start(model, ids, sampling, stop, **more)
    list(run.stream(model, mtp, max_new_tokens, draft_tokens, cost_now))  # 读到底
    return run


def generate_mtp(model, mtp, ids, max_new_tokens=100, stop=(), sampling=None, draft_tokens=None, **more):
    """投机解码，返回 (tokens, rounds, hits)；贪心时 tokens 与 generate(model, ids, …) 逐个相同。详细结果见 speculate()。"""
    r = speculate(model, mtp, ids, max_new_tokens, stop, sampling, draft_tokens, **more)
    return r.tokens, r.rounds, r.hits
