"""第 14 章 mtp.py：MTP 草稿头与投机解码。"""

import time

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from checkpoints import make_checkpoint
from qwen import Model, State
from qwen.fast import load_draft, load_model
from qwen.bench import OracleDrafter
from qwen.mtp import MTP, generate_mtp, speculate
from qwen.sample import generate, probabilities


@pytest.fixture(scope="module")
def mtp(lively, model):
    return load_draft(model)


def ids_of(T, seed=0, vocab=512):
    return torch.randint(3, vocab, (1, T), generator=torch.Generator().manual_seed(seed))


def test_mtp_matches_independent_formula(lively, model, mtp):
    """用检查点张量与 transformers 的构件独立计算 MTP 公式，整段提示词逐位置比较。"""
    from safetensors import safe_open
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5DecoderLayer, Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding,
    )

    path, hf = lively
    raw = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as g:
            raw.update({k[4:]: g.get_tensor(k).float() for k in g.keys() if k.startswith("mtp.")})
    c = hf.config.__class__(**{**hf.config.to_dict(), "layer_types": ["full_attention"], "num_hidden_layers": 1})
    layer = Qwen3_5DecoderLayer(c, 0).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in raw.items() if k.startswith("layers.0.")})
    norms = {}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[n] = Qwen3_5RMSNorm(c.hidden_size, c.rms_norm_eps)
        norms[n].weight.data = raw[f"{n}.weight"]
    rot = Qwen3_5TextRotaryEmbedding(c)

    ids = ids_of(70, seed=4)
    T = ids.shape[1] - 1
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state[:, :T]  # 最后一次 norm 之后的隐藏状态 h_t
        e = hf.model.embed_tokens(ids[:, 1:])  # e_{t+1}
        x = torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h)], -1) @ raw["fc.weight"].T
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        pos = rot(x, torch.arange(T)[None])
        ref = norms["norm"](layer(x, position_embeddings=pos, attention_mask=mask))
        ours = mtp(model.embed_tokens(ids[:, 1:]), model.hidden(ids)[:, :T], 0, None)
    assert ref.abs().max() > 0.5
    assert (ours - ref).abs().max().item() <= 1e-4


def test_mtp_incremental_cache_matches_one_shot(model, mtp):
    from qwen.attention import AttentionState

    ids = ids_of(30, seed=5)
    with torch.no_grad():
        h = model.hidden(ids)[:, :-1]
        e = model.embed_tokens(ids[:, 1:])
        full = mtp(e, h, 0, None)
        s = AttentionState()
        parts = [mtp(e[:, :10], h[:, :10], 0, s)] + [mtp(e[:, i : i + 3], h[:, i : i + 3], i, s) for i in range(10, 29, 3)]
    assert (torch.cat(parts, 1) - full).abs().max().item() <= 1e-4


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 100), k=st.integers(1, 4), n=st.integers(1, 24), seed=st.integers(0, 10_000))
@example(T=63, k=3, n=24, seed=1).via("提示词跨过 64 个 token 一块的边界")
@example(T=65, k=1, n=24, seed=2).via("提示词跨过 64 个 token 一块的边界")
@example(T=1, k=2, n=24, seed=3).via("只有一个 token 的提示词")
def test_greedy_speculative_equals_plain(model, mtp, T, k, n, seed):
    ids = ids_of(T, seed=seed)
    tokens, rounds, hits = generate_mtp(model, mtp, ids, n, draft_tokens=k)
    assert tokens == generate(model, ids, n) and rounds <= n - 1 and hits <= n - 1


@pytest.mark.parametrize("k", [1, 3, None])
def test_greedy_speculative_with_penalties_equals_plain(model, mtp, k):
    """罚重复时贪心的投机解码仍与普通贪心逐 token 相同（验证第 i 个位置时它前面的草稿也算出现过）。"""
    for T in (6, 40):
        ids = ids_of(T, seed=300 + T)
        more = dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.3)
        plain = generate(model, ids, 30, **more)
        assert plain != generate(model, ids, 30)  # 罚重复真的改变了输出
        seq = ids[0].tolist() + plain
        assert speculate(model, OracleDrafter(mtp, seq, 0.7, seed=T), ids, 30, draft_tokens=k, **more).tokens == plain


def test_plain_path_speculates_like_greedy(lively):
    """各章的普通模型与草稿头（pack=False，不变换）：投机解码与普通贪心逐 token 相同，与快路径的结果也相同。"""
    plain = Model.from_pretrained(lively[0], dtype=torch.float32)
    head = MTP.from_pretrained(plain.cfg, lively[0], dtype=torch.float32)
    fast = load_model(lively[0], layout="packed", dtype=torch.float32)
    for T, k in ((9, 1), (40, 3), (70, None)):
        ids = ids_of(T, seed=900 + T)
        plain_tokens = generate(plain, ids, 24)
        assert plain_tokens == generate(fast, ids, 24)
        assert speculate(plain, head, ids, 24, draft_tokens=k).tokens == plain_tokens
        r = speculate(plain, OracleDrafter(head, ids[0].tolist() + plain_tokens, 0.6, seed=T), ids, 24, draft_tokens=k)
        assert r.tokens == plain_tokens and r.drafted > 0
        assert r.drafted > r.hits > 0 or k is None  # 有接受也有拒绝：两种提交都走到了（自动挑 k 时这里起草得少）


@pytest.fixture(scope="module")
def smooth(tmp_path_factory):
    """较平稳的小模型（写回残差流的投影尺度 0.2）：一层的草稿头学得会它，而它的贪心续写仍然多样（尺度 0.1 的 tiny
    续写只重复一个 token，那样的“接受率”谁都猜得中）。"""
    path = make_checkpoint(tmp_path_factory.mktemp("smooth"), seed=1, out_scale=0.2)[0]
    model = Model.from_pretrained(path, dtype=torch.float32)  # 要对它求导来拟合草稿头
    return model, load_draft(load_model(path, layout="packed", dtype=torch.float32)), fit_mtp(model)


def fit_mtp(model, steps=300, seed=0):
    """训练目标正是投机解码要的：给定 (h_t, e_{t+1})，猜主模型在位置 t+1 的贪心输出。
    输入是随机 token 序列（多样，不会塌缩成重复），标签由主模型自己给出。"""
    torch.manual_seed(seed)
    head = MTP(model.cfg)
    with torch.no_grad():
        for n, p in head.named_parameters():
            if "norm" in n:
                p.zero_()
    data = torch.randint(3, model.cfg.vocab_size, (32, 64), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hidden = model.hidden(data)  # [32, 64, h]
        emb = model.embed_tokens(data)
        target = model.lm_head(hidden).argmax(-1)  # 主模型在每个位置的贪心输出
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        x = head(emb[:, 1:], hidden[:, :-1], 0, None)  # 第 t 行：(h_t, e_{t+1})
        loss = torch.nn.functional.cross_entropy(model.lm_head(x).flatten(0, 1), target[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


def test_acceptance_is_real_with_a_good_head(smooth):
    """拟合过的草稿头在没见过的提示词上猜中一半以上，随机的几乎猜不中；续写是多样的（多数提示词 10 种以上的 token），
    所以猜中的不是“重复上一个”。输出与贪心相同由 test_greedy_speculative_equals_plain 测。"""
    model, mtp, good_mtp = smooth
    good, bad, varied = [], [], 0
    for s in range(6):
        ids = ids_of(8, seed=5000 + s)  # 没拟合过的提示词
        r = speculate(model, good_mtp, ids, 40)
        varied += len(set(r.tokens)) >= 10
        good.append(r.acceptance)
        bad.append(speculate(model, mtp, ids, 40).acceptance)
    assert varied >= 4, varied
    assert sum(good) / 6 >= 0.45 and sum(bad) / 6 <= 0.1, (good, bad)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_stops_and_budget(model, mtp, k):
    """停止符落在被接受的草稿上、落在主模型补的那个 token 上、或者就是第一个 token。"""
    ids = ids_of(8, seed=5100 + k)
    plain = generate(model, ids, 40)
    seq = ids[0].tolist() + plain
    r = speculate(model, OracleDrafter(mtp, seq, 0.7, seed=k), ids, 40, draft_tokens=k)
    assert r.tokens == plain and 0 < r.hits < r.drafted
    # 每轮输出的 token 里，哪些是被接受的草稿、哪个是主模型补的
    pos, draft_positions, bonus_positions = 0, [], []
    for drafted, accepted, emitted in r.trace:
        draft_positions += [pos + 1 + j for j in range(accepted)]
        bonus_positions += [pos + 1 + accepted] if len(emitted) > accepted else []
        pos += len(emitted)
    cases = {"first": 0}
    for name, where in (("draft", draft_positions), ("bonus", bonus_positions)):
        for p in where:
            if plain.index(plain[p]) == p:  # 这个 token 第一次出现在这里
                cases[name] = p
                break
    assert "draft" in cases and "bonus" in cases
    for name, p in cases.items():
        oracle = OracleDrafter(mtp, seq, 0.7, seed=k)  # 同样的猜测序列：停止符落在同样的位置上
        out = generate_mtp(model, oracle, ids, 40, stop=[plain[p]], draft_tokens=k)[0]
        assert out == plain[: p + 1] == generate(model, ids, 40, stop=[plain[p]]), name
    for n in range(1, 9):
        assert generate_mtp(model, OracleDrafter(mtp, seq, 0.7), ids, n, draft_tokens=k)[0] == plain[:n]


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("n", [5, 17, 30])
def test_rollback_is_exact(model, mtp, n, recompute):
    """结束时的状态与普通解码喂完同样 token 后的状态一样：下一个 token 的 logits 相同。"""
    ids = ids_of(20, seed=n)
    plain_tokens = generate(model, ids, n)
    oracle = OracleDrafter(mtp, ids[0].tolist() + plain_tokens, 0.6, seed=n)
    r = speculate(model, oracle, ids, n, draft_tokens=3, recompute=recompute)
    assert r.tokens == plain_tokens and (n < 10 or 0 < r.hits < r.drafted)
    plain = State(model)
    with torch.inference_mode():  # r.state 是在 inference_mode 里建的
        model(torch.cat([ids, torch.tensor([r.tokens[:-1]], dtype=torch.long)], 1) if n > 1 else ids, plain)
        a = model(torch.tensor([[r.tokens[-1]]]), plain)
        b = model(torch.tensor([[r.tokens[-1]]]), r.state)
    assert r.state.pos == plain.pos
    assert (a - b).abs().max().item() <= 1e-4


def test_no_recomputation(model, mtp, monkeypatch):
    """有拒绝的一次运行里，主模型前向次数 = 验证轮数 + 1 次预填充。"""
    calls = []
    original = Model.hidden

    def counted(self, ids, state=None, *inputs):
        calls.append(ids.shape[-1])
        return original(self, ids, state, *inputs)

    monkeypatch.setattr(Model, "hidden", counted)
    ids = ids_of(10, seed=9)
    r = speculate(model, mtp, ids, 30, draft_tokens=2)
    assert r.drafted > r.hits  # 确实有被拒绝的草稿
    assert len(calls) == r.rounds + 1 == r.forwards
    calls.clear()
    r2 = speculate(model, mtp, ids, 30, draft_tokens=2, recompute=True)  # 课程里的做法：每次拒绝多一次前向
    assert r2.tokens == r.tokens
    assert len(calls) == r2.forwards > r2.rounds + 1


def test_prefill_seconds_counts_only_the_prefill(model, mtp, monkeypatch):
    """Run.prefill_seconds 只含预填充：预填充慢 0.3 秒、第一次验证慢 0.6 秒时，它只多出前一个。只有下界：机器忙时
    什么都可能慢，但 0.6 秒的那一次一定在 prefill_seconds 之外。"""
    original, slept = Model.hidden, []

    def slow(self, ids, state=None, *inputs):
        if ids.shape[-1] == 10 or (ids.shape[-1] == 3 and 3 not in slept):  # 预填充（10 个 token）与第一次验证（k = 2）
            slept.append(ids.shape[-1])
            time.sleep(0.3 if ids.shape[-1] == 10 else 0.6)
        return original(self, ids, state, *inputs)

    monkeypatch.setattr(Model, "hidden", slow)
    t0 = time.perf_counter()
    r = speculate(model, mtp, ids_of(10, seed=3), 8, draft_tokens=2)
    total = time.perf_counter() - t0
    assert slept == [10, 3]
    assert r.prefill_seconds >= 0.3 and total - r.prefill_seconds >= 0.6


def test_bad_arguments(model, mtp, tmp_path):
    ids = ids_of(4)
    with pytest.raises(ValueError, match="draft_tokens"):
        generate_mtp(model, mtp, ids, 5, draft_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        generate_mtp(model, mtp, ids, 5, temperature=-1)
    from checkpoints import make_checkpoint

    path, _ = make_checkpoint(tmp_path / "nomtp", seed=3, mtp=False, tokenizer=False)
    with pytest.raises(ValueError, match="没有 MTP 草稿头"):
        MTP.from_pretrained(model.cfg, path)
    assert load_draft(model, path) is None  # 快路径的加载：没有草稿头是一个值，不是报错


# ---------- 采样：输出分布与普通采样相同 ----------


def small_model_and_heads():
    from checkpoints import small_model

    m = small_model(16, embed_std=0.1)  # 分布足够分散：前两个 token 都有十来个候选
    cfg = m.cfg
    torch.manual_seed(1)
    head = MTP(cfg).eval()
    bad = MTP(cfg).eval()
    with torch.no_grad():
        for p in bad.parameters():
            p.normal_(0, 2.0)  # 故意很差、很自信的草稿头
    return m, head, bad


def exact_two_token_distribution(m, ids, temperature, top_k, top_p, repetition=1.0, presence=0.0):
    """普通采样下前两个 token 的精确联合分布 P(x1, x2)。罚重复按定义直接写（不用 Penalty）：出现过的 token
    （提示词与 x1）logit 为正时除以 repetition、为负时乘以它；生成过的（x1）再减 presence。"""
    V = m.cfg.vocab_size

    def penalize(logits, seen, made):
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
        return logits - presence * made.float()

    prompt = torch.zeros(V, dtype=torch.bool)
    prompt[ids[0]] = True
    with torch.no_grad():
        p1 = probabilities(penalize(m(ids)[0, -1], prompt, torch.zeros(V, dtype=torch.bool)), temperature, top_k, top_p)
        ext = torch.cat([ids.expand(V, -1), torch.arange(V)[:, None]], 1)
        x1 = torch.eye(V, dtype=torch.bool)  # 第 x1 行：x1 生成过
        p2 = probabilities(penalize(m(ext)[:, -1], prompt | x1, x1), temperature, top_k, top_p)  # [V, V]：给定 x1
    return p1[:, None] * p2


@pytest.mark.parametrize("which,k,penalties", [("head", 1, (1.0, 0.0)), ("bad", 1, (1.0, 0.0)), ("bad", 2, (1.6, 0.7))])
def test_speculative_sampling_distribution(which, k, penalties):
    """N = 3000 次带种子的投机采样，前两个 token 的边缘分布与普通采样的精确分布一致：
    每个词的频率偏差不超过 5 个标准差加 0.003，总变差距离 < 0.05。罚重复时，验证第 i 个位置的惩罚算上它前面的草稿，
    分布照样相同。"""
    m, head, bad = small_model_and_heads()
    drafter = head if which == "head" else bad
    ids = torch.tensor([[1, 2, 3]])
    temperature, top_k, top_p = 1.0, 12, 0.95
    joint = exact_two_token_distribution(m, ids, temperature, top_k, top_p, *penalties)
    more = dict(repetition_penalty=penalties[0], presence_penalty=penalties[1])
    N, V = 3000, m.cfg.vocab_size
    counts = torch.zeros(V, V)
    drafted = hits = 0
    for s in range(N):
        # 预算 k+2：第二个 token 来自一次带 k 个草稿的验证
        r = speculate(m, drafter, ids, k + 2, draft_tokens=k, temperature=temperature, top_k=top_k, top_p=top_p, seed=s,
                      **more)
        counts[r.tokens[0], r.tokens[1]] += 1
        drafted, hits = drafted + r.drafted, hits + r.hits
    assert drafted > 0 and (0 < hits < drafted)  # 有接受也有拒绝
    for marginal, expected in ((counts.sum(1) / N, joint.sum(1)), (counts.sum(0) / N, joint.sum(0))):
        sd = (expected * (1 - expected) / N).sqrt()
        assert ((marginal - expected).abs() <= 5 * sd + 0.003).all()
        assert 0.5 * (marginal - expected).abs().sum() < 0.05
    assert 0.5 * (counts / N - joint).abs().sum() < 0.1  # 联合分布也接近


# ---------- 更快的起草：子词表与自动挑选草稿数 ----------


@pytest.mark.parametrize("vocab", [100, list(range(3, 512, 3))], ids=["first-100", "every-third"])
def test_draft_vocab_subset(lively, model, vocab):
    """起草只给起草词表（前 100 个 id，或每隔两个取一个）打分：草稿都落在里面，输出仍与贪心逐 token 相同；
    词表外的 logits 是 −∞，词表里的与全词表的输出头相同。"""
    head = load_draft(model, lively[0], draft_vocab=vocab)
    keep = torch.arange(100) if vocab == 100 else torch.tensor(vocab)
    assert torch.equal(head.draft_ids, keep)
    seen = []
    original = head.draft

    def spy(*args):
        drafts, qs = original(*args)
        seen.extend(drafts)
        return drafts, qs

    head.draft = spy
    for s in range(3):
        ids = ids_of(12, seed=700 + s)
        r = speculate(model, head, ids, 20, draft_tokens=2)
        assert r.tokens == generate(model, ids, 20)
    assert len(seen) > 20 and set(seen) <= set(keep.tolist())
    assert head.draft_head.shape == (len(keep), model.cfg.hidden_size)  # 只读出输出头的这几行
    with torch.inference_mode():
        x = torch.randn(1, 1, model.cfg.hidden_size)
        plain = Model.from_pretrained(lively[0], dtype=torch.float32)
        got, want = head.draft_logits(model, x), plain.lm_head(x)
        assert torch.allclose(got[..., keep], want[..., keep], atol=1e-5)
        assert torch.isneginf(got).sum() == model.cfg.vocab_size - len(keep)
        head.draft_ids = torch.arange(200)
        with pytest.raises(ValueError, match="重新加载"):
            head.draft_logits(model, x)
    assert load_draft(model, lively[0], draft_vocab=None).draft_ids is None
    assert load_draft(model, lively[0], draft_vocab=10_000).draft_ids is None  # 比词表还大：全词表


def test_best_draft_count():
    from qwen.mtp import MAX_DRAFTS, best_draft_count

    def linear(each, fixed=0.0):  # 一轮的代价：每轮的固定开销 + 每个草稿的
        return [1.0] + [1 + fixed + each * k for k in range(1, MAX_DRAFTS + 1)]

    assert best_draft_count(0.02, linear(0.08)) == 0  # 几乎从不接受：不起草，就是普通的一步
    assert best_draft_count(0.31, linear(0.08)) == 1  # 起草一个还划算
    assert best_draft_count(0.31, linear(0.35)) == 0  # 同样的接受率，起草贵：不起草
    assert best_draft_count(0.95, linear(0.08)) == MAX_DRAFTS  # 几乎总接受、起草便宜：起草最多
    assert best_draft_count(0.95, linear(0.9)) == 1  # 每多起草一个就多花近一步：不值得多起草
    ks = [best_draft_count(a / 100, linear(0.1)) for a in range(0, 101, 10)]
    assert ks == sorted(ks)  # 接受率越高，起草越多
    # 每轮的固定开销：同样的每个草稿的代价，起草就要先付一笔，接受率要更高才划算，一旦划算就多起草几个摊开它
    assert best_draft_count(0.5, linear(0.1)) == 2 and best_draft_count(0.5, linear(0.1, fixed=0.8)) == 0
    assert best_draft_count(0.9, linear(0.1, fixed=0.8)) == MAX_DRAFTS
    # 量出的代价不是直线：验证 5 行时一下子贵起来，k = 4 就不选（直线会把这一跳摊给每个 k）
    assert best_draft_count(0.9, [1.0, 1.1, 1.2, 1.3, 2.0]) == 3
    # 草稿全对（a 封顶 0.99）也不划算：一个也不起草
    assert best_draft_count(1.0, [1.0, 2.6, 3.5, 4.2, 5.1]) == 0 and best_draft_count(1.0, linear(0.9)) > 0


@pytest.mark.parametrize("seed", range(4))
def test_auto_draft_count_is_exact(model, mtp, seed):
    """默认（自动挑草稿数）的投机解码与普通贪心逐 token 相同，且真的用过不止一种草稿数。"""
    ids = ids_of(10, seed=800 + seed)
    seq = ids[0].tolist() + generate(model, ids, 40)
    r = speculate(model, OracleDrafter(mtp, seq, 0.9, seed=seed), ids, 40)
    assert r.tokens == seq[10:]
    assert len({k for k, _, _ in r.trace if k}) >= 2


def test_compiled_speculative_equals_plain(lively):
    """layout="graphs"（分块布局、解码一步编译成图）时，投机解码与普通贪心仍逐 token 相同。"""
    from qwen.fast.linear import BlockedLinear

    model = load_model(lively[0], layout="graphs", dtype=torch.float32)
    mtp = load_draft(model)
    plain = Model.from_pretrained(lively[0], dtype=torch.float32)
    assert isinstance(model.lm_head, BlockedLinear) and isinstance(mtp.fc, BlockedLinear)
    for T, k in ((5, 1), (63, 3), (70, None)):
        ids = ids_of(T, seed=T)
        assert generate_mtp(model, mtp, ids, 20, draft_tokens=k)[0] == generate(plain, ids, 20)
    # 起草词表不是 32 的整块数、也不是前几个 id：那几行读出来换成自己的分块布局，存成 int8（草稿只是猜测）
    vocab = list(range(5, 512, 5))
    mtp = load_draft(model, lively[0], draft_vocab=vocab)
    assert isinstance(mtp.draft_head, BlockedLinear) and mtp.draft_head.out_features == len(vocab)
    assert mtp.draft_head.blocks.dtype == torch.int8
    with torch.inference_mode():
        x = torch.randn(1, 1, model.cfg.hidden_size)
        got, want = mtp.draft_logits(model, x)[..., vocab], plain.lm_head(x)[..., vocab]
        assert (got - want).norm() / want.norm() <= 0.02
    ids = ids_of(12, seed=3)
    assert generate_mtp(model, mtp, ids, 20, draft_tokens=2)[0] == generate(plain, ids, 20)


def test_round_cost_is_asked_every_round(model, mtp):
    """cost_now 是每轮问一次的函数（服务时随同时生成的请求数变）：便宜的几轮起草，变贵之后不起草（每 PROBE_EVERY
    轮试一个）；草稿全对也不划算时一个也不起草、也不试；输出始终与普通贪心相同。"""
    from qwen.mtp import PROBE_EVERY

    ids = ids_of(10, seed=801)
    seq = ids[0].tolist() + generate(model, ids, 80)
    cheap, dear = [1 + 0.05 * k for k in range(5)], [1.0, 1.97, 2.9, 3.9, 4.9]  # dear：接受率 0.99 时才划算
    costs = iter([cheap] * 5 + [dear] * 200)
    r = speculate(model, OracleDrafter(mtp, seq, 0.9, seed=1), ids, 80, cost_now=lambda: next(costs))
    assert r.tokens == seq[10:]
    ks = [k for k, _, _ in r.trace]
    assert all(k >= 1 for k in ks[:5]) and ks[5 : 5 + PROBE_EVERY] == [0] * PROBE_EVERY and max(ks[5 + PROBE_EVERY :]) == 1
    never = [1.0, 2.6, 3.5, 4.2, 5.1]  # demo 那样：一轮的固定开销比一步还大
    r = speculate(model, OracleDrafter(mtp, seq, 1.0, seed=1), ids, 80, cost_now=lambda: never)
    assert r.tokens == seq[10:] and r.drafted == 0 and r.rounds == 79
    assert r.drafter.tokens.shape[1] <= PROBE_EVERY + 1  # 草稿头照样每隔几轮读掉攒下的 (h, e) 对：不越攒越多


def test_auto_stops_drafting_when_drafts_are_wrong(model, mtp):
    """草稿总是错的：自动挑选很快改成不起草，每隔 PROBE_EVERY 轮试一个；输出仍与普通贪心相同。
    不起草的几轮里草稿头没有运行，它的 (h_t, e_{t+1}) 对攒着，下次起草时一并送进去：一对也不能漏。"""
    from qwen.mtp import PROBE_EVERY

    calls = []

    class Recording(OracleDrafter):
        def draft(self, model, run, k):
            pending = run.drafter
            assert pending.tokens.shape[1] == pending.hidden.shape[1]
            calls.append((pending.start, pending.tokens.shape[1]))
            return super().draft(model, run, k)

    ids = ids_of(12, seed=5)
    n = 60
    seq = ids[0].tolist() + generate(model, ids, n)
    r = speculate(model, Recording(mtp, seq, 0.0), ids, n)
    assert r.tokens == seq[12:]
    ks = [k for k, _, _ in r.trace]
    assert set(ks) == {0, 1} and r.hits == 0  # 接受率的估计低于 cost：多数轮不起草
    assert r.drafted <= 3 + len(ks) // (PROBE_EVERY + 1)  # 只是偶尔试一个
    assert 1 in ks[PROBE_EVERY + 1:]  # 但不会永远不起草
    assert len(calls) >= 4 and calls[0][0] == 0
    for (s0, n0), (s1, _) in zip(calls, calls[1:]):
        assert s1 == s0 + n0  # 每个位置的对恰好送进草稿头一次


def test_course_names_import(model, mtp):
    """课程正文里的写法：from qwen.mtp import Run, prefill, snapshot, rollback, MTP, generate_mtp。Run.start 预填充、选出第一个
    token、让草稿头这一边记下提示词（每个 h 配上下一个 token）；run.stream 逐轮产出，统计就在 run 上。"""
    from qwen.mtp import MTP, Run, generate_mtp, prefill, rollback, snapshot  # noqa: F401（MTP、generate_mtp：课程里写的名字）

    ids = ids_of(12, seed=8)
    run = Run.start(model, ids)
    assert run.state.pos == 12 and run.drafter.tokens.shape[1] == run.drafter.hidden.shape[1] == 12
    assert run.tokens == generate(model, ids, 1) and run.drafter.tokens[0, -1] == run.tokens[0]
    rounds = list(run.stream(model, mtp, 20, draft_tokens=2))
    assert [t for emitted in rounds for t in emitted] == run.tokens == generate(model, ids, 20) and run.rounds == len(rounds) - 1
    state = State(model)
    with torch.inference_mode():
        h, drafter = prefill(model, ids, state)
        assert torch.equal(h, model.hidden(ids)) and drafter.tokens.shape[1] == 11  # 最后一个 h 等下一个 token
        snap = snapshot(state)
        more = model(ids[:, :3], state)
        rollback(state, snap)
        assert state.pos == 12 and torch.equal(model(ids[:, :3], state), more)
