"""附录 qwen/serve/anthropic.py：Anthropic 的 Messages API。官方的 anthropic SDK 是客户端：同一段对话，/v1/messages（流式与
非流式）的贪心回答与 chat completions 的逐个 token 相同——文字、工具调用、思考；count_tokens 与 input_tokens 相同；
错误是 Anthropic 的错误体；key 在 x-api-key 里。"""

import json

import pytest

from serving import NAME, post, served  # noqa: F401  fixture

anthropic = pytest.importorskip("anthropic")

TOOLS = [{"name": "get_weather", "description": "查天气", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["北京", "上海"]}}, "required": ["city"]}}]


def client_of(url, key="unused"):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def chat_answer(served, messages, **more):
    client, *_ = served
    return client.chat.completions.create(model=NAME, messages=messages, temperature=0, **more)


def streamed_blocks(client, **kw) -> tuple:
    """流式的事件拼回 (内容块, stop_reason, output_tokens)；同时查事件的顺序：块的下标 0、1、2… 各自 start、delta、stop。"""
    blocks, order, reason, made = {}, [], None, None
    with client.messages.stream(**kw) as stream:
        for e in stream:
            order.append(e.type)
            if e.type == "content_block_start":
                blocks[e.index] = e.content_block.model_dump()
            elif e.type == "content_block_delta":
                d = e.delta
                key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[d.type]
                blocks[e.index][key] = blocks[e.index].get(key, "") + getattr(d, key)
            elif e.type == "message_delta":
                reason, made = e.delta.stop_reason, e.usage.output_tokens
    assert order[0] == "message_start" and order[-1] == "message_stop" and list(blocks) == list(range(len(blocks)))
    return [blocks[i] for i in sorted(blocks)], reason, made


def test_text_answers_equal_chat_completions(served):
    """系统提示词（字符串与块）、多轮：非流式与流式的文字与 chat completions 的逐字相同，token 数也一样；count_tokens
    等于 input_tokens，也等于 chat completions 的 prompt_tokens。"""
    _, _, _, url = served
    client = client_of(url)
    system = [{"type": "text", "text": "你是"}, {"type": "text", "text": "助手。"}]
    turns = [{"role": "user", "content": "介绍一下长江。"}, {"role": "assistant", "content": [{"type": "text", "text": "长江很长。"}]},
             {"role": "user", "content": [{"type": "text", "text": "再说一句"}, {"type": "text", "text": ""}]}]
    want = chat_answer(served, [{"role": "system", "content": "你是助手。"}, {"role": "user", "content": "介绍一下长江。"},
                                {"role": "assistant", "content": "长江很长。"}, {"role": "user", "content": "再说一句"}], max_tokens=12)
    got = client.messages.create(model="claude-whatever", max_tokens=12, system=system, messages=turns)
    assert [b.type for b in got.content] == ["text"] and got.content[0].text == want.choices[0].message.content
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == want.usage.prompt_tokens  # 接着读的另算
    assert got.usage.output_tokens == want.usage.completion_tokens
    assert got.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    assert client.messages.count_tokens(model="x", system=system, messages=turns).input_tokens == want.usage.prompt_tokens
    blocks, reason, made = streamed_blocks(client, model="x", max_tokens=12, system=system, messages=turns)
    assert [(b["type"], b["text"]) for b in blocks] == [("text", want.choices[0].message.content)]
    assert reason == got.stop_reason and made == got.usage.output_tokens


def test_a_tool_call_and_its_result(served):
    """tool_choice any：回答是一个 tool_use 块（input 是对象），stop_reason tool_use，与 chat completions 的 tool_calls 相同；
    流式的 input_json_delta 拼起来是同样的参数。送回 tool_result 之后的下一轮与 chat completions 的 tool 消息那一轮相同。"""
    _, _, _, url = served
    client = client_of(url)
    ask = [{"role": "user", "content": "北京天气"}]
    want = chat_answer(served, ask, max_tokens=300, tools=[{"type": "function", "function": {
        "name": "get_weather", "description": "查天气", "parameters": TOOLS[0]["input_schema"]}}], tool_choice="required")
    call = want.choices[0].message.tool_calls[0]
    got = client.messages.create(model="x", max_tokens=300, messages=ask, tools=TOOLS, tool_choice={"type": "any"})
    uses = [b for b in got.content if b.type == "tool_use"]
    assert got.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == call.function.name
    assert uses[0].input == json.loads(call.function.arguments)
    blocks, reason, _ = streamed_blocks(client, model="x", max_tokens=300, messages=ask, tools=TOOLS,
                                        tool_choice={"type": "any"})
    assert reason == "tool_use" and json.loads(blocks[-1]["partial_json"]) == uses[0].input
    back = ask + [{"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": uses[0].name, "input": uses[0].input}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "晴"}]}]
    then = client.messages.create(model="x", max_tokens=10, messages=back, tools=TOOLS)
    plain = chat_answer(served, ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": uses[0].id, "type": "function", "function": {"name": uses[0].name, "arguments": json.dumps(uses[0].input, ensure_ascii=False)}}]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "晴"}], max_tokens=10, tools=[{"type": "function", "function": {
            "name": "get_weather", "description": "查天气", "parameters": TOOLS[0]["input_schema"]}}])
    assert then.usage.input_tokens + then.usage.cache_read_input_tokens == plain.usage.prompt_tokens
    assert "".join(b.text for b in then.content if b.type == "text") == (plain.choices[0].message.content or "")


def test_thinking_blocks(served):
    """thinking enabled：回答从推理开始，推理是 thinking 块、之后的是 text 块（与 chat completions 的 reasoning_content、
    content 相同）；disabled 与不给时用模板的默认（这个模板是不思考）。"""
    _, _, _, url = served
    client = client_of(url)
    ask = [{"role": "user", "content": "1+1?"}]
    want = chat_answer(served, ask, max_tokens=30, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    got = client.messages.create(model="x", max_tokens=30, messages=ask,
                                 thinking={"type": "enabled", "budget_tokens": 1024})
    assert got.content[0].type == "thinking" and got.content[0].thinking == want.choices[0].message.reasoning_content
    assert "".join(b.text for b in got.content if b.type == "text") == (want.choices[0].message.content or "")
    plain = client.messages.create(model="x", max_tokens=4, messages=ask, thinking={"type": "disabled"})
    assert plain.usage.input_tokens + plain.usage.cache_read_input_tokens == client.messages.count_tokens(
        model="x", messages=ask, thinking={"type": "disabled"}).input_tokens
    with client.messages.stream(model="x", max_tokens=30, messages=ask, thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        final = s.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].signature == "" and final.content[0].thinking == got.content[0].thinking
    total = lambda r: r.usage.input_tokens + r.usage.cache_read_input_tokens  # noqa: E731
    assert total(plain) != total(got) and all(b.type != "thinking" for b in plain.content)


def test_errors_are_anthropic_errors(served):
    """坏的请求：SDK 收到 BadRequestError，错误体是 {"type": "error", "error": {"type": "invalid_request_error", "message"}}，
    说明里有字段；不认识的块类型略过，不是错误。"""
    _, _, _, url = served
    client = client_of(url)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="x", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    for body, field in [({"max_tokens": 5, "messages": []}, "messages"), ({"max_tokens": 5, "messages": [{"role": "robot"}]}, "messages[0]"),
                        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}}, "tool_choice"),
                        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, "frobnicate")]:
        status, reply = post(url + "/v1/messages", body)
        assert status == 400 and reply["type"] == "error" and field in reply["error"]["message"], reply
    odd = [{"role": "user", "content": [{"type": "document", "source": {}}, {"type": "text", "text": "你好"}]}]
    assert client.messages.count_tokens(model="x", messages=odd).input_tokens == \
        client.messages.count_tokens(model="x", messages=[{"role": "user", "content": "你好"}]).input_tokens
    big = client.messages.create(model="x", max_tokens=10**6, messages=[{"role": "user", "content": "你好"}])  # 只是上限
    assert big.stop_reason in ("end_turn", "max_tokens") and big.usage.output_tokens > 0
    for body, field in [({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "messages[0]"),
                        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, "tool_choice"),
                        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                          "content": [{"type": "image", "source": {}}]}]}]}, "messages[0]")]:
        status, reply = post(url + "/v1/messages", body)
        assert status == 400 and field in reply["error"]["message"], reply


def test_claude_codes_billing_header_does_not_defeat_the_saved_state(served):
    """Claude Code 的第一块系统提示词是计费头，cch= 每个请求都变：去掉它，第二轮从第一轮留下的状态接着读（cache_read > 0），
    提示词与没有计费头时的相同。"""
    _, _, _, url = served
    client = client_of(url)

    def system(nonce):
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=cli; cch={nonce};"},
                {"type": "text", "text": "You are Claude Code."}]
    ask = [{"role": "user", "content": "介绍一下长江。"}]
    first = client.messages.create(model="x", max_tokens=4, system=system("aaaaa"), messages=ask)
    more = ask + [{"role": "assistant", "content": first.content[0].text if first.content else ""}, {"role": "user", "content": "再说说"}]
    second = client.messages.create(model="x", max_tokens=4, system=system("bbbbb"), messages=more)
    assert second.usage.cache_read_input_tokens > 0
    plain = client.messages.count_tokens(model="x", system="You are Claude Code.", messages=more).input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == plain


def test_structured_output_through_output_config(served):
    """output_config.format 的 JSON Schema：回答合乎它，与 chat completions 的 response_format 逐字相同（流式也是）。"""
    pytest.importorskip("llguidance")
    client, _, _, url = served
    schema = {"type": "object", "additionalProperties": False, "required": ["color"], "properties": {"color": {"enum": ["red", "blue"]}}}
    ask = [{"role": "user", "content": "给一个颜色"}]
    want = chat_answer(served, ask, max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    claude = client_of(url)
    got = claude.messages.create(model="x", max_tokens=60, messages=ask, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert got.content[0].text == want.choices[0].message.content and json.loads(got.content[0].text)["color"] in ("red", "blue")
    blocks, _, _ = streamed_blocks(claude, model="x", max_tokens=60, messages=ask,
                                   output_config={"format": {"type": "json_schema", "schema": schema}})
    assert "".join(b.get("text", "") for b in blocks) == got.content[0].text
