"""附录 · 服务（四）：OpenAI 兼容的 HTTP 接口（FastAPI + uvicorn，pip install -e ".[serve]"）。

    python -m qwen serve --model PATH|demo [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--allow-origin URL]

GET /health（加载时 503，之后 200）、GET /v1/models、POST /v1/chat/completions、POST /v1/completions；给运维的 GET /metrics
（metrics.py）、POST /tokenize 与 /detokenize（tokenize.py），Anthropic 的 POST /v1/messages 与 count_tokens（anthropic.py），
OpenAI 的 POST /v1/responses（responses.py），GET /docs 是 FastAPI 的接口页。这一页只有应用本身：
Server（加载、关闭、读请求体）与各个接口；别的按一件事一个文件：
- access.py：Host、Origin、Content-Type 的防线与 API key（最外层的中间件 Guard）；
- protocol.py：每个接口的请求体是一个 pydantic 模型（接口页的请求体也从它来）；body.py、messages.py、requests.py：请求体
  → 查过的 Job（引擎的 Request 与读回文字的 Reader），坏的一律 4xx，OpenAI 的错误体（errors.py），404、405 与意料之外的
  500 也是；
- reader.py：token → reasoning_content、content、tool_calls，停止字符串；
- sse.py：回答体与流式的 SSE，引擎的线程与事件循环之间的桥，客户端断开时让引擎停下；
- listen.py：uvicorn 的连接（空着的连接几秒后关掉、TCP keepalive）与关闭。
引擎（engine.py）与 HTTP 无关：这一层只把请求翻译成 token、把 token 翻译回文字。
"""

import asyncio
import sys
import threading

from fastapi import FastAPI, Request as HttpRequest
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..chat import Chat
from ..conversation import Prompt, generation_defaults, template_defaults
from ..sampling.grammar import Grammars
from ..sampling.logprobs import token_bytes
from . import anthropic, responses
from .access import Access, Guard
from .body import parse_json
from ..vision import VisionTower
from .engine import Closed, Request, in_own_team
from .errors import ApiError, engine_error
from .listen import uvicorn_server
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, schema
from .requests import Job, chat_job, completion_job
from .sse import Reply
from .tokenize import detokenize, tokenize

MAX_BODY = 20 << 20  # 请求体默认至多 20 MB：带图的请求是 base64 的 data: URL（OpenAI 一张图收到 20 MB）
ROUTES = ("GET /health、GET /metrics、GET /v1/models、POST /v1/chat/completions、POST /v1/completions、POST /v1/messages、"
          "POST /v1/messages/count_tokens、POST /v1/responses、POST /tokenize、POST /detokenize、GET /docs")


class Server:
    """HTTP 层的状态：引擎（加载完之前是 None）、对话模板与分词器、限制与访问规则（Access）。
    host：监听的地址（它也是合法的 Host）；allow_hosts / allow_origins：另外放行的 Host 名与 Origin（"*" 是全部）。"""

    def __init__(self, name: str, api_key=None, max_body=MAX_BODY, max_prompt=None, max_tokens=4096, host="127.0.0.1",
                 allow_hosts=(), allow_origins=(), body_timeout=30.0, header_timeout=10.0, default_chat_template_kwargs=None):
        self.name = name
        self.given_template_kwargs = default_chat_template_kwargs or {}  # --default-chat-template-kwargs
        self.access = Access(api_key, host, allow_hosts, allow_origins)
        self.max_body = max_body
        self.max_prompt = max_prompt
        self.max_tokens = max_tokens
        self.body_timeout = body_timeout  # 请求体至多读这么多秒
        self.header_timeout = header_timeout  # 连上之后（或上一个回答之后）这么多秒内要发完请求头
        self.engine = None
        self.chat = None
        self.prompt = None  # 对话消息的主人：用哪个模板、模板的参数、客户的文字只是文字（qwen/conversation/prompt.py）
        self.defaults = {}  # 检查点推荐的采样设置（generation_config.json）
        self.template_kwargs = {}  # 交给模板的默认参数：检查点的 default_chat_template_kwargs，叠上 --default-chat-template-kwargs
        self.load_error = None
        self.closing = False
        self.tower = None  # 视觉塔（第 15 章）：第一个带图的请求来时才读
        self.tower_lock = threading.Lock()
        self.table = None  # 结构化输出的分词器表（qwen/sampling/grammar.py 的 Grammars）：第一个带 response_format 的请求来时才建
        self.pieces = None  # 每个 token 的字节（qwen/sampling/logprobs.py 的 token_bytes）：第一个要对数概率的请求来时才建
        self.vocab_size = None

    def ready(self, engine):
        self.chat = Chat(engine.model)
        self.prompt = Prompt(self.chat)
        self.defaults = generation_defaults(self.chat.path)
        self.template_kwargs = self.prompt.check(template_defaults(self.chat.path) | self.given_template_kwargs)
        engine.metrics = Metrics(engine)  # 引擎记下每个请求的 token、延迟与草稿；GET /metrics 读它
        self.max_prompt = self.max_prompt or engine.model.cfg.max_position_embeddings
        self.vocab_size = engine.model.cfg.vocab_size
        self.engine = engine
        if self.closing:  # 加载时就收到了 SIGTERM
            engine.close()

    def see(self, parts, most: int):
        """消息里的图 → Images（第 15 章）：塔在一个只活这一次的线程里算（engine.in_own_team：请求线程不开自己的 OpenMP 队），
        与别的请求的解码同时跑。most：上下文还剩几个 token。检查点没有视觉塔、图读不了：ValueError（400）。"""
        with self.tower_lock:
            if self.tower is None:
                self.tower = VisionTower.from_pretrained(self.chat.path, dtype=self.engine.model.dtype)
        return in_own_team(lambda: self.tower.encode(parts, most), self.engine.threads)

    def grammars(self):
        """结构化输出的 Grammars（建一次；没装 llguidance 时 ImportError 说出要装的 extra）。"""
        with self.tower_lock:
            if self.table is None:
                self.table = Grammars(self.chat, self.engine.model.cfg.vocab_size)
        return self.table

    def token_bytes(self) -> list:
        """每个 token 的字节（logprobs 的 token 与 bytes 从它来；建一次）。"""
        with self.tower_lock:
            if self.pieces is None:
                self.pieces = token_bytes(self.chat.tk, self.vocab_size)
        return self.pieces

    def close(self):
        """关闭（SIGTERM）：不再接请求，没生成完的在下一个 token 之前停下。"""
        self.closing = True
        if self.engine is not None:
            self.engine.close()

    async def read_body(self, http, authorization: str | None = None) -> dict:
        """验过 key（authorization：另给的 Authorization 头，Anthropic 的 x-api-key 换成它）之后边读边数请求体：超过 max_body
        就 413（不必等它读完），body_timeout 秒读不完就 408。"""
        self.access.authorize(authorization or http.headers.get("authorization"))
        if self.engine is None or self.closing:
            raise ApiError(503, "服务正在关闭" if self.closing else "模型还在加载" if self.load_error is None
                           else f"模型加载失败：{self.load_error}")
        size = http.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body:
            raise ApiError(413, f"请求体超过 {self.max_body} 字节")
        try:
            raw = await asyncio.wait_for(self.read_capped(http), self.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"请求体 {self.body_timeout:g} 秒内没有读完") from None
        return parse_json(raw)

    async def read_capped(self, http) -> bytes:
        raw, parts = bytearray(), http.stream()
        async for part in parts:
            raw += part
            if len(raw) > self.max_body:
                await drain(parts, 4 * self.max_body)
                raise ApiError(413, f"请求体超过 {self.max_body} 字节")
        return bytes(raw)

    def submit(self, request: Request):
        try:
            self.engine.submit(request)
        except Closed as e:
            raise ApiError(503, str(e)) from None
        except ValueError as e:  # 引擎不收的请求（查过的请求不会有：留着给直接用 Engine 的代码）
            raise ApiError(400, str(e)) from None


async def drain(parts, most: int, idle: float = 0.5) -> None:
    """413 之前把客户还在发的请求体读掉扔了（至多 most 字节；idle 秒没有新的一块就不等了）：连接上还有没读的数据时关掉它，
    操作系统回的是 RST，客户往往连 413 都读不到，只看见“连接被重置”（nginx 的 lingering_close 也是为这个）。"""
    drained = 0
    try:
        while drained < most:
            drained += len(await asyncio.wait_for(parts.__anext__(), idle))
    except (StopAsyncIteration, asyncio.TimeoutError, ClientDisconnect):
        pass


# ---------- 四个接口 ----------


async def health(http: HttpRequest):
    server = http.app.state.server
    if server.engine is None or server.closing:
        status = "closing" if server.closing else "loading" if server.load_error is None else "failed"
        return JSONResponse({"status": status}, status_code=503)
    return {"status": "ok"}


async def models(http: HttpRequest):
    server = http.app.state.server
    server.access.authorize(http.headers.get("authorization"))
    return {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0, "owned_by": "qwen"}]}


async def chat_completions(http: HttpRequest):
    server = http.app.state.server
    body = await server.read_body(http)  # 查请求（带图时视觉塔看图）在线程里：事件循环不等它
    return await answer(http, server, await asyncio.to_thread(chat_job, body, server))


async def completions(http: HttpRequest):
    server = http.app.state.server
    return await answer(http, server, completion_job(await server.read_body(http), server))


async def tokenize_route(http: HttpRequest):
    server = http.app.state.server
    body = await server.read_body(http)
    return await asyncio.to_thread(tokenize, body, server)  # 带图的消息要视觉塔：在线程里


async def detokenize_route(http: HttpRequest):
    server = http.app.state.server
    return detokenize(await server.read_body(http), server)


async def metrics(http: HttpRequest):
    """Prometheus 的文本格式（metrics.py）；加载完之前是空的。不要 key（同 vLLM）：抓取的一方通常不带。"""
    engine = http.app.state.server.engine
    text = engine.metrics.text() if engine is not None and engine.metrics is not None else b""
    return Response(text, media_type=CONTENT_TYPE_LATEST)


async def answer(http, server: Server, job: Job):
    """交给引擎，再回答：流式的一块块 SSE，否则等整个回答体。Reply 先接好 token 的去处，再提交。"""
    reply = Reply(job, server.name)
    try:
        for request in job.requests:  # n 个回答：各是引擎里的一个请求
            server.submit(request)
    except ApiError:
        reply.cancel()  # 已经交出去的也不要了
        raise
    if job.stream:
        return StreamingResponse(reply.events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})
    return await reply.whole(http)


def create_app(server: Server) -> FastAPI:
    """FastAPI 应用：最外层是 Guard（access.py），放行的网页要读得到回答时再加 CORS，然后是四个接口与错误体。"""
    app = FastAPI(title="qwen", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.server = server
    if server.access.allow_origins:  # 放行的网页要读得到回答：CORS 的预检与响应头
        app.add_middleware(CORSMiddleware, allow_origins=sorted(server.access.allow_origins),
                           allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type", "x-api-key",
                                                                            "anthropic-version", "anthropic-beta"])
    app.add_middleware(Guard, access=server.access)
    for method, path, endpoint in (("GET", "/health", health), ("GET", "/metrics", metrics), ("GET", "/v1/models", models)):
        app.add_api_route(path, endpoint, methods=[method])
    for path, endpoint, model in (("/v1/chat/completions", chat_completions, ChatCompletionRequest),
                                  ("/v1/completions", completions, CompletionRequest),
                                  ("/v1/messages", anthropic.messages, anthropic.MessagesRequest),
                                  ("/v1/messages/count_tokens", anthropic.count_tokens, anthropic.MessagesRequest),
                                  ("/v1/responses", responses.responses, responses.ResponsesRequest),
                                  ("/tokenize", tokenize_route, TokenizeRequest), ("/detokenize", detokenize_route, DetokenizeRequest)):
        app.add_api_route(path, endpoint, methods=["POST"], openapi_extra=schema(model))  # 接口页上的请求体：protocol.py 的模型
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
    return app


# ---------- 错误体：我们的 ApiError、路由的 404 与 405、意料之外的 500 ----------


def error_response(e: ApiError, headers=None):
    return JSONResponse(e.body, status_code=e.status, headers=headers)


async def api_error(http, e: ApiError):
    return error_response(e)


async def http_error(http, e: HTTPException):  # 404（没有这个路径）、405（方法不对）
    what = {404: f"没有这个路径（接口是 {ROUTES}）", 405: "这个路径不接受这个方法"}.get(e.status_code, e.detail)
    return error_response(ApiError(e.status_code, f"{http.method} {http.url.path}：{what}"), e.headers)


async def unexpected(http, e: Exception):  # 服务器不因一个请求而停：报 500，接着服务别的请求
    return error_response(engine_error(e))


def serve(load, name: str, host="127.0.0.1", port=8000, api_key=None, **options):
    """在后台线程里加载（load() → Engine），同时开始监听：加载完之前 /health 是 503。加载失败时打印原因、退出码 1。
    options：Server 的别的参数（max_tokens、allow_hosts、allow_origins……）。"""
    server = Server(name, api_key, host=host, **options)
    uv = uvicorn_server(create_app(server), server, host=host, port=port)

    def loading():
        try:
            server.ready(load())
            print(f"（{server.prompt.describe()}）", file=sys.stderr)
        except Exception as e:
            server.load_error = e
            uv.should_exit = True

    threading.Thread(target=loading, daemon=True, name="qwen-load").start()
    uv.run()
    if server.load_error is not None:
        sys.exit(f"错误：模型加载失败：{type(server.load_error).__name__}: {server.load_error}")
