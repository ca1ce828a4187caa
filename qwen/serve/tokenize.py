"""附录 · 服务：POST /tokenize 与 POST /detokenize（vLLM 的样子）：看一段文字、一组对话消息切成哪些 token，或一串 token
拼回什么文字，不生成。对话消息走 chat completions 同一条路（requests.py 的 chat_prompt）：token 数就是那边的 prompt_tokens。"""

from .errors import ApiError, show
from .protocol import DetokenizeRequest, TokenizeRequest, read
from .requests import chat_prompt, check_common, rendered


def tokenize(body, server) -> dict:
    """{"prompt": 文字} 或 {"messages": [...], "tools"?, "chat_template_kwargs"?} → {count, max_model_len, tokens}。"""
    body = read(TokenizeRequest, body)
    check_common(body, server.name)
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "给 prompt（一段文字）或 messages（对话消息）中的一个", "prompt")
    if "messages" in body:
        ids = chat_prompt(body, server).ids
    elif isinstance(body["prompt"], str) and body["prompt"]:
        ids = rendered(lambda: server.chat.encode(body["prompt"]))[0].tolist()
    else:
        raise ApiError(400, f"prompt 应为非空字符串，收到 {show(body['prompt'])}", "prompt")
    return {"count": len(ids), "max_model_len": server.max_prompt, "tokens": ids}


def detokenize(body, server) -> dict:
    """{"tokens": [id, …]} → {"prompt": 文字}（控制记号照原样写出）。"""
    body = read(DetokenizeRequest, body)
    check_common(body, server.name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < server.vocab_size for t in tokens):
        raise ApiError(400, f"tokens 应为词表里的 token id（0…{server.vocab_size - 1}）组成的列表，收到 {show(tokens)}", "tokens")
    return {"prompt": server.chat.decode(tokens)}
