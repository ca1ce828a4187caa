"""服务的测试共用的：起停服务（与 python -m qwen serve 同样的 uvicorn 设置）、发请求、两个服务的 fixture（随机检查点带草稿头
与对话模板；随包的 demo 没有对话模板）。测试文件按要测的事分开，都从这里取。"""

import http.client
import json
import socket
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest
import torch

from qwen.fast import load_draft, load_model

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

NAME = "qwen-test"
QUESTIONS = ["你好", "介绍一下长江。", "def add(a, b):", "谢谢 🚀", "写一首诗", "1 + 1 = ?"]
LONG = 4000  # 不断开就要写好几秒的回答（去掉停止符之后）：只有真的取消了，测试才过得去


def connect(url, timeout=120):
    u = urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout), u.path or "/"


def post(url, body, headers=None):
    """POST 原始的请求体（bytes 或可以转成 JSON 的对象）→ (状态码, 解析后的 JSON)。"""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn, path = connect(url)
    try:
        conn.request("POST", path, raw, {"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def request(method, url, headers=None, body=None):
    """任意方法 → (状态码, 响应头, 解析后的 JSON；不是 JSON 的回答时 None)。"""
    conn, path = connect(url, 30)
    try:
        conn.request(method, path, body, headers or {})
        r = conn.getresponse()
        raw = r.read()
        return r.status, r.headers, json.loads(raw) if r.headers.get("content-type") == "application/json" else None
    finally:
        conn.close()


def check_error(code, reply, status, words):
    """一个错误的回答：状态码是 status，OpenAI 的错误体（message、type、param、code），message 里有 words。"""
    assert code == status, reply
    error = reply["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}


def get(url):
    status, _, body = request("GET", url)
    return status, body


@contextmanager
def sse(url, body):
    """流式请求 → (状态码, 逐行的迭代器)；离开时直接关掉连接（客户端断开）。"""
    conn, path = connect(url)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json"})
        r = conn.getresponse()
        yield r.status, (line.decode().rstrip("\n") for line in r if line.strip())
    finally:
        conn.close()


def wait_until(condition, seconds) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def start(server):
    """在后台线程里起服务（与 python -m qwen serve 同样的 uvicorn 设置），监听本机一个空闲端口 → (基地址, uvicorn.Server)。"""
    from qwen.serve.api import create_app, uvicorn_server

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn_server(create_app(server), server)
    threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    assert wait_until(lambda: uv.started, 10)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", uv


def stop(uv, server, keep_engine=True):
    """停下服务；keep_engine：引擎是别的服务也在用的，不随这个服务关掉。"""
    if keep_engine:
        server.engine = None
    uv.should_exit = True


@pytest.fixture(scope="module")
def served(lively):
    from qwen.serve.api import Server
    from qwen.serve.engine import Engine

    model = load_model(lively[0], dtype=torch.float32)  # 默认路径：分块布局、C++ 的 matvec
    mtp = load_draft(model)
    assert mtp is not None
    engine = Engine(model, mtp, slots=4, cache_mb=64)
    assert engine.batcher is not None
    server = Server(NAME, max_tokens=LONG)
    url, uv = start(server)
    assert get(url + "/health")[0] == 503  # 还在加载
    server.ready(engine)
    assert server.chat.templated and get(url + "/health") == (200, {"status": "ok"})
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield client, engine, server, url
    stop(uv, server, keep_engine=False)


@pytest.fixture(scope="module")
def plain():
    """随包的 demo：没有对话模板。"""
    from qwen.serve.api import Server
    from qwen.serve.engine import Engine

    engine = Engine(load_model("demo", dtype=torch.float32), None, slots=2, cache_mb=16)
    server = Server(NAME, max_tokens=64)
    server.ready(engine)
    assert not server.chat.templated
    url, uv = start(server)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120), engine, server, url
    stop(uv, server, keep_engine=False)


@pytest.fixture(params=["templated", "plain"])
def either(request):
    return request.getfixturevalue("served" if request.param == "templated" else "plain")


@pytest.fixture
def endless(served, monkeypatch):
    """这个测试里回答没有停止符：一直写到 max_tokens。→ 记下提交给引擎的每个 Request 的列表。"""
    _, engine, server, _ = served
    monkeypatch.setattr(server.chat, "stop", [])
    return recorded(engine, monkeypatch)


def recorded(engine, monkeypatch) -> list:
    made, submit = [], engine.submit
    monkeypatch.setattr(engine, "submit", lambda r: made.append(r) or submit(r))
    return made


def idle(engine) -> bool:
    return not engine.running and not engine.queue and not engine.batcher.members and not engine.batcher.waiting


def ask(client, text, **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}], **kw)


def streamed(client, text, **kw):
    """流式请求 → (拼起来的 content, 最后的 finish_reason, usage 块)。"""
    content, reason, usage = "", None, None
    for chunk in ask(client, text, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return content, reason, usage
