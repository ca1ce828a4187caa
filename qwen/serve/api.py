"""附录 · 服务（三）：OpenAI 兼容的 HTTP 接口。

    python -m qwen serve --model PATH|demo [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--allow-origin URL]

GET /health（加载时 503，之后 200）、GET /v1/models、POST /v1/chat/completions、POST /v1/completions。
流式回答照 OpenAI 的做法用 SSE（Server-Sent Events）：第一块带 role，最后一块带 finish_reason，
stream_options.include_usage 时再加一块 choices 为空的 usage，最后是 `data: [DONE]`。
思考（chat_template_kwargs.enable_thinking）放进 reasoning_content，与 vLLM 的 Qwen3 推理解析器一样；
模型写的 <tool_call> 块变成 tool_calls（finish_reason 是 "tool_calls"），它们原样送回来也收。

没有哪个请求能伤到服务器：
- 坏的请求一律 4xx，回答体是 OpenAI 的 {"error": {message, type, param, code}}（404、405 也是）。输入在进 torch 与分词器之前
  查完：JSON 的嵌套深度、不成对的代理字符、NaN 与 Infinity、每个字段的类型与范围、每条消息与每个工具。不支持的一律说明
  并拒绝（n > 1、logprobs、tool_choice "none"……），不默默忽略；
- 请求体边读边数，超过上限就 413；客户端断开（流式或不是、生成中或排队）时引擎在下一个 token 之前停下；
  空着、或请求头只发一半的连接几秒后关掉；关闭（SIGTERM）时不再接请求，没生成完的几秒内结束；
- 本机的服务也防着浏览器里的网页（DNS rebinding 与跨站的“简单请求”）：Host 不是本机或 --host 的、Origin 不是本服务或
  --allow-origin 的请求 403；POST 必须是 application/json；API key 按常数时间比较。
引擎（engine.py）与 HTTP 无关：这一层只把请求翻译成 token、把 token 翻译回文字。
"""

import asyncio
import hmac
import ipaddress
import json
import math
import re
import socket
import sys
import threading
import time
import uuid

from ..chat import Chat, TextStream, build_prompt
from ..conversation import generation_defaults
from .engine import Closed, Request

SAMPLING = ("temperature", "top_p", "top_k", "presence_penalty", "repetition_penalty")
COMMON = {"model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "seed", "stop", "user", "n",
          "frequency_penalty", "logprobs", "top_logprobs", "logit_bias", *SAMPLING}
CHAT_FIELDS = COMMON | {"messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                        "response_format"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}
TOOL_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
MAX_DEPTH = 64  # 请求体（与工具调用的 arguments）的 JSON 至多嵌套这么多层
MAX_STOP = 500  # 一个停止字符串至多这么多个字
GREEDY_BELOW = 1e-5  # 比这还低的 temperature 按贪心算（与 vLLM 相同：再低 logits / temperature 就溢出了）
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # 函数名：OpenAI 的规则另加 “.”；写进 <function=…> 也不会出错
SEED = (-2**63, 2**63 - 1)


class ApiError(Exception):
    """回给客户端的错误：HTTP 状态码与 OpenAI 的错误体。"""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                               "param": param, "code": code}}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 503: "service_unavailable", 500: "server_error"}


def show(value) -> str:
    """错误信息里收到的值：JSON 的写法，至多 40 个字。"""
    return json.dumps(value, ensure_ascii=False)[:40]


# ---------- 请求体：JSON 本身 ----------


def reject_constant(name):
    raise ValueError(f"{name} 不是 JSON 的数")


def finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} 超出了浮点数的范围")
    return value


def parse_json(raw, path=""):
    """bytes 或 str → JSON 的值，再查一遍 check_tree。NaN、Infinity 与溢出的数不收（json 模块默认收）。
    path：它在请求体里的位置（"" 是请求体本身；工具调用的 arguments 是个 JSON 字符串，也这样读）。"""
    what = f"{path} 的字符串" if path else "请求体"
    try:
        value = json.loads(raw, parse_constant=reject_constant, parse_float=finite_float)
    except RecursionError:
        raise ApiError(400, f"{what}嵌套太深（至多 {MAX_DEPTH} 层）", top(path)) from None
    except ValueError as e:  # 含 UnicodeDecodeError：不是 UTF-8
        raise ApiError(400, f"{what}不是合法的 JSON：{e}", top(path)) from None
    check_tree(value, path)
    return value


def top(path: str) -> str | None:
    """messages[0].content → messages（错误体的 param）。"""
    return re.split(r"[.\[]", path)[0] or None


def check_tree(value, path=""):
    """JSON 的值里每个字符串（含键）都是合法的 Unicode（"\\ud800" 这样不成对的代理字符进不了分词器，也写不回 UTF-8），
    嵌套不超过 MAX_DEPTH 层。不递归：多深的值都查得完。"""
    stack = [(value, path, 0)]
    while stack:
        value, at, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"{path or '请求体'}嵌套太深（至多 {MAX_DEPTH} 层）", top(path))
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"{at or '请求体'} 里有不成对的代理字符（比如 \\ud800）：不是合法的 Unicode",
                               top(at)) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack += [(key, at, depth + 1), (item, f"{at}.{key}" if at else str(key), depth + 1)]
        elif isinstance(value, list):
            stack += [(item, f"{at}[{i}]", depth + 1) for i, item in enumerate(value)]


# ---------- 请求体：字段 ----------


def number(body, name, low=None, high=None, integer=False, low_open=False):
    """body[name] 的数值（没给或 null 时 None）；类型、范围不对时 400，说明是哪个字段、要什么。"""
    value = body.get(name)
    if value is None:
        return None
    kind = "整数" if integer else "数"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) \
            or (isinstance(value, float) and not math.isfinite(value)):
        raise ApiError(400, f"{name} 应为{kind}，收到 {show(value)}", name)
    if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
        bound = f"{'(' if low_open else '['}{low}, {high if high is not None else '∞'}{']' if high is not None else ')'}"
        raise ApiError(400, f"{name} 应在 {bound} 之内，收到 {value}", name)
    return value


def flag(body, name, default=False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} 应为 true 或 false，收到 {show(value)}", name)
    return value


def stream_flags(body) -> tuple[bool, bool]:
    """(stream, include_usage)。stream_options 只能与 stream: true 一起给（与 OpenAI 相同）。"""
    stream, options = flag(body, "stream"), body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise ApiError(400, "stream_options 只能与 \"stream\": true 一起用", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, f"stream_options 应为 {{\"include_usage\": true/false}}，收到 {show(options)}", "stream_options")
    return stream, flag(options, "include_usage")


def stops(body) -> list[str]:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP for s in stop):
        raise ApiError(400, f"stop 应为一个非空字符串或至多 4 个非空字符串的列表（每个至多 {MAX_STOP} 个字）", "stop")
    return stop


# ---------- 请求体：消息与工具 ----------

MESSAGE_KEYS = {"system": {"role", "content"}, "user": {"role", "content"},
                "assistant": {"role", "content", "tool_calls", "reasoning_content"},
                "tool": {"role", "content", "tool_call_id"}}
EMPTY_KEYS = {"refusal", "function_call", "audio", "annotations"}  # OpenAI 回答里的这些常是 null：原样送回时为空就收
NO_TEMPLATE = "这个检查点没有对话模板（比如 demo）：各条消息的内容原样接起来让它续写，"


def content_text(m: dict, where: str) -> str:
    """消息的 content → 文字：字符串，或 [{"type": "text", "text": …}] 分段（拼起来）。助手的可以没有（只有工具调用时）。"""
    content = m.get("content")
    if content is None:
        if m["role"] == "assistant" and m.get("tool_calls"):
            return ""
        raise ApiError(400, f"{where}.content 缺少或为 null：{m['role']} 消息要有文字", "messages")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content 应为字符串或文字分段的列表，收到 {show(content)}", "messages")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str) \
                or set(part) - {"type", "text"}:
            raise ApiError(400, f"{where}.content[{j}] 应为 {{\"type\": \"text\", \"text\": …}}（这里不支持图像、音频与文件），"
                                f"收到 {show(part)}", "messages")
    return "".join(part["text"] for part in content)


def function_name(name, where: str) -> str:
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ApiError(400, f"{where} 应为 1 到 64 个字母、数字、_、.、- 组成的函数名，收到 {show(name)}", top(where))
    return name


def arguments(value, where: str) -> dict:
    """工具调用的参数：OpenAI 的写法是 JSON 字符串（"{\\"city\\": \\"Paris\\"}"），也收对象；都要是 JSON 对象。"""
    if isinstance(value, str):
        value = parse_json(value, where) if value.strip() else {}
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ApiError(400, f"{where} 应为 JSON 对象（或写着 JSON 对象的字符串），收到 {show(value)}", "messages")
    for key in value:
        if not key or any(c in key for c in "<>\n"):
            raise ApiError(400, f"{where} 的参数名 {show(key)} 不能为空，也不能有 <、> 或换行", "messages")
    return value


def tool_calls(calls, where: str) -> list[dict]:
    """助手消息里的工具调用（OpenAI 的写法）→ build_prompt 要的 {"function": {"name", "arguments": dict}}。"""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls 应为列表，收到 {show(calls)}", "messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or set(call) - {"id", "type", "function", "index"} \
                or call.get("type", "function") != "function" or set(fn) - {"name", "arguments"}:
            raise ApiError(400, f"{at} 应为 {{\"id\": …, \"type\": \"function\", \"function\": {{\"name\": …, "
                                f"\"arguments\": …}}}}，收到 {show(call)}", "messages")
        out.append({"type": "function", "function": {"name": function_name(fn.get("name"), f"{at}.function.name"),
                                                     "arguments": arguments(fn.get("arguments"), f"{at}.function.arguments")}})
    return out


def check_message(m, i: int, templated: bool) -> dict:
    """一条消息 → {"role", "content": 文字, 可选 "tool_calls"、"reasoning_content"}；不认识的角色、字段、类型都 400。"""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ApiError(400, f"{where} 应为对象，收到 {show(m)}", "messages")
    role = m.get("role")
    if role not in MESSAGE_KEYS:
        raise ApiError(400, f"{where}.role 应为 system、user、assistant、tool 之一，收到 {show(role)}", "messages")
    extra = sorted(k for k in m if k not in MESSAGE_KEYS[role] and not (k in EMPTY_KEYS and not m[k]))
    if extra:
        raise ApiError(400, f"{where}（{role}）不支持字段 {', '.join(extra)}", "messages")
    out = {"role": role, "content": content_text(m, where)}
    if m.get("tool_calls"):
        out["tool_calls"] = tool_calls(m["tool_calls"], where)
    if m.get("reasoning_content") is not None:
        if not isinstance(m["reasoning_content"], str):
            raise ApiError(400, f"{where}.reasoning_content 应为字符串", "messages")
        out["reasoning_content"] = m["reasoning_content"]
    if m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
        raise ApiError(400, f"{where}.tool_call_id 应为字符串", "messages")
    if not templated and (role in ("system", "tool") or set(out) - {"role", "content"}):
        what = f"{role} 消息" if role in ("system", "tool") else "工具调用与 reasoning_content"
        raise ApiError(400, f"{where}：{NO_TEMPLATE}{what}放不进去", "messages")
    return out


def check_messages(messages, templated: bool) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, f"messages 应为非空的列表，收到 {show(messages)}", "messages")
    return [check_message(m, i, templated) for i, m in enumerate(messages)]


def check_tools(body, templated: bool) -> list | None:
    """tools：每个是 {"type": "function", "function": {"name", "description", "parameters"}}；空列表等于没给。
    tool_choice 只支持 "auto"（模型自己决定），parallel_tool_calls 只支持 true：别的我们做不到，就不收。"""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "auto"):
        raise ApiError(400, f"tool_choice 只支持 \"auto\"（模型自己决定调不调工具），收到 {show(choice)}", "tool_choice")
    if body.get("parallel_tool_calls") not in (None, True):
        raise ApiError(400, "parallel_tool_calls 只支持 true：模型一次可以写几个工具调用", "parallel_tool_calls")
    if tools is None or tools == []:
        return None
    if not templated:
        raise ApiError(400, f"{NO_TEMPLATE}tools 放不进去", "tools")
    if not isinstance(tools, list):
        raise ApiError(400, f"tools 应为列表，收到 {show(tools)}", "tools")
    names = set()
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"} \
                or set(fn) - {"name", "description", "parameters", "strict"}:
            raise ApiError(400, f"tools[{j}] 应为 {{\"type\": \"function\", \"function\": {{\"name\": …, \"description\": …, "
                                f"\"parameters\": {{…}}}}}}，收到 {show(tool)}", "tools")
        name = function_name(fn.get("name"), f"tools[{j}].function.name")
        if name in names:
            raise ApiError(400, f"tools 里有两个 {name}", "tools")
        names.add(name)
        if not isinstance(fn.get("description", ""), str) or not isinstance(fn.get("parameters", {}), dict):
            raise ApiError(400, f"tools[{j}].function 的 description 应为字符串、parameters 应为对象（JSON Schema）", "tools")
        if fn.get("strict"):
            raise ApiError(400, f"tools[{j}]：不支持 strict（输出不受 JSON Schema 约束）", "tools")
    return tools


def thinking(body, templated: bool) -> bool:
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    value = kwargs.get("enable_thinking", False) if isinstance(kwargs, dict) else None
    if not isinstance(value, bool) or set(kwargs) - {"enable_thinking"}:
        raise ApiError(400, "chat_template_kwargs 只支持 {\"enable_thinking\": true/false}", "chat_template_kwargs")
    if value and not templated:
        raise ApiError(400, f"{NO_TEMPLATE}不会思考", "chat_template_kwargs")
    return value


def host_name(host: str) -> str:
    """Host 头或 --host → 小写的名字（去掉端口与 IPv6 的方括号）。"""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]")[0]
    return host.split(":")[0] if host.count(":") == 1 else host


class Server:
    """HTTP 层的状态：引擎（加载完之前是 None）、对话模板与分词器、限制与访问规则。
    host：监听的地址（它也是合法的 Host）；allow_hosts / allow_origins：另外放行的 Host 名与 Origin（"*" 是全部）。"""

    def __init__(self, name: str, api_key=None, max_body=1 << 20, max_prompt=None, max_tokens=4096, host="127.0.0.1",
                 allow_hosts=(), allow_origins=(), body_timeout=30.0, header_timeout=10.0):
        self.name = name
        self.api_key = api_key
        self.max_body = max_body
        self.max_prompt = max_prompt
        self.max_tokens = max_tokens
        self.host = host
        self.allow_hosts = {h.lower() for h in allow_hosts}
        self.allow_origins = {o.rstrip("/").lower() for o in allow_origins}
        self.body_timeout = body_timeout  # 请求体至多读这么多秒
        self.header_timeout = header_timeout  # 连上之后（或上一个回答之后）这么多秒内要发完请求头
        self.engine = None
        self.chat = None
        self.defaults = {}
        self.load_error = None
        self.closing = False

    def ready(self, engine):
        self.chat = Chat(engine.model, mtp=False)
        self.defaults = generation_defaults(self.chat.path)
        self.max_prompt = self.max_prompt or engine.model.cfg.max_position_embeddings
        self.engine = engine
        if self.closing:  # 加载时就收到了 SIGTERM
            engine.close()

    def close(self):
        """关闭（SIGTERM）：不再接请求，没生成完的在下一个 token 之前停下。"""
        self.closing = True
        if self.engine is not None:
            self.engine.close()

    # ---------- 访问 ----------

    def authorize(self, header: str | None):
        """Authorization: Bearer <key>（"Bearer" 不分大小写，key 按常数时间比较：比较的时间不泄露 key 的前缀）。"""
        if self.api_key is None:
            return
        scheme, _, token = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "缺少或错误的 API key：请在 Authorization 头里带上 Bearer <key>", code="invalid_api_key")

    def host_ok(self, host: str) -> bool:
        """Host 头（去掉端口）是本机的名字、一个 IP 地址、--host 或 --allow-host 的：DNS rebinding 的网页发来的 Host
        是攻击者的域名。端口不查：ssh -L、docker -p 转发之后端口会变。"""
        name = host_name(host)
        if not name or "*" in self.allow_hosts or name in self.allow_hosts or name == host_name(self.host) \
                or name == "localhost" or name.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False

    def origin_ok(self, origin: str, host: str) -> bool:
        """Origin 是这个服务自己（http://<Host>）或 --allow-origin 的。浏览器跨站发请求时一定带 Origin。"""
        origin = origin.rstrip("/").lower()
        return "*" in self.allow_origins or origin in self.allow_origins or origin in (f"http://{host}".lower(),
                                                                                     f"https://{host}".lower())

    def guard(self, method: str, headers) -> ApiError | None:
        """浏览器里的网页能向 127.0.0.1 发请求：Host 或 Origin 不对的 403；POST 不是 application/json 的 415
        （text/plain 的 POST 是 CORS 的“简单请求”，浏览器不先问一声就发）。"""
        host = headers.get("host", "")
        if not self.host_ok(host):
            return ApiError(403, f"Host {host!r} 不是这个服务的地址：若经过反向代理或用别的域名访问，请用 --allow-host 放行",
                            code="forbidden_host")
        origin = headers.get("origin")
        if origin is not None and not self.origin_ok(origin, host):
            return ApiError(403, f"不接受来自 {origin!r} 的网页的请求：需要的话请用 --allow-origin {origin} 放行",
                            code="forbidden_origin")
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if method == "POST" and kind != "application/json":
            return ApiError(415, f"POST 的 Content-Type 应为 application/json，收到 {kind or '（没有）'!r}")
        return None

    async def read_body(self, http) -> dict:
        """验过 key 之后边读边数请求体：超过 max_body 就 413（不必等它读完），body_timeout 秒读不完就 408。"""
        self.authorize(http.headers.get("authorization"))
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
        raw = bytearray()
        async for part in http.stream():
            raw += part
            if len(raw) > self.max_body:
                raise ApiError(413, f"请求体超过 {self.max_body} 字节")
        return bytes(raw)

    # ---------- 请求 → Request ----------

    def check_common(self, body, fields):
        if not isinstance(body, dict):
            raise ApiError(400, "请求体应为 JSON 对象")
        unknown = sorted(set(body) - fields)
        if unknown:
            raise ApiError(400, f"不支持的字段 {', '.join(unknown)}", unknown[0])
        model = body.get("model")
        if model is not None and model != self.name:
            raise ApiError(404, f"没有模型 {show(model)}：这里只有 {self.name!r}（见 GET /v1/models）", "model",
                           "model_not_found")
        if number(body, "n", 1, integer=True) not in (None, 1):
            raise ApiError(400, "n 只支持 1：一次请求一个回答", "n")
        for name, off in (("logprobs", False), ("top_logprobs", 0), ("logit_bias", {}), ("frequency_penalty", 0),
                          ("echo", False), ("suffix", ""), ("best_of", 1)):
            value = body.get(name)
            if value is not None and (value != off or isinstance(value, bool) != isinstance(off, bool)):
                raise ApiError(400, f"不支持 {name}（只能不给或是 {show(off)}）", name)
        if not isinstance(body.get("user", ""), str):
            raise ApiError(400, "user 应为字符串", "user")

    def sampling(self, body) -> tuple[dict, int | None, int]:
        s = {"temperature": number(body, "temperature", 0, 2), "top_p": number(body, "top_p", 1e-6, 1),
             "top_k": number(body, "top_k", -1, integer=True), "presence_penalty": number(body, "presence_penalty", -2, 2),
             "repetition_penalty": number(body, "repetition_penalty", 0.01, 100)}
        if s["top_k"] in (-1, 0):  # vLLM 的写法：-1 或 0 是不截断
            s["top_k"] = None
        if s["temperature"] is not None and s["temperature"] < GREEDY_BELOW:
            s["temperature"] = 0
        s = self.defaults | {k: v for k, v in s.items() if v is not None}
        seed = number(body, "seed", *SEED, integer=True)
        longest = number(body, "max_completion_tokens", 1, self.max_tokens, integer=True)
        limit = number(body, "max_tokens", 1, self.max_tokens, integer=True)
        return s, seed, longest or limit or min(512, self.max_tokens)

    def request(self, ids, body, keep=None) -> Request:
        sampling, seed, limit = self.sampling(body)
        if len(ids) + limit > self.max_prompt:
            raise ApiError(400, f"提示词 {len(ids)} 个 token 加上 max_tokens {limit} 超过上限 {self.max_prompt}：请缩短提示词"
                                "或调小 max_tokens", "messages", "context_length_exceeded")
        return Request(ids, limit, self.chat.stop, sampling, seed, keep)

    def chat_request(self, body) -> "Job":
        self.check_common(body, CHAT_FIELDS)
        templated = self.chat.templated
        messages, tools = check_messages(body.get("messages"), templated), check_tools(body, templated)
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise ApiError(400, "不支持 response_format（只能是 {\"type\": \"text\"}）", "response_format")
        think = thinking(body, templated)
        try:
            text = self.chat.prompt(messages, think, tools)
            ids = self.chat.encode(text)[0].tolist()
            keep = self.keep_point(messages, tools, ids)
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        reader = Reader(self.chat.tk, think, stops(body), tools is not None)
        return Job(self.request(ids, body, keep), reader, *stream_flags(body), chat=True)

    def keep_point(self, messages, tools, ids):
        """最后一个用户问题结束的位置：下一轮一定原样出现，引擎在这里留一份状态（没有对话模板时 None）。"""
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not self.chat.templated or not users:
            return None
        prefix = self.chat.encode(build_prompt(messages[: users[-1] + 1], tools=tools, add_generation_prompt=False))
        prefix = prefix[0].tolist()
        return len(prefix) if ids[: len(prefix)] == prefix and len(prefix) < len(ids) else None

    def completion_request(self, body) -> "Job":
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
        reader = Reader(self.chat.tk, False, stops(body), False)
        return Job(self.request(ids, body), reader, *stream_flags(body), chat=False)

    def submit(self, request: Request):
        try:
            self.engine.submit(request)
        except Closed as e:
            raise ApiError(503, str(e)) from None
        except ValueError as e:  # 采样参数的组合不合法（第 12 章的 check_sampling）
            raise ApiError(400, str(e)) from None


class Job:
    """一个验过的请求：引擎的 Request、把 token 读回文字的 Reader、流不流式、要不要 usage 块、是不是对话。"""

    def __init__(self, request: Request, reader, stream: bool, include_usage: bool, chat: bool):
        self.request = request
        self.reader = reader
        self.stream = stream
        self.include_usage = include_usage
        self.chat = chat


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


def engine_error(e: Exception) -> ApiError:
    """引擎交回的错误 → 回给客户端的：关闭 503，我们自己的 ApiError 原样，别的 500。"""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Closed):
        return ApiError(503, str(e))
    return ApiError(500, f"服务器内部错误：{type(e).__name__}: {e}")


class Reply:
    """一个请求的回答：从引擎读 token，拼成 OpenAI 的回答体（whole）或一块块 SSE（events）。"""

    def __init__(self, server: Server, job: Job):
        self.server = server
        self.job = job
        self.request, self.reader, self.chat = job.request, job.reader, job.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.tokens = asyncio.Queue()
        self.request.out = Forward(asyncio.get_running_loop(), self.tokens)

    async def pieces(self):
        """逐块产出 (reasoning, content)；停止字符串命中时让引擎停下。"""
        request, reader, stop = self.request, self.reader, self.server.chat.stop
        while True:
            t = await self.tokens.get()
            if t is None:
                if request.error is not None and not reader.stopped:  # 停止字符串之后的错误（比如关闭）无关紧要
                    raise engine_error(request.error)
                yield reader.feed(final=True)
                return
            if t in stop or reader.stopped:
                continue
            out = reader.feed(t)
            if reader.stopped:
                request.cancel()
            yield out

    def finish(self):
        calls = self.reader.tool_calls() if self.chat else []
        reason = "stop" if self.reader.stopped else self.request.finish_reason
        return calls, "tool_calls" if calls else ("stop" if reason == "cancelled" else reason)

    async def whole(self, http) -> dict:
        """非流式：等回答写完。等的时候看着连接：客户端断开就让引擎停下（没有人读这个连接时，只有这样才知道）。"""
        watch = asyncio.ensure_future(disconnected(http, self.request))
        try:
            async for _ in self.pieces():
                pass
        finally:
            watch.cancel()
            self.request.cancel()
        calls, reason = self.finish()
        if self.chat:
            message = {"role": "assistant", "content": self.reader.content or (None if calls else "")}
            if self.reader.reasoning:
                message["reasoning_content"] = self.reader.reasoning
            if calls:
                message["tool_calls"] = calls
            choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": self.reader.content, "finish_reason": reason, "logprobs": None}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.server.name, "choices": [choice], "usage": usage(self.request)}

    def chunk(self, choices, **more) -> str:
        data = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.server.name, "choices": choices}
        return f"data: {json.dumps(data | more, ensure_ascii=False)}\n\n"

    def delta(self, **fields) -> list:
        if self.chat:
            return [{"index": 0, "delta": fields, "finish_reason": None, "logprobs": None}]
        return [{"index": 0, "text": fields.get("content", ""), "finish_reason": None, "logprobs": None}]

    async def events(self):
        """流式：一块块的 SSE。客户端断开时 Starlette 取消这个生成器，finally 让引擎停下；出错时发一块 error、没有 [DONE]。"""
        try:
            if self.chat:
                yield self.chunk(self.delta(role="assistant", content=""))
            async for r, c in self.pieces():
                if r:
                    yield self.chunk(self.delta(reasoning_content=r))
                if c:
                    yield self.chunk(self.delta(content=c))
            calls, reason = self.finish()
            if calls:
                yield self.chunk(self.delta(tool_calls=[{"index": i, **call} for i, call in enumerate(calls)]))
            last = {"index": 0, "finish_reason": reason, "logprobs": None}
            yield self.chunk([last | ({"delta": {}} if self.chat else {"text": ""})])
            if self.job.include_usage:
                yield self.chunk([], usage=usage(self.request))
            yield "data: [DONE]\n\n"
        except Exception as e:  # 已经开始流式发送：错误作为一块 error 发出
            yield f"data: {json.dumps(engine_error(e).body, ensure_ascii=False)}\n\n"
        finally:
            self.request.cancel()  # 客户端断开（或出错）：引擎在下一个 token 之前停下，释放这个请求的状态


async def disconnected(http, request: Request):
    """等到客户端断开（请求体已经读完：之后 receive 只会等来 http.disconnect），让引擎停下这个请求。"""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    request.cancel()


class Forward:
    """引擎线程放进来的 token 转交给事件循环里的 asyncio.Queue（线程安全）。"""

    def __init__(self, loop, q):
        self.loop = loop
        self.q = q

    def put(self, item):
        self.loop.call_soon_threadsafe(self.q.put_nowait, item)


class Guard:
    """最外层的 ASGI 中间件：Server.guard 不放行的请求在这里就以 OpenAI 的错误体结束，到不了路由与 CORS。"""

    def __init__(self, app, server: Server):
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            from starlette.datastructures import Headers
            from starlette.responses import JSONResponse

            error = self.server.guard(scope["method"], Headers(scope=scope))
            if error is not None:
                return await JSONResponse(error.body, status_code=error.status)(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(server: Server):
    """FastAPI 应用（需要 pip install -e ".[serve]"）。"""
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="qwen", docs_url=None, redoc_url=None, openapi_url=None)
    if server.allow_origins:  # 放行的网页要读得到回答：CORS 的预检与响应头
        app.add_middleware(CORSMiddleware, allow_origins=sorted(server.allow_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(Guard, server=server)
    add_error_handlers(app)

    @app.get("/health")
    async def health():
        if server.engine is None or server.closing:
            status = "closing" if server.closing else "loading" if server.load_error is None else "failed"
            return JSONResponse({"status": status}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(http: HttpRequest):
        server.authorize(http.headers.get("authorization"))
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0, "owned_by": "qwen"}]}

    async def answer(http: HttpRequest, job: Job):
        reply = Reply(server, job)
        server.submit(job.request)
        if job.stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})
        return await reply.whole(http)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await answer(http, server.chat_request(await server.read_body(http)))

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await answer(http, server.completion_request(await server.read_body(http)))

    return app


def add_error_handlers(app):
    """每个错误都是 OpenAI 的错误体：我们的 ApiError、路由的 404 与 405、意料之外的 500。"""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def error(e: ApiError, headers=None):
        return JSONResponse(e.body, status_code=e.status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(http, e: ApiError):
        return error(e)

    @app.exception_handler(HTTPException)
    async def http_error(http, e: HTTPException):  # 404（没有这个路径）、405（方法不对）
        what = {404: "没有这个路径（接口是 GET /health、GET /v1/models、POST /v1/chat/completions、POST /v1/completions）",
                405: "这个路径不接受这个方法"}.get(e.status_code, e.detail)
        return error(ApiError(e.status_code, f"{http.method} {http.url.path}：{what}"), e.headers)

    @app.exception_handler(Exception)
    async def unexpected(http, e: Exception):  # 服务器不因一个请求而停：报 500，接着服务别的请求
        return error(engine_error(e))


# ---------- uvicorn ----------

KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))  # 对方掉线后约一分钟内发现


def connection_class(header_timeout: float):
    """uvicorn 的 HTTP/1.1 连接，另加两件事。uvicorn 只在一个回答之后才计空闲：连上了什么也不发、或请求头只发一半就停的
    连接会一直占着——这里从连上（和每个回答之后）起计时，header_timeout 秒内还没有一个完整的请求头就关掉。另开 TCP
    keepalive：对方掉线（半开的连接）时内核在约一分钟内发现，连接关掉，正在等回答的请求随之取消。"""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Connection(H11Protocol):
        deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                for name, value in KEEPALIVE:
                    if hasattr(socket, name):
                        sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
            except (AttributeError, OSError):  # 不是 TCP 的套接字（比如 Unix 域）
                pass
            self.arm()

        def on_response_complete(self):
            super().on_response_complete()
            self.arm()

        def arm(self):
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(header_timeout, self.expire)

        def expire(self):
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()  # 没有正在处理的请求：还在等请求头

        def connection_lost(self, exc):
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

    return Connection


def uvicorn_server(app, server: Server, **config):
    """uvicorn 的服务器：连接见 connection_class；回答之后的空闲连接 5 秒关掉；关闭（SIGTERM、Ctrl-C）时先让
    引擎停下没生成完的请求（它们几秒内结束），再照 uvicorn 的做法等连接关完，至多 5 秒。"""
    import uvicorn

    class Uvicorn(uvicorn.Server):
        async def shutdown(self, sockets=None):
            server.close()
            await super().shutdown(sockets)

    return Uvicorn(uvicorn.Config(app, http=connection_class(server.header_timeout), timeout_keep_alive=5,
                                  timeout_graceful_shutdown=5, log_level="warning", **config))


def serve(load, name: str, host="127.0.0.1", port=8000, api_key=None, **options):
    """在后台线程里加载（load() → Engine），同时开始监听：加载完之前 /health 是 503。加载失败时打印原因、退出码 1。"""
    server = Server(name, api_key, host=host, **options)
    uv = uvicorn_server(create_app(server), server, host=host, port=port)

    def loading():
        try:
            server.ready(load())
        except Exception as e:
            server.load_error = e
            uv.should_exit = True

    threading.Thread(target=loading, daemon=True, name="qwen-load").start()
    uv.run()
    if server.load_error is not None:
        sys.exit(f"错误：模型加载失败：{type(server.load_error).__name__}: {server.load_error}")
