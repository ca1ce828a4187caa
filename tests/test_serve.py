"""附录 qwen/serve：用真的 openai 客户端连本机上的服务（整个文件共用一个服务：随机检查点，带草稿头与对话模板）。"""

import http.client
import json
import random
import socket
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest
import torch

from qwen import Chat, Conversation, Model, generate

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

NAME = "qwen-test"
QUESTIONS = ["你好", "介绍一下长江。", "def add(a, b):", "谢谢 🚀", "写一首诗", "1 + 1 = ?"]


def post(url, body, headers=None):
    """POST 原始的请求体（bytes 或可以转成 JSON 的对象）→ (状态码, 解析后的 JSON)。"""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request("POST", u.path, raw, {"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def get(url):
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("GET", u.path)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


@contextmanager
def sse(url, body):
    """流式请求 → (状态码, 逐行的迭代器)；离开时直接关掉连接（客户端断开）。"""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request("POST", u.path, json.dumps(body).encode(), {"content-type": "application/json"})
        r = conn.getresponse()
        yield r.status, (line.decode().rstrip("\n") for line in r if line.strip())
    finally:
        conn.close()


def start(app):
    """在后台线程里起 uvicorn，监听本机一个空闲端口 → (基地址, uvicorn.Server)。"""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


@pytest.fixture(scope="module")
def served(lively):
    from qwen.serve.api import Server, create_app
    from qwen.serve.engine import Engine

    model = Model.from_pretrained(lively[0], dtype=torch.float32)  # 默认路径：分块布局、C++ 的 matvec
    mtp = Conversation(Chat(model)).mtp
    assert mtp is not None
    engine = Engine(model, mtp, slots=4, cache_mb=64)
    assert engine.batcher is not None
    server = Server(NAME, max_tokens=64)
    url, uv = start(create_app(server))
    assert get(url + "/health")[0] == 503  # 还在加载
    server.ready(engine)
    assert get(url + "/health") == (200, {"status": "ok"})
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield client, engine, server, url
    uv.should_exit = True


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


def test_stream_equals_non_stream_equals_generate(served):
    """贪心：流式与非流式相同，也与 generate（同一个模型、同样的提示词）解码出来的相同；usage 对得上。"""
    client, engine, server, _ = served
    chat = server.chat
    for text in QUESTIONS[:3]:
        full = ask(client, text, max_tokens=12, temperature=0)
        content, reason, usage = streamed(client, text, max_tokens=12, temperature=0)
        assert content == full.choices[0].message.content and reason == full.choices[0].finish_reason
        ids = chat.encode(chat.prompt([{"role": "user", "content": text}]))
        plain = generate(engine.model, ids, 12, chat.stop)
        assert content == chat.decode([t for t in plain if t not in chat.stop])
        assert full.usage.prompt_tokens == ids.shape[1] == usage.prompt_tokens
        assert full.usage.completion_tokens == len(plain) == usage.completion_tokens
        assert full.choices[0].finish_reason == ("stop" if plain[-1] in chat.stop else "length")


def test_concurrent_streams_equal_their_solo_answers(served):
    """4 个并发的流，每个都与它单独请求时逐字相同；它们的前向真的拼在了一起（平均一次算多于一个请求的）。"""
    client, engine, _, _ = served
    solo = {q: ask(client, q, max_tokens=16, temperature=0).choices[0].message.content for q in QUESTIONS[:4]}
    calls, jobs = engine.batcher.calls, engine.batcher.jobs
    results = {}
    threads = [threading.Thread(target=lambda q=q: results.__setitem__(q, streamed(client, q, max_tokens=16, temperature=0)[0]))
               for q in QUESTIONS[:4]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo
    assert engine.batcher.jobs - jobs > engine.batcher.calls - calls


def test_a_drafting_request_is_not_starved(served):
    """对齐的顺序里草稿头的几件事排在主模型之前：否则只要别的请求还在逐个 token 地解码（总在主模型的某一层等着），
    起草的请求就一直轮不到。"""
    _, engine, _, _ = served
    order, model, mtp = engine.batcher.order, engine.model, engine.mtp
    head = [order[id(mtp.fc.blocks)], order[id(mtp.layers[0])]]
    main = [order[id(model)], order[id(model.lm_head.blocks)]]  # 主模型的全部解码层、输出头
    assert max(head) < min(main)


def test_drafting_costs_more_in_a_batch(served):
    """贪心的请求与别的请求一起生成时，多起草一个 token 按 BATCHED_DRAFT_COST 倍的代价算（接受率不够高就不起草）。"""
    from qwen.serve.engine import BATCHED_DRAFT_COST

    _, engine, _, _ = served
    with engine.lock:
        saved = set(engine.running)
        engine.running.clear()
        engine.running.add(1)
        alone = engine.draft_cost()
        engine.running.add(2)
        together = engine.draft_cost()
        engine.running.clear()
        engine.running.update(saved)
    assert alone == engine.mtp.draft_cost and together == BATCHED_DRAFT_COST * alone > alone


def test_seeded_sampling_alone_and_in_a_batch(served):
    """带 seed 的采样：单独请求两次相同；三个同时请求，各自也与单独时相同。"""
    client, _, _, _ = served
    kw = dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    alone = ask(client, "写一首诗", **kw).choices[0].message.content
    assert ask(client, "写一首诗", **kw).choices[0].message.content == alone
    other = ask(client, "写一首诗", **(kw | {"seed": 8})).choices[0].message.content
    out = []
    threads = [threading.Thread(target=lambda: out.append(ask(client, "写一首诗", **kw).choices[0].message.content))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [alone] * 3 and other != alone


def test_second_turn_resumes_from_the_first(served):
    """第二轮从第一轮留下的状态接着读（cached_tokens > 0），回答与清空留下的状态、从头读时相同。"""
    client, engine, _, _ = served
    first = [{"role": "user", "content": "你好，介绍一下长江。"}]
    answer = client.chat.completions.create(model=NAME, messages=first, max_tokens=10, temperature=0)
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    second = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                      {"role": "user", "content": "再写 200 字。"}]
    resumed = client.chat.completions.create(model=NAME, messages=second, max_tokens=10, temperature=0)
    assert resumed.usage.prompt_tokens_details.cached_tokens > 0
    engine.cache.items.clear()
    engine.cache.size = 0
    fresh = client.chat.completions.create(model=NAME, messages=second, max_tokens=10, temperature=0)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.choices[0].message.content == resumed.choices[0].message.content


@pytest.mark.parametrize("body,status,words", [
    (b"{not json", 400, "JSON"),
    ({"model": NAME}, 400, "messages"),
    ({"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}, 400, "robot"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n 只支持 1"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "max_tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "gpt-4"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, "max_tokens"),
])
def test_bad_requests_get_openai_errors(served, body, status, words):
    _, _, _, url = served
    code, reply = post(url + "/v1/chat/completions", body)
    assert code == status
    error = reply["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_limits_and_api_key(served):
    """请求体太大 413；--api-key 时不带或带错的 key 401，带对的照常。"""
    from qwen.serve.api import Server, create_app

    _, engine, _, url = served
    big = {"model": NAME, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    assert post(url + "/v1/chat/completions", big)[0] == 413
    locked = Server(NAME, api_key="sekret", max_tokens=8)
    locked.ready(engine)
    url2, uv = start(create_app(locked))
    try:
        bad = openai.OpenAI(base_url=url2 + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=url2 + "/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in good.models.list().data] == [NAME]
        assert ask(good, "你好", max_tokens=4).usage.completion_tokens <= 4
    finally:
        uv.should_exit = True


def test_disconnected_stream_frees_its_slot(served):
    """客户端读了两块就断开：引擎在下一个 token 之前停下，这个请求的位置与线程都释放。"""
    _, engine, _, url = served
    body = {"model": NAME, "messages": [{"role": "user", "content": "写一篇长文"}], "max_tokens": 64, "stream": True}
    with sse(url + "/v1/chat/completions", body) as (status, lines):
        assert status == 200
        next(lines)
        next(lines)
        assert engine.running  # 正在生成
    for _ in range(200):
        if not engine.running and not engine.batcher.members:
            break
        time.sleep(0.05)
    assert not engine.running and not engine.batcher.members


def test_completions_and_tool_call_round_trip(served):
    """/v1/completions 原样续写；带 tools 的对话、助手的工具调用与工具结果都能送进去；模型写的 <tool_call> 块解析成
    tool_calls（参数是 JSON 字符串），思考放进 reasoning_content。"""
    from qwen.serve.api import Reader

    client, engine, server, _ = served
    c = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=6, temperature=0)
    assert c.choices[0].finish_reason in ("stop", "length") and c.usage.completion_tokens <= 6
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "北京天气？"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "晴"}]
    r = client.chat.completions.create(model=NAME, messages=messages, tools=tools, max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tk = server.chat.tk
    reader = Reader(tk, thinking=True, stops=[], tools=True)
    text = "想一想\n</think>\n\n好的。<tool_call>\n<function=get_weather>\n<parameter=city>\n北京\n</parameter>\n" \
           "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    pieces = [reader.feed(t) for t in tk.encode(text, add_special_tokens=False).ids] + [reader.feed(final=True)]
    assert "".join(p[0] for p in pieces) == "想一想\n" and "".join(p[1] for p in pieces) == "好的。"
    calls = reader.tool_calls()
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "北京", "days": 3}


def test_load_with_random_cancellations(served):
    """16 个请求、8 个线程，长度随机，一部分读几块就断开：全部结束或取消，没有 5xx，没有留下占着的位置。"""
    _, engine, _, url = served
    rng = random.Random(0)
    jobs = [(rng.choice(QUESTIONS), rng.randint(1, 24), rng.random() < 0.4, rng.random() < 0.5) for _ in range(16)]
    statuses = []

    def run(job):
        text, n, cancel, stream = job
        body = {"model": NAME, "messages": [{"role": "user", "content": text}], "max_tokens": n, "stream": stream,
                "temperature": 0.8, "seed": n}
        if not stream:
            statuses.append(post(url + "/v1/chat/completions", body)[0])
            return
        with sse(url + "/v1/chat/completions", body) as (status, lines):
            statuses.append(status)
            for i, line in enumerate(lines):
                if cancel and i >= 2:
                    break

    threads = [threading.Thread(target=lambda part=jobs[i::8]: [run(j) for j in part]) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(statuses) == 16 and set(statuses) == {200}
    for _ in range(200):
        if not engine.running and not engine.batcher.members:
            break
        time.sleep(0.05)
    assert not engine.running and not engine.batcher.members and not engine.batcher.waiting
