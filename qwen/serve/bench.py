"""附录 · 服务的吞吐：N 个并发的流，总的 token/s 与首个 token 的时间（p50）。

    python -m qwen.serve.bench --url http://127.0.0.1:8000 --streams 1 2 4 8 [--tokens 64] [--rounds 2]

对任何 OpenAI 兼容的服务都能测（我们的 python -m qwen serve、llama.cpp 的 llama-server），所以两者可以用同一个脚本、
轮流测。每一轮把 N 个 /v1/completions 的流式请求同时发出去（各自的提示词不同），量：
- 总吞吐：N 个回答的 token 数之和 ÷ 从发出到最后一个回答结束的墙钟时间；
- 首个 token 的时间：每个请求从发出到收到第一块文字，取中位数。
回答的 token 数取自最后的 usage 块（stream_options.include_usage）；服务不给时按收到的块数。
"""

import argparse
import http.client
import json
import statistics
import threading
import time
from urllib.parse import urlsplit

PROMPTS = ["def quicksort(items):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
           "# 计算斐波那契数列\ndef fib(n):", "for i in range(10):", "def read_config(path):", "async def fetch(url):",
           "SELECT name FROM users WHERE"]


def one(url, prompt, tokens, extra, out):
    """发一个流式请求，记下 (首个 token 的秒数, 回答的 token 数, 结束的时刻)。"""
    u = urlsplit(url)
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    first, chunks, counted = None, 0, None
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{url} 回了 {r.status}：{r.read()[:200]!r}")
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        data = json.loads(line[6:])
        if data.get("usage"):
            counted = data["usage"]["completion_tokens"]
        for choice in data.get("choices") or []:
            if choice.get("text"):
                first = first or time.perf_counter() - t0
                chunks += 1
    conn.close()
    out.append((first, counted if counted is not None else chunks, time.perf_counter()))


def run(url, streams: int, tokens: int, extra) -> dict:
    out = []
    threads = [threading.Thread(target=one, args=(url, PROMPTS[i % len(PROMPTS)], tokens, extra, out))
               for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(out) != streams:
        raise RuntimeError("有请求失败了（见上面的错误）")
    end = max(o[2] for o in out)
    total = sum(o[1] for o in out)
    return {"streams": streams, "tokens": total, "seconds": end - t0, "tok_s": total / (end - t0),
            "ttft_p50": statistics.median(o[0] for o in out if o[0] is not None)}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m qwen.serve.bench", description="OpenAI 兼容服务的并发吞吐与首个 token 的时间")
    p.add_argument("--url", action="append", required=True, help="服务的地址；给几个就轮流测几个")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--tokens", type=int, default=64, help="每个回答的 token 数（max_tokens）")
    p.add_argument("--rounds", type=int, default=2, help="每种并发数轮流测几轮，取总吞吐最高的一轮")
    p.add_argument("--extra", default="{}", help="另加进请求体的 JSON（比如 llama-server 的 {\"ignore_eos\": true}），"
                                                 "与 --url 一一对应时用 | 分开")
    args = p.parse_args(argv)
    extras = [json.loads(e) for e in args.extra.split("|")]
    extras = extras * len(args.url) if len(extras) == 1 else extras
    best = {}
    for n in args.streams:
        for _ in range(args.rounds):
            for url, extra in zip(args.url, extras):
                r = run(url, n, args.tokens, extra)
                key = (url, n)
                best[key] = r if key not in best or r["tok_s"] > best[key]["tok_s"] else best[key]
    print("| 服务 | 并发 | 总吞吐 tok/s | 相对单流 | 首个 token p50 (s) |")
    print("|---|---|---|---|---|")
    for url in args.url:
        single = best.get((url, args.streams[0]))
        for n in args.streams:
            r = best[(url, n)]
            print(f"| {url} | {n} | {r['tok_s']:.1f} | {r['tok_s'] / single['tok_s']:.2f}× | {r['ttft_p50']:.2f} |")
    print("RESULT " + json.dumps({f"{u} {n}": r for (u, n), r in best.items()}))


if __name__ == "__main__":
    main()
