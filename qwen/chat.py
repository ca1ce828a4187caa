"""第 13 章 · 对话：分词器、Qwen3.5 的对话格式、流式输出中文。

模型只认 token id：分词器（检查点里的 tokenizer.json，用 `tokenizers` 库读）把文字切成 id，再把 id 拼回文字；流式输出时
半个汉字不输出（第 12 章附的 TextStream）。

对话格式是 ChatML：每轮 `<|im_start|>{角色}\\n{内容}<|im_end|>\\n`，最后以 `<|im_start|>assistant\\n` 请模型接话。
“思考”时模型先在 <think>…</think> 里推理，不思考时模板放一个空的。build_prompt 照着发布的对话模板（Jinja）手写：工具说明
放进系统轮，工具调用写成 <tool_call> 块，连续的工具结果合进一个用户轮；最后一个问题之后的助手轮带上思考，之前的不带。
"""

import json
from itertools import count, takewhile
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .sample import stream
from .streaming import TextStream

ROLES = ("system", "user", "assistant", "tool")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # 模板里的一张图；<|image_pad|> 之后按图的大小展开（第 15 章）
# 有工具时系统轮的开头：发布的模板里的英文原文，{tools} 处每行一个工具的 JSON
TOOLS_PROMPT = (Path(__file__).parent / "tools_prompt.txt").read_text(encoding="utf-8")


def chat_template(folder: Path) -> tuple:
    """检查点文件夹 → (对话模板的文字, 它在哪个文件里)，没有时 (None, "")：先看 chat_template.jinja，再看 tokenizer_config.json
    的 chat_template。有没有模板只在这里判断；附录照这段文字渲染检查点自己的模板。"""
    jinja, config = folder / "chat_template.jinja", folder / "tokenizer_config.json"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), jinja.name
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
    except (ValueError, AttributeError):
        raise ValueError(f"{config} 不是 JSON 对象：读不出它的 chat_template") from None
    if isinstance(value, list):  # 几个有名字的模板 [{"name", "template"}]：用名为 default 的那个
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    return (value, config.name) if isinstance(value, str) and value.strip() else (None, "")


def text_of(content, i: int, numbers=None, add_vision_id: bool = False) -> str:
    """消息内容 → 去掉首尾空白的文字。内容是字符串、None 或分段的列表：文字 {"type": "text", "text": …}，图写成 IMAGE
    （第 15 章的 pictures(messages) 是同样顺序的那几张；numbers：给图编号的 itertools.count(1)；系统消息的是 None：不能带图）。"""
    out = ""
    for c in content if isinstance(content, list) else [{"text": content or ""}]:
        kind = next((k for k in ("image", "image_url", "text") if isinstance(c, dict) and (k in c or c.get("type") == k)), None)
        if kind in ("image", "image_url") and numbers is not None:
            out += f"Picture {next(numbers)}: " * add_vision_id + IMAGE
        elif kind == "text" and isinstance(c.get("text"), str):
            out += c["text"]
        else:  # 系统消息里的图、视频、别的
            why = "系统消息不能带图" if kind not in (None, "text") else "还不支持视频"
            raise ValueError(f"第 {i} 条消息的 content 应为字符串或文字、图像分段的列表（{why}），收到 {str(c)[:60]}")
    return out.strip()


def tool_call_text(call, i: int) -> str:
    """助手的一个工具调用 {"name", "arguments": {参数: 值}}（或包在 "function" 里）→ <tool_call> 块。"""
    call = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise ValueError(f"第 {i} 条消息的 tool_calls 里有一个没有 name（函数名）的调用")
    args = call.get("arguments") or {}
    if not isinstance(args, dict):
        raise ValueError(f"第 {i} 条消息的工具调用 {call['name']} 的 arguments 应为 dict（参数名: 值）")
    params = "".join(f"<parameter={k}>\n{json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v}\n</parameter>\n"
                     for k, v in args.items())  # 字典、列表写成 JSON，其余照原样
    return f"<tool_call>\n<function={call['name']}>\n{params}</function>\n</tool_call>"


def build_prompt(messages, enable_thinking=False, tools=None, add_generation_prompt=True, add_vision_id=False) -> str:
    """把 [{"role": ..., "content": ...}, ...]（可选 tools：函数说明的列表）渲染成 Qwen3.5 的对话提示词。消息里的图写成
    IMAGE；add_vision_id：每张图前写 “Picture n: ”。"""
    if not messages:
        raise ValueError("messages 是空的：至少要有一条用户消息")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else m
        if role not in ROLES or role == "system" and i:
            raise ValueError(f"第 {i} 条消息的角色 {role!r} " + ("不对：系统消息只能是第一条" if role == "system" else
                                                              f"未知：应为 {', '.join(ROLES)} 之一"))
    numbers = count(1)
    texts = [text_of(m.get("content"), i, numbers if m["role"] != "system" else None, add_vision_id) for i, m in enumerate(messages)]
    queries = [i for i, m in enumerate(messages) if m["role"] == "user"
               and not (texts[i].startswith("<tool_response>") and texts[i].endswith("</tool_response>"))]
    if not queries:
        raise ValueError("messages 里没有用户的问题（只有系统消息、助手回答或工具结果）")
    last_query, parts = queries[-1], []
    system = texts[0] if messages[0]["role"] == "system" else None
    if tools:  # 工具的说明在前，系统提示词（有的话）接在后面
        listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        system = TOOLS_PROMPT.replace("{tools}", listed) + ("\n\n" + system if system else "")
    if system is not None:
        parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for i, (m, content) in enumerate(zip(messages, texts)):
        if m["role"] == "user":
            parts.append(f"<|im_start|>user\n{content}<|im_end|>\n")
        elif m["role"] == "assistant":
            reasoning = m.get("reasoning_content")
            if not isinstance(reasoning, str):  # 没单独给出：从内容里的 <think>…</think> 取
                before, _, after = content.rpartition("</think>") if "</think>" in content else ("", "", content)
                reasoning, content = before.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n"), after.lstrip("\n")
            think = f"<think>\n{reasoning.strip()}\n</think>\n\n" if i > last_query else ""
            calls = "\n".join(tool_call_text(c, i) for c in m.get("tool_calls") or [])
            gap = "\n\n" if calls and content.strip() else ""  # 正文与工具调用之间空一行
            parts.append(f"<|im_start|>assistant\n{think}{content}{gap}{calls}<|im_end|>\n")
        elif m["role"] == "tool":  # 连续的工具结果合进同一个用户轮
            opening = "<|im_start|>user" if i and messages[i - 1]["role"] != "tool" else ""
            closing = "<|im_end|>\n" if i + 1 == len(messages) or messages[i + 1]["role"] != "tool" else ""
            parts.append(f"{opening}\n<tool_response>\n{content}\n</tool_response>{closing}")
    generation = "<|im_start|>assistant\n" + ("<think>\n" if enable_thinking else "<think>\n\n</think>\n\n")
    return "".join(parts) + generation * add_generation_prompt


class Chat:
    def __init__(self, model, path=None):  # path：检查点文件夹（分词器与对话模板在里面），默认是加载 model 的那个
        self.model = model
        self.path = path = Path(path if path is not None else getattr(model, "path", "."))
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} 里没有 tokenizer.json：对话需要检查点自带的分词器文件")
        try:  # 不是 JSON、不是分词器的文件：说出是哪个文件
            self.tk = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise ValueError(f"{path / 'tokenizer.json'} 读不了（{e}）：文件可能被截断或改坏了，请重新下载它") from None
        self.stop = [i for i in (self.tk.token_to_id("<|im_end|>"), self.tk.token_to_id("<|endoftext|>")) if i is not None]
        # 有对话模板的检查点按 ChatML 组织提示词；没有的（比如只学过代码的 demo 模型）提示词原样喂给它续写
        self.template, self.template_file = chat_template(path)
        self.templated = self.template is not None

    def prompt(self, messages, enable_thinking=False, tools=None) -> str:
        """对话消息 → 提示词文字：有模板时用 build_prompt，否则把各条消息的内容原样接起来（图同样写成 IMAGE）。"""
        if self.templated:
            return build_prompt(messages, enable_thinking, tools)
        return "".join(m["content"] if isinstance(m["content"], str) else text_of(m["content"], i, count(1))
                       for i, m in enumerate(messages) if m.get("role") != "system")

    def encode(self, text: str) -> torch.Tensor:
        """文字 → [1, T] 的 id 张量（特殊记号如 <|im_start|> 按一个 token 识别）。"""
        if not isinstance(text, str) or not text or any("\ud800" <= c <= "\udfff" for c in text):
            raise ValueError(f"提示词应是非空、合法的 Unicode 文字（str，不含单独的代理字符 U+D800–U+DFFF），收到 {text!r:.60}")
        return torch.tensor([self.tk.encode(text, add_special_tokens=False).ids])

    def decode(self, ids) -> str:  # 特殊记号照原样写出
        return self.tk.decode(list(ids), skip_special_tokens=False)

    def stream_text(self, tokens):  # token 的迭代器 → 文字片段的迭代器；停止符不输出
        out = TextStream(self.tk)
        for t in takewhile(lambda t: t not in self.stop, tokens):
            yield from filter(None, [out.put(t)])  # 还是半个字符时这一步什么也不产出
        yield from filter(None, [out.flush()])

    def reply(self, messages, enable_thinking=False, max_new_tokens=512, tools=None, sampling=None, **settings):
        """流式产出回答的文字片段，每次从头读整段对话（复用历史、投机解码、推荐的采样、内容里的控制记号当文字：附录的 Conversation）。"""
        if any(t.special and t.content in str([messages, tools]) for t in self.tk.get_added_tokens_decoder().values()):
            raise ValueError("消息里写着控制记号（如 <|im_end|>）：本章会把它读成控制记号、伪造出一轮；要当文字读，请用附录的 "
                             "qwen.Conversation")
        if IMAGE in (text := self.prompt(messages, enable_thinking, tools)):
            raise ValueError("消息里有图：要第 15 章的视觉塔读它们，请用附录的 qwen.Conversation")
        ids = self.encode(text)
        return self.stream_text(stream(self.model, ids, max_new_tokens, self.stop, sampling, **settings))
