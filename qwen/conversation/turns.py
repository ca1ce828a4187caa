"""附录 · 多轮对话：读过的历史不再重读，有草稿头就投机解码，采样默认用检查点推荐的设置。

每一轮的提示词是整段对话渲染出来的（prompt.py 的 Prompt：用哪个模板、消息里写的控制记号只是文字）。
下一轮的提示词并不总是这一轮“提示词 + 回答”的延长：模板会去掉上一轮回答里的思考部分。但到最后一个用户问题为止的那一段，
下一轮一定原样出现（只要历史没改）。
所以每轮喂提示词时分两段：先喂到最后一个用户问题的末尾，把这时的状态复制一份留下（主模型的状态、草稿头的 KV 缓存、
最后一个位置的隐藏状态），再喂剩下的、开始生成。下一轮只要 token 上对得上，就从留下的那份接着喂新的部分；
对不上（历史被改了、换了系统提示词）就从头读。两种情况的输出逐 token 相同，只是快慢不同。

采样的默认值来自检查点的 generation_config.json（与 transformers 一样：do_sample 为真才采样，否则贪心），
用户给的参数覆盖它；temperature=0 就是贪心。
"""

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cache import State, copy_state
from ..fast import load_draft
from ..mtp import Drafter, Run, prefill
from ..sample import Sampling, stream
from ..vision import VisionTower
from .prompt import Prompt

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty")  # 检查点能推荐的几项


def generation_defaults(path) -> dict:
    """检查点的 generation_config.json → 采样参数的默认值。do_sample 不为真（或没有这个文件）时是 {}：贪心。
    与 transformers 的 GenerationConfig 一样，采样而没写 top_k 时取 50、没写 temperature 时取 1。"""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        d = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{file} 不是合法的 JSON（{e}）：请重新下载或删掉它") from None
    if not isinstance(d, dict) or not d.get("do_sample"):
        return {}
    out = {"temperature": 1.0, "top_k": 50} | {k: d[k] for k in SAMPLING_KEYS if d.get(k) is not None}
    try:
        Sampling(**out)
    except ValueError as e:
        raise ValueError(f"{file}：{e}") from None
    return out


def template_defaults(path) -> dict:
    """检查点的 generation_config.json 里的 default_chat_template_kwargs（vLLM 也读它）→ 交给对话模板的默认参数；没有时 {}。
    服务在它之上叠 --default-chat-template-kwargs，再叠请求的 chat_template_kwargs；值由 Prompt.check 查。"""
    file = Path(path) / "generation_config.json"
    d = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}  # 坏的 JSON：generation_defaults 先说了
    value = d.get("default_chat_template_kwargs") if isinstance(d, dict) else None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{file} 的 default_chat_template_kwargs 应为对象，收到 {type(value).__name__}")
    return value or {}


@dataclass
class Resume:
    """读到某处的一份状态，从这里接着生成（多轮对话留下的、服务的前缀缓存里的）。tokens：已读过的 token；state：主模型
    读过它们之后的状态；drafter：草稿头这一边（第 14 章的 Drafter：读过它们的缓存，待送最后一个位置的 h；没有草稿头时 None）。"""
    tokens: list
    state: State
    drafter: Drafter | None = None
    images: list = field(default_factory=list)  # 读过的图的内容摘要（按顺序）：token 相同、图不同时不能接着用

    def same_images(self, images, tokens) -> bool:
        """tokens（展开过的提示词，前面与 self.tokens 相同）里、self.tokens 那一段的图是不是读过的那几张。"""
        part = images.part(tokens, 0, len(self.tokens)) if images is not None else None
        return (part.digests if part else []) == self.images

    @classmethod
    def start(cls, model) -> "Resume":
        return cls([], State(model))

    def copy(self) -> "Resume":
        """生成时状态就地往前走：留着的那份先复制一份再用。"""
        return Resume(list(self.tokens), copy_state(self.state), self.drafter and self.drafter.copy(), list(self.images))

    def feed(self, model, mtp, tokens: list, images=None) -> "Resume":
        """接着读 tokens（就地往前走）：主模型读（第 14 章的 prefill）；有草稿头时它顺手读掉这一段的 (h_t, e_{t+1}) 对
        （最后一个 h 等下一个 token）。images：这一段里的图（第 15 章的 Images，整张地在这一段里）。"""
        _, drafter = prefill(model, torch.tensor([tokens]), self.state, self.drafter, images)
        self.drafter = drafter if mtp is not None else None
        if mtp is not None:
            mtp.draft(model, self, 0)  # 起草 0 个：只读
        self.tokens = self.tokens + list(tokens)
        self.images = self.images + (images.digests if images is not None else [])
        return self

    def generate(self, model, mtp, tokens: list, max_new_tokens: int, stop, sampling: Sampling, images=None, **more):
        """读新来的 tokens（images：其中的图）并生成（就地往前走）→ (token 的迭代器, 统计)：有草稿头时投机解码（第 14 章，
        统计是那次的 Run），否则普通解码（第 12 章，统计是 None）。"""
        if mtp is None:
            return stream(model, [tokens], max_new_tokens, stop, sampling, state=self.state, history=self.tokens, images=images), None
        run = Run.start(model, [tokens], sampling, stop, resume=self, images=images)
        return (t for emitted in run.stream(model, mtp, max_new_tokens, **more) for t in emitted), run


def cut_point(prompt: Prompt, messages, tools, tokens, images=None, chat_template_kwargs=None) -> int | None:
    """提示词里最后一个用户问题结束的位置（token 下标），下一轮一定原样出现；没有对话模板或没有用户消息时 None（不复用）。
    images：tokens 里的图（占位已展开）：前缀里的每个占位也按它的图展开。chat_template_kwargs：渲染 tokens 时交给模板的。
    到那里为止单独渲染的一段不是 tokens 的开头（检查点自己的模板按后面的消息改写前面的轮次）时也是 None：不留错的状态。"""
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    if not prompt.chat.templated or not users:
        return None
    prefix = prompt.render(messages[: users[-1] + 1], tools, chat_template_kwargs, add_generation_prompt=False).ids
    prefix = (images.expand(prefix, prefix=True) if images is not None else prefix)[0].tolist()
    return len(prefix) if tokens[: len(prefix)] == prefix else None


class Conversation:
    """对话的状态：留下的那一份（读到某个用户问题末尾的 Resume），以及上一轮的统计。

    chat 是第 13 章的 Chat；mtp=True 时检查点有草稿头就用（与主模型同样的布局，qwen.fast.load_draft；False：普通解码；
    也可以直接给一个 MTP）。"""

    def __init__(self, chat, mtp=True):
        self.chat, self.model = chat, chat.model
        self.prompt = Prompt(chat)  # 用哪个模板、模板的参数；客户的文字里的控制记号按文字切
        self.mtp = load_draft(chat.model, chat.path) if mtp is True else (mtp or None)
        self.defaults = generation_defaults(chat.path)
        self.saved: Resume | None = None
        self.fed = 0  # 上一轮主模型实际读了提示词的几个 token
        self.stats = None  # 上一轮：dict(tokens, seconds, drafted, hits)
        self.busy = threading.Lock()  # 一个回答在生成时拿着：同一个对话不能同时生成两个回答
        self.tower = None  # 视觉塔（第 15 章）：第一次有图时才读

    def reset(self) -> None:
        """丢掉留下的状态：下一轮从头读。"""
        self.saved = None

    def reply(self, messages, enable_thinking=False, max_new_tokens=512, tools=None, sampling=None, chat_template_kwargs=None,
              **settings):
        """对一组消息流式产出助手的回答（文字片段）。chat_template_kwargs：交给对话模板的参数（Prompt.check 查；其中的
        enable_thinking 优先于同名参数）；enable_thinking=None 时用模板自己的默认。sampling（Sampling）或 settings（temperature、top_k、top_p、
        repetition_penalty、presence_penalty、frequency_penalty、logit_bias、seed）：没给（或 None）的取检查点的默认值。上一个回答的生成器还没读完
        （也没关掉）时报错：留下的状态与统计属于一个对话，几个并发的对话请各用自己的 Conversation。"""
        if not self.busy.acquire(blocking=False):
            raise RuntimeError("这个 Conversation 的上一个回答还没生成完（生成器没读完也没关掉）：并发的对话请各用自己的 "
                               "Conversation")
        try:
            kwargs = self.prompt.check(chat_template_kwargs, enable_thinking)
            yield from self.answer(messages, kwargs, max_new_tokens, tools, sampling, settings)
        finally:
            self.busy.release()

    def sampling(self, sampling, settings) -> Sampling:
        """采样设置：给了 Sampling 就用它，否则检查点的默认值；settings 里不是 None 的几项覆盖它们。"""
        return Sampling.of(sampling or Sampling(**self.defaults), **{k: v for k, v in settings.items() if v is not None})

    def answer(self, messages, kwargs, max_new_tokens, tools, sampling, settings):
        s = self.sampling(sampling, settings)
        Sampling.check("max_new_tokens", max_new_tokens)
        chat, model, t0 = self.chat, self.model, time.perf_counter()
        tokens, images = self.encode(messages, tools, kwargs)
        cut = cut_point(self.prompt, messages, tools, tokens, images, kwargs)
        with torch.inference_mode():  # 只包住这一段：生成器在 yield 之间不替调用方开着 inference_mode
            resume = self.resume(tokens, cut, images)
            start = len(resume.tokens)
            if cut is not None and cut > start:  # 读到最后一个用户问题的末尾，留下一份
                self.saved = resume.feed(model, self.mtp, tokens[start:cut], images and images.part(tokens, start, cut)).copy()
        begin = len(resume.tokens)
        self.fed = len(tokens) - start
        out, r = resume.generate(model, self.mtp, tokens[begin:], max_new_tokens, chat.stop, s,  # 每产出一步前自己进入 inference_mode
                                 images=images and images.part(tokens, begin, len(tokens)))
        counted = []

        def counting(tokens):
            for t in tokens:
                counted.append(t)
                yield t

        yield from chat.stream_text(counting(out))
        self.stats = dict(tokens=len(counted), seconds=time.perf_counter() - t0,  # drafted、hits：用了草稿头时才有
                          drafted=r.drafted if r else None, hits=r.hits if r else None)

    def encode(self, messages, tools=None, chat_template_kwargs=None):
        """消息 → (提示词的 token 列表, 其中的图)：有图时视觉塔（第一次用时读，与模型同一个 dtype）看图，占位按图展开。"""
        rendered = self.prompt.render(messages, tools, chat_template_kwargs)
        if not rendered.pictures:
            return rendered.ids[0].tolist(), None
        with torch.inference_mode():
            self.tower = self.tower or VisionTower.from_pretrained(self.chat.path, dtype=self.model.dtype)
            images = self.tower.encode(rendered.pictures)
        return images.expand(rendered.ids)[0].tolist(), images

    def resume(self, tokens, cut, images=None) -> Resume:
        """从留下的那份接着（token 对得上、读过的图也是这几张时，复制一份），否则从头。"""
        if self.saved is not None and cut is not None:
            kept = self.saved.tokens
            if len(kept) <= cut and tokens[: len(kept)] == kept and self.saved.same_images(images, tokens):
                return self.saved.copy()
        return Resume.start(self.model)
