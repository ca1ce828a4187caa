"""附录 · 服务：请求的样子。每个接口的请求体声明一次，是一个 pydantic 模型（vLLM、SGLang 的 protocol.py 也这样）：有哪些字段、
各是 JSON 的什么类型；不认识的字段、类型不对、缺了必需的，都在门口（read）变成一个 400，说出字段的路径。/docs 的接口页
也从这些模型来。pydantic 说不了的留在原处：NaN、不成对的代理字符与嵌套深度（body.py，读 JSON 时），取值的范围（采样的
几项是第 12 章的 RULES 加上 OpenAI 的范围），消息与工具的结构（messages.py），与模型有关的（词表、上下文的长度）。

这一页是 OpenAI 的两个接口（chat completions、completions）与 /tokenize、/detokenize；Anthropic 的在 anthropic.py，
Responses 的在 responses.py，各自的模型写在各自那一页。
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from .errors import ApiError, show

Number = StrictFloat | StrictInt  # JSON 的数：true、"1" 都不是
WHAT = {"missing": "是必需的", "extra_forbidden": "是不支持的字段", "int_type": "应为整数", "bool_type": "应为 true 或 false",
        "float_type": "应为数", "string_type": "应为字符串", "list_type": "应为列表", "dict_type": "应为对象",
        "model_type": "应为对象"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Sampled(Strict):
    """OpenAI 两个接口共有的字段。"""
    model: StrictStr | None = None
    stream: StrictBool | None = None
    stream_options: dict[str, Any] | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[Any] | None = None
    user: StrictStr | None = None
    n: StrictInt | None = None
    logit_bias: dict[str, Any] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None


class ChatCompletionRequest(Sampled):
    """POST /v1/chat/completions。消息与工具的结构由 messages.py 查。"""
    messages: list[Any]
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None


class CompletionRequest(Sampled):
    """POST /v1/completions：原样续写 prompt。"""
    prompt: StrictStr | list[Any]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class TokenizeRequest(Strict):
    """POST /tokenize：prompt（一段文字）或 messages（对话消息，同 chat completions）中的一个。"""
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: StrictBool | None = None


class DetokenizeRequest(Strict):
    """POST /detokenize。"""
    model: StrictStr | None = None
    tokens: list[StrictInt]


def read(model: type[BaseModel], body) -> dict:
    """请求体 → 按 model 查过的 dict（只有给了的字段）；不合它的：一个 400，说出第一个不对的字段（路径）、要什么、收到什么。"""
    if not isinstance(body, dict):
        raise ApiError(400, "请求体应为 JSON 对象")
    try:
        return model.model_validate(body).model_dump(exclude_unset=True)
    except ValidationError as e:
        err = e.errors()[0]
        field, path = str(err["loc"][0]), where(body, err["loc"])
        got = "" if err["type"] in ("missing", "extra_forbidden") else f"，收到 {show(err.get('input'))}"
        raise ApiError(400, f"{path} {WHAT.get(err['type'], err['msg'])}{got}", field) from None


def where(body: dict, loc) -> str:
    """pydantic 的错误位置 → 字段的路径（messages[0].content）：只走请求里真有的键与下标，联合类型插进的类型名（str、int…）跳过。"""
    path, at = str(loc[0]), body.get(loc[0])
    for p in loc[1:]:
        if isinstance(at, list) and isinstance(p, int) and p < len(at):
            path, at = f"{path}[{p}]", at[p]
        elif isinstance(at, dict) and p in at:
            path, at = f"{path}.{p}", at[p]
    return path


def schema(model: type[BaseModel]) -> dict:
    """给 FastAPI 的接口页（/docs、/openapi.json）：这个接口的请求体。"""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}
