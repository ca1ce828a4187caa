"""附录 · 服务：请求体本身。JSON 在进分词器与 torch 之前查完：嵌套深度、不成对的代理字符、NaN 与 Infinity（pydantic 说不了的）。
有哪些字段、各是什么类型在 protocol.py 的模型里；取值的范围（number、flag）与字段的含义在 requests.py 与 messages.py。"""

import json
import math
import re

from .errors import ApiError, show

MAX_DEPTH = 64  # 请求体（与工具调用的 arguments）的 JSON 至多嵌套这么多层


def reject_constant(name):
    raise ValueError(f"{name} 不是 JSON 的数")


def finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} 超出了浮点数的范围")
    return value


def parse_json(raw, path=""):
    """bytes 或 str → JSON 的值，再查一遍 check_tree。NaN、Infinity 与溢出的数不收（json 模块默认收）。
    path：它在请求体里的位置（"" 是请求体本身；工具调用的 arguments 是个 JSON 字符串，也这样读）。"""
    what = f"{path} 的字符串" if path else "请求体"
    try:
        value = json.loads(raw, parse_constant=reject_constant, parse_float=finite_float)
    except RecursionError:
        raise ApiError(400, f"{what}嵌套太深（至多 {MAX_DEPTH} 层）", top(path)) from None
    except ValueError as e:  # 含 UnicodeDecodeError：不是 UTF-8
        raise ApiError(400, f"{what}不是合法的 JSON：{e}", top(path)) from None
    check_tree(value, path)
    return value


def top(path: str) -> str | None:
    """messages[0].content → messages（错误体的 param）。"""
    return re.split(r"[.\[]", path)[0] or None


def check_tree(value, path=""):
    """JSON 的值里每个字符串（含键）都是合法的 Unicode（"\\ud800" 这样不成对的代理字符进不了分词器，也写不回 UTF-8），
    嵌套不超过 MAX_DEPTH 层。不递归：多深的值都查得完。"""
    stack = [(value, path, 0)]
    while stack:
        value, at, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"{path or '请求体'}嵌套太深（至多 {MAX_DEPTH} 层）", top(path))
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"{at or '请求体'} 里有不成对的代理字符（比如 \\ud800）：不是合法的 Unicode",
                               top(at)) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack += [(key, at, depth + 1), (item, f"{at}.{key}" if at else str(key), depth + 1)]
        elif isinstance(value, list):
            stack += [(item, f"{at}[{i}]", depth + 1) for i, item in enumerate(value)]


def number(body, name, low=None, high=None, integer=False):
    """body[name] 的数值（没给或 null 时 None）；类型、范围 [low, high] 不对时 400，说明是哪个字段、要什么。
    采样的几项不用它：它们的类型与范围是第 12 章的 RULES（requests.py 的 setting）。"""
    value = body.get(name)
    if value is None:
        return None
    kind = "整数" if integer else "数"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) \
            or (isinstance(value, float) and not math.isfinite(value)):
        raise ApiError(400, f"{name} 应为{kind}，收到 {show(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"{name} 应在 {within(low, high)} 之内，收到 {value}", name)
    return value


def within(low, high) -> str:
    """范围的写法：[low, high] 或 [low, ∞)。"""
    return f"[{low}, {high}]" if high is not None else f"[{low}, ∞)"


def flag(body, name, default=False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} 应为 true 或 false，收到 {show(value)}", name)
    return value
