"""附录 · 服务：监听。uvicorn 的 HTTP/1.1 连接另加两道防线（空着、或请求头只发一半的连接几秒后关掉；TCP keepalive 发现
掉线的对方），关闭（SIGTERM、Ctrl-C）时先让引擎停下没生成完的请求。"""

import socket

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


def uvicorn_server(app, server, **config):
    """uvicorn 的服务器：连接见 connection_class；回答之后的空闲连接 5 秒关掉；关闭（SIGTERM、Ctrl-C）时先让
    引擎停下没生成完的请求（它们几秒内结束），再照 uvicorn 的做法等连接关完，至多 5 秒。"""
    import uvicorn

    class Uvicorn(uvicorn.Server):
        async def shutdown(self, sockets=None):
            server.close()
            await super().shutdown(sockets)

    return Uvicorn(uvicorn.Config(app, http=connection_class(server.header_timeout), timeout_keep_alive=5,
                                  timeout_graceful_shutdown=5, log_level="warning", **config))
