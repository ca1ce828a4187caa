"""附录 · 服务：回给客户端的错误。每个错误都是 OpenAI 的错误体 {"error": {message, type, param, code}}。"""

import json

from .engine import Closed

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 503: "service_unavailable", 500: "server_error", 501: "server_error"}


class ApiError(Exception):
    """回给客户端的错误：HTTP 状态码与 OpenAI 的错误体。param：是哪个字段（没有时 None）。"""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                               "param": param, "code": code}}


def show(value) -> str:
    """错误信息里收到的值：JSON 的写法，至多 40 个字。"""
    return json.dumps(value, ensure_ascii=False)[:40]


def engine_error(e: Exception) -> ApiError:
    """引擎交回的错误 → 回给客户端的：关闭 503，我们自己的 ApiError 原样，别的 500。"""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Closed):
        return ApiError(503, str(e))
    return ApiError(500, f"服务器内部错误：{type(e).__name__}: {e}")
