"""第 14 章 · MTP 草稿头与投机解码。

检查点里的 `mtp.*` 是一个只有一层的“草稿头”：训练时它学的是从主模型在位置 t 的隐藏状态
h_t（最后一次 norm 之后）和 token t+1 的嵌入，预测 token t+2：

    x = fc([pre_fc_norm_embedding(e_{t+1}), pre_fc_norm_hidden(h_t)])    （嵌入在前）
    x = 一个门控全注意力解码层（自己的 KV 缓存，RoPE 位置 t）
    token t+2 的 logits = lm_head(norm(x))                               （与主模型共用输出头）

投机解码：主模型刚选出 token `last`，草稿头便宜地猜出后面的 d₁（再把自己的输出喂回去，
还能猜 d₂、d₃…），主模型把 [last, d₁, …, d_k] 一次前向验证。CPU 上解码的时间几乎都花在
读权重上，验证 k+1 个 token 与算 1 个差不多贵；主模型同意的前缀全部收下，再加上主模型自己在
第一个分歧处给出的 token。输出与普通贪心解码逐 token 相同，猜对的 token 等于白送。

回滚是难点。被拒绝的草稿已经改过每个 DeltaNet 层的记忆 S 和卷积窗口，而它们无法“减掉”一个 token：
- 简单的做法（snapshot / rollback）：验证前把 DeltaNet 状态拷一份，有拒绝时恢复，再把收下的
  token 重新喂一遍。每次拒绝多花一次前向。
- 我们用的做法（思路与 vLLM、SGLang 相同）：验证的那次前向顺手记下重建记忆要的量（逐 token 递推时就是
  每个位置之后的 S；分块形式是 (S₀, G, K, U) 几个小张量），提交时用第 7 章的 state_after 取出或算出
  最后一个被接受的位置之后的那份 S；卷积窗口从完整输入里切出，注意力的 KV 缓存只需截断。拒绝不再有额外的前向。

采样时用拒绝采样（Leviathan 等 2023）：草稿 x ~ q 以 min(1, p(x)/q(x)) 的概率接受，
拒绝时从 normalize(max(0, p − q)) 里重新抽。这样输出的分布与只从 p 采样完全相同。
"""

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .attention import AttentionState
from .cache import State
from .deltanet import state_after
from .layer import DECODE_LENGTHS, DecoderLayer
from .norm import RMSNorm
from .rope import rope_tables
from .sample import check_sampling, make_generator, probabilities
from .weights import (BLOCK, Linear, RowReader, check_state_dict, compile_matvec, find_model, gemv,
                      load_weights, pack_linears, preferred_dtype, tensor_file)

# 起草只给词表前这么多个 token 打分。BPE 词表按合并顺序编号，靠前的 id 是训练语料里最常见的片段；
# 草稿只是猜测，猜不到冷门 token 只是少接受一次，输出仍由主模型的验证决定，与贪心逐 token 相同。
DRAFT_VOCAB = 32768
MAX_DRAFTS = 4  # 自动挑选时每轮最多起草几个
PROBE_EVERY = 8  # 自动挑选选了不起草（接受率太低）时，每隔这么多轮仍起草一个：看看接受率有没有回升


class MTP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention")])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.draft_vocab = None  # 起草时只给词表前这么多个 token 打分；None 时给全词表打分
        self.draft_rows = None  # [draft_vocab, h]：输出头的前 draft_vocab 行（from_pretrained 读出）

    def forward(self, emb_next, hidden, start: int, state: AttentionState | None = None):
        """emb_next、hidden [B, T, h] → [B, T, h]（mtp.norm 之后，送进共用的 lm_head）。

        第 i 行是位置 start + i 的一对 (h_t, e_{t+1})，预测位置 t + 2 的 token。
        """
        dtype = self.fc.dtype
        x = torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x.to(dtype))  # [B, T, h]：嵌入在前，隐藏状态在后
        T = x.shape[1]
        cos, sin = rope_tables(self.cfg, torch.arange(start, start + T, device=x.device))
        x = self.layers[0](x.float(), cos, sin, state)
        return self.norm(x).to(dtype)

    def draft(self, model, tokens, hidden, start: int, k: int, state: AttentionState, temperature=0.0,
              top_k=None, top_p=None, gen=None):
        """起草 k 个 token，返回 (草稿列表, 每个草稿的分布 q 或 None)。

        tokens、hidden [1, T]、[1, T, h]：草稿头还没见过的 (e_{t+1}, h_t) 对，从位置 start 起。
        第一个草稿来自最后一对；之后草稿头吃自己的输出（它的 x 当作下一步的 h），再猜下一个。
        """
        embed = model.embed_tokens
        state.truncate(start)  # 丢掉上一轮递归起草留下的推测条目
        x = self(embed(tokens), hidden, start, state)[:, -1:]  # [1, 1, h]
        pos = start + tokens.shape[1]
        drafts, qs = [], []
        for i in range(k):
            d, q = choose(self.draft_logits(model, x)[0, -1], temperature, top_k, top_p, gen)
            if q is not None and q.shape[0] < model.cfg.vocab_size:  # 子词表上的分布补成全词表
                q = torch.cat([q, q.new_zeros(model.cfg.vocab_size - q.shape[0])])
            drafts.append(d)
            qs.append(q)
            if i + 1 < k:
                x = self(embed(torch.tensor([[d]], device=x.device)), x, pos, state)
                pos += 1
        return drafts, qs

    def draft_logits(self, model, x):
        """草稿头的输出 x [B, 1, h] → float32 logits。只打前 draft_vocab 个 token 的分时，输出矩阵就是
        输出头的前 draft_vocab 行：compile=True 时输出头本来就是分块布局（第 1 章），前 draft_vocab / 32 块就是这些行，
        用同一个编译的 matvec 乘（单独测比 gemv 快约三成，也不必另存一份）；否则是加载时读出的 draft_rows
        （模型没打包时直接取 lm_head.weight 的视图），一行输入走 gemv。"""
        if self.draft_vocab is None or self.draft_vocab >= model.cfg.vocab_size:
            return model.lm_head(x).float()
        head = model.lm_head
        if head.blocks is not None:
            y = head.kernel(x.reshape(-1, x.shape[-1]), head.blocks[: -(-self.draft_vocab // BLOCK)])  # [B, ⌈n/32⌉·32]
            return y[:, : self.draft_vocab].reshape(*x.shape[:-1], -1).float()  # [B, 1, draft_vocab]
        rows = self.draft_rows if self.draft_rows is not None else head.weight
        if rows is None or rows.shape[0] < self.draft_vocab:
            raise ValueError(f"草稿头要输出头的前 {self.draft_vocab} 行，但手上只有 {0 if rows is None else rows.shape[0]} 行："
                             "请用与主模型相同的 compile 设置、MTP.from_pretrained(..., draft_vocab=...) 重新加载")
        return gemv(x, rows[: self.draft_vocab]).float()  # [B, 1, draft_vocab]

    @classmethod
    def from_pretrained(cls, cfg, path=None, dtype: torch.dtype | None = None, pack: bool = True,
                        draft_vocab: int | None = DRAFT_VOCAB, compile: bool = False) -> "MTP":
        """读检查点里的 mtp.*。draft_vocab：起草时只给前这么多个 token 打分（None 为全词表）。
        pack、compile 与 Model.from_pretrained 的同名参数一样（compile=True 时矩阵换成分块布局）。"""
        path = find_model(path)
        dtype = dtype or preferred_dtype()
        sd = load_weights(path, "mtp.", dtype)
        if not sd:
            raise ValueError(f"检查点 {path} 里没有 mtp.* 张量：它没有 MTP 草稿头，不能做投机解码")
        with torch.device("meta"):
            mtp = cls(cfg)
        check_state_dict({k: v.shape for k, v in mtp.state_dict().items()}, sd, f"检查点 {path} 的 MTP 草稿头")
        mtp.load_state_dict(sd, assign=True)
        del sd
        blocked = compile and mtp.fc.weight.device.type == "cpu"
        if blocked:
            pack_linears(mtp, compile_matvec(dtype))
            mtp.layers[0].compile_for(DECODE_LENGTHS)  # 起草一个 token、送进上一轮留下的几对：与主模型的层一样整层编译
        elif pack:
            pack_linears(mtp)
        mtp.draft_vocab = draft_vocab if draft_vocab is not None and draft_vocab < cfg.vocab_size else None
        if mtp.draft_vocab is not None and not blocked:  # 输出头的前 draft_vocab 行：普通布局的一份小副本（0.8B 取 32768 行时 64 MB；
            # compile=True 时不用：输出头的分块布局里就有）
            head = ("model.", "embed_tokens.weight") if cfg.tie_word_embeddings else ("", "lm_head.weight")
            mtp.draft_rows = RowReader(*tensor_file(path, *head), dtype).head(mtp.draft_vocab)
        return mtp.eval()


def forward_hidden(model, ids, state=None, last: bool = False):
    """主模型前向，同时返回 logits 与最后一次 norm 之后的隐藏状态 [B, T, h]。"""
    hidden = model.hidden(ids, state)
    logits = model.lm_head(hidden[:, -1:] if last else hidden).float()
    return logits, hidden


# ---------- 回滚的两种做法 ----------


def snapshot(state: State):
    """简单做法：拷下每个 DeltaNet 层的状态与 pos（注意力的 KV 缓存靠截断，无需拷贝）。"""
    saved = [None if isinstance(s, AttentionState) else (s.conv.clone(), s.S.clone()) for s in state.layers]
    return state.pos, saved


def rollback(state: State, snap) -> None:
    """恢复到 snapshot 时的样子。之后要把收下的 token 重新喂一遍（多一次前向）。"""
    pos, saved = snap
    for s, kept in zip(state.layers, saved):
        if isinstance(s, AttentionState):
            s.truncate(pos)
        else:
            s.conv, s.S = kept
    state.pos = pos


def keep_history(state: State, on: bool) -> None:
    """让 DeltaNet 层在下一次前向里记下回滚所需的量（完整卷积输入与 state_after 要的量）。"""
    for s in state.layers:
        if not isinstance(s, AttentionState):
            s.keep_history = on
            s.history = None


def commit(state: State, start: int, keep: int) -> None:
    """我们的做法：上一次前向从位置 start 喂了若干 token，只保留前 keep 个的效果。

    DeltaNet：卷积窗口是完整输入里紧接第 keep 个 token 之前的 3 列，S 取第 keep 个位置之后的那份；
    注意力：KV 缓存截断到 start + keep。不需要任何重算。
    """
    for s in state.layers:
        if isinstance(s, AttentionState):
            s.truncate(start + keep)
        else:
            full, parts = s.history  # full [B, 3 + T, C]：窗口从这里切；parts 给 state_after
            width = s.conv.shape[1]  # 核宽 − 1
            s.conv = full[:, keep : keep + width].clone(memory_format=torch.contiguous_format)  # 同第 7 章：自己的一份
            if keep < full.shape[1] - width:  # 有被拒绝的：取出或重建第 keep 个位置之后的 S（旧的 S₀ 不再需要，就地算）
                s.S = state_after(parts, keep - 1, in_place=True)
            # 全部接受时 s.S 已是前向算到最后的那份，不必重建
            s.history = None
    state.pos = start + keep


# ---------- 投机解码 ----------


@dataclass
class SpecResult:
    """投机解码的详细结果。tokens、rounds、hits 即 generate_mtp 返回的三元组。"""

    tokens: list = field(default_factory=list)  # 新 token（不含提示词）
    rounds: int = 0  # 验证前向的次数
    hits: int = 0  # 被接受并输出的草稿数
    drafted: int = 0  # 起草的总数
    accepted_at: list = field(default_factory=list)  # accepted_at[i]：第 i+1 个草稿位置通过验证的次数
    tried_at: list = field(default_factory=list)  # tried_at[i]：第 i+1 个草稿位置被验证的次数（前面的都通过了）
    trace: list = field(default_factory=list)  # 每轮 (起草数, 接受数, 本轮输出的 token)
    forwards: int = 0  # 主模型前向次数（含预填充与重算）
    prefill_seconds: float = 0.0  # 从调用到第一个 token 选出（预填充）的秒数：解码阶段的速度要扣掉它
    state: State | None = None  # 结束时提交的主模型状态：与普通解码喂完同样 token 后的状态相同

    @property
    def acceptance(self) -> float:
        return self.hits / self.drafted if self.drafted else 0.0


def choose(logits, temperature, top_k, top_p, gen):
    """logits [V] → (token, 概率分布或 None)。贪心时没有分布。"""
    if temperature == 0:
        return int(logits.argmax()), None
    p = probabilities(logits, temperature, top_k, top_p)
    return int(torch.multinomial(p, 1, generator=gen)), p


def verify(drafts, qs, logits, temperature, top_k, top_p, gen):
    """主模型的 logits [k+1, V] 检验 k 个草稿，返回 (接受数 n, 本轮的 token：d₁…d_n 加一个主模型的 token)。"""
    for i, d in enumerate(drafts):
        if temperature == 0:
            target = int(logits[i].argmax())
            if d != target:
                return i, drafts[:i] + [target]
            continue
        p, q = probabilities(logits[i], temperature, top_k, top_p), qs[i]
        if torch.rand((), generator=gen) >= min(1.0, float(p[d] / q[d])):  # 以 min(1, p/q) 接受
            residual = (p - q).clamp(min=0)  # 拒绝：从 max(0, p − q) 里重抽
            return i, drafts[:i] + [int(torch.multinomial(residual / residual.sum(), 1, generator=gen))]
    bonus, _ = choose(logits[len(drafts)], temperature, top_k, top_p, gen)  # 全部接受：主模型再送一个
    return len(drafts), drafts + [bonus]


def extra_cost(model) -> float:
    """每多起草一个 token，一轮约多花几次普通解码步。

    起草一个是草稿头的一层（主模型有 L 层，约 1/L）加上输出头的前 32768 行（0.8B 上又约 1/L），
    验证时多出的一行再加约 0.5/L，合计估为 2.5/L（0.8B：L = 24，约 0.10；实测起草一个约 5 ms、
    验证 2～5 行的一步比只算 1 行多 6%～13%，一步约 65 ms）。这要求多出的一行几乎不花钱：
    打包的矩阵（第 1 章）或 GPU 上确实如此；CPU 上没打包时，每多一行几乎多一整步。
    """
    if model.lm_head.blocks is not None:
        # compile=True：解码一步本身更快，起草与多验证的行相对地贵，机器快时（多行的 matvec 算不过读内存）更贵。
        # 起草 1、2、3、4 个的一轮，机器慢时实测约 1.18、1.34、1.45、1.62 步；快时（拒绝还要重建记忆的时候）测过
        # 1.3、1.6、1.7～1.9、1.9～2.1 步，不再重建之后约少 0.05 步。取快时的斜率：每多起草一个约多一步的 25%
        return 6.0 / model.cfg.num_hidden_layers
    flat = model.lm_head.packed is not None or model.norm.weight.is_cuda
    return 2.5 / model.cfg.num_hidden_layers if flat else 0.9


def best_draft_count(accepted: int, tried: int, cost: float, most: int = MAX_DRAFTS) -> int:
    """按目前观察到的接受率挑每轮起草几个：最大化 每轮期望产出 / 每轮代价。

    每个草稿以概率 a 被接受（前面的都接受了才轮到它），一轮期望产出 (1 − a^(k+1)) / (1 − a) 个 token，
    代价约 1 + cost·k 个普通解码步。a 用第一个草稿位置的接受次数估计，先验是“2 次里对 1 次”。
    返回 0 表示这一轮不起草、就是普通的一步：a 低于 cost 时起草一个也不划算（(1 + a) / (1 + cost) < 1）。
    """
    a = min((accepted + 1) / (tried + 2), 0.99)
    return max(range(0, most + 1), key=lambda k: (1 - a ** (k + 1)) / (1 - a) / (1 + cost * k))


@torch.inference_mode()
def speculate(model, mtp, ids, max_new_tokens=100, stop=(), draft_tokens=None, temperature=0.0, top_k=None,
              top_p=None, seed=None, recompute: bool = False) -> SpecResult:
    """投机解码，返回 SpecResult。

    draft_tokens：每轮起草几个；None（默认）时按观察到的接受率自动挑（best_draft_count）。
    recompute=True 用课程里的简单回滚（快照 + 重算），用于对照。
    """
    t0 = time.perf_counter()
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if draft_tokens is not None and (not isinstance(draft_tokens, int) or draft_tokens < 1):
        raise ValueError(f"draft_tokens 至少为 1（或 None：自动），收到 {draft_tokens!r}")
    ids = model.check_ids(ids, None)
    if ids.shape[0] != 1:
        raise ValueError("投机解码一次处理一个提示词")
    most = draft_tokens or MAX_DRAFTS
    r = SpecResult(accepted_at=[0] * most, tried_at=[0] * most)
    if max_new_tokens == 0:
        return r
    stop, gen = set(stop), make_generator(seed, ids.device)
    state, mtp_state = State(model), AttentionState()
    r.state = state
    cost = extra_cost(model)
    idle = 0  # 连续几轮没有起草

    logits, hidden = forward_hidden(model, ids, state, last=True)  # 预填充
    r.forwards = 1
    last, _ = choose(logits[0, -1], temperature, top_k, top_p, gen)
    r.tokens.append(last)
    r.prefill_seconds = time.perf_counter() - t0
    # 草稿头还没见过的 (h_t, e_{t+1}) 对：提示词的每个位置，下一轮开始时一并送进去
    pend_hidden = hidden  # [1, T, h]
    pend_tokens = torch.cat([ids[:, 1:], torch.tensor([[last]], device=ids.device)], dim=1)  # [1, T]
    pend_start = 0

    while last not in stop and len(r.tokens) < max_new_tokens:
        k = draft_tokens or best_draft_count(r.accepted_at[0], r.tried_at[0], cost)
        if k == 0 and idle >= PROBE_EVERY:
            k = 1  # 太久没起草：试一个，让接受率的估计跟上文本的变化
        k = min(k, max_new_tokens - len(r.tokens) - 1)  # 别起草超出预算的 token
        idle = idle + 1 if k == 0 else 0
        drafts, qs = [], []
        if k > 0:  # 1. 起草
            drafts, qs = mtp.draft(model, pend_tokens, pend_hidden, pend_start, k, mtp_state,
                                   temperature, top_k, top_p, gen)

        # 2. 验证：[last, d₁, …, d_k] 一次前向
        start = state.pos
        feed = torch.tensor([[last] + drafts], device=ids.device)
        snap = snapshot(state) if recompute else None
        keep_history(state, not recompute and k > 0)  # 不起草时这一步就是普通解码，不会回滚
        logits, hidden = forward_hidden(model, feed, state)  # [1, k+1, V]
        r.forwards += 1
        r.rounds += 1

        # 3. 接受最长的一致前缀，再加一个主模型的 token；遇到停止符或预算用完就截断
        n, new = verify(drafts, qs, logits[0], temperature, top_k, top_p, gen)
        emitted = []
        for t in new:
            emitted.append(t)
            if t in stop or len(r.tokens) + len(emitted) == max_new_tokens:
                break
        m = len(emitted)  # 本轮喂进去的 token 里保留前 m 个：last 与 d₁…d_{m−1}

        # 4. 提交状态
        if recompute:
            if m < k + 1:  # 有被丢弃的 token：恢复快照，再把保留的重新喂一遍
                rollback(state, snap)
                _, hidden = forward_hidden(model, feed[:, :m], state, last=True)
                r.forwards += 1
        elif k > 0:
            commit(state, start, m)
        keep_history(state, False)

        for i in range(k):
            r.tried_at[i] += i <= n  # 第 i+1 个草稿真的被检验过：它前面的都被接受了
            r.accepted_at[i] += i < n
        r.hits += min(n, m)
        r.drafted += k
        r.trace.append((k, min(n, m), emitted))
        r.tokens += emitted
        last = emitted[-1]
        new_tokens = torch.tensor([emitted], device=ids.device)
        if k > 0:  # 草稿头刚吃掉了之前待送的对，从这一轮的开始重新攒
            pend_hidden, pend_tokens, pend_start = hidden[:, :m], new_tokens, start
        else:  # 这一轮草稿头没有运行：新的一对接在待送的后面，下次起草时一并送进去
            pend_hidden = torch.cat([pend_hidden, hidden[:, :m]], 1)
            pend_tokens = torch.cat([pend_tokens, new_tokens], 1)
    return r


def generate_mtp(model, mtp, ids, max_new_tokens=100, stop=(), draft_tokens=None, temperature=0.0, top_k=None,
                 top_p=None, seed=None):
    """投机解码，返回 (tokens, rounds, hits)。贪心时 tokens 与 generate(model, ids, …) 逐个相同。

    要每个草稿位置的接受次数、逐轮轨迹或结束时的状态，请用 speculate()。
    """
    r = speculate(model, mtp, ids, max_new_tokens, stop, draft_tokens, temperature, top_k, top_p, seed)
    return r.tokens, r.rounds, r.hits
