"""附录 · 服务：HTTP 请求 → 引擎的 Request。请求体先按 protocol.py 的模型读（有哪些字段、各是什么类型），再在这里查
取值（范围、支不支持），坏的一律 400，说出是哪个字段、要什么、收到了什么；查过的请求进引擎之后不再查。采样的设置合成一个 Sampling（第 12 章）：每一项收不收由第 12 章
的 RULES（Sampling.check）定，服务另在其上收窄到 OpenAI 的范围（API_RANGES）。"""

import re
from dataclasses import dataclass

from ..conversation import cut_point
from ..sample import RULES, Sampling
from ..sampling.logprobs import MAX_TOP
from ..vision import TooManyImageTokens
from .body import flag, number, within
from .engine import Request
from .errors import ApiError, show
from .messages import check_messages, check_tools, chosen, template_kwargs
from .protocol import ChatCompletionRequest, CompletionRequest, read
from .reader import Reader

SAMPLING = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty")
# 这些只能不给或是“关”的值：我们做不到，就不收
UNSUPPORTED = (("suffix", ""), ("best_of", 1))
MAX_STOP = 500  # 一个停止字符串至多这么多个字
MAX_N = 8  # 一次请求至多要这么多个回答（n）：每个是引擎里一个自己的请求，占一个生成的位置
GREEDY_BELOW = 1e-5  # 比这还低的 temperature 按贪心算（与 vLLM 相同：再低 logits / temperature 就溢出了）
# 服务收的范围：OpenAI（与 vLLM）给这几项的，比 RULES 窄——RULES 说的是模型能算什么，这里是服务收什么。收窄也是防线：
# repetition_penalty 太小时罚过的 logits 除以它溢出成 inf，采样的分布成了 NaN，那就是 500 而不是 400。
# top_k 另收 -1 与 0（vLLM 的写法：不截断，见 setting）
API_RANGES = {"temperature": (0, 2), "top_p": (1e-6, 1), "top_k": (-1, None), "presence_penalty": (-2, 2),
              "frequency_penalty": (-2, 2), "repetition_penalty": (0.01, 100)}


@dataclass
class Job:
    """一个查过的请求：n 个回答各一个引擎的 Request 与把 token 读回文字的 Reader，流不流式、要不要 usage 块、是不是对话；
    echo：completions 的回答前面带上提示词。"""
    requests: list
    readers: list
    stream: bool
    include_usage: bool
    chat: bool
    echo: bool = False
    prompt: str = ""  # echo 时回答前面带上的提示词
    pieces: list | None = None  # 要对数概率时：每个 token 的字节（Server.token_bytes）


def check_common(body, name: str):
    """查过样子（protocol.py）的请求体：model 是这个服务的（name）、n 在范围内、不支持的都没开。"""
    model = body.get("model")
    if model is not None and model != name:
        raise ApiError(404, f"没有模型 {show(model)}：这里只有 {name!r}（见 GET /v1/models）", "model", "model_not_found")
    number(body, "n", 1, MAX_N, integer=True)
    for field, off in UNSUPPORTED:
        value = body.get(field)
        if value is not None and (value != off or isinstance(value, bool) != isinstance(off, bool)):
            raise ApiError(400, f"不支持 {field}（只能不给或是 {show(off)}）", field)


def stream_flags(body) -> tuple[bool, bool]:
    """(stream, include_usage)。stream_options 只能与 stream: true 一起给（与 OpenAI 相同）。"""
    stream, options = flag(body, "stream"), body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise ApiError(400, "stream_options 只能与 \"stream\": true 一起用", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, f"stream_options 应为 {{\"include_usage\": true/false}}，收到 {show(options)}", "stream_options")
    return stream, flag(options, "include_usage")


def stops(body) -> list[str]:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP for s in stop):
        raise ApiError(400, f"stop 应为一个非空字符串或至多 4 个非空字符串的列表（每个至多 {MAX_STOP} 个字）", "stop")
    return stop


def setting(body, name: str):
    """采样的一项（没给或 null 时 None）。收不收由第 12 章的 Sampling.check（RULES）与 API_RANGES 一起定；不收时 400，
    param 是这个字段，说的是服务收的类型与范围（refusal）。top_k 的 -1 与 0 是 vLLM 的写法：不截断。"""
    value = body.get(name)
    if value is None or name == "top_k" and type(value) is int and value in (-1, 0):
        return None
    low, high = served_range(name)
    try:
        Sampling.check(name, value)
        ok = (low is None or low <= value) and (high is None or value <= high)
    except ValueError:
        ok = False
    if not ok:
        raise ApiError(400, refusal(name, value), name)
    return value


def served_range(name: str) -> tuple:
    """服务收的范围 (下限, 上限)：API_RANGES 里有的用它，否则是 RULES 的（比如 seed 的 64 位）。"""
    return API_RANGES.get(name) or RULES[name][1:3]


def refusal(name: str, value) -> str:
    """不收的一项怎么说：类型不对时要什么类型，否则要什么范围（JSON 的写法，与别的字段的错误一样）。"""
    integer = RULES[name][0]
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return f"{name} 应为{'整数' if integer else '数'}，收到 {show(value)}"
    low, high = served_range(name)
    return f"{name} 应在 {within(low, high)} 之内，收到 {value}"


def sampling(body, defaults: dict) -> Sampling:
    """请求的采样设置：检查点推荐的（defaults，generation_config.json）之上，请求给了的几项覆盖它；seed 只来自请求。"""
    given = {name: setting(body, name) for name in (*SAMPLING, "seed")}
    if given["temperature"] is not None and given["temperature"] < GREEDY_BELOW:
        given["temperature"] = 0
    return Sampling(**(defaults | {k: v for k, v in given.items() if v is not None}))


def request(ids, body, server, keep=None, images=None, grammar=None, top=None, ceiling=False) -> Request:
    """提示词的 token 与请求体 → 引擎的 Request。server：api.py 的 Server（defaults、max_tokens、max_prompt、chat）；
    grammar：response_format 的文法（只许合乎它的 token）；top：要对数概率时每个 token 另带几个（None：不要）；
    ceiling：max_tokens 只是上限（Anthropic、Responses 的意思）：超出服务的上限或上下文时截到能写的，而不是 400。"""
    s = Sampling.of(sampling(body, server.defaults), grammar=grammar, logit_bias=logit_bias(body, server.vocab_size), logprobs=top)
    longest = number(body, "max_completion_tokens", 1, server.max_tokens, integer=True)
    if ceiling and type(body.get("max_tokens")) is int and body["max_tokens"] > 0:  # 只是上限：截到服务与上下文能写的
        body = body | {"max_tokens": max(min(body["max_tokens"], server.max_tokens, server.max_prompt - len(ids)), 1)}
    limit = number(body, "max_tokens", 1, server.max_tokens, integer=True)
    limit = longest or limit or min(512, server.max_tokens)
    if len(ids) + limit > server.max_prompt:
        raise ApiError(400, f"提示词 {len(ids)} 个 token 加上 max_tokens {limit} 超过上限 {server.max_prompt}：请缩短提示词"
                            "或调小 max_tokens", "messages", "context_length_exceeded")
    return Request(ids, limit, server.chat.stop, s, keep, images=images)


@dataclass
class ChatPrompt:
    """查过、渲染好的对话提示词：token（图的占位已展开）、其中的图、是否从推理开始，与渲染它的消息、工具、模板参数。"""
    ids: list
    images: object
    thinks: bool
    messages: list
    tools: list | None
    kwargs: dict


def chat_prompt(body, server) -> ChatPrompt:
    """请求体的 messages、tools、chat_template_kwargs → ChatPrompt（Prompt.render；带图时视觉塔看图）。chat completions、
    /tokenize 都走这里：同样的消息，同样的 token。"""
    prompt = server.prompt
    messages, tools = check_messages(body.get("messages"), server.chat.templated), check_tools(body, server.chat.templated)
    kwargs = template_kwargs(body, prompt, server.template_kwargs)
    made = rendered(lambda: prompt.render(messages, tools, kwargs))  # 消息里写的控制记号只是文字
    images = rendered(lambda: server.see(made.pictures, server.max_prompt - made.ids.shape[1] - 1)) if made.pictures else None
    ids = (images.expand(made.ids) if images is not None else made.ids)[0].tolist()
    return ChatPrompt(ids, images, made.thinks, messages, tools, kwargs)


def chat_job(body, server, ceiling: bool = False) -> Job:
    """POST /v1/chat/completions 的请求体 → Job。引擎在最后一个用户问题的末尾留一份状态（cut_point）。回答是不是从推理开始
    看渲染出的提示词（模板以没合上的 <think> 结尾：Rendered.thinks），与 enable_thinking 给没给、模板默认什么无关。"""
    body = read(ChatCompletionRequest, body)
    check_common(body, server.name)
    p = chat_prompt(body, server)
    grammar = tool_grammar(body, p.tools, server, p.thinks) or response_grammar(body.get("response_format"), server, p.thinks)
    keep = None
    if any(m["role"] == "user" for m in p.messages):
        keep = rendered(lambda: cut_point(server.prompt, p.messages, p.tools, p.ids, p.images, p.kwargs))
    requests = copies(request(p.ids, body, server, keep, p.images, grammar, chat_logprobs(body), ceiling), body)
    readers = [Reader(server.chat.tk, p.thinks, stops(body), p.tools is not None) for _ in requests]
    pieces = server.token_bytes() if requests[0].sampling.logprobs is not None else None
    return Job(requests, readers, *stream_flags(body), chat=True, pieces=pieces)


def rendered(step):
    """渲染提示词、看图的一步：消息不合模板的规矩、检查点自己的模板 raise_exception 或超出界限（TemplateError）、图读不了
    → 400 说明原因；服务这边没装 Pillow → 501 说出要装的 extra。"""
    try:
        return step()
    except ImportError as e:
        raise ApiError(501, str(e), "messages") from None
    except TooManyImageTokens as e:
        raise ApiError(400, str(e), "messages", "context_length_exceeded") from None
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None


def copies(first: Request, body) -> list:
    """n 个回答：第 i 个是 first 的一份，给了 seed 时用 seed + i（可复现，彼此不同；贪心时 n 个相同，与 OpenAI 一样）。"""
    out, s = [first], first.sampling
    for i in range(1, number(body, "n", 1, MAX_N, integer=True) or 1):
        seed = None if s.seed is None else (s.seed + i + 2**63) % 2**64 - 2**63  # 留在 64 位有符号整数里
        out.append(Request(first.ids, first.max_tokens, first.stop, Sampling.of(s, seed=seed), first.keep,
                           first.images, first.echo))
    return out


def response_grammar(fmt, server, think: bool):
    """response_format → 文法（qwen/sampling/grammar.py 的 Grammar）或 None：json_object 是任意一个 JSON 对象，json_schema 按它的
    schema（strict 给不给都照 schema 写：我们只会写合乎它的）。"""
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    spec = fmt.get("json_schema") if kind == "json_schema" else {"schema": {"type": "object"}}
    if kind not in ("json_object", "json_schema") or not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ApiError(400, 'response_format 应为 {"type": "text"}、{"type": "json_object"} 或 {"type": "json_schema", '
                            '"json_schema": {"name": …, "schema": {…}}}', "response_format")
    if think:
        raise ApiError(400, "response_format 不能与思考一起用（enable_thinking 或模板的默认）：思考的那一段不是 JSON", "response_format")
    try:
        return server.grammars().json_schema(spec["schema"])
    except ImportError as e:
        raise ApiError(501, str(e), "response_format") from None
    except ValueError as e:
        raise ApiError(400, f"response_format 的 {e}", "response_format") from None


def tool_grammar(body, tools, server, think: bool):
    """tool_choice 是 "required" 或指定了函数时 → 只许工具调用的文法（Grammars.tool_calls），否则 None。"""
    choice = body.get("tool_choice")
    if tools is None or choice in (None, "auto"):  # check_tools 查过 choice；"none" 时 tools 是 None
        return None
    if body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "tool_choice 与 response_format 不能一起用：回答要么是工具调用，要么是那个 JSON", "tool_choice")
    if think:
        raise ApiError(400, f"tool_choice {show(choice)} 不能与思考一起用（enable_thinking 或模板的默认）：思考的那一段不是工具调用", "tool_choice")
    try:
        return server.grammars().tool_calls(tools, chosen(choice))
    except ImportError as e:
        raise ApiError(501, str(e), "tool_choice") from None
    except ValueError as e:
        raise ApiError(400, str(e), "tools") from None


def completion_job(body, server) -> Job:
    """POST /v1/completions 的请求体 → Job：原样续写 prompt，没有要留的状态。"""
    body = read(CompletionRequest, body)
    check_common(body, server.name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt 应为非空字符串（一次一个）", "prompt")
    try:
        ids = server.chat.encode(prompt)[0].tolist()
    except ValueError as e:
        raise ApiError(400, str(e), "prompt") from None
    top, echo = number(body, "logprobs", 0, MAX_TOP, integer=True), flag(body, "echo")
    first = request(ids, body, server, top=top)
    first.echo = top if echo else None  # 也要提示词各位置的对数概率
    requests = copies(first, body)
    return Job(requests, [Reader(server.chat.tk, False, stops(body), False) for _ in requests], *stream_flags(body),
               chat=False, echo=echo, prompt=prompt, pieces=None if top is None else server.token_bytes())


def chat_logprobs(body) -> int | None:
    """chat 的 logprobs（true/false）与 top_logprobs（0…MAX_TOP，只能与 logprobs: true 一起给，与 OpenAI 相同）
    → 每个 token 另带几个（None：不要对数概率）。"""
    on, top = flag(body, "logprobs"), number(body, "top_logprobs", 0, MAX_TOP, integer=True)
    if top is not None and not on:
        raise ApiError(400, 'top_logprobs 只能与 "logprobs": true 一起用', "top_logprobs")
    return (top or 0) if on else None


def logit_bias(body, vocab_size: int) -> dict | None:
    """logit_bias：{"token id（字符串）": [-100, 100] 内的数}（OpenAI 的写法）→ {id: 数}；键不是词表里的 id、值不对时 400。"""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ApiError(400, f'logit_bias 应为对象 {{"token id": -100…100 的数}}，收到 {show(bias)}', "logit_bias")
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]{1,9}", key) or int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias 的键 {show(key)} 不是 token id（0…{vocab_size - 1} 的整数，写成字符串）", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias[{show(key)}] 应为 [-100, 100] 内的数，收到 {show(value)}", "logit_bias")
    return {int(key): value for key, value in bias.items()} or None
