"""附录 qwen/sampling/grammar.py：按 JSON Schema 只许合乎它的 token。写出的一定解析得了、合乎 schema；投机解码在文法下与普通贪心
逐个相同（bfloat16、int8、int4 的快路径）；坏的 schema 是一行清楚的错误。"""

import json

import pytest
import torch

from qwen import Chat, generate
from qwen.fast import load
from qwen.mtp import speculate

from checkpoints import prompt

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from qwen.sampling.grammar import Grammars  # noqa: E402

SCHEMAS = {  # 三种形状：嵌套的对象、枚举、有界的数组
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["name", "id"], "properties": {
            "name": {"type": "string", "maxLength": 6}, "id": {"type": "integer", "minimum": 0, "maximum": 999}}}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["color", "ok"], "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["xs"], "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4}}},
}
PATHS = {"bfloat16": {}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"}}
LOADED = {}


def loaded(lively, name):
    if name not in LOADED:
        model, mtp = load(lively[0], dtype=torch.bfloat16, **PATHS[name])
        chat = Chat(model, lively[0])
        LOADED[name] = model, mtp, chat, Grammars(chat, model.cfg.vocab_size)
    return LOADED[name]


def text_of(chat, tokens) -> str:
    return chat.decode([t for t in tokens if t not in chat.stop])


@pytest.mark.parametrize("shape", SCHEMAS)
@pytest.mark.parametrize("path", PATHS)
def test_output_follows_the_schema_and_speculation_is_exact(lively, path, shape):
    """贪心与抽样（两个种子）写出的都解析得了、合乎 schema，以停止符结束；文法下投机解码与普通贪心逐个相同，草稿也被
    接受过（不是每个草稿都被拒）。"""
    model, mtp, chat, grammars = loaded(lively, path)
    grammar, schema = grammars.json_schema(SCHEMAS[shape]), SCHEMAS[shape]
    ids = chat.encode(chat.prompt([{"role": "user", "content": "写一个 JSON"}]))
    greedy = generate(model, ids, 160, stop=chat.stop, grammar=grammar)
    runs = [greedy] + [generate(model, ids, 160, stop=chat.stop, grammar=grammar, temperature=1.0, seed=s) for s in (1, 2)]
    for tokens in runs:
        assert tokens[-1] in chat.stop, text_of(chat, tokens)
        jsonschema.validate(json.loads(text_of(chat, tokens)), schema)
    spec = speculate(model, mtp, ids, 160, stop=chat.stop, grammar=grammar, draft_tokens=2)
    assert spec.tokens == greedy
    assert sum(spec.accepted_at) > 0


@pytest.mark.parametrize("schema,words", [
    ({"type": "object", "properties": {"a": {"type": "nonsense"}}}, "schema 编译不了"),
    ([1, 2], "schema 应为 JSON Schema"),
])
def test_bad_schemas_are_clear_errors(lively, schema, words):
    _, _, _, grammars = loaded(lively, "bfloat16")
    with pytest.raises(ValueError, match=words):
        grammars.json_schema(schema)


def test_the_sampling_value_carries_the_grammar_to_a_batch(lively):
    """文法是 Sampling 的一项：一次生成取一份自己的状态，同一个 Grammar 给批里的两行：每行合乎 schema，且与它单独生成的
    逐个相同（批的一行就是它自己的运行，文法下也是）。"""
    from qwen.batch import generate_batch

    model, _, chat, grammars = loaded(lively, "bfloat16")
    grammar = grammars.json_schema(SCHEMAS["enum"])
    ids = [prompt(model.cfg.vocab_size, n, seed=n)[0].tolist() for n in (5, 9)]
    rows = generate_batch(model, ids, 40, stop=chat.stop, grammar=grammar)
    for p, row in zip(ids, rows):
        jsonschema.validate(json.loads(text_of(chat, row)), SCHEMAS["enum"])
        assert row == generate(model, torch.tensor([p]), 40, stop=chat.stop, grammar=grammar)


def test_without_llguidance_the_error_names_the_extra(lively, monkeypatch):
    """没装 llguidance：一行说出要装的 extra（pip install "qwen[grammar]"），不是 ModuleNotFoundError 的 traceback。"""
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__",
                        lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name)) if name == "llguidance" else real(name, *a, **k))
    _, _, chat, _ = loaded(lively, "bfloat16")
    with pytest.raises(ImportError, match=r'pip install "qwen\[grammar\]"'):
        Grammars(chat, 1000)


def no_digit_drafts(lively, name):
    """同一个快模型，草稿头的起草词表却没有一个数字 token：文法此刻只许数字时，草稿头打分的 token 一个也不许。"""
    from qwen.fast import load_draft

    model, _, chat, grammars = loaded(lively, name)
    digits = {i for i in range(model.cfg.vocab_size) if (chat.tk.id_to_token(i) or " ")[0].isdigit()}
    assert len(digits) >= 10
    return model, load_draft(model, draft_vocab=[i for i in range(model.cfg.vocab_size) if i not in digits]), chat, grammars


@pytest.mark.parametrize("path", ["bfloat16", "int4"])
def test_sampled_drafts_under_a_schema_the_draft_vocabulary_cannot_write(lively, path):
    """起草词表里没有文法此刻许的 token 时（整数要数字，草稿头不给数字打分）草稿头少起草几个，而不是从全是 −∞ 的一行里
    抽样（那会是 NaN、一个 500）：3 个 schema × 16 个种子 × 起草 1、2、3 个，抽样都不出错，写完的都合乎 schema；贪心仍与
    不起草的逐个相同。"""
    model, mtp, chat, grammars = no_digit_drafts(lively, path)
    ids = chat.encode(chat.prompt([{"role": "user", "content": "写一个 JSON"}]))
    for shape in SCHEMAS:
        grammar, finished = grammars.json_schema(SCHEMAS[shape]), 0
        for seed in range(16):
            for k in (1, 2, 3):
                tokens = speculate(model, mtp, ids, 40, chat.stop, grammar=grammar, temperature=1.0, seed=seed, draft_tokens=k).tokens
                if tokens[-1] in chat.stop:
                    jsonschema.validate(json.loads(text_of(chat, tokens)), SCHEMAS[shape])
                    finished += 1
        assert finished >= 24, shape
        greedy = generate(model, ids, 60, stop=chat.stop, grammar=grammar)
        assert speculate(model, mtp, ids, 60, chat.stop, grammar=grammar, draft_tokens=2).tokens == greedy
