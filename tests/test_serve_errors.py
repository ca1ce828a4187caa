"""附录 qwen/serve 的防线：坏的请求得到 4xx 与 OpenAI 的错误体（有没有对话模板的检查点都试），请求体的上限、API key、
Host 与 Origin、空闲与发了一半的连接。"""

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from qwen import generate

from serving import NAME, ask, check_error, either, get, openai, plain, post, request, served, start, stop  # noqa: F401  fixture


# ---------- 坏的请求：4xx 与 OpenAI 的错误体，有没有对话模板都是 ----------

HI = [{"role": "user", "content": "hi"}]


def raw(tail: str) -> bytes:
    """消息是 HI、再接上 tail 这几个字段的请求体（原样的 JSON 文字：NaN、Infinity 这些 json.dumps 写不出来）。"""
    return ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}]%s}' % (NAME, tail)).encode()


BAD = [
    (b"{not json", 400, "JSON"),
    (b"[" * 100_000, 400, "嵌套"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "代理字符"),
    ({"model": NAME}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "robot"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "wizard"),
    ({"messages": [{"role": "user"}]}, 400, "content"),
    ({"messages": [{"role": "user", "content": None}]}, 400, "content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "data: URL"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400, "name"),
    ({"messages": HI, "max_tokens": -3}, 400, "max_tokens"),
    ({"messages": HI, "max_tokens": 10**6}, 400, "max_tokens"),
    ({"messages": HI, "max_completion_tokens": 5, "max_tokens": "abc"}, 400, "max_tokens"),
    ({"messages": HI, "temperature": "hot"}, 400, "temperature"),
    ({"messages": HI, "top_p": 1e-300, "temperature": 1}, 400, "top_p"),
    ({"messages": HI, "seed": 2**64}, 400, "seed"),
    ({"messages": HI, "seed": 2**64, "stream": True}, 400, "seed"),
    (raw(', "temperature": 0.7, "presence_penalty": NaN'), 400, "NaN"),
    (raw(', "presence_penalty": NaN'), 400, "NaN"),
    (raw(', "repetition_penalty": Infinity'), 400, "Infinity"),
    (raw(', "repetition_penalty": 1e999'), 400, "1e999"),
    ({"messages": HI, "stream": True, "stream_options": "x"}, 400, "stream_options"),
    ({"messages": HI, "stream": True, "stream_options": {"include_usage": "no"}}, 400, "include_usage"),
    ({"messages": HI, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"messages": HI, "stop": ["x" * 1000]}, 400, "stop"),
    ({"messages": HI, "logprobs": "yes"}, 400, "logprobs"),
    ({"messages": HI, "top_logprobs": 2}, 400, "top_logprobs 只能与"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs 应在 [0, 20]"),
    ({"messages": HI, "logit_bias": {"abc": 1}}, 400, "logit_bias 的键"),
    ({"messages": HI, "logit_bias": {"99999999": 1}}, 400, "logit_bias 的键"),
    ({"messages": HI, "logit_bias": {"5": -101}}, 400, "[-100, 100]"),
    ({"messages": HI, "logit_bias": [5]}, 400, "logit_bias 应为对象"),
    ({"messages": HI, "frequency_penalty": True}, 400, "frequency_penalty"),
    ({"messages": HI, "frequency_penalty": 2.5}, 400, "frequency_penalty 应在 [-2, 2] 之内"),
    ({"messages": HI, "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
    ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, 400, "schema 编译不了"),
    ({"messages": HI, "tools": "x"}, 400, "tools"),
    ({"messages": HI, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": HI, "tools": ["get_weather"]}, 400, "tools"),
    ({"messages": HI, "tool_choice": "required"}, 400, "要有 tools"),
    ({"messages": HI, "tool_choice": "always"}, 400, "tool_choice 应为"),
    ({"messages": HI, "parallel_tool_calls": False}, 400, "parallel_tool_calls"),
    ({"messages": HI, "user": 5}, 400, "user"),
    ({"model": "gpt-4", "messages": HI}, 404, "gpt-4"),
    ({"messages": HI, "n": 9}, 400, "n 应在"),
]


@pytest.mark.parametrize("body,status,words", BAD)
def test_bad_requests_get_openai_errors(either, body, status, words):
    _, engine, _, url = either
    check_error(*post(url + "/v1/chat/completions", body), status, words)
    assert not engine.running and not engine.queue  # 都在进引擎之前拒绝


@pytest.mark.parametrize("call,words", [
    ({"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}, "arguments"),
    ({"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[1, 2]"}}, "arguments"),
    ({"id": "c", "type": "function", "function": {"name": "a>b", "arguments": "{}"}}, "name"),
    ({"id": "c", "type": "code", "function": {"name": "get_weather"}}, "tool_calls[0]"),
])
def test_bad_tool_calls_in_the_history(served, call, words):
    _, _, _, url = served
    messages = HI + [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "?"}]
    check_error(*post(url + "/v1/chat/completions", {"messages": messages}), 400, words)


@pytest.mark.parametrize("body,words", [
    ({"messages": [{"role": "system", "content": "你是助手"}] + HI}, "system"),
    ({"messages": HI + [{"role": "tool", "content": "晴"}]}, "tool"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": HI, "chat_template_kwargs": {"enable_thinking": True}}, "思考"),
])
def test_what_a_checkpoint_without_a_template_cannot_do_is_refused(plain, body, words):
    """没有对话模板时消息原样接起来续写：系统提示词、工具、思考都无处可放，说明并拒绝，不默默丢掉。"""
    check_error(*post(plain[3] + "/v1/chat/completions", body), 400, words)


def test_text_parts_and_several_turns_on_both_checkpoints(either):
    """文字分段（OpenAI 文档里的写法）与一段字符串是同一个提示词；几轮对话也收。"""
    client, engine, server, _ = either
    parts = [{"type": "text", "text": "def add"}, {"type": "text", "text": "(a, b):"}]
    a = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": parts}], max_tokens=4, temperature=0)
    b = ask(client, "def add(a, b):", max_tokens=4, temperature=0)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens and a.choices[0].message.content == b.choices[0].message.content
    turns = [{"role": "user", "content": "x = 1"}, {"role": "assistant", "content": "\n"}, {"role": "user", "content": "y"}]
    r = client.chat.completions.create(model=NAME, messages=turns, max_tokens=3, temperature=0)
    ids = server.prompt.render(turns).ids
    want = generate(engine.model, ids, 3, server.chat.stop)  # 与库在同样的提示词上的贪心相同
    assert r.usage.prompt_tokens == ids.shape[1] and r.usage.completion_tokens == len(want)
    assert r.choices[0].message.content == server.chat.decode([t for t in want if t not in server.chat.stop])


def test_unknown_paths_and_methods_get_openai_errors(either):
    _, _, _, url = either
    for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/chat/completions", 405),
                                 ("POST", "/v1/models", 405), ("GET", "/redoc", 404)):
        code, _, body = request(method, url + path, {"content-type": "application/json"})
        assert code == status and set(body["error"]) == {"message", "type", "param", "code"}, (method, path, body)


# ---------- 限制、key 与本机服务的防线 ----------


def test_limits_and_api_key(served, monkeypatch):
    """请求体太大 413；--api-key 时不带或带错的 key 401，带对的照常（"bearer" 不分大小写）；key 也可以来自 QWEN_API_KEY。"""
    from qwen.__main__ import serve_arguments
    from qwen.serve.api import Server

    client, engine, server, url = served
    big = {"model": NAME, "messages": [{"role": "user", "content": "x" * server.max_body}]}
    assert post(url + "/v1/chat/completions", big)[0] == 413
    locked = Server(NAME, api_key="sekret", max_tokens=8)
    locked.ready(engine)
    url2, uv = start(locked)
    try:
        bad = openai.OpenAI(base_url=url2 + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=url2 + "/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in good.models.list().data] == [NAME]
        answer = ask(good, "你好", max_tokens=4, temperature=0).choices[0].message.content
        assert answer == ask(client, "你好", max_tokens=4, temperature=0).choices[0].message.content
        assert request("GET", url2 + "/v1/models", {"authorization": "bearer sekret"})[0] == 200
        assert request("GET", url2 + "/v1/models", {"authorization": "Bearer sekret2"})[0] == 401
    finally:
        stop(uv, locked)
    monkeypatch.setenv("QWEN_API_KEY", "from-env")
    assert serve_arguments([]).api_key == "from-env" and serve_arguments(["--api-key", "k"]).api_key == "k"


def test_chunked_body_over_the_limit_is_refused_while_it_is_read(served):
    """没有 Content-Length 的分块请求体：读到超过上限就 413，不等它发完（这里故意永远不发最后一块）。"""
    _, _, server, url = served
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                  b"transfer-encoding: chunked\r\n\r\n")
        piece = b"x" * 65536
        for _ in range(server.max_body // len(piece) + 1):  # 刚过上限
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        assert s.recv(64).startswith(b"HTTP/1.1 413")


def test_a_whole_body_over_the_limit_gets_its_413_not_a_reset(served):
    """客户把 48 MB 的分块请求体慢慢发完才读回答（一般的 HTTP 客户端都这样；发完要好几秒）：服务 413 之前把多出的读掉扔了，
    客户读得到 413。不读掉的话，413 发出之后连接空着等下一个请求头，header_timeout 一到就关——客户还在发，内核回 RST，
    客户只看见连接被重置。"""
    from qwen.serve.api import Server

    _, engine, _, _ = served
    slow = Server(NAME, header_timeout=1.0)
    slow.ready(engine)
    url, uv = start(slow)
    try:
        u = urlsplit(url)
        with socket.create_connection((u.hostname, u.port), timeout=60) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                      b"transfer-encoding: chunked\r\n\r\n")
            piece = b"x" * (1 << 20)
            for _ in range(48):
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                time.sleep(0.08)
            s.sendall(b"0\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 413")
    finally:
        stop(uv, slow)


def test_foreign_host_origin_and_content_type_are_refused(served):
    """DNS rebinding（Host 是别人的域名）、别的网站的网页（Origin）、text/plain 的“简单请求”：403 / 415，OpenAI 的错误体。
    本服务自己的 Origin、IP 地址与 localhost 的 Host 照常（这里的请求体是空的 messages：过了这道防线就是 400）。"""
    _, _, _, url = served
    path = url + "/v1/chat/completions"
    port = urlsplit(url).port
    empty = json.dumps({"messages": []})
    cases = [({"host": f"evil.example:{port}"}, 403, "Host"), ({"origin": "https://evil.example"}, 403, "evil.example"),
             ({"origin": "null"}, 403, "null"), ({"content-type": "text/plain"}, 415, "application/json"),
             ({"content-type": "application/x-www-form-urlencoded"}, 415, "application/json"),
             ({"host": f"localhost:{port}"}, 400, "messages"), ({"host": "[::1]:9"}, 400, "messages"),
             ({"origin": url}, 400, "messages")]
    for headers, status, words in cases:
        code, _, body = request("POST", path, {"content-type": "application/json", **headers}, empty)
        check_error(code, body, status, words)


def test_allowed_origin_gets_cors_headers(served):
    """--allow-origin 放行的网页：预检（OPTIONS）与回答都带 CORS 头；别的来源照样 403。"""
    from qwen.serve.api import Server

    _, engine, _, _ = served
    opened = Server(NAME, allow_origins=["http://localhost:3000"], allow_hosts=["models.lan"])
    opened.ready(engine)
    url, uv = start(opened)
    try:
        ui = {"origin": "http://localhost:3000"}
        code, headers, _ = request("OPTIONS", url + "/v1/chat/completions",
                                   ui | {"access-control-request-method": "POST",
                                         "access-control-request-headers": "content-type, authorization"})
        assert code == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"
        code, headers, body = request("POST", url + "/v1/chat/completions",
                                      ui | {"content-type": "application/json", "host": "models.lan"}, b'{"messages": []}')
        assert code == 400 and headers["access-control-allow-origin"] == "http://localhost:3000"
        code, _, body = request("GET", url + "/v1/models", {"origin": "http://localhost:3001"})
        check_error(code, body, 403, "localhost:3001")
    finally:
        stop(uv, opened)


def test_idle_and_half_sent_connections_are_closed(served):
    """连上了什么也不发、请求头只发一半：header_timeout 秒后服务关掉连接（uvicorn 自己只在回答之后才计空闲）。"""
    from qwen.serve.api import Server

    _, engine, _, _ = served
    quick = Server(NAME, header_timeout=0.3)
    quick.ready(engine)
    url, uv = start(quick)
    u = urlsplit(url)
    try:
        for sent in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0."):
            with socket.create_connection((u.hostname, u.port), timeout=10) as s:
                s.sendall(sent)
                t0 = time.monotonic()
                assert s.recv(64) == b"" and time.monotonic() - t0 < 5
        assert get(url + "/health") == (200, {"status": "ok"})  # 好好发请求的不受影响
    finally:
        stop(uv, quick)
