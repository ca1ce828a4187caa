"""检查点自己的对话模板（qwen/conversation/template.py）：与发布的不同时按它渲染，参数（chat_template_kwargs）交给它；库、命令行与服务
都与 transformers 的 apply_chat_template 切出同样的 token；投机解码与留下的状态照旧；坏的模板在加载时或每个请求里说清楚。

三个模板都从测试检查点的 QWEN_LIKE（照 build_prompt 写的 Qwen3.5 写法）改出来：CHANGED 没有系统消息时加一条默认的、
读自己的参数 persona；PRESERVE 像 Qwen3.6 的，preserve_thinking 时早先的回答也留着推理；REWRITING 的系统消息写着一共
几个问题——每来一轮都改写开头，留下的状态必须不用。发布的模板本身与 build_prompt 的比较在 test_chat.py。"""

import hashlib
import time

import pytest
import torch

from checkpoints import QWEN_LIKE
from qwen import Chat, Conversation, generate
from qwen.fast import load_draft, load_model
from qwen.conversation import Prompt
from serving import NAME, openai, post, start, stop

SYSTEM_LINE = '{%- set system = (text(messages[0].content) | trim) if messages[0].role == "system" else none -%}'
CHANGED = QWEN_LIKE.replace(SYSTEM_LINE, SYSTEM_LINE.replace(
    "else none", 'else "你是" ~ (persona or "小千") ~ "，一个乐于助人的助手。"'))
PRESERVE = QWEN_LIKE.replace('if loop.index0 > ns.last else ""',
                             'if loop.index0 > ns.last or (preserve_thinking and reasoning) else ""')
REWRITING = QWEN_LIKE.replace(SYSTEM_LINE, SYSTEM_LINE.replace(
    "else none", 'else "共 " ~ (messages | selectattr("role", "equalto", "user") | list | length) ~ " 个问题"'))
BAD_AT_RENDER = """{%- set q = messages[-1].content -%}
{%- if q == "raise" -%}{{ raise_exception("这个模板不回答 raise") }}{%- endif -%}
{%- if q == "loop" -%}{%- for i in range(100000) -%}{%- for j in range(100000) -%}{%- endfor -%}{%- endfor -%}{%- endif -%}
{%- if q == "big" -%}{%- for i in range(100000) -%}{{ "x" * 1000 }}{%- endfor -%}{%- endif -%}
{%- if q == "attr" -%}{{ messages.__class__.__mro__ }}{%- endif -%}
{%- if q == "append" -%}{{ messages.append(1) }}{%- endif -%}
""" + QWEN_LIKE
HISTORY = [{"role": "system", "content": "你是助手。"}, {"role": "user", "content": "1+1?"},
           {"role": "assistant", "content": "2", "reasoning_content": "一加一，简单"}, {"role": "user", "content": "再加 1？"}]
HI = [{"role": "user", "content": "你好"}]
CASES = {"changed": (CHANGED, [(HI, {}), (HI, {"persona": "长江"}), (HISTORY, {})]),
         "preserve": (PRESERVE, [(HISTORY, {}), (HISTORY, {"preserve_thinking": True}), (HI, {"preserve_thinking": True})])}


def with_template(root, lively, text):
    """lively 检查点的一份（文件是链接），对话模板换成 text。"""
    root.mkdir()
    for f in lively[0].iterdir():
        if f.name != "chat_template.jinja":
            (root / f.name).symlink_to(f)
    (root / "chat_template.jinja").write_text(text, encoding="utf-8")
    return root


def reference_ids(folder, messages, **kwargs) -> list:
    """transformers 的 apply_chat_template 按检查点的模板切出的 token。"""
    transformers = pytest.importorskip("transformers")
    tk = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return tk.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=True,
                                  return_dict=False, **kwargs)


@pytest.fixture(scope="module")
def folders(lively, tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    return {name: with_template(root / name, lively, text) for name, text in
            {"changed": CHANGED, "preserve": PRESERVE, "rewriting": REWRITING, "bad": BAD_AT_RENDER}.items()}


# ---------- 库：与 transformers 切出的 token 相同，参数交给模板 ----------


@pytest.mark.parametrize("name", CASES)
def test_library_renders_the_checkpoints_template(model, folders, name):
    """Prompt（Conversation、命令行、服务都用它）切出的 token 与 transformers 的相同；参数改变了提示词。
    模板与发布的不同：说明里这样说，渲染的不是 build_prompt。"""
    text, cases = CASES[name]
    chat = Chat(model, folders[name])
    prompt = Prompt(chat)
    assert prompt.template is not None and "检查点自己的" in prompt.describe()
    seen = set()
    for messages, kwargs in cases:
        ids = prompt.render(messages, None, kwargs).ids[0].tolist()
        assert ids == reference_ids(folders[name], messages, **kwargs)
        seen.add(tuple(ids))
    assert len(seen) == len(cases)  # 每组参数、消息切出的都不同：参数真的到了模板
    assert prompt.render(HI).ids[0].tolist() != chat.encode(chat.prompt(HI))[0].tolist() or name == "preserve"


def test_released_template_takes_no_other_kwargs(model, folders, monkeypatch):
    """模板是发布的那个时走 build_prompt：除 enable_thinking、add_vision_id 外的参数是错，不默默丢掉（这里把 QWEN_LIKE 当作发布的：
    发布的原文 CI 上没有，它与 build_prompt 逐字相同由 test_chat 测）。"""
    import qwen.conversation.template

    monkeypatch.setattr(qwen.conversation.template, "RELEASED", hashlib.sha256(QWEN_LIKE.strip().encode()).hexdigest())
    prompt = Prompt(Chat(model))
    assert prompt.template is None and "build_prompt" in prompt.describe()
    with pytest.raises(ValueError, match="发布的 Qwen3.5 模板.*'preserve_thinking'"):
        prompt.check({"preserve_thinking": True})
    pictures = [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "?"}]}]
    numbered = prompt.render(pictures, None, {"add_vision_id": True, "enable_thinking": True})  # 发布的模板的两个参数
    assert "Picture 1: <|vision_start|>" in Chat(model).decode(numbered.ids[0]) and numbered.thinks
    assert numbered.pictures == [pictures[0]["content"][0]] and prompt.render(pictures).thinks  # 发布的模板默认思考
    custom = Prompt(Chat(model, folders["preserve"]))
    for bad, why in [({"_x": 1}, "'_x' 不能给"), ({"messages": []}, "'messages' 不能给"), ([1], "应为 dict"),
                     ({"enable_thinking": "yes"}, "应为 true/false")]:
        with pytest.raises(ValueError, match=why):
            custom.check(bad)


@pytest.mark.parametrize("name, reused", [("changed", True), ("rewriting", False)])
def test_saved_turns_with_a_custom_template(model, folders, name, reused):
    """投机解码加留下的状态：模板不改写历史时第二轮只读新的部分；改写了（REWRITING 的系统消息每轮都变）时从头读。
    两种都与新开的对话、与普通贪心逐 token 相同。"""
    chat = Chat(model, folders[name])
    talking = Conversation(chat, mtp=load_draft(model))
    assert talking.mtp is not None
    messages, kwargs = [{"role": "user", "content": "你好，介绍一下长江。"}], {"persona": "黄河"}
    for turn in range(2):
        answer = "".join(talking.reply(messages, max_new_tokens=10, temperature=0, chat_template_kwargs=kwargs))
        ids = Prompt(chat).render(messages, None, {"enable_thinking": False} | kwargs).ids
        plain = [t for t in generate(model, ids, 10, chat.stop) if t not in chat.stop]
        assert answer == chat.decode(plain)
        fresh = Conversation(chat, mtp=talking.mtp)
        assert "".join(fresh.reply(messages, max_new_tokens=10, temperature=0, chat_template_kwargs=kwargs)) == answer
        assert talking.fed == ids.shape[1] if turn == 0 or not reused else talking.fed < ids.shape[1]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "再写一句。"}]


# ---------- 服务：prompt_tokens 与 transformers 的相同，贪心与库相同 ----------


@pytest.fixture(scope="module", params=list(CASES))
def custom(request, folders):
    """用检查点自己的模板的服务（带草稿头：投机解码）。"""
    from qwen.serve.api import Server
    from qwen.serve.engine import Engine

    name = request.param
    model = load_model(folders[name], dtype=torch.float32)
    engine = Engine(model, load_draft(model), slots=2, cache_mb=32)
    server = Server(NAME, max_tokens=64)
    server.ready(engine)
    url, uv = start(server)
    yield name, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120), server, engine
    stop(uv, server, keep_engine=False)


def test_served_prompt_is_the_checkpoints_own(custom):
    """每组消息与 chat_template_kwargs：服务的 prompt_tokens 等于 transformers 的 apply_chat_template 的 token 数，
    贪心的回答等于库在同一串 token 上 generate 的。"""
    name, client, server, engine = custom
    chat = server.chat
    for messages, kwargs in CASES[name][1]:
        ids = reference_ids(chat.path, messages, **kwargs)
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"chat_template_kwargs": kwargs})
        assert r.usage.prompt_tokens == len(ids)
        plain = [t for t in generate(engine.model, torch.tensor([ids]), 10, chat.stop) if t not in chat.stop]
        assert r.choices[0].message.content == chat.decode(plain)


def test_served_second_turn_reuses_the_state(custom):
    """第二轮从第一轮留下的状态接着读（cached_tokens > 0，模板的参数也一样），回答与清空后从头读的相同。"""
    name, client, server, engine = custom
    kwargs = {"persona": "长江"} if name == "changed" else {"preserve_thinking": True}
    ask = lambda messages: client.chat.completions.create(  # noqa: E731
        model=NAME, messages=messages, max_tokens=8, temperature=0, extra_body={"chat_template_kwargs": kwargs})
    first = ask(HISTORY)
    second = HISTORY + [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "好"}]
    resumed = ask(second)
    assert resumed.usage.prompt_tokens_details.cached_tokens > 0
    engine.cache.items.clear()
    engine.cache.size = 0
    fresh = ask(second)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.choices[0].message.content == resumed.choices[0].message.content


@pytest.mark.parametrize("kwargs, error", [
    ({"enable_thinking": "yes"}, "enable_thinking 应为 true/false"),
    ({"_secret": 1}, "'_secret' 不能给"),
    ({"add_generation_prompt": False}, "'add_generation_prompt' 不能给"),
    ([1], "chat_template_kwargs 应为对象"),
])
def test_bad_template_kwargs(custom, kwargs, error):
    _, client, _, _ = custom
    with pytest.raises(openai.BadRequestError, match=error) as e:
        client.chat.completions.create(model=NAME, messages=HI, max_tokens=2, extra_body={"chat_template_kwargs": kwargs})
    assert e.value.body["param"] == "chat_template_kwargs"


# ---------- 坏的模板 ----------


def test_a_template_that_does_not_parse(lively, tmp_path, capsys):
    """解析不了的模板：加载时就说出文件与行（库、命令行、服务都在加载时）。"""
    from qwen.__main__ import main
    from qwen.serve.api import Server
    from qwen.serve.engine import Engine

    folder = with_template(tmp_path / "broken", lively, QWEN_LIKE.replace("{%- endmacro -%}", "{%- endmacr -%}"))
    model = load_model(folder, layout="packed", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"chat_template.jinja 的对话模板第 \d+ 行解析不了"):
        Conversation(Chat(model), mtp=False)
    with pytest.raises(ValueError, match="解析不了"):
        Server(NAME).ready(Engine(model, None, slots=1, cache_mb=8))
    with pytest.raises(SystemExit, match="错误：chat_template.jinja 的对话模板第 .* 行解析不了"):
        main(["你好", "--model", str(folder), "--dtype", "float32", "--no-mtp"])


def test_bad_templates_are_a_400_and_the_server_lives_on(folders):
    """渲染时出错的模板：它自己的 raise_exception（说明原样给客户端）、空转太久、写出几百 MB、碰沙箱不许碰的东西——
    每个都是 400（param 是 messages），很快回来，之后服务照常回答。"""
    from qwen.serve.api import Server
    from qwen.serve.engine import Engine

    server = Server(NAME, max_tokens=8)
    server.ready(Engine(load_model(folders["bad"], dtype=torch.float32), None, slots=1, cache_mb=8))
    url, uv = start(server)
    try:
        for question, error in [("raise", "这个模板不回答 raise"), ("loop", "渲染超过 2 秒"), ("big", "超过 4194304 个字"),
                                ("attr", "沙箱不许碰"), ("append", "沙箱不许碰")]:
            t0 = time.monotonic()
            status, body = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": question}]})
            assert status == 400 and error in body["error"]["message"] and body["error"]["param"] == "messages", body
            assert time.monotonic() - t0 < 20
        status, body = post(url + "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] > 0
    finally:
        stop(uv, server, keep_engine=False)


def test_served_thinking_follows_the_template_then_the_server_defaults(lively, folders, tmp_path):
    """没给 chat_template_kwargs 时服务用模板自己的默认（与 transformers 的 apply_chat_template 切出的 token 数相同）；
    检查点的 generation_config.json 里的 default_chat_template_kwargs 与 --default-chat-template-kwargs 依次叠在上面，
    请求自己给的最后叠上；服务的默认参数不合模板时加载就报错。"""
    import json
    import shutil

    from qwen.serve.api import Server
    from qwen.serve.engine import Engine

    folder = shutil.copytree(folders["preserve"], tmp_path / "ck")
    (folder / "generation_config.json").write_text(json.dumps({"default_chat_template_kwargs": {"enable_thinking": True}}))
    model = load_model(folder, dtype=torch.float32)
    engine = Engine(model, None, slots=1, cache_mb=0)
    messages = [{"role": "user", "content": "介绍一下长江。"}]
    for given, want in [(None, {"enable_thinking": True}), ({"preserve_thinking": True}, {"enable_thinking": True, "preserve_thinking": True}),
                        ({"enable_thinking": False}, {"enable_thinking": False, "preserve_thinking": True})]:
        server = Server(NAME, max_tokens=8, default_chat_template_kwargs=given)
        server.ready(engine)
        url, uv = start(server)
        for asked in [{}, {"enable_thinking": False}]:
            status, reply = post(url + "/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 2,
                                                               "temperature": 0, "chat_template_kwargs": asked})
            assert status == 200 and reply["usage"]["prompt_tokens"] == len(reference_ids(folder, messages, **(want | asked)))
        stop(uv, server)
    with pytest.raises(ValueError, match="'_x' 不能给"):
        Server(NAME, default_chat_template_kwargs={"_x": 1}).ready(engine)
    plain = Server(NAME)
    plain.ready(Engine(load_model(folders["preserve"], dtype=torch.float32), None, slots=1, cache_mb=0))
    assert plain.template_kwargs == {}  # 没有 generation_config.json：模板自己的默认
