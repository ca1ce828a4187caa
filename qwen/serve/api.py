"""附录 · 服务（三）：OpenAI 兼容的 HTTP 接口。

    python -m qwen serve --model PATH|demo [--host 127.0.0.1] [--port 8000] [--api-key KEY]

GET /health（加载时 503，之后 200）、GET /v1/models、POST /v1/chat/completions、POST /v1/completions。
流式回答照 OpenAI 的做法用 SSE（Server-Sent Events）：第一块带 role，最后一块带 finish_reason，
stream_options.include_usage 时再加一块 choices 为空的 usage，最后是 `data: [DONE]`。
思考（chat_template_kwargs.enable_thinking）放进 reasoning_content，与 vLLM 的 Qwen3 推理解析器一样；
模型写的 <tool_call> 块变成 tool_calls（finish_reason 是 "tool_calls"）。不支持的字段（n > 1、logprobs、
response_format……）一律 400 说明，不默默忽略；出错的回答体是 OpenAI 的 {"error": {message, type, param, code}}。
引擎（engine.py）与 HTTP 无关：这一层只把请求翻译成 token、把 token 翻译回文字。
"""

import asyncio
import json
import re
import threading
import time
import uuid

from ..chat import Chat, TextStream, build_prompt
from ..conversation import generation_defaults
from .engine import Request

SAMPLING = ("temperature", "top_p", "top_k", "presence_penalty", "repetition_penalty")
COMMON = {"model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "seed", "stop", "user", "n",
          "frequency_penalty", "logprobs", "top_logprobs", "logit_bias", *SAMPLING}
CHAT_FIELDS = COMMON | {"messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                        "response_format"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}
TOOL_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class ApiError(Exception):
    """回给客户端的错误：HTTP 状态码与 OpenAI 的错误体。"""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                               "param": param, "code": code}}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 503: "service_unavailable", 500: "server_error"}


def number(body, name, low=None, high=None, integer=False, low_open=False):
    """body[name] 的数值（没给或 null 时 None）；类型、范围不对时 400，说明是哪个字段、要什么。"""
    value = body.get(name)
    if value is None:
        return None
    kind = "整数" if integer else "数"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ApiError(400, f"{name} 应为{kind}，收到 {json.dumps(value, ensure_ascii=False)[:40]}", name)
    if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
        bound = f"{'(' if low_open else '['}{low}, {high if high is not None else '∞'}{']' if high is not None else ')'}"
        raise ApiError(400, f"{name} 应在 {bound} 之内，收到 {value}", name)
    return value


class Server:
    """HTTP 层的状态：引擎（加载完之前是 None）、对话模板与分词器、限制。"""

    def __init__(self, name: str, api_key=None, max_body=1 << 20, max_prompt=None, max_tokens=4096):
        self.name = name
        self.api_key = api_key
        self.max_body = max_body
        self.max_prompt = max_prompt
        self.max_tokens = max_tokens
        self.engine = None
        self.chat = None
        self.defaults = {}
        self.load_error = None

    def ready(self, engine):
        self.chat = Chat(engine.model, mtp=False)
        self.defaults = generation_defaults(self.chat.path)
        self.max_prompt = self.max_prompt or engine.model.cfg.max_position_embeddings
        self.engine = engine

    # ---------- 请求 → Request ----------

    def check_common(self, body, fields):
        if not isinstance(body, dict):
            raise ApiError(400, "请求体应为 JSON 对象")
        unknown = sorted(set(body) - fields)
        if unknown:
            raise ApiError(400, f"不支持的字段 {', '.join(unknown)}", unknown[0])
        model = body.get("model")
        if model is not None and model != self.name:
            raise ApiError(404, f"没有模型 {model!r}：这里只有 {self.name!r}（见 GET /v1/models）", "model", "model_not_found")
        if number(body, "n", 1, integer=True) not in (None, 1):
            raise ApiError(400, "n 只支持 1：一次请求一个回答", "n")
        for name, off in (("logprobs", (None, False, 0)), ("top_logprobs", (None, 0)), ("logit_bias", (None, {})),
                          ("frequency_penalty", (None, 0)), ("echo", (None, False)), ("suffix", (None, "")),
                          ("best_of", (None, 1))):
            if body.get(name, None) not in off:
                raise ApiError(400, f"不支持 {name}", name)
        if not isinstance(body.get("stream", False), bool):
            raise ApiError(400, "stream 应为 true 或 false", "stream")

    def sampling(self, body) -> tuple[dict, int | None, int]:
        s = {"temperature": number(body, "temperature", 0, 2), "top_p": number(body, "top_p", 0, 1, low_open=True),
             "top_k": number(body, "top_k", -1, integer=True), "presence_penalty": number(body, "presence_penalty", -2, 2),
             "repetition_penalty": number(body, "repetition_penalty", 0, low_open=True)}
        if s["top_k"] in (-1, 0):  # vLLM 的写法：-1 或 0 是不截断
            s["top_k"] = None
        s = self.defaults | {k: v for k, v in s.items() if v is not None}
        seed = number(body, "seed", integer=True)
        limit = number(body, "max_completion_tokens", 1, self.max_tokens, integer=True)
        limit = limit or number(body, "max_tokens", 1, self.max_tokens, integer=True)
        return s, seed, limit or min(512, self.max_tokens)

    def stops(self, body) -> list[str]:
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, "stop 应为一个非空字符串或至多 4 个非空字符串的列表", "stop")
        return stop

    def request(self, ids, body, keep=None) -> Request:
        sampling, seed, limit = self.sampling(body)
        if len(ids) + limit > self.max_prompt:
            raise ApiError(400, f"提示词 {len(ids)} 个 token 加上 max_tokens {limit} 超过上限 {self.max_prompt}：请缩短提示词"
                                "或调小 max_tokens", "messages", "context_length_exceeded")
        return Request(ids, limit, self.chat.stop, sampling, seed, keep)

    def chat_request(self, body):
        self.check_common(body, CHAT_FIELDS)
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages 应为非空的列表", "messages")
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "tools 应为列表", "tools")
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise ApiError(400, "不支持 response_format（只能是 {\"type\": \"text\"}）", "response_format")
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = kwargs.get("enable_thinking", False) if isinstance(kwargs, dict) else None
        if not isinstance(thinking, bool) or set(kwargs) - {"enable_thinking"}:
            raise ApiError(400, "chat_template_kwargs 只支持 {\"enable_thinking\": true/false}", "chat_template_kwargs")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ApiError(400, f"messages[{i}] 应为对象", "messages")
        try:
            text = self.chat.prompt(messages, thinking, tools)
            ids = self.chat.encode(text)[0].tolist()
            keep = self.keep_point(messages, tools, ids)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        return self.request(ids, body, keep), thinking, self.stops(body), tools is not None

    def keep_point(self, messages, tools, ids):
        """最后一个用户问题结束的位置：下一轮一定原样出现，引擎在这里留一份状态（没有对话模板时 None）。"""
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not self.chat.templated or not users:
            return None
        prefix = self.chat.encode(build_prompt(messages[: users[-1] + 1], tools=tools, add_generation_prompt=False))
        prefix = prefix[0].tolist()
        return len(prefix) if ids[: len(prefix)] == prefix and len(prefix) < len(ids) else None

    def completion_request(self, body):
        self.check_common(body, COMPLETION_FIELDS)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt 应为非空字符串（一次一个）", "prompt")
        try:
            ids = self.chat.encode(prompt)[0].tolist()
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from None
        return self.request(ids, body), self.stops(body)


class Reader:
    """token → 文字，再切成 reasoning_content、content 与工具调用。停止字符串命中时截断并结束。
    流式时每次 feed 返回可以发出的 (reasoning 片段, content 片段)；留着可能是标记或停止字符串开头的尾巴。"""

    def __init__(self, tk, thinking: bool, stops, tools: bool):
        self.text = TextStream(tk)
        self.stops = stops
        self.thinking = thinking
        self.in_reasoning = thinking
        self.tools = tools
        self.pending = ""  # 还没发出的文字
        self.reasoning = ""
        self.content = ""
        self.calls_text = ""  # <tool_call> 之后的文字：最后一起解析
        self.stopped = False

    def feed(self, token=None, final=False):
        """再来一个 token（final：结束了，交出剩下的）→ 这次可以发出的 (reasoning 片段, content 片段)。"""
        self.pending += self.text.flush() if final else self.text.put(token)
        for s in self.stops:  # 停止字符串：它和它之后的都不要，生成也到此为止
            at = self.pending.find(s)
            if at >= 0:
                self.pending = self.pending[:at]
                self.stopped = final = True
        reasoning = content = ""
        if self.in_reasoning:
            at = self.pending.find("</think>")
            if at < 0:
                reasoning = self.emit(("</think>", *self.stops), final)
            else:
                reasoning = self.pending[:at]
                self.pending = self.pending[at + len("</think>"):]
                self.in_reasoning = False
        if not self.in_reasoning:
            at = self.pending.find("<tool_call>") if self.tools and not self.calls_text else -1
            if at >= 0 or self.calls_text:  # 工具调用：之后的文字攒起来，最后一起解析
                content = self.pending[: max(at, 0)]
                self.calls_text += self.pending[max(at, 0):]
                self.pending = ""
            else:
                content = self.emit((("<tool_call>",) if self.tools else ()) + tuple(self.stops), final)
        if self.thinking and not self.content:  # 模板在 </think> 之后空一行：正文从第一个不是换行的字开始
            content = content.lstrip("\n")
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def emit(self, marks, final: bool) -> str:
        """交出 pending，只留下末尾可能是某个标记开头的一段（结束时全交出）。"""
        keep = 0 if final else self.hold(marks)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out

    def hold(self, marks) -> int:
        """pending 末尾最长的、可能是某个标记开头的一段有多长（先不发）。"""
        best = 0
        for m in marks:
            for n in range(min(len(m) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(m[:n]):
                    best = n
                    break
        return best

    def tool_calls(self) -> list[dict]:
        calls = []
        for name, inner in TOOL_CALL.findall(self.calls_text):
            args = {}
            for key, value in PARAMETER.findall(inner):
                try:
                    args[key.strip()] = json.loads(value)
                except ValueError:
                    args[key.strip()] = value
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": name.strip(), "arguments": json.dumps(args, ensure_ascii=False)}})
        if self.calls_text and not calls:  # 写坏了的工具调用：原样当作文字交回去
            self.content += self.calls_text
        return calls


def usage(request: Request) -> dict:
    prompt = len(request.ids)
    return {"prompt_tokens": prompt, "completion_tokens": len(request.tokens),
            "total_tokens": prompt + len(request.tokens),
            "prompt_tokens_details": {"cached_tokens": request.cached_tokens}}


def create_app(server: Server):
    """FastAPI 应用（需要 pip install -e ".[serve]"）。"""
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="qwen", docs_url=None, redoc_url=None)

    def error(e: ApiError):
        return JSONResponse(e.body, status_code=e.status)

    def authorize(http: HttpRequest):
        if server.api_key is not None and http.headers.get("authorization") != f"Bearer {server.api_key}":
            raise ApiError(401, "缺少或错误的 API key：请在 Authorization 头里带上 Bearer <key>", code="invalid_api_key")

    async def read_body(http: HttpRequest):
        authorize(http)
        if server.engine is None:
            raise ApiError(503, "模型还在加载" if server.load_error is None else f"模型加载失败：{server.load_error}")
        size = http.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > server.max_body:
            raise ApiError(413, f"请求体超过 {server.max_body} 字节")
        raw = await http.body()
        if len(raw) > server.max_body:
            raise ApiError(413, f"请求体超过 {server.max_body} 字节")
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"请求体不是合法的 JSON：{e}") from None

    @app.exception_handler(ApiError)
    async def api_error(http, e: ApiError):
        return error(e)

    @app.exception_handler(Exception)
    async def unexpected(http, e: Exception):  # 服务器不因一个请求而停：报 500，接着服务别的请求
        return error(ApiError(500, f"服务器内部错误：{type(e).__name__}: {e}"))

    @app.get("/health")
    async def health():
        if server.engine is None:
            return JSONResponse({"status": "loading" if server.load_error is None else "failed"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(http: HttpRequest):
        authorize(http)
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0, "owned_by": "qwen"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        body = await read_body(http)
        request, thinking, stops, tools = server.chat_request(body)
        reader = Reader(server.chat.tk, thinking, stops, tools)
        return await respond(request, reader, body, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body = await read_body(http)
        request, stops = server.completion_request(body)
        return await respond(request, Reader(server.chat.tk, False, stops, False), body, chat=False)

    async def respond(request: Request, reader: Reader, body: dict, chat: bool):
        loop = asyncio.get_running_loop()
        tokens = asyncio.Queue()
        request.out = Forward(loop, tokens)
        try:
            server.engine.submit(request)
        except ValueError as e:  # 采样参数的组合不合法（第 12 章的 check_sampling）
            raise ApiError(400, str(e)) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        async def pieces():
            """逐块产出 (reasoning, content)；停止字符串命中时让引擎停下。"""
            while True:
                t = await tokens.get()
                if t is None:
                    if request.error is not None:
                        raise request.error
                    yield reader.feed(final=True)
                    return
                if t in server.chat.stop or reader.stopped:
                    continue
                out = reader.feed(t)
                if reader.stopped:
                    request.cancel()
                yield out

        def finish():
            calls = reader.tool_calls() if chat else []
            reason = "stop" if reader.stopped else request.finish_reason
            return calls, "tool_calls" if calls else ("stop" if reason == "cancelled" else reason)

        if not body.get("stream"):
            try:
                async for _ in pieces():
                    pass
            finally:
                request.cancel()
            calls, reason = finish()
            if chat:
                message = {"role": "assistant", "content": reader.content or (None if calls else "")}
                if reader.reasoning:
                    message["reasoning_content"] = reader.reasoning
                if calls:
                    message["tool_calls"] = calls
                choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": reader.content, "finish_reason": reason, "logprobs": None}
            return {"id": rid, "object": kind, "created": created, "model": server.name, "choices": [choice],
                    "usage": usage(request)}

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices, **more):
            data = {"id": rid, "object": chunk_kind, "created": created, "model": server.name, "choices": choices}
            return f"data: {json.dumps(data | more, ensure_ascii=False)}\n\n"

        def delta(**fields):
            if chat:
                return [{"index": 0, "delta": fields, "finish_reason": None, "logprobs": None}]
            return [{"index": 0, "text": fields.get("content", ""), "finish_reason": None, "logprobs": None}]

        async def events():
            try:
                if chat:
                    yield chunk(delta(role="assistant", content=""))
                async for r, c in pieces():
                    if r:
                        yield chunk(delta(reasoning_content=r))
                    if c:
                        yield chunk(delta(content=c))
                calls, reason = finish()
                if calls:
                    yield chunk(delta(tool_calls=[{"index": i, **call} for i, call in enumerate(calls)]))
                last = {"index": 0, "finish_reason": reason, "logprobs": None}
                yield chunk([last | ({"delta": {}} if chat else {"text": ""})])
                if include_usage:
                    yield chunk([], usage=usage(request))
                yield "data: [DONE]\n\n"
            except Exception as e:  # 已经开始流式发送：错误作为一块 error 发出
                yield f"data: {json.dumps(ApiError(500, str(e)).body, ensure_ascii=False)}\n\n"
            finally:
                request.cancel()  # 客户端断开（或出错）：引擎在下一个 token 之前停下，释放这个请求的状态

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class Forward:
    """引擎线程放进来的 token 转交给事件循环里的 asyncio.Queue（线程安全）。"""

    def __init__(self, loop, q):
        self.loop = loop
        self.q = q

    def put(self, item):
        self.loop.call_soon_threadsafe(self.q.put_nowait, item)


def serve(load, name: str, host="127.0.0.1", port=8000, api_key=None, **limits):
    """在后台线程里加载（load() → Engine），同时开始监听：加载完之前 /health 是 503。"""
    import uvicorn

    server = Server(name, api_key, **limits)

    def loading():
        try:
            server.ready(load())
        except Exception as e:
            server.load_error = e

    threading.Thread(target=loading, daemon=True).start()
    uvicorn.run(create_app(server), host=host, port=port, log_level="warning")
