"""附录 · 服务：回答。从引擎读 token（引擎的线程 → 事件循环：Forward），拼成 OpenAI 的回答体，或一块块 SSE。

流式回答照 OpenAI 的做法用 SSE（Server-Sent Events）：第一块带 role，最后一块带 finish_reason，stream_options.include_usage
时再加一块 choices 为空的 usage，最后是 `data: [DONE]`。已经开始发送之后出的错是一块 error、没有 [DONE]。
客户端断开时引擎在下一个 token 之前停下：流式的由 Starlette 取消生成器，非流式的另看着连接（disconnected）。"""

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from itertools import accumulate

from .engine import Request
from .errors import engine_error


def usage(requests: list) -> dict:
    """n 个回答共用一个提示词：提示词只算一次，生成的 token 加起来（OpenAI 的算法）。"""
    prompt, made = len(requests[0].ids), sum(len(r.tokens) for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made,
            "prompt_tokens_details": {"cached_tokens": requests[0].cached_tokens}}


@dataclass
class Choice:
    """n 个回答里的第 index 个：引擎的请求、把 token 读回文字的 Reader、引擎线程送来 token 的队列。"""
    index: int
    request: Request
    reader: object
    tokens: asyncio.Queue
    entries: list = field(default_factory=list)  # 要对数概率时：写进回答的 Token（停止符与停止字符串之后的不算）
    offset: int = 0  # completions 的 text_offset：流式时已经发出的文字有多长
    unsent: list = field(default_factory=list)  # 流式时还没发出的 Token
    calls: list | None = None  # 写完之后解析出的工具调用（finish 第一次时）


DONE = object()  # 合在一起的流里：这个回答写完了


class Reply:
    """一个请求的回答（n 个 choice）：从引擎读 token，拼成 OpenAI 的回答体（whole）或一块块 SSE（events）。"""

    def __init__(self, job, name: str):  # job：requests.py 的 Job；name：/v1/models 里的名字
        self.name = name
        self.job = job
        self.chat = job.chat
        self.logprobs = job.requests[0].sampling.logprobs is not None
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        loop = asyncio.get_running_loop()
        self.choices = [Choice(i, r, reader, asyncio.Queue()) for i, (r, reader) in enumerate(zip(job.requests, job.readers))]
        for c in self.choices:
            c.request.out = Forward(loop, c.tokens)

    def cancel(self):
        for c in self.choices:
            c.request.cancel()

    async def pieces(self, c: Choice):
        """一个回答逐块产出 (reasoning, content, 这一块的 Token)；停止字符串命中时让引擎停下它。
        文字可能比 token 晚到（Reader 留着可能是标记开头的尾巴）：Token 跟着下一块文字走。"""
        request, reader, count, fresh = c.request, c.reader, 0, []
        while True:
            t = await c.tokens.get()
            if t is None:
                if request.error is not None and not reader.stopped:  # 停止字符串之后的错误（比如关闭）无关紧要
                    raise engine_error(request.error)
                yield *reader.feed(final=True), fresh
                return
            count += 1
            if t in request.stop or reader.stopped:
                continue
            if self.logprobs:  # 引擎放进 t 之前已经记下它（带对数概率的 Token）
                fresh.append(request.logprobs[count - 1])
                c.entries.append(fresh[-1])
            out = reader.feed(t)
            if reader.stopped:
                request.cancel()
            if out[0] or out[1]:
                yield *out, fresh
                fresh = []

    def finish(self, c: Choice):
        """(工具调用, finish_reason)。工具调用只解析一次（写坏了的原样并回 content；id 每次解析都是新的）。"""
        if c.calls is None:
            c.calls = c.reader.tool_calls() if self.chat else []
        calls = c.calls
        reason = "stop" if c.reader.stopped else c.request.finish_reason
        return calls, "tool_calls" if calls else ("stop" if reason == "cancelled" else reason)

    async def whole(self, http) -> dict:
        """非流式：等 n 个回答都写完。等的时候看着连接：客户端断开就让引擎停下（没有人读这个连接时，只有这样才知道）。"""
        watch = asyncio.ensure_future(disconnected(http, self))
        try:
            await asyncio.gather(*(self.read_all(c) for c in self.choices))
        finally:
            watch.cancel()
            self.cancel()
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.name, "choices": [self.body(c) for c in self.choices],
                "usage": usage(self.job.requests)}

    async def read_all(self, c: Choice):
        async for _ in self.pieces(c):
            pass

    def body(self, c: Choice) -> dict:
        """非流式回答里的一个 choice。"""
        calls, reason = self.finish(c)
        if not self.chat:
            entries = (c.request.prompt_logprobs or []) + c.entries
            return {"index": c.index, "text": self.job.echo * self.job.prompt + c.reader.content, "finish_reason": reason,
                    "logprobs": self.scores(c, entries)}
        message = {"role": "assistant", "content": c.reader.content or (None if calls else "")}
        if c.reader.reasoning:
            message["reasoning_content"] = c.reader.reasoning
        if calls:
            message["tool_calls"] = calls
        return {"index": c.index, "message": message, "finish_reason": reason, "logprobs": self.scores(c, c.entries)}

    def scores(self, c: Choice, entries: list) -> dict | None:
        """OpenAI 的 logprobs：chat 是 {"content": [{token, logprob, bytes, top_logprobs}]}；completions 是 tokens、
        token_logprobs、top_logprobs（{token: logprob}）与 text_offset（每个 token 在这个回答的文字里从第几个字起）。
        entries：第 12 章的 Token（提示词的第 0 个没有前文，是普通的 int：它的 logprob 与 top 是 null）。"""
        if not self.logprobs:
            return None
        text = [token_text(self.job.pieces[e]) for e in entries]
        logprobs, tops = [getattr(e, "logprob", None) for e in entries], [getattr(e, "top", None) for e in entries]
        if self.chat:
            def one(t, logprob):
                return {"token": token_text(self.job.pieces[t]), "logprob": logprob, "bytes": list(self.job.pieces[t])}
            return {"content": [one(e, lp) | {"top_logprobs": [one(*best) for best in top]} for e, lp, top in zip(entries, logprobs, tops)]}
        ends = list(accumulate((len(x) for x in text), initial=c.offset))  # 每个 token 的文字从哪里起（一遍累加）
        offsets, c.offset = ends[:-1], ends[-1]
        top = [None if t is None else {token_text(self.job.pieces[i]): lp for i, lp in t} for t in tops]
        return {"tokens": text, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}

    def chunk(self, choices, **more) -> str:
        data = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.name, "choices": choices}
        return f"data: {json.dumps(data | more, ensure_ascii=False)}\n\n"

    def delta(self, c: Choice, entries=(), **fields) -> list:
        scores = self.scores(c, list(entries)) if entries else None
        if self.chat:
            return [{"index": c.index, "delta": fields, "finish_reason": None, "logprobs": scores}]
        return [{"index": c.index, "text": fields.get("content", ""), "finish_reason": None, "logprobs": scores}]

    async def events(self):
        """流式：一块块的 SSE，n 个回答的块按到来的先后交错（每块带自己的 index）。客户端断开时 Starlette 取消这个生成器，
        finally 让引擎停下；出错时发一块 error、没有 [DONE]。"""
        merged = asyncio.Queue()
        tasks = [asyncio.ensure_future(self.forward(c, merged)) for c in self.choices]
        try:
            for c in self.choices:
                if self.chat:
                    yield self.chunk(self.delta(c, role="assistant", content=""))
            echoed = set()
            for _ in self.choices:
                while True:
                    c, piece = await merged.get()
                    if self.job.echo and c.index not in echoed:  # completions 的 echo：这个回答先发提示词（与它的对数概率）
                        echoed.add(c.index)
                        yield self.chunk(self.delta(c, c.request.prompt_logprobs or (), content=self.job.prompt))
                    if piece is DONE:
                        break
                    for chunk in self.piece_chunks(c, piece):
                        yield chunk
                for chunk in self.last_chunks(c):
                    yield chunk
            if self.job.include_usage:
                yield self.chunk([], usage=usage(self.job.requests))
            yield "data: [DONE]\n\n"
        except Exception as e:  # 已经开始流式发送：错误作为一块 error 发出
            yield f"data: {json.dumps(engine_error(e).body, ensure_ascii=False)}\n\n"
        finally:
            for task in tasks:
                task.cancel()
            self.cancel()  # 客户端断开（或出错）：引擎在下一个 token 之前停下，释放这些请求的状态

    def piece_chunks(self, c: Choice, piece):
        """pieces 的一块 (reasoning, content, Token) → SSE 块。Token 跟着这一块的第一段文字发；没有文字时留给最后一块。"""
        if isinstance(piece, Exception):
            raise piece
        c.unsent += piece[2]
        for key, text in (("reasoning_content", piece[0]), ("content", piece[1])):
            if text:
                yield self.chunk(self.delta(c, c.unsent, **{key: text}))
                c.unsent = []

    async def forward(self, c: Choice, merged: asyncio.Queue):
        """把一个回答的块放进合在一起的队列：(c, (reasoning, content))，出错时 (c, 错误)，写完时 (c, DONE)。"""
        try:
            async for piece in self.pieces(c):
                await merged.put((c, piece))
        except Exception as e:
            await merged.put((c, e))
        await merged.put((c, DONE))

    def last_chunks(self, c: Choice):
        """一个回答写完：工具调用（有的话）与带 finish_reason 的最后一块。"""
        calls, reason = self.finish(c)
        if calls:
            yield self.chunk(self.delta(c, tool_calls=[{"index": i, **call} for i, call in enumerate(calls)]))
        last = {"index": c.index, "finish_reason": reason, "logprobs": self.scores(c, c.unsent) if c.unsent else None}
        yield self.chunk([last | ({"delta": {}} if self.chat else {"text": ""})])


async def disconnected(http, reply: Reply):
    """等到客户端断开（请求体已经读完：之后 receive 只会等来 http.disconnect），让引擎停下这个回答的请求。"""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    reply.cancel()


def token_text(piece: bytes) -> str:
    """一个 token 的字节 → logprobs 里的 token 文字：半个 UTF-8 字符的字节写成 \\xe4 这样（与 OpenAI 相同）。"""
    return piece.decode("utf-8", errors="backslashreplace")


class Forward:
    """引擎线程放进来的 token 转交给事件循环里的 asyncio.Queue（线程安全）。"""

    def __init__(self, loop, q):
        self.loop = loop
        self.q = q

    def put(self, item):
        self.loop.call_soon_threadsafe(self.q.put_nowait, item)
