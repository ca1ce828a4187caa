"""附录 qwen/serve/responses.py：OpenAI 的 Responses API。官方的 openai SDK 是客户端：同一段对话，/v1/responses（流式与
非流式）的贪心回答与 chat completions 的逐个 token 相同——文字、工具调用（function_call 条目与送回的 function_call_output）、
结构化输出、推理；usage 有 input、output、total；写到上限时 incomplete；previous_response_id 是一个清楚的 400。"""

import json

import pytest

from serving import NAME, post, served  # noqa: F401  fixture

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color"], "properties": {"color": {"enum": ["red", "blue"]}}}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["北京", "上海"]}}, "required": ["city"]}


def chat_answer(client, messages, **more):
    return client.chat.completions.create(model=NAME, messages=messages, temperature=0, **more)


def streamed(client, **kw):
    """流式的事件：sequence_number 从 0 逐个加一，第一个是 response.created，最后是 response.completed → 它的 response。"""
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return events[-1].response, text


def test_text_answers_equal_chat_completions(served):
    """instructions 与多轮的 input 条目：非流式、流式的 output_text 与 chat completions 的逐字相同，usage 的三个数都对；
    写到 max_output_tokens 时 status 是 incomplete。"""
    client, *_ = served
    items = [{"role": "user", "content": "介绍一下长江。"}, {"role": "assistant", "content": [{"type": "output_text", "text": "长江很长。"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "再说一句"}]}]
    want = chat_answer(client, [{"role": "system", "content": "你是助手。"}, {"role": "user", "content": "介绍一下长江。"},
                                {"role": "assistant", "content": "长江很长。"}, {"role": "user", "content": "再说一句"}], max_tokens=12)
    got = client.responses.create(model=NAME, instructions="你是助手。", input=items, max_output_tokens=12, temperature=0)
    assert got.output_text == want.choices[0].message.content
    assert (got.usage.input_tokens, got.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert got.usage.total_tokens == want.usage.total_tokens
    assert got.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")
    final, text = streamed(client, model=NAME, instructions="你是助手。", input=items, max_output_tokens=12, temperature=0)
    assert text == final.output_text == got.output_text and final.usage.output_tokens == got.usage.output_tokens
    assert client.responses.create(model=NAME, input="你好", max_output_tokens=4).usage.input_tokens == \
        chat_answer(client, [{"role": "user", "content": "你好"}], max_tokens=4).usage.prompt_tokens


def test_function_calls_and_their_outputs(served):
    """tool_choice required：output 是 function_call 条目（arguments 与 chat completions 的相同），流式的参数 delta 一样；
    把 function_call 与 function_call_output 放回 input，下一轮与 chat completions 的 tool 消息那一轮相同。"""
    client, *_ = served
    ask = [{"role": "user", "content": "北京天气"}]
    tools = [{"type": "function", "name": "get_weather", "description": "查天气", "parameters": WEATHER}]
    want = chat_answer(client, ask, max_tokens=300, tool_choice="required", tools=[{"type": "function", "function": {
        "name": "get_weather", "description": "查天气", "parameters": WEATHER}}])
    call = want.choices[0].message.tool_calls[0]
    got = client.responses.create(model=NAME, input=ask, tools=tools, tool_choice="required", max_output_tokens=300, temperature=0)
    calls = [o for o in got.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == call.function.name and json.loads(calls[0].arguments) == json.loads(call.function.arguments)
    final, _ = streamed(client, model=NAME, input=ask, tools=tools, tool_choice="required", max_output_tokens=300, temperature=0)
    assert [o.arguments for o in final.output if o.type == "function_call"] == [calls[0].arguments]
    back = ask + [{"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name, "arguments": calls[0].arguments},
                  {"type": "function_call_output", "call_id": calls[0].call_id, "output": "晴"}]
    then = client.responses.create(model=NAME, input=back, tools=tools, max_output_tokens=10, temperature=0)
    plain = chat_answer(client, ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": calls[0].call_id, "type": "function", "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "晴"}], max_tokens=10, tools=[{"type": "function", "function": {
            "name": "get_weather", "description": "查天气", "parameters": WEATHER}}])
    assert then.usage.input_tokens == plain.usage.prompt_tokens and then.output_text == (plain.choices[0].message.content or "")


def test_structured_output_and_reasoning(served):
    """text.format 的 json_schema：回答合乎 schema，与 chat completions 的 response_format 相同；reasoning.effort 为 high 时
    回答从推理开始（reasoning 条目），为 none 时不思考。"""
    pytest.importorskip("llguidance")
    client, *_ = served
    ask = [{"role": "user", "content": "给一个颜色"}]
    fmt = {"format": {"type": "json_schema", "name": "c", "schema": SCHEMA, "strict": True}}
    got = client.responses.create(model=NAME, input=ask, text=fmt, max_output_tokens=60, temperature=0)
    want = chat_answer(client, ask, max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
    assert got.output_text == want.choices[0].message.content and json.loads(got.output_text)["color"] in ("red", "blue")
    thought = client.responses.create(model=NAME, input=ask, reasoning={"effort": "high"}, max_output_tokens=20, temperature=0)
    plain = chat_answer(client, ask, max_tokens=20, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert thought.output[0].type == "reasoning" and thought.output[0].content[0].text == plain.choices[0].message.reasoning_content
    none = client.responses.create(model=NAME, input=ask, reasoning={"effort": "none"}, max_output_tokens=4, temperature=0)
    assert none.usage.input_tokens != thought.usage.input_tokens and all(o.type != "reasoning" for o in none.output)


def test_bad_requests_name_the_field(served):
    """坏的请求 400，param 是这个接口的字段名；Codex 发的 parallel_tool_calls: false、client_metadata 收下；max_output_tokens
    只是上限（超出服务的上限也照样回答）。"""
    client, _, _, url = served
    r = client.responses.create(model=NAME, input="你好", parallel_tool_calls=False, max_output_tokens=10**6,
                                extra_body={"client_metadata": {"x": 1}})
    assert r.usage.output_tokens > 0
    for body, field in [({"input": []}, "input"), ({"input": [{"type": "nonsense"}]}, "input[0]"),
                        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": "hi", "frobnicate": 1}, "frobnicate"), ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0]")]:
        status, reply = post(url + "/v1/responses", {"model": NAME} | body)
        assert status == 400 and reply["error"]["param"] == field, (body, reply)


def test_history_items_become_the_turns_they_were():
    """推理、正文、两个调用是同一个助手轮（Codex 送回历史就是这样排的）；工具结果的分段列表是文字；instructions 在最前。"""
    from qwen.serve.responses import messages_of

    items = [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "想"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "好"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "晴"}]}]
    out = messages_of({"input": items, "instructions": "sys"})
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"] and out[0]["content"] == "sys"
    assert out[2]["reasoning_content"] == "想" and [c["id"] for c in out[2]["tool_calls"]] == ["c1", "c2"]
    assert out[3] == {"role": "tool", "tool_call_id": "c1", "content": "晴"}
