"""第 12 章 sample.py：贪心与 transformers 的 generate 逐 token 相同，罚重复、温度、top-k / top-p 的分布，种子可复现，坏的设置
一行清楚的错误。"""

import pytest
import torch

from qwen import State
from qwen.batch import generate_batch
from qwen.sample import choose, generate, probabilities


def ids_of(T, seed=0, vocab=512):
    return torch.randint(3, vocab, (1, T), generator=torch.Generator().manual_seed(seed))


def greedy_by_hand(model, ids, n):
    state = State(model)
    out = []
    with torch.no_grad():
        logits = model(ids, state)[:, -1]
        for _ in range(n):
            t = int(logits.argmax(-1))
            out.append(t)
            logits = model(torch.tensor([[t]]), state)[:, -1]
    return out


def test_plain_greedy_equals_transformers(lively, lively_model, model):
    """普通模型的贪心生成与 transformers 的 generate 逐 token 相同（跨过 64 个 token 一块的边界）；快路径也与它相同。"""
    hf = lively[1]
    for T in (5, 70):
        ids = ids_of(T, seed=40 + T)
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[0, T:].tolist()
        assert len(ref) == 16 and len(set(ref)) > 4  # 续写多样，不是一直重复
        assert generate(lively_model, ids, 16) == ref == generate(model, ids, 16)


def test_repetition_penalty_equals_transformers(lively, lively_model, model):
    """repetition_penalty 与 transformers 的 generate 相同（提示词与已生成的 token 都算）；快路径与批处理也一样。"""
    hf = lively[1]
    prompts, changed = [ids_of(T, seed=60 + T) for T in (9, 30)], 0
    for ids in prompts:
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=20, do_sample=False, repetition_penalty=1.5, eos_token_id=None,
                              pad_token_id=0)[0, ids.shape[1]:].tolist()
        changed += ref != generate(lively_model, ids, 20)
        assert generate(lively_model, ids, 20, repetition_penalty=1.5) == ref == generate(model, ids, 20, repetition_penalty=1.5)
    assert changed  # 至少一个提示词上真的罚到了（第二个：不罚时会重复前面出现过的 token）
    assert generate_batch(model, [p[0] for p in prompts], 20, repetition_penalty=1.5) == [
        generate(model, p, 20, repetition_penalty=1.5) for p in prompts]


@pytest.mark.parametrize("presence,frequency", [(2.0, 0.0), (0.0, 0.7), (0.5, 0.4)])
def test_presence_and_frequency_penalties_by_hand(tiny_model, presence, frequency):
    """OpenAI 的两项：生成过 n 次的 token 减去 presence·[n > 0] + frequency·n（不罚提示词里的）。平稳的小模型不罚时总在重复。"""
    model = tiny_model
    ids = ids_of(12, seed=5)
    state, out, made = State(model), [], torch.zeros(model.cfg.vocab_size)
    with torch.no_grad():
        logits = model(ids, state)[0, -1]
        for _ in range(16):
            out.append(int((logits - presence * (made > 0).float() - frequency * made).argmax()))
            made[out[-1]] += 1
            logits = model(torch.tensor([[out[-1]]]), state)[0, -1]
    got = generate(model, ids, 16, presence_penalty=presence, frequency_penalty=frequency)
    assert got == out != generate(model, ids, 16)


@pytest.mark.parametrize("T", [1, 7, 64, 65])
def test_greedy_equals_argmax_by_hand(model, T):
    ids = ids_of(T, seed=T)
    assert generate(model, ids, max_new_tokens=12) == greedy_by_hand(model, ids, 12)


def test_max_new_tokens_exact_and_stop_included(model):
    ids = ids_of(10, seed=1)
    full = generate(model, ids, max_new_tokens=20)
    assert len(full) == 20
    assert generate(model, ids, max_new_tokens=0) == []
    stop_at = 6
    t = full[stop_at]
    first = full.index(t)  # 停止符第一次出现的位置
    out = generate(model, ids, max_new_tokens=20, stop=[t])
    assert out == full[: first + 1] and out[-1] == t


def test_seed_reproducible(model):
    ids = ids_of(10, seed=2)
    a = generate(model, ids, 15, temperature=1.0, seed=123)
    b = generate(model, ids, 15, temperature=1.0, seed=123)
    c = generate(model, ids, 15, temperature=1.0, seed=124)
    assert a == b and a != c


def test_probabilities_truncation():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    p = probabilities(logits, 1.0, top_k=2)
    assert (p[0, 2:] == 0).all() and torch.allclose(p[0, :2], torch.softmax(logits[0, :2], -1))
    full = torch.softmax(logits[0], -1)  # ≈ [.64, .23, .09, .03, .01]
    p = probabilities(logits, 1.0, top_p=0.8)  # .64 < .8，加上第二个 .87 ≥ .8：保留两个
    assert (p[0, 2:] == 0).all() and torch.allclose(p[0, :2], full[:2] / full[:2].sum())
    p = probabilities(logits, 1.0, top_p=0.5)  # 第一个就够了
    assert p[0, 0] == 1.0


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.6), (1.0, 8, 0.9)])
def test_sampling_distribution_matches(temperature, top_k, top_p):
    """首个采样 token 的经验分布与截断、重新归一化的 softmax 一致。

    小词表模型，N = 4000 次抽样；每个词的频率与期望概率之差不超过 5 个标准差
    （sqrt(p(1-p)/N)）再加 0.002，且总变差距离 < 0.04。种子固定，不会偶然失败。
    """
    from checkpoints import small_model

    m = small_model(24, embed_std=0.5)
    cfg = m.cfg
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        logits = m(ids)[:, -1]  # [1, V]
    expected = probabilities(logits, temperature, top_k, top_p)[0]
    N = 4000
    # 同一个 logits 抽 N 次：正是 generate 每一步调用的 choose；再用 generate 本身核对前 50 次
    gen = torch.Generator().manual_seed(0)
    draws = torch.tensor([choose(logits[0], temperature, top_k, top_p, gen)[0] for _ in range(N)])
    counts = torch.bincount(draws, minlength=cfg.vocab_size).float()
    freq = counts / N
    for s in range(50):
        first = generate(m, ids, 1, temperature=temperature, top_k=top_k, top_p=top_p, seed=s)[0]
        assert first == choose(logits[0], temperature, top_k, top_p, torch.Generator().manual_seed(s))[0]
    sd = (expected * (1 - expected) / N).sqrt()
    assert ((freq - expected).abs() <= 5 * sd + 0.002).all()
    assert 0.5 * (freq - expected).abs().sum() < 0.04
    assert (counts[expected == 0] == 0).all()  # 截掉的词一次也没抽到
    if top_k:
        assert (expected > 0).sum() <= top_k


def test_bad_sampling_settings(model):
    ids = ids_of(3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, ids, -1)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, ids, 5, temperature=-0.1)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, ids, 5, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, ids, 5, temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, ids, 5, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match="空"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="repetition_penalty 应为正数"):
        generate(model, ids, 5, repetition_penalty=0)
    with pytest.raises(ValueError, match="presence_penalty"):
        generate(model, ids, 5, presence_penalty="1.5")
    with pytest.raises(ValueError, match="temperature"):
        generate(model, ids, 5, temperature="0.7")  # 不会替你把字符串转成数
