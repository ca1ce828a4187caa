"""附录 qwen/serve：OpenAI 请求里改变“怎么选 token”的字段——response_format（结构化输出）、n、logprobs / top_logprobs、
completions 的 logprobs 与 echo、logit_bias。服务给的与库里（generate 的 Token、Grammar）同样的提示词算出的相同。"""

import json

import pytest
import torch

from qwen import generate
from qwen.conversation import Prompt
from qwen.serve.reader import Reader

from serving import NAME, openai, post, served, sse  # noqa: F401


def test_structured_output_round_trip_with_the_openai_client(served):
    """openai 客户端自己的 parse(response_format=Pydantic 模型)：服务按它的 JSON Schema 只写合乎它的 token，客户端解析出
    对象；回答与库里用同一个文法贪心生成的逐字相同。json_object 写出一个 JSON 对象。"""
    pytest.importorskip("llguidance")
    from pydantic import BaseModel, Field

    from qwen.sampling.grammar import Grammars

    class City(BaseModel):
        name: str = Field(max_length=6)
        people: int = Field(ge=0, le=9999)

    client, engine, server, _ = served
    messages = [{"role": "user", "content": "给我一个城市"}]
    done = client.beta.chat.completions.parse(model=NAME, messages=messages, response_format=City, max_tokens=80, temperature=0)
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and done.choices[0].finish_reason == "stop"
    grammar = Grammars(server.chat, engine.model.cfg.vocab_size).json_schema(
        openai.lib._pydantic.to_strict_json_schema(City))  # 客户端发出去的就是 City 的严格形式
    want = generate(engine.model, Prompt(server.chat).render(messages).ids, 80, stop=server.chat.stop, grammar=grammar)
    assert done.choices[0].message.content == server.chat.decode([t for t in want if t not in server.chat.stop])
    loose = client.chat.completions.create(model=NAME, messages=messages, max_tokens=60, temperature=0,
                                           response_format={"type": "json_object"})
    text = loose.choices[0].message.content
    assert text.startswith("{") and (loose.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    long = {"type": "json_schema", "json_schema": {"name": "long", "schema": {  # 8 个 token 写不完：截断，给出写了的部分
        "type": "object", "properties": {"essay": {"type": "string", "minLength": 500}}, "required": ["essay"]}}}
    cut = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, response_format=long)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith('{"essay":')


def test_n_samples_are_distinct_reproducible_and_each_its_own_run(served):
    """n = 4、给了 seed：四个回答各不相同，再问一次一模一样；第 i 个与用 seed + i 单独请求的相同。流式时每块带自己的
    index，按 index 拼起来与非流式的相同；usage 的提示词只算一次。"""
    client, _, _, _ = served
    messages = [{"role": "user", "content": "写一首诗"}]
    kw = dict(model=NAME, messages=messages, max_tokens=12, temperature=1.0, seed=7, n=4)
    first, again = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2, 3] and len(set(texts)) == 4
    assert texts == [c.message.content for c in sorted(again.choices, key=lambda c: c.index)]
    alone = [client.chat.completions.create(**(kw | {"n": 1, "seed": 7 + i})) for i in range(4)]
    assert texts == [a.choices[0].message.content for a in alone]
    assert first.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert first.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    parts, reasons = ["", "", "", ""], {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert parts == texts and set(reasons) == {0, 1, 2, 3} and None not in reasons.values()


MESSAGES = [{"role": "user", "content": "介绍一下长江。"}]


def library(server, engine, ids, n, **sampling):
    """库里同样的提示词（token）：generate 的 Token（带对数概率与前 3 个），停止符不算（它不在回答的文字里）。"""
    tokens = generate(engine.model, torch.tensor([ids]), n, stop=server.chat.stop, logprobs=3, **sampling)
    return [(t, t) for t in tokens if t not in server.chat.stop]


def test_chat_logprobs_equal_the_library_stream_and_not(served):
    """chat 的 logprobs：每个 token 的对数概率与前 3 个与库里（generate 的 Token）同样的提示词算出的逐位相同；bytes 接起来是回答；
    流式各块的接起来与非流式的相同。n = 2 加种子：每个回答记自己的，与用 seed、seed + 1 单独生成的相同。"""
    client, engine, server, _ = served
    ids = Prompt(server.chat).render(MESSAGES).ids[0].tolist()
    kw = dict(model=NAME, messages=MESSAGES, max_tokens=10, logprobs=True, top_logprobs=3)
    full = client.chat.completions.create(temperature=0, **kw)
    got, want = full.choices[0].logprobs.content, library(server, engine, ids, 10)
    assert [(g.logprob, [t.logprob for t in g.top_logprobs]) for g in got] == [(e.logprob, [lp for _, lp in e.top]) for _, e in want]
    assert bytes(b for g in got for b in g.bytes).decode("utf-8", "replace") == full.choices[0].message.content
    chunks = client.chat.completions.create(temperature=0, stream=True, **kw)
    assert [(c.token, c.logprob) for chunk in chunks for choice in chunk.choices if choice.logprobs
            for c in choice.logprobs.content] == [(g.token, g.logprob) for g in got]
    two = client.chat.completions.create(temperature=1.0, seed=3, n=2, **kw)
    for choice in two.choices:
        alone = library(server, engine, ids, 10, temperature=1.0, seed=3 + choice.index)
        assert [g.logprob for g in choice.logprobs.content] == [e.logprob for _, e in alone]


def test_completion_logprobs_and_echo_equal_the_library(served):
    """completions 的 logprobs N 与 echo：提示词的第 0 个没有对数概率，其余与 prompt_logprobs 相同，生成的与 generate 的 Token 相同；
    text 以提示词开头，text_offset 是 tokens 的文字一个个接起来的位置；流式的接起来与非流式的相同。"""
    from qwen.sampling.logprobs import prompt_logprobs

    client, engine, server, _ = served
    text = "def add(a, b):"
    ids = server.chat.encode(text)[0].tolist()
    kw = dict(model=NAME, prompt=text, max_tokens=8, temperature=0, logprobs=2, echo=True)
    full = client.completions.create(**kw)
    lp, choice = full.choices[0].logprobs, full.choices[0]
    made = library(server, engine, ids, 8)
    assert lp.token_logprobs == [None] + [e.logprob for e in prompt_logprobs(engine.model, ids, 2)[1:]] + [e.logprob for _, e in made]
    assert lp.top_logprobs[0] is None and all(len(top) <= 2 for top in lp.top_logprobs[1:])
    assert choice.text.startswith(text) and len(lp.tokens) == len(ids) + len(made)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    plain = client.completions.create(model=NAME, prompt=text, max_tokens=8, temperature=0, echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


def test_logit_bias_equals_the_library(served):
    """logit_bias：−100 给贪心的第一个 token，回答换了，且与库里同样偏置的 generate 相同。"""
    client, engine, server, _ = served
    ids = Prompt(server.chat).render(MESSAGES).ids[0].tolist()
    first = library(server, engine, ids, 1)[0][0]
    biased = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                            logit_bias={str(first): -100, "7": 2.5})
    want = [t for t, _ in library(server, engine, ids, 8, logit_bias={first: -100, 7: 2.5})]
    assert biased.choices[0].message.content == server.chat.decode(want) and want[0] != first


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "required": ["unit", "days"],
          "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_required_and_named_always_call(served, choice):
    """tool_choice "required" 与指定函数：抽样（三个种子）也好、贪心也好，回答都是解析得了的工具调用，参数合乎它的
    schema（指定时是那一个函数）；贪心的与库里用同一个文法（Grammars.tool_calls）生成的相同。"""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    client, engine, server, _ = served
    messages = [{"role": "user", "content": "明天北京的天气？"}]
    kw = dict(model=NAME, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=300)  # 小词表：一个调用要上百个 token
    replies = [client.chat.completions.create(temperature=1.0, seed=s, **kw) for s in range(3)]
    replies.append(client.chat.completions.create(temperature=0, **kw))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for reply in replies:
        c = reply.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message.content
        for call in c.message.tool_calls:
            assert choice == "required" or call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    grammar = server.grammars().tool_calls(TOOLS, None if choice == "required" else "get_weather")
    want = generate(engine.model, Prompt(server.chat).render(messages, TOOLS).ids, 300, stop=server.chat.stop, grammar=grammar)
    reader = Reader(server.chat.tk, False, [], True)  # 库里的 token 读成工具调用：与服务给的（草稿头起草的）相同
    for t in want:
        if t not in server.chat.stop:
            reader.feed(t)
    reader.feed(final=True)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in reader.tool_calls()] == \
        [(c.function.name, c.function.arguments) for c in replies[-1].choices[0].message.tool_calls]


SCHEMAS = {  # 整数（要数字）、枚举与数组、嵌套的整数数组
    "digit": {"type": "object", "additionalProperties": False, "required": ["n", "flag"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "flag": {"type": "boolean"}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "tags"], "properties": {
        "color": {"enum": ["red", "green"]}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}},
    "arrays": {"type": "object", "additionalProperties": False, "required": ["xs"], "properties": {"xs": {"type": "array",
               "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3}}},
}


@pytest.fixture(scope="module", params=["bfloat16", "int4"])
def no_digit_drafts(request, lively):
    """bfloat16 或 int4 的服务，草稿头的起草词表里没有一个数字 token（文法只许数字时草稿头打分的一个也不许）。"""
    from qwen.fast import load_draft, load_model
    from qwen.serve.api import Server
    from qwen.serve.engine import Engine

    from serving import start, stop

    model = load_model(lively[0], dtype=torch.bfloat16, quantize=None if request.param == "bfloat16" else "int4")
    tk = __import__("qwen").Chat(model, lively[0]).tk
    digits = {i for i in range(model.cfg.vocab_size) if (tk.id_to_token(i) or " ")[0].isdigit()}
    mtp = load_draft(model, draft_vocab=[i for i in range(model.cfg.vocab_size) if i not in digits])
    mtp.round_cost = [1.0] * 5  # 起草不要钱：抽样的请求每轮都起草 4 个（自动挑的数），数字的位置上一定轮到草稿头
    server = Server(NAME, max_tokens=64)
    server.ready(Engine(model, mtp, slots=4, cache_mb=16))
    url, uv = start(server)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stop(uv, server, keep_engine=False)


def test_a_sampled_schema_is_never_a_server_error(no_digit_drafts):
    """3 个 schema × 10 个种子 × n = 5：150 个抽样的回答（bfloat16 与 int4 各一遍，共 300 个），一个 5xx 也没有；写完的
    （finish_reason 是 stop）都解析得了、合乎 schema。原先草稿头从全是 −∞ 的一行里抽样，这里约三分之一是 500。"""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    finished = 0
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        for seed in range(10):
            r = no_digit_drafts.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "JSON"}], n=5,
                                                        max_tokens=40, temperature=1.0, seed=seed, response_format=fmt)
            for c in r.choices:
                if c.finish_reason == "stop":
                    jsonschema.validate(json.loads(c.message.content), schema)
                    finished += 1
    assert finished >= 100
