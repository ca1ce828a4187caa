"""附录 · 服务：OpenAI 的 Responses API——POST /v1/responses。OpenAI 的 Agents SDK 与 Codex 说的是它（Codex 已经不说 chat
completions），vLLM 也有。

做法与 anthropic.py 相同：请求翻译成 chat completions 的请求体（to_chat），走同一条路，回答再翻译回 Responses 的样子：
- input 是一段文字，或一串条目：消息（user、assistant、system、developer；内容是文字或 input_text、input_image、
  output_text 分段）、function_call（助手调用了工具）、function_call_output（工具的结果）、reasoning（上一轮的推理）；
  instructions 与 system、developer 消息合成开头的一个系统轮；
- tools 是平的函数工具 {type: function, name, description, parameters}，tool_choice 同 chat completions（指定函数时
  {type: function, name}）；text.format 的 json_schema、json_object 是 response_format；reasoning.effort 为 none、minimal
  时不思考，别的思考（模板的 enable_thinking），不给时用模板的默认；
- 不存回答（store 收下、不管）：previous_response_id 是一个 400，请把历史放进 input（Codex 就这样发，store: false）；
- 回答的 output 依次是 reasoning、message（output_text）、function_call 条目；usage 有 input、output、total tokens（Codex 没有
  它们会失败）；写到上限时 status 是 incomplete（incomplete_details.reason = max_output_tokens；流式时仍以 response.completed
  结束，带着这个 status：Codex 把 response.incomplete 事件当作错误）；max_output_tokens 只是上限，超出服务或上下文的截到能写的；
- 流式的事件都带 event: 行与 sequence_number：response.created 立刻发出，之后各条目 output_item.added、内容的 delta、done，
  最后 response.completed 带着整个 output 与 usage；错误是一个 error 事件。
出处：https://platform.openai.com/docs/api-reference/responses ；llama.cpp 的 test_compat_oai_responses.py；codex-rs。
"""

import asyncio
import json
import time

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from typing import Any

from pydantic import StrictBool, StrictInt, StrictStr

from .errors import ApiError, engine_error, show
from .protocol import Number, Strict, read
from .requests import chat_job
from .sse import Reply


class ResponsesRequest(Strict):
    """POST /v1/responses 的样子。条目的结构由 messages_of 查；后面几个收下、不管（不存回答；模型一次总是可以写几个工具调用：
    Codex 对不认识的模型发 parallel_tool_calls: false，照样收下）。"""
    model: StrictStr | None = None
    input: StrictStr | list[Any]
    instructions: StrictStr | None = None
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    max_output_tokens: StrictInt | None = None
    stream: StrictBool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    user: StrictStr | None = None
    seed: StrictInt | None = None
    previous_response_id: StrictStr | None = None
    store: Any = None
    metadata: Any = None
    include: Any = None
    truncation: Any = None
    prompt_cache_key: Any = None
    service_tier: Any = None
    background: Any = None
    safety_identifier: Any = None
    stream_options: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    prompt_cache_retention: Any = None
    client_metadata: Any = None
    parallel_tool_calls: Any = None

FIELD_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text"}  # chat completions 的字段 → 这里的名字
NO_THINKING = ("none", "minimal")
ITEM_IDS = {"reasoning": "rs_", "message": "msg_"}  # 条目的 id：前缀加上回答的 id


def parts_of(content, field: str) -> list | str:
    """消息的内容：字符串原样；input_text、output_text 分段是文字，input_image 是图（image_url 是 data: URL 或地址）。"""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{field}.content 应为字符串或内容分段的列表，收到 {show(content)}", field)
    out = []
    for p in [p for p in content if isinstance(p, dict)]:
        if p.get("type") in ("input_text", "output_text", "text"):
            out.append({"type": "text", "text": p.get("text") if isinstance(p.get("text"), str) else ""})
        elif p.get("type") == "input_file":
            raise ApiError(400, f"{field} 的 input_file 还不支持：请把文件的文字放进 input_text", field)
        elif p.get("type") == "input_image":
            url = p.get("image_url") if isinstance(p.get("image_url"), str) else None
            if url is None:
                raise ApiError(400, f"{field} 的 input_image 要 image_url（data: URL）；file_id 不收（这里不存文件）", field)
            out.append({"type": "image_url", "image_url": {"url": url}})
    return out


def messages_of(body) -> list:
    """instructions 与 input → chat completions 的消息。相邻的 function_call 合成一个助手轮；reasoning 放进下一个助手轮。"""
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if not isinstance(items, list) or not items:
        raise ApiError(400, f"input 应为一段文字或非空的条目列表，收到 {show(given)}", "input")
    system = [body["instructions"]] if isinstance(body.get("instructions"), str) and body["instructions"] else []
    out, reasoning = [], ""
    for i, item in enumerate(items):
        field, kind = f"input[{i}]", item.get("type", "message") if isinstance(item, dict) else None
        role = item.get("role") if kind == "message" else None
        if role in ("system", "developer"):
            text = parts_of(item.get("content"), field)
            system.append(text if isinstance(text, str) else "".join(p.get("text", "") for p in text))
        elif role in ("user", "assistant"):
            out.append({"role": role, "content": parts_of(item.get("content"), field)})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {"name": item.get("name"),
                                                                                "arguments": item.get("arguments") or "{}"}}
            if not (out and out[-1]["role"] == "assistant"):  # 同一轮的正文之后的调用：放进那一轮
                out.append({"role": "assistant", "content": ""} | ({"reasoning_content": reasoning} if reasoning else {}))
                reasoning = ""
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else parts_of(output if isinstance(output, list) else [], field)
            text = text if isinstance(text, str) else "".join(p["text"] for p in text if p["type"] == "text")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            reasoning += "".join(p["text"] for key in ("content", "summary") for p in item.get(key) or []
                                 if isinstance(p, dict) and isinstance(p.get("text"), str))
        else:
            raise ApiError(400, f"{field} 应为消息、function_call、function_call_output 或 reasoning，收到 {show(item)}", field)
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + out


def to_chat(body, server) -> dict:
    """Responses 的请求体 → chat completions 的请求体（查过的）。"""
    body = read(ResponsesRequest, body)
    if body.get("previous_response_id") is not None:
        raise ApiError(400, "这里不存回答：没有 previous_response_id 可接，请把之前的条目放进 input（store: false 的写法）",
                       "previous_response_id")
    chat = {"model": server.name, "messages": messages_of(body)}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ApiError(400, f"tools 应为 {{type: function, name, parameters}} 的列表，收到 {show(tools)}", "tools")
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                         for t in tools if t.get("type") == "function"]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    fmt = body["text"].get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    effort = body["reasoning"].get("effort") if isinstance(body.get("reasoning"), dict) else None
    for ours, value in (("tool_choice", choice), ("response_format", fmt), ("max_tokens", body.get("max_output_tokens")),
                        ("chat_template_kwargs", None if effort is None else {"enable_thinking": effort not in NO_THINKING}),
                        *((k, body.get(k)) for k in ("temperature", "top_p", "stream", "seed", "user"))):
        if value is not None:
            chat[ours] = value
    return chat


def output_items(message: dict, rid: str) -> list:
    """chat completions 的助手消息 → Responses 的 output 条目：reasoning、message、function_call。"""
    items = [{"type": "reasoning", "id": f"rs_{rid}", "summary": [], "status": "completed",
              "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]}] if message.get("reasoning_content") else []
    if message.get("content"):
        items.append({"type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message["content"], "annotations": [], "logprobs": []}]})
    return items + [{"type": "function_call", "id": f"fc_{c['id']}", "call_id": c["id"], "name": c["function"]["name"],
                     "arguments": c["function"]["arguments"], "status": "completed"} for c in message.get("tool_calls") or []]


def response(reply: Reply, name: str, body: dict, output: list | None, status: str) -> dict:
    """Responses 的回答对象；output 为 None：还在生成（response.created 里的那个）。"""
    request, finished = reply.choices[0].request, output is not None
    prompt, made = len(request.ids), len(request.tokens) if finished else 0
    incomplete = finished and reply.finish(reply.choices[0])[1] == "length"
    return {"id": "resp_" + reply.id.split("-")[-1], "object": "response", "created_at": reply.created, "model": name,
            "status": "incomplete" if incomplete else status, "output": output or [], "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"), "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "text": body.get("text") or {"format": {"type": "text"}}, "reasoning": body.get("reasoning"), "store": False,
            "usage": {"input_tokens": prompt, "output_tokens": made, "total_tokens": prompt + made,
                      "input_tokens_details": {"cached_tokens": request.cached_tokens},
                      "output_tokens_details": {"reasoning_tokens": 0}} if finished else None}


def error_response(e: ApiError):
    """OpenAI 的错误体；param 换成这个接口的字段名。"""
    param = e.body["error"].get("param")
    return JSONResponse({"error": e.body["error"] | {"param": FIELD_NAMES.get(param, param)}}, status_code=e.status)


async def responses(http: HttpRequest):
    """POST /v1/responses。错误体与 chat completions 的一样（OpenAI 的 {"error": {message, type, param, code}}）。"""
    server = http.app.state.server
    try:
        body = await server.read_body(http)
        job = await asyncio.to_thread(lambda: chat_job(to_chat(body, server), server, ceiling=True))
        reply = Reply(job, server.name)
        server.submit(job.requests[0])
    except ApiError as e:
        return error_response(e)
    if job.stream:
        return StreamingResponse(events(reply, server.name, body), media_type="text/event-stream", headers={"cache-control": "no-cache"})
    try:
        whole = await reply.whole(http)
    except ApiError as e:
        return error_response(e)
    return response(reply, server.name, body, output_items(whole["choices"][0]["message"], reply.id.split("-")[-1]), "completed")


class Events:
    """流式事件：每个带 event: 行与递增的 sequence_number。"""

    def __init__(self):
        self.n = 0

    def __call__(self, kind: str, **data) -> str:
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.n - 1} | data, ensure_ascii=False)}\n\n"


async def events(reply: Reply, name: str, body: dict):
    """流式：推理与正文各一个条目（先推理后正文），工具调用各一个 function_call 条目（参数一次 delta）。"""
    c, emit, rid = reply.choices[0], Events(), reply.id.split("-")[-1]
    index, open_kind, texts = -1, None, {"reasoning": "", "message": ""}
    try:
        yield emit("response.created", response=response(reply, name, body, None, "in_progress"))
        yield emit("response.in_progress", response=response(reply, name, body, None, "in_progress"))
        async for reasoning, content, _ in reply.pieces(c):
            for kind, text in (("reasoning", reasoning), ("message", content)):
                if not text:
                    continue
                if open_kind != kind:
                    for done in close(emit, open_kind, index, rid, texts):
                        yield done
                    index, open_kind = index + 1, kind
                    for opened in open_item(emit, kind, index, rid):
                        yield opened
                texts[kind] += text
                delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                yield emit(delta, item_id=ITEM_IDS[kind] + rid, output_index=index, content_index=0, delta=text,
                           **({"logprobs": []} if kind == "message" else {}))
        calls, _ = reply.finish(c)
        if rest := c.reader.content[len(texts["message"]):]:  # 写坏了的工具调用并回了正文：同非流式的一样发出去
            if open_kind != "message":
                for done in close(emit, open_kind, index, rid, texts):
                    yield done
                index, open_kind = index + 1, "message"
                for opened in open_item(emit, "message", index, rid):
                    yield opened
            texts["message"] += rest
            yield emit("response.output_text.delta", item_id=ITEM_IDS["message"] + rid, output_index=index, content_index=0,
                       delta=rest, logprobs=[])
        for done in close(emit, open_kind, index, rid, texts):
            yield done
        message = {"reasoning_content": texts["reasoning"], "content": texts["message"], "tool_calls": calls}
        output = output_items(message, rid)
        for call in output[index + 1:]:
            index += 1
            yield emit("response.output_item.added", output_index=index, item=call | {"arguments": "", "status": "in_progress"})
            yield emit("response.function_call_arguments.delta", item_id=call["id"], output_index=index, delta=call["arguments"])
            yield emit("response.function_call_arguments.done", item_id=call["id"], output_index=index, arguments=call["arguments"])
            yield emit("response.output_item.done", output_index=index, item=call)
        yield emit("response.completed", response=response(reply, name, body, output, "completed"))
    except Exception as e:  # 已经开始流式发送：错误作为一个 error 事件
        err = engine_error(e).body["error"]
        yield emit("error", code=err.get("code"), message=err["message"], param=err.get("param"))
    finally:
        reply.cancel()


def open_item(emit, kind: str, index: int, rid: str):
    if kind == "reasoning":
        yield emit("response.output_item.added", output_index=index,
                   item={"type": "reasoning", "id": f"rs_{rid}", "summary": [], "content": [], "status": "in_progress"})
    else:
        yield emit("response.output_item.added", output_index=index, item={"type": "message", "id": f"msg_{rid}",
                   "status": "in_progress", "role": "assistant", "content": []})
        yield emit("response.content_part.added", item_id=f"msg_{rid}", output_index=index, content_index=0,
                   part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})


def close(emit, kind, index: int, rid: str, texts: dict):
    if kind == "reasoning":
        yield emit("response.reasoning_text.done", item_id=f"rs_{rid}", output_index=index, content_index=0, text=texts[kind])
        yield emit("response.output_item.done", output_index=index, item={
            "type": "reasoning", "id": f"rs_{rid}", "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": texts[kind]}]})
    elif kind == "message":
        part = {"type": "output_text", "text": texts[kind], "annotations": [], "logprobs": []}
        yield emit("response.output_text.done", item_id=f"msg_{rid}", output_index=index, content_index=0, text=texts[kind], logprobs=[])
        yield emit("response.content_part.done", item_id=f"msg_{rid}", output_index=index, content_index=0, part=part)
        yield emit("response.output_item.done", output_index=index, item={
            "type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant", "content": [part]})
