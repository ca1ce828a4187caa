"""附录 · 服务：每条消息与每个工具。角色、字段、类型都查：不认识的 400，不支持的说明并拒绝（远程图像、视频、strict 的工具、
tool_choice 是 "required" 或指定函数……），不默默忽略。没有对话模板的检查点（demo）把各条消息的内容原样接起来续写：系统与工具消息、
tools、工具调用与思考都无处可放，也是 400。"""

import re

from .body import parse_json, top
from .errors import ApiError, show

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # 函数名：OpenAI 的规则另加 “.”；写进 <function=…> 也不会出错
MESSAGE_KEYS = {"system": {"role", "content"}, "user": {"role", "content"},
                "assistant": {"role", "content", "tool_calls", "reasoning_content"},
                "tool": {"role", "content", "tool_call_id"}}
EMPTY_KEYS = {"refusal", "function_call", "audio", "annotations"}  # OpenAI 回答里的这些常是 null：原样送回时为空就收
NO_TEMPLATE = "这个检查点没有对话模板（比如 demo）：各条消息的内容原样接起来让它续写，"


def content_text(m: dict, where: str):
    """消息的 content → 文字：字符串，或分段的列表：文字 {"type": "text", "text": …} 与图像 {"type": "image_url",
    "image_url": {"url": "data:image/…;base64,…"}}。只有文字时拼成一个字符串，有图时是分段的列表（build_prompt 照模板写出）。
    助手的可以没有 content（只有工具调用时）。"""
    content = m.get("content")
    if content is None:
        if m["role"] == "assistant" and m.get("tool_calls"):
            return ""
        raise ApiError(400, f"{where}.content 缺少或为 null：{m['role']} 消息要有文字", "messages")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content 应为字符串或分段的列表，收到 {show(content)}", "messages")
    parts = [content_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
    return parts if any(p["type"] == "image_url" for p in parts) else "".join(p["text"] for p in parts)


def content_part(part, where: str) -> dict:
    """一段：文字，或 data: URL 的图像。远程的 http(s) 图像不替客户端下载，服务器上的文件也不给客户端读。"""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str) and not set(part) - {"type", "text"}:
        return part
    if kind in ("input_audio", "file", "video", "video_url"):
        raise ApiError(400, f"{where}：不支持 {kind}（音频、文件与视频）；图像请用 image_url 的 data: URL", "messages")
    image = part.get("image_url") if kind == "image_url" else None
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str) or set(part) - {"type", "image_url"} or isinstance(image, dict) and set(image) - {"url", "detail"}:
        raise ApiError(400, f"{where} 应为 {{\"type\": \"text\", \"text\": …}} 或 {{\"type\": \"image_url\", \"image_url\": "
                            f"{{\"url\": \"data:image/png;base64,…\"}}}}，收到 {show(part)}", "messages")
    if url.startswith(("http://", "https://")):
        raise ApiError(400, f"{where}：本地的服务不替客户端下载远程图像，请把图编成 data: URL 发来（data:image/png;base64,…）",
                       "messages")
    if not url.startswith("data:"):
        raise ApiError(400, f"{where}.image_url.url 应为 data: URL（data:image/png;base64,…），收到 {show(url[:40])}", "messages")
    return {"type": "image_url", "image_url": {"url": url}}


def function_name(name, where: str) -> str:
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ApiError(400, f"{where} 应为 1 到 64 个字母、数字、_、.、- 组成的函数名，收到 {show(name)}", top(where))
    return name


def arguments(value, where: str) -> dict:
    """工具调用的参数：OpenAI 的写法是 JSON 字符串（"{\\"city\\": \\"Paris\\"}"），也收对象；都要是 JSON 对象。"""
    if isinstance(value, str):
        value = parse_json(value, where) if value.strip() else {}
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ApiError(400, f"{where} 应为 JSON 对象（或写着 JSON 对象的字符串），收到 {show(value)}", "messages")
    for key in value:
        if not key or any(c in key for c in "<>\n"):
            raise ApiError(400, f"{where} 的参数名 {show(key)} 不能为空，也不能有 <、> 或换行", "messages")
    return value


def tool_calls(calls, where: str) -> list[dict]:
    """助手消息里的工具调用（OpenAI 的写法）→ build_prompt 要的 {"function": {"name", "arguments": dict}}。"""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls 应为列表，收到 {show(calls)}", "messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or set(call) - {"id", "type", "function", "index"} \
                or call.get("type", "function") != "function" or set(fn) - {"name", "arguments"}:
            raise ApiError(400, f"{at} 应为 {{\"id\": …, \"type\": \"function\", \"function\": {{\"name\": …, "
                                f"\"arguments\": …}}}}，收到 {show(call)}", "messages")
        out.append({"type": "function", "function": {"name": function_name(fn.get("name"), f"{at}.function.name"),
                                                     "arguments": arguments(fn.get("arguments"), f"{at}.function.arguments")}})
    return out


def check_message(m, i: int, templated: bool) -> dict:
    """一条消息 → {"role", "content": 文字（或带图的分段）, 可选 "tool_calls"、"reasoning_content"}；不认识的都 400。"""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ApiError(400, f"{where} 应为对象，收到 {show(m)}", "messages")
    role = m.get("role")
    if role not in MESSAGE_KEYS:
        raise ApiError(400, f"{where}.role 应为 system、user、assistant、tool 之一，收到 {show(role)}", "messages")
    extra = sorted(k for k in m if k not in MESSAGE_KEYS[role] and not (k in EMPTY_KEYS and not m[k]))
    if extra:
        raise ApiError(400, f"{where}（{role}）不支持字段 {', '.join(extra)}", "messages")
    out = {"role": role, "content": content_text(m, where)}
    if m.get("tool_calls"):
        out["tool_calls"] = tool_calls(m["tool_calls"], where)
    if m.get("reasoning_content") is not None:
        if not isinstance(m["reasoning_content"], str):
            raise ApiError(400, f"{where}.reasoning_content 应为字符串", "messages")
        out["reasoning_content"] = m["reasoning_content"]
    if m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
        raise ApiError(400, f"{where}.tool_call_id 应为字符串", "messages")
    if not templated and (role in ("system", "tool") or set(out) - {"role", "content"}):
        what = f"{role} 消息" if role in ("system", "tool") else "工具调用与 reasoning_content"
        raise ApiError(400, f"{where}：{NO_TEMPLATE}{what}放不进去", "messages")
    return out


def check_messages(messages, templated: bool) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, f"messages 应为非空的列表，收到 {show(messages)}", "messages")
    return [check_message(m, i, templated) for i, m in enumerate(messages)]


def check_tools(body, templated: bool) -> list | None:
    """tools：每个是 {"type": "function", "function": {"name", "description", "parameters"}}；空列表等于没给。
    tool_choice："auto"（模型自己决定）、"none"（不调工具：工具照样查，但不写进提示词、回答里也不找工具调用，同 vLLM
    的默认）、"required"（一定调，调哪个模型定）或 {"type": "function", "function": {"name": …}}（一定调这一个）；后两种由
    requests.py 的 tool_grammar 按文法写。parallel_tool_calls 只支持 true：别的我们做不到，就不收。"""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "auto", "none", "required") and chosen(choice) is None:
        raise ApiError(400, 'tool_choice 应为 "auto"、"none"、"required" 或 {"type": "function", "function": {"name": …}}，'
                            f"收到 {show(choice)}", "tool_choice")
    if body.get("parallel_tool_calls") not in (None, True):
        raise ApiError(400, "parallel_tool_calls 只支持 true：模型一次可以写几个工具调用", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice == "required" or chosen(choice) is not None:
            raise ApiError(400, f"tool_choice {show(choice)} 要有 tools", "tool_choice")
        return None
    if not templated:
        raise ApiError(400, f"{NO_TEMPLATE}tools 放不进去", "tools")
    if not isinstance(tools, list):
        raise ApiError(400, f"tools 应为列表，收到 {show(tools)}", "tools")
    names = set()
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"} \
                or set(fn) - {"name", "description", "parameters", "strict"}:
            raise ApiError(400, f"tools[{j}] 应为 {{\"type\": \"function\", \"function\": {{\"name\": …, \"description\": …, "
                                f"\"parameters\": {{…}}}}}}，收到 {show(tool)}", "tools")
        name = function_name(fn.get("name"), f"tools[{j}].function.name")
        if name in names:
            raise ApiError(400, f"tools 里有两个 {name}", "tools")
        names.add(name)
        if not isinstance(fn.get("description", ""), str) or not isinstance(fn.get("parameters", {}), dict):
            raise ApiError(400, f"tools[{j}].function 的 description 应为字符串、parameters 应为对象（JSON Schema）", "tools")
        if fn.get("strict"):
            raise ApiError(400, f"tools[{j}]：不支持 strict（输出不受 JSON Schema 约束）", "tools")
    if chosen(choice) not in (None, *names):
        raise ApiError(400, f"tool_choice 指定的函数 {show(chosen(choice))} 不在 tools 里", "tool_choice")
    return None if choice == "none" else tools


def chosen(choice) -> str | None:
    """tool_choice 指定的函数名（{"type": "function", "function": {"name": …}}）；别的写法 None。"""
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" and len(choice) == 2 else None
    name = fn.get("name") if isinstance(fn, dict) and set(fn) == {"name"} else None
    return name if isinstance(name, str) else None


def template_kwargs(body, prompt, defaults: dict) -> dict:
    """chat_template_kwargs（叠在服务的默认 defaults 之上）→ 交给模板的参数（Prompt.check 查：发布的模板只有 enable_thinking
    与 add_vision_id；检查点自己的模板收它读的参数，JSON 的值原样交给它；enable_thinking 没给时用模板自己的默认）。"""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, f"chat_template_kwargs 应为对象，收到 {show(kwargs)}", "chat_template_kwargs")
    try:
        return prompt.check(defaults | (kwargs or {}))
    except ValueError as e:
        raise ApiError(400, f"chat_template_kwargs：{e}", "chat_template_kwargs") from None
