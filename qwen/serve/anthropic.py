"""附录 · 服务：Anthropic 的 Messages API——POST /v1/messages 与 /v1/messages/count_tokens。Claude Code 与 anthropic SDK
这样接本地模型（llama-server、vLLM 也有这两个接口）。

做法同 vLLM 的 entrypoints/anthropic：把请求翻译成 chat completions 的请求体（to_chat），走同一条路——同样的提示词、
同样的采样、同样逐位相同的输出——再把回答翻译回 Messages 的样子：
- system 是字符串或文字块，合成开头的一个系统轮（Qwen 的模板不许后面再有系统消息）；
- 块：text（空的也收）、image（base64 或 url）、助手的 tool_use 与 thinking、用户的 tool_result（变成 tool 消息，排在同一轮的
  文字之前）；不认识的块类型略过；
- tools 是 {name, description, input_schema}，tool_choice 的 auto / any / tool / none 对应 auto / required / 指定函数 / none；
  thinking 的 enabled / disabled 是模板的 enable_thinking；output_config.format 的 JSON Schema 是 response_format；采样的
  设置（新的 SDK 已经不发 temperature）没给时是检查点推荐的；
- 回答的 content 依次是 thinking、text、tool_use 块，stop_reason 是 end_turn、max_tokens、stop_sequence 或 tool_use；
- 流式照 Anthropic 的事件：每个带 event: 行（SDK 按它分派），message_start 与 ping 立刻发出（长的预填充时客户端不以为断了），
  块的下标 0、1、2… 各自 start、delta、stop，最后 message_delta 与 message_stop；
- 错误体是 {"type": "error", "error": {"type", "message"}}；key 在 x-api-key 或 Authorization: Bearer 里；model 随便写
  （Claude Code 写它自己的名字），anthropic-version、anthropic-beta 头与 ?beta=true 不看；
- Claude Code 系统提示词开头的计费头（x-anthropic-billing-header: …; cch=<每个请求都变>;）去掉（vLLM、SGLang、llama.cpp 也这样）：
  不然提示词从第一行起就不同，留下的对话状态一次也接不上。
出处：https://docs.anthropic.com/en/api/messages 、/en/api/messages-streaming；llama.cpp tools/server 的 test_compat_anthropic.py。
"""

import asyncio
import json
import re
import uuid

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from typing import Any

from pydantic import StrictBool, StrictInt, StrictStr

from .errors import ApiError, engine_error, show
from .protocol import Number, Strict, read
from .requests import chat_job, chat_prompt
from .sse import Reply


class MessagesRequest(Strict):
    """POST /v1/messages（与 count_tokens，它不要 max_tokens）的样子。块的结构由 turn 查；后面几个收下、不管（缓存、地域、
    计费之类，本地的服务没有）。"""
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    messages: list[Any]
    system: StrictStr | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: Any = None
    service_tier: Any = None
    container: Any = None
    context_management: Any = None
    mcp_servers: Any = None
    cache_control: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    speed: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None

ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
FIELD_NAMES = {"stop": "stop_sequences", "response_format": "output_config"}  # chat completions 的字段 → 这里的名字
# Claude Code 的系统提示词第一行（或第一块）是计费头，其中的 cch= 每个请求都变：不是给模型的，留着它留下的状态就永远接不上
BILLING = re.compile(r"^x-anthropic-billing-header:[^\n]*(\n|$)")


def error_body(e: ApiError) -> dict:
    """我们的 ApiError → Anthropic 的错误体（说明里带上是哪个字段）。"""
    param = FIELD_NAMES.get(e.body["error"].get("param"), e.body["error"].get("param"))
    message = e.body["error"]["message"] + (f"（{param}）" if param and param not in e.body["error"]["message"] else "")
    return {"type": "error", "error": {"type": ERRORS.get(e.status, "api_error"), "message": message}}


def text_of(blocks, field: str) -> str:
    """字符串或文字块的列表 → 文字（别的块略过）。"""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise ApiError(400, f"{field} 应为字符串或内容块的列表，收到 {show(blocks)}", field)
    texts = [b for b in blocks if isinstance(b, dict) and b.get("type") in ("text", "image")]
    if any(b["type"] == "image" or not isinstance(b.get("text"), str) for b in texts):
        raise ApiError(400, f"{field} 的块应为有 text 字符串的 text 块（这里的图还不支持）", field)
    return "".join(b["text"] for b in texts)


def image_part(block, field: str) -> dict:
    """image 块 → chat completions 的 image_url 分段：base64 写成 data: URL，url 原样（远程的图服务会说不替你下载）。"""
    src = block.get("source") if isinstance(block.get("source"), dict) else {}
    if src.get("type") == "base64" and isinstance(src.get("data"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{src.get('media_type', 'image/png')};base64,{src['data']}"}}
    if src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    raise ApiError(400, f"image 块的 source 应为 {{type: base64, media_type, data}} 或 {{type: url, url}}，收到 {show(src)}", field)


def turn(m, i: int) -> list:
    """Messages 的一条消息 → chat completions 的一条或几条（用户轮里的 tool_result 各是一条 tool 消息，排在前面）。"""
    field = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise ApiError(400, f"{field} 应为 {{role: user 或 assistant, content}}，收到 {show(m)}", field)
    blocks = m.get("content")
    blocks = [{"type": "text", "text": blocks}] if isinstance(blocks, str) else blocks
    if not isinstance(blocks, list):
        raise ApiError(400, f"{field}.content 应为字符串或内容块的列表，收到 {show(blocks)}", field)
    parts, calls, results, reasoning = [], [], [], ""
    for b in [b for b in blocks if isinstance(b, dict)]:
        kind = b.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": text_of([b], field)})
        elif kind == "image":
            parts.append(image_part(b, field))
        elif kind == "tool_use" and m["role"] == "assistant":
            calls.append({"id": b.get("id") or f"toolu_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text_of(b.get("content", ""), field)})
        elif kind == "thinking":
            reasoning += b.get("thinking") if isinstance(b.get("thinking"), str) else ""
    if m["role"] == "user":
        return results + ([{"role": "user", "content": parts}] if parts or not results else [])
    out = {"role": "assistant", "content": "".join(p.get("text", "") for p in parts if p["type"] == "text")}
    return [out | ({"tool_calls": calls} if calls else {}) | ({"reasoning_content": reasoning} if reasoning else {})]


def tools_of(body) -> dict:
    """tools 与 tool_choice → chat completions 的（只有自定义的工具：服务端工具的类型略过）。"""
    tools, choice, out = body.get("tools"), body.get("tool_choice"), {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is not None and kind not in ("auto", "any", "tool", "none"):
        raise ApiError(400, f"tool_choice 应为 {{type: auto、any、tool（带 name）或 none}}，收到 {show(choice)}", "tool_choice")
    if tools is None:
        if kind in ("any", "tool"):
            raise ApiError(400, f"tool_choice {kind} 要与 tools 一起给", "tool_choice")
        return out
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ApiError(400, f"tools 应为 {{name, description, input_schema}} 的列表，收到 {show(tools)}", "tools")
    out["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                       "parameters": t.get("input_schema") or {"type": "object"}}}
                    for t in tools if t.get("type") in (None, "custom")]
    if kind is not None:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
            {"type": "function", "function": {"name": choice.get("name")}}
    return out


def to_chat(body, server, counting: bool = False) -> dict:
    """Messages 的请求体 → chat completions 的请求体（查过的；counting：count_tokens，不要 max_tokens）。"""
    body = read(MessagesRequest, body)
    if not counting and (type(body.get("max_tokens")) is not int or body["max_tokens"] < 1):
        raise ApiError(400, f"max_tokens 是必需的正整数，收到 {show(body.get('max_tokens'))}", "max_tokens")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise ApiError(400, "messages 应为非空的列表", "messages")
    system = body.get("system", "")
    system = [b for b in system if not (isinstance(b, dict) and BILLING.match(str(b.get("text"))))] if isinstance(system, list) else system
    system = BILLING.sub("", text_of(system, "system"))
    messages = [{"role": "system", "content": system}] if system else []
    messages += [out for i, m in enumerate(body["messages"]) for out in turn(m, i)]
    chat = {"model": server.name, "messages": messages, **tools_of(body)}
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    fmt = body["output_config"].get("format") if isinstance(body.get("output_config"), dict) else None
    if fmt is not None:  # 结构化输出：{type: json_schema, schema} 即 chat completions 的 response_format
        schema = fmt.get("schema") if isinstance(fmt, dict) and fmt.get("type") == "json_schema" else None
        if not isinstance(schema, dict):
            raise ApiError(400, f"output_config.format 应为 {{type: json_schema, schema: {{…}}}}，收到 {show(fmt)}", "output_config")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    for ours, theirs in (("max_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k"), ("stop", "stop_sequences"), ("stream", "stream")):
        if body.get(theirs) is not None and not counting:
            chat[ours] = body[theirs]
    return chat


def content_blocks(message: dict) -> list:
    """chat completions 的助手消息 → Messages 的内容块：thinking、text、tool_use。"""
    blocks = [{"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}] if message.get("reasoning_content") else []
    blocks += [{"type": "text", "text": message["content"]}] if message.get("content") else []
    return blocks + [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": json.loads(c["function"]["arguments"])}
                     for c in message.get("tool_calls") or []]


def stop_reason(reply: Reply) -> tuple:
    """(stop_reason, stop_sequence)。"""
    c = reply.choices[0]
    _, reason = reply.finish(c)
    if c.reader.matched is not None:
        return "stop_sequence", c.reader.matched
    return STOP_REASONS.get(reason, "end_turn"), None


def usage(reply: Reply, output_tokens: int) -> dict:
    """Anthropic 的 usage：input_tokens 不含从留下的状态接着读的（那些是 cache_read_input_tokens，两者之和是提示词）。"""
    request = reply.choices[0].request
    return {"input_tokens": len(request.ids) - request.cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": request.cached_tokens, "cache_creation_input_tokens": 0}


def message(reply: Reply, name: str, content: list, output_tokens: int) -> dict:
    reason, sequence = stop_reason(reply) if content is not None else (None, None)
    return {"id": "msg_" + reply.id.split("-")[-1], "type": "message", "role": "assistant", "model": name,
            "content": content or [], "stop_reason": reason, "stop_sequence": sequence, "usage": usage(reply, output_tokens)}


async def messages(http: HttpRequest):
    """POST /v1/messages。"""
    server = http.app.state.server
    try:
        body = await server.read_body(http, key(http))
        job = await asyncio.to_thread(lambda: chat_job(to_chat(body, server), server, ceiling=True))
        reply = Reply(job, server.name)
        server.submit(job.requests[0])
    except ApiError as e:
        return JSONResponse(error_body(e), status_code=e.status)
    if job.stream:
        return StreamingResponse(events(reply, server.name), media_type="text/event-stream", headers={"cache-control": "no-cache"})
    try:
        whole = await reply.whole(http)
    except ApiError as e:
        return JSONResponse(error_body(e), status_code=e.status)
    return message(reply, server.name, content_blocks(whole["choices"][0]["message"]), whole["usage"]["completion_tokens"])


async def count_tokens(http: HttpRequest):
    """POST /v1/messages/count_tokens → {"input_tokens": n}：系统、工具与消息一起，与 /v1/messages 的提示词相同。"""
    server = http.app.state.server
    try:
        body = await server.read_body(http, key(http))
        ids = await asyncio.to_thread(lambda: chat_prompt(to_chat(body, server, counting=True), server).ids)
    except ApiError as e:
        return JSONResponse(error_body(e), status_code=e.status)
    return {"input_tokens": len(ids)}


def key(http) -> str | None:
    """x-api-key（Anthropic 的写法）或 Authorization: Bearer。"""
    given = http.headers.get("x-api-key")
    return f"Bearer {given}" if given is not None else http.headers.get("authorization")


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind} | data, ensure_ascii=False)}\n\n"


async def events(reply: Reply, name: str):
    """流式：Anthropic 的事件。思考与正文各是一个块（先思考后正文），工具调用各一个 tool_use 块，参数一次 input_json_delta。"""
    c, index, open_kind, sent = reply.choices[0], -1, None, ""
    try:
        yield event("message_start", {"message": message(reply, name, None, 0)})
        yield event("ping", {})
        async for reasoning, content, _ in reply.pieces(c):
            for kind, text in (("thinking", reasoning), ("text", content)):
                if not text:
                    continue
                if open_kind != kind:
                    if open_kind is not None:
                        yield event("content_block_stop", {"index": index})
                    index, open_kind = index + 1, kind
                    block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
                    yield event("content_block_start", {"index": index, "content_block": block})
                yield event("content_block_delta", {"index": index, "delta": {"type": f"{kind}_delta", kind: text}})
                sent += text if kind == "text" else ""
        calls, _ = reply.finish(c)
        if rest := c.reader.content[len(sent):]:  # 写坏了的工具调用并回了正文：同非流式的一样发出去
            if open_kind != "text":
                if open_kind is not None:
                    yield event("content_block_stop", {"index": index})
                index, open_kind = index + 1, "text"
                yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
            yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": rest}})
        if open_kind is not None:
            yield event("content_block_stop", {"index": index})
        for call in calls:
            index += 1
            start = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
            yield event("content_block_start", {"index": index, "content_block": start})
            yield event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                         "partial_json": call["function"]["arguments"]}})
            yield event("content_block_stop", {"index": index})
        reason, sequence = stop_reason(reply)
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage(reply, len(c.request.tokens))})
        yield event("message_stop", {})
    except Exception as e:  # 已经开始流式发送：错误作为一个 error 事件
        yield event("error", error_body(engine_error(e)))
    finally:
        reply.cancel()
