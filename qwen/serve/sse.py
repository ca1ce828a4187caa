"""附录 · 服务：回答。从引擎读 token（引擎的线程 → 事件循环：Forward），拼成 OpenAI 的回答体，或一块块 SSE。

流式回答照 OpenAI 的做法用 SSE（Server-Sent Events）：第一块带 role，最后一块带 finish_reason，stream_options.include_usage
时再加一块 choices 为空的 usage，最后是 `data: [DONE]`。已经开始发送之后出的错是一块 error、没有 [DONE]。
客户端断开时引擎在下一个 token 之前停下：流式的由 Starlette 取消生成器，非流式的另看着连接（disconnected）。"""

import asyncio
import json
import time
import uuid

from .engine import Request
from .errors import engine_error


def usage(request: Request) -> dict:
    prompt = len(request.ids)
    return {"prompt_tokens": prompt, "completion_tokens": len(request.tokens),
            "total_tokens": prompt + len(request.tokens),
            "prompt_tokens_details": {"cached_tokens": request.cached_tokens}}


class Reply:
    """一个请求的回答：从引擎读 token，拼成 OpenAI 的回答体（whole）或一块块 SSE（events）。"""

    def __init__(self, job, name: str):  # job：requests.py 的 Job；name：/v1/models 里的名字
        self.name = name
        self.job = job
        self.request, self.reader, self.chat = job.request, job.reader, job.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.tokens = asyncio.Queue()
        self.request.out = Forward(asyncio.get_running_loop(), self.tokens)

    async def pieces(self):
        """逐块产出 (reasoning, content)；停止字符串命中时让引擎停下。"""
        request, reader = self.request, self.reader
        while True:
            t = await self.tokens.get()
            if t is None:
                if request.error is not None and not reader.stopped:  # 停止字符串之后的错误（比如关闭）无关紧要
                    raise engine_error(request.error)
                yield reader.feed(final=True)
                return
            if t in request.stop or reader.stopped:
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
                "model": self.name, "choices": [choice], "usage": usage(self.request)}

    def chunk(self, choices, **more) -> str:
        data = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.name, "choices": choices}
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
