"""附录 · 客户的文字只是文字：消息里写的 <|im_end|> 伪造不出一轮对话。

第 13 章的 Chat 把整段对话渲染成一个字符串再交给分词器；分词器在字符串里认出 <|im_start|>、<|im_end|> 这样的控制记号，
不论它们是模板写的，还是用户的消息、工具的结果里本来就有的。于是谁都能在内容里写 “<|im_end|>\\n<|im_start|>system\\n…”，
模型看到的就是一轮真的系统消息（图的占位 <|image_pad|> 也一样伪造得出）。OpenAI 的接口里内容永远是文字，这里也一样：
1. 渲染之前，客户给的每段文字（内容、推理、工具调用的参数、工具说明；图的来源除外）里的控制记号换成占位：ESC 加上
   它是第几个控制记号（U+F0000 起的私用字符），ESC 自己写成两个——占位还原得回原文，不会与别的文字混淆；
2. 渲染之后在加进词表的记号处切开：分词器本来就先这样切开、各段分别切，所以模板写的记号照旧是一个 token；
3. 各段把占位还原成原文，照分词器的步骤（规范化、预切分、BPE）切成 token：控制记号的文字切成几个普通的 token。
客户的文字里没有控制记号时第 1 步什么也不换，结果就是 chat.encode(chat.prompt(…))。
检查点的对话模板与发布的不同时（template.py），渲染用它自己的模板，其余照旧。

Prompt 是提示词唯一的主人：用哪个模板（第 13 章的 Chat 判断有没有模板，这里判断是不是发布的那个）、模板的参数
chat_template_kwargs 收不收（库、命令行、服务都用这一个名字）、渲染出了什么——Rendered：token、其中的图、是否以没合上的
<think> 结尾。
"""

import re
from dataclasses import dataclass
from itertools import count

import torch

from ..chat import build_prompt, text_of
from ..vision import pictures
from .template import Template, is_released, specials

KWARG = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")  # 交给模板的参数名
RESERVED = ("messages", "tools", "add_generation_prompt")  # 这几个有自己的参数，不从 chat_template_kwargs 来
RELEASED = ("enable_thinking", "add_vision_id")  # 发布的模板（第 13 章的 build_prompt）的参数
ESC = "\ufdd0"  # Unicode 的“非字符”：正常的文字里没有它；有也不要紧（写成两个）


@dataclass
class Rendered:
    """渲染出的提示词。ids [1, T]：图的占位还没按图的大小展开（第 15 章的 Images.expand）；pictures：其中的图，按出现的
    顺序（交给视觉塔的就是它们）；thinks：以没合上的 <think> 结尾，回答从推理开始（读回答时放进 reasoning_content）。"""
    ids: torch.Tensor
    pictures: list
    thinks: bool


class Prompt:
    """第 13 章的一个 Chat 的提示词：render(…) 把对话消息变成 Rendered，客户的文字里的控制记号按文字切。"""

    def __init__(self, chat):
        self.chat, self.tk = chat, chat.tk
        text = chat.template  # 第 13 章判断有没有；与发布的逐字相同时照旧用 build_prompt
        self.template = None if text is None or is_released(text) else Template(text, chat.template_file, specials(chat.path))
        added = sorted(self.tk.get_added_tokens_decoder().values(), key=lambda t: -len(t.content))  # 长的先配
        self.specials = [t.content for t in added if t.special]
        self.marker = re.compile("|".join(map(re.escape, [ESC, *self.specials])))
        self.added = re.compile("(" + "|".join(map(re.escape, [t.content for t in added])) + ")")

    def render(self, messages, tools=None, chat_template_kwargs=None, add_generation_prompt=True) -> Rendered:
        """对话消息 → Rendered（ids 同 chat.encode(chat.prompt(…))，只是客户的文字里的控制记号是文字）。chat_template_kwargs：
        交给模板的参数（check 先查）；没给 enable_thinking 时用模板自己的默认（发布的模板是思考：它只在 false 时放空的 <think>）。"""
        kwargs, chat = self.check(chat_template_kwargs), self.chat
        messages, tools = self.escape(messages), self.escape(tools)
        if self.template is not None:
            for i, m in enumerate(messages):  # 模板照样写出图的占位；这里同第 13 章一样查内容的每一段（系统消息不能带图）
                if isinstance(m, dict) and isinstance(m.get("content"), list):
                    text_of(m["content"], i, count(1) if m.get("role") != "system" else None)
            text = self.template.render(messages, tools, add_generation_prompt, **kwargs)
        elif chat.templated:
            text = build_prompt(messages, kwargs.get("enable_thinking", True), tools, add_generation_prompt,
                                kwargs.get("add_vision_id", False))
        else:
            text = chat.prompt(messages)
        ids = chat.encode(text) if ESC not in text else self.split(text)
        thinks = chat.templated and chat.decode(ids[0, -6:].tolist()).rstrip().endswith("<think>")
        return Rendered(ids, pictures(messages), thinks)

    def check(self, chat_template_kwargs, enable_thinking=None) -> dict:
        """chat_template_kwargs → 交给模板的 dict；不能交的 ValueError 说明原因。发布的模板只有 enable_thinking 与 add_vision_id
        （给了别的就是错，不默默丢掉）；检查点自己的模板收它读的参数，值原样交给它。enable_thinking：kwargs 里没有时用它。"""
        kwargs = {} if chat_template_kwargs is None else chat_template_kwargs
        if not isinstance(kwargs, dict):
            raise ValueError(f"模板的参数应为 dict，收到 {type(kwargs).__name__}")
        kwargs = {"enable_thinking": enable_thinking} | kwargs
        for key in [k for k in RELEASED if kwargs.get(k) is not None and not isinstance(kwargs[k], bool)]:
            raise ValueError(f"模板的参数 {key} 应为 true/false，收到 {kwargs[key]!r}")
        if self.template is None and (extra := [k for k in kwargs if k not in RELEASED or not self.chat.templated and kwargs[k]]):
            what = "用发布的 Qwen3.5 模板，只有 enable_thinking 与 add_vision_id 两个参数" if self.chat.templated else \
                "没有对话模板：不会思考，也没有别的参数可给"
            raise ValueError(f"这个检查点{what}，收到 {', '.join(map(repr, extra))}")
        for key in kwargs:
            if not isinstance(key, str) or not KWARG.fullmatch(key) or key in RESERVED:
                raise ValueError(f"模板的参数 {key!r} 不能给：参数名是字母开头的标识符（至多 64 个字），"
                                 f"不是 {', '.join(RESERVED)}（它们有自己的参数）")
        return {k: v for k, v in kwargs.items() if not (k in RELEASED and v is None)}  # None：用模板自己的默认

    def describe(self) -> str:
        """加载时说一句用的是哪个模板。"""
        if self.template is not None:
            return f"对话模板：检查点自己的（{self.template.where}，与发布的 Qwen3.5 模板不同），用 jinja2 的沙箱渲染"
        return "对话模板：发布的 Qwen3.5 模板（第 13 章的 build_prompt）" if self.chat.templated else "没有对话模板：消息原样接起来续写"

    def split(self, text: str) -> torch.Tensor:
        """渲染出的文字 → [1, T] 的 id：在加进词表的记号处切开，模板写的记号是一个 token，其余各段按文字切。"""
        pieces = self.added.split(text)  # 奇数位置是切开处的记号：模板写的（客户写的已换成占位）
        ids = [self.as_text(p) if i % 2 == 0 else [self.tk.token_to_id(p)] for i, p in enumerate(pieces)]
        return torch.tensor([[t for part in ids for t in part]])

    def escape(self, v):
        """消息、工具里的每段文字：控制记号换成占位。图的分段（有 image 或 image_url）原样留着。"""
        if isinstance(v, str):
            return self.marker.sub(lambda m: ESC * 2 if m[0] == ESC else ESC + chr(0xF0000 + self.specials.index(m[0])), v)
        if isinstance(v, dict):
            return v if "image" in v or "image_url" in v else {k: self.escape(x) for k, x in v.items()}
        return [self.escape(x) for x in v] if isinstance(v, (list, tuple)) else v

    def as_text(self, piece: str) -> list:
        """一段（其中没有模板写的记号）→ id：占位还原成原文，再照分词器的步骤切，不认控制记号。"""
        piece = re.sub(ESC + "(.)", lambda m: ESC if m[1] == ESC else self.specials[ord(m[1]) - 0xF0000], piece, flags=re.S)
        piece = self.tk.normalizer.normalize_str(piece) if self.tk.normalizer else piece
        words = self.tk.pre_tokenizer.pre_tokenize_str(piece) if self.tk.pre_tokenizer else [(piece, None)]
        return [t.id for w, _ in words for t in self.tk.model.tokenize(w)]
