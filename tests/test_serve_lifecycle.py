"""附录 qwen/serve 的生命周期：客户端走了引擎放下它（流、排队的、随机取消），进程收到 SIGTERM、加载失败、没装 extra、
命令行的数。"""

import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import pytest

from serving import LONG, NAME, QUESTIONS, ask, endless, get, idle, post, served, sse, wait_until  # noqa: F401  fixture


# ---------- 客户端走了：引擎放下它 ----------


def test_disconnected_stream_stops_its_request(served, endless):
    """流式：客户端读了几块就断开，引擎在下一个 token 之前停下（回答本要写 LONG 个 token），位置与线程都释放。"""
    _, engine, _, url = served
    body = {"model": NAME, "messages": [{"role": "user", "content": "写一篇长文"}], "max_tokens": LONG, "stream": True}
    with sse(url + "/v1/chat/completions", body) as (status, lines):
        assert status == 200
        for _ in range(4):
            next(lines)
    assert wait_until(lambda: idle(engine), 30)
    (r,) = endless
    assert r.finish_reason == "cancelled" and 0 < len(r.tokens) < LONG


def open_request(url, body) -> socket.socket:
    """发出一个非流式请求，不读回答（之后关掉这个套接字就是客户端走了）。"""
    u, raw = urlsplit(url), json.dumps(body).encode()
    s = socket.create_connection((u.hostname, u.port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(raw), raw))
    return s


def test_disconnected_requests_free_running_and_queued_slots(served, endless):
    """非流式：4 个位置都在生成、另有 2 个排队时客户端都走了。排队的离开队列、一个 token 也不生成；生成中的在下一个 token
    之前停下。之后的短请求马上有位置。"""
    client, engine, _, url = served
    body = {"model": NAME, "messages": [{"role": "user", "content": "写一篇长文"}], "max_tokens": LONG, "temperature": 0}
    running = [open_request(url, body) for _ in range(engine.slots)]
    assert wait_until(lambda: len(engine.running) == engine.slots, 30)
    queued = [open_request(url, body) for _ in range(2)]
    assert wait_until(lambda: len(endless) == engine.slots + 2 and len(engine.queue) == 2, 30)
    for s in queued:
        s.close()
    assert wait_until(lambda: not engine.queue, 30)
    assert all(r.finish_reason == "cancelled" and not r.tokens for r in endless[engine.slots:])
    for s in running:
        s.close()
    assert wait_until(lambda: idle(engine), 30)
    assert all(r.finish_reason == "cancelled" and len(r.tokens) < LONG for r in endless[:engine.slots])
    assert ask(client, "你好", max_tokens=8).usage.completion_tokens == 8


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
    assert wait_until(lambda: idle(engine), 30)


# ---------- 进程：关闭、加载失败、命令行 ----------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint_copy(src, dst, tokenizer=None):
    """检查点的一份拷贝（权重是符号链接）；tokenizer：换掉 tokenizer.json 的文字。"""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy(f, dst / f.name)
    if tokenizer is not None:
        (dst / "tokenizer.json").write_text(tokenizer((src / "tokenizer.json").read_text()))
    return dst


def health(url):
    try:
        return get(url + "/health")[0]
    except OSError:
        return None


def test_sigterm_ends_running_streams_and_exits(lively, tmp_path):
    """python -m qwen serve 收到 SIGTERM：正在生成的流（本要写 LONG 个 token）与排队的几秒内结束（一块 error，没有
    [DONE]），进程退出。检查点的分词器去掉了停止符，回答只能写满或被停下。"""
    endless = checkpoint_copy(lively[0], tmp_path / "endless",
                              lambda t: t.replace("<|im_end|>", "<|im_fin|>").replace("<|endoftext|>", "<|fin|>"))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qwen", "serve", "--model", str(endless), "--port", str(port),
                             "--no-mtp", "--slots", "2", "--max-tokens", str(LONG)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url, ends, seen = f"http://127.0.0.1:{port}", {}, {}
    body = {"model": endless.name, "messages": [{"role": "user", "content": "写一篇长文"}], "max_tokens": LONG, "stream": True}

    def read(i):
        with sse(url + "/v1/chat/completions", body) as (status, lines):
            for line in lines:
                seen[i] = seen.get(i, 0) + 1
                ends[i] = line

    try:
        assert wait_until(lambda: health(url) == 200, 120), proc.stderr.read() if proc.poll() is not None else ""
        threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert wait_until(lambda: sum(n >= 3 for n in seen.values()) == 2 and len(seen) == 3, 30)  # 2 个在写，1 个排队
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 10, took
    assert len(ends) == 3 and all(line != "data: [DONE]" and "关闭" in line for line in ends.values()), ends


def test_a_checkpoint_that_fails_to_load_exits(lively, tmp_path):
    """加载失败（这里是 tokenizer.json 不是 JSON）：打印原因，进程以非零退出，而不是一直开着、/health 503。"""
    from qwen.__main__ import main

    broken = checkpoint_copy(lively[0], tmp_path / "broken", lambda t: "not json")
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--model", str(broken), "--port", str(free_port()), "--no-mtp"])
    assert "模型加载失败" in str(exit.value.code)


def test_serve_without_the_extra_says_what_to_install(monkeypatch):
    from qwen.__main__ import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # 没装
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--model", "demo"])
    assert 'pip install "qwen[serve]"' in exit.value.code and 'pip install -e ".[serve]"' in exit.value.code


@pytest.mark.parametrize("args,message", [
    (["--seed", "18446744073709551616"], "argument --seed: 要在 \\[-9223372036854775808, 9223372036854775807\\] 里"),
    (["--repetition-penalty", "inf"], "argument --repetition-penalty: 要有限的数"),
    (["--presence-penalty", "nan"], "argument --presence-penalty: 要有限的数"),
    (["--temperature", "inf"], "argument --temperature: 要有限的数"),
])
def test_cli_numbers_out_of_range(args, message, capsys):
    import re

    from qwen.__main__ import main

    with pytest.raises(SystemExit) as exit:
        main(["你好", *args])
    assert exit.value.code == 2 and re.search(message, capsys.readouterr().err)
