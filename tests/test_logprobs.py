"""对数概率：Sampling(logprobs=n) 时生成的每个 token 是第 12 章的 Token，带着它在选出它的那一行上的 log-softmax 与前 n 个。
与整段前向的那一行相同；投机解码（草稿被接受过）带回的与普通解码逐位相同，快路径的 bfloat16、int8、int4 都是；logit_bias
改变选哪个，不改变记下的分布。提示词各位置的（附录 qwen/sampling/logprobs.py 的 prompt_logprobs）与整段前向相同。"""

import pytest
import torch

from qwen.bench import OracleDrafter
from qwen.fast import load
from qwen.sampling.logprobs import prompt_logprobs, token_bytes
from qwen.mtp import speculate
from qwen.sample import generate

from checkpoints import prompt

PATHS = {"float32": {"dtype": torch.float32}, "bfloat16": {"dtype": torch.bfloat16},
         "int8": {"dtype": torch.bfloat16, "quantize": "int8"}, "int4": {"dtype": torch.bfloat16, "quantize": "int4"}}


@pytest.mark.parametrize("path", PATHS)
def test_speculative_logprobs_equal_plain_and_the_whole_forward(lively, path):
    model, mtp = load(lively[0], **PATHS[path])
    ids = prompt(model.cfg.vocab_size, 12, seed=4)
    scored = lambda tokens: [(int(t), t.logprob, t.top) for t in tokens]  # noqa: E731
    tokens = generate(model, ids, 24, logprobs=3)
    r = speculate(model, OracleDrafter(mtp, ids[0].tolist() + tokens, 0.7, seed=1), ids, 24, logprobs=3, draft_tokens=3)
    assert r.tokens == tokens and r.hits > 4  # 草稿被接受过：带回的有验证的那几行
    assert scored(r.tokens) == scored(tokens)  # 逐位相同（logprob 是 float）
    # 真的草稿头：起草时看的是草稿头的分数，输出的 token 都带着验证时主模型的那一行（偏置让草稿常被接受）
    want = generate(model, ids, 24, logprobs=3, logit_bias={5: 3.0})
    r = speculate(model, mtp, ids, 24, logprobs=3, draft_tokens=2, logit_bias={5: 3.0})
    assert r.tokens == want and r.hits > 0 and scored(r.tokens) == scored(want)
    if path != "float32":  # 量化与 bfloat16 的整段前向用的是别的内核（预填充），只差在舍入之内，不逐位比
        return
    # 整段一次前向：第 i 个生成的 token 在提示词之后第 i 行上。35 个 token 走预填充的内核（分块形式、注意力、激活），
    # 与逐个解码只差 float32 的舍入（这个模型上约 1e-5；逐个解码与 transformers 之差是 2.4e-5）
    with torch.inference_mode():
        rows = model(torch.cat([ids, torch.tensor([tokens[:-1]])], 1))[0, ids.shape[1] - 1 :].float().log_softmax(-1)
    for row, e in zip(rows, tokens):
        assert e.logprob == pytest.approx(float(row[e]), abs=2e-5)
        assert [t for t, _ in e.top] == row.topk(3).indices.tolist() and e.top[0][1] >= e.logprob


def test_logit_bias_changes_the_choice_not_the_recorded_distribution(lively):
    """logit_bias −100 给贪心的第一个 token：换成别的；+100 给一个 token：每一步都是它。记下的是原样的分布（vLLM 的
    raw_logprobs），与不偏置时同一行相同。投机解码在偏置下仍与普通解码相同。"""
    model, mtp = load(lively[0], dtype=torch.float32)
    ids = prompt(model.cfg.vocab_size, 10, seed=6)
    first = generate(model, ids, 1, logprobs=0)[0]
    other = generate(model, ids, 6, logprobs=0, logit_bias={first: -100})
    assert other[0] != first and other[0].logprob < first.logprob and first.top == []
    assert type(generate(model, ids, 1)[0]) is int  # 不要对数概率时就是 int
    assert generate(model, ids, 6, logit_bias={7: 100}) == [7] * 6
    assert speculate(model, mtp, ids, 12, logit_bias={first: -100, 9: 5.5}, draft_tokens=2).tokens == \
        generate(model, ids, 12, logit_bias={first: -100, 9: 5.5})


@pytest.mark.parametrize("bias,words", [({5: 101}, r"\[-100, 100\]"), ({-1: 1}, "token id"), ({10**9: 1}, "token id"),
                                         ([5], "logit_bias 应为"), ({5: True}, "logit_bias 应为")])
def test_bad_logit_bias_is_a_clear_error(tiny_model, bias, words):
    with pytest.raises(ValueError, match=words):
        generate(tiny_model, prompt(tiny_model.cfg.vocab_size, 4), 2, logit_bias=bias)


def test_prompt_logprobs_in_pieces_equal_one_forward(lively):
    """echo 的提示词对数概率：一段段读（piece 小于提示词）与一次整段前向的相同行；第 0 个没有前文。"""
    model, _ = load(lively[0], dtype=torch.float32)
    ids = prompt(model.cfg.vocab_size, 23, seed=2)[0].tolist()
    got = prompt_logprobs(model, ids, top=2, piece=8)
    with torch.inference_mode():
        rows = model(torch.tensor([ids]))[0].float().log_softmax(-1)
    assert got == ids and type(got[0]) is int  # 第 0 个没有前文：就是它的 id
    for i in range(1, len(ids)):
        assert got[i].logprob == pytest.approx(float(rows[i - 1, ids[i]]), abs=1e-5) and len(got[i].top) == 2


def test_token_bytes_join_to_the_text(lively):
    """每个 token 的字节接起来就是文字的 UTF-8（半个字符的 token 也对）；控制记号是它的文字。"""
    from qwen import Chat

    chat = Chat(load(lively[0], dtype=torch.float32)[0], lively[0])
    table = token_bytes(chat.tk, 600)
    text = "héllo 世界 🚀 <|im_end|>"
    ids = chat.encode(text)[0].tolist()
    assert b"".join(table[i] for i in ids) == text.encode()
