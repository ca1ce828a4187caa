"""附录 · 服务：本机服务的防线与 API key。

浏览器里任何网页都能向 127.0.0.1 发请求。Host 不是本机（localhost、IP 地址、--host 的值或 --allow-host）的请求 403：
DNS rebinding 的网页发来的 Host 是攻击者的域名。带着 Origin、又不是本服务自己或 --allow-origin 的请求 403。POST 必须是
application/json，否则 415：text/plain 的 POST 是 CORS 的“简单请求”，浏览器不先发预检就直接送到。API key 按常数时间比较。
"""

import hmac
import ipaddress

from .errors import ApiError


def host_name(host: str) -> str:
    """Host 头或 --host → 小写的名字（去掉端口与 IPv6 的方括号）。"""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]")[0]
    return host.split(":")[0] if host.count(":") == 1 else host


class Access:
    """谁能用这个服务。api_key：要求的 Bearer key（None 不要求）；host：监听的地址（它也是合法的 Host）；
    allow_hosts / allow_origins：另外放行的 Host 名与 Origin（"*" 是全部）。"""

    def __init__(self, api_key=None, host="127.0.0.1", allow_hosts=(), allow_origins=()):
        self.api_key = api_key
        self.host = host
        self.allow_hosts = {h.lower() for h in allow_hosts}
        self.allow_origins = {o.rstrip("/").lower() for o in allow_origins}

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


class Guard:
    """最外层的 ASGI 中间件：Access.guard 不放行的请求在这里就以 OpenAI 的错误体结束，到不了路由与 CORS。"""

    def __init__(self, app, access: Access):
        self.app = app
        self.access = access

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            from starlette.datastructures import Headers
            from starlette.responses import JSONResponse

            error = self.access.guard(scope["method"], Headers(scope=scope))
            if error is not None:
                return await JSONResponse(error.body, status_code=error.status)(scope, receive, send)
        await self.app(scope, receive, send)
