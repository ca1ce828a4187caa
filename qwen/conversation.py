"""附录 · 多轮对话：读过的历史不再重读，有草稿头就投机解码，采样默认用检查点推荐的设置。

每一轮的提示词是整段对话渲染出来的（第 13 章的 build_prompt）。下一轮的提示词并不总是这一轮“提示词 + 回答”的延长：
模板会去掉上一轮回答里的思考部分。但到最后一个用户问题为止的那一段，下一轮一定原样出现（只要历史没改）。
所以每轮喂提示词时分两段：先喂到最后一个用户问题的末尾，把这时的状态复制一份留下（主模型的状态、草稿头的 KV 缓存、
最后一个位置的隐藏状态），再喂剩下的、开始生成。下一轮只要 token 上对得上，就从留下的那份接着喂新的部分；
对不上（历史被改了、换了系统提示词）就从头读。两种情况的输出逐 token 相同，只是快慢不同。

采样的默认值来自检查点的 generation_config.json（与 transformers 一样：do_sample 为真才采样，否则贪心），
用户给的参数覆盖它；temperature=0 就是贪心。
"""

import json
import threading
import time
from pathlib import Path

import torch
from torch import nn

from .attention import AttentionState
from .cache import State, copy_state
from .chat import build_prompt
from .mtp import MTP, SpecResult, stream_mtp
from .sample import check_sampling, stream

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty")


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
        check_sampling(**out)
    except ValueError as e:
        raise ValueError(f"{file}：{e}") from None
    return out


def load_draft_head(model, path):
    """检查点有 mtp.* 时读出草稿头（与主模型同样的布局），没有时返回 None。"""
    from .fast import same_layout  # 草稿头要与主模型同样的布局

    try:
        head = model.lm_head
        return MTP.from_pretrained(model.cfg, path, dtype=model.dtype, pack=not isinstance(head, nn.Linear),
                                   compile=same_layout(model),
                                   quantize="int8" if getattr(head, "scales", None) is not None else None)
    except ValueError as e:
        if "没有 mtp.*" in str(e):
            return None
        raise


class Conversation:
    """对话的状态：留下的那一份（读到某个用户问题末尾的状态），以及上一轮的统计。

    chat 是第 13 章的 Chat；mtp=True 时检查点有草稿头就用（False：普通解码；也可以直接给一个 MTP）。"""

    def __init__(self, chat, mtp=True):
        self.chat, self.model = chat, chat.model
        self.mtp = load_draft_head(chat.model, chat.path) if mtp is True else (mtp or None)
        self.defaults = generation_defaults(chat.path)
        self.saved = None  # (token 列表, State, 草稿头的 AttentionState, 最后一个位置的隐藏状态 [1, 1, h])
        self.fed = 0  # 上一轮主模型实际读了提示词的几个 token
        self.stats = None  # 上一轮：dict(tokens, seconds, drafted, hits)
        self.busy = threading.Lock()  # 一个回答在生成时拿着：同一个对话不能同时生成两个回答

    def reset(self) -> None:
        """丢掉留下的状态：下一轮从头读。"""
        self.saved = None

    def reply(self, messages, enable_thinking=False, max_new_tokens=512, tools=None, seed=None, **sampling):
        """对一组消息流式产出助手的回答（文字片段）。sampling：temperature、top_k、top_p、repetition_penalty、
        presence_penalty，没给（或 None）的取检查点的默认值。上一个回答的生成器还没读完（也没关掉）时报错：
        留下的状态与统计属于一个对话，几个并发的对话请各用自己的 Conversation。"""
        if not self.busy.acquire(blocking=False):
            raise RuntimeError("这个 Conversation 的上一个回答还没生成完（生成器没读完也没关掉）：并发的对话请各用自己的 "
                               "Conversation")
        try:
            yield from self.answer(messages, enable_thinking, max_new_tokens, tools, seed, **sampling)
        finally:
            self.busy.release()

    def answer(self, messages, enable_thinking, max_new_tokens, tools, seed, **sampling):
        unknown = set(sampling) - set(SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"未知的采样参数 {', '.join(sorted(unknown))}：可用的有 {', '.join(SAMPLING_KEYS)}")
        sampling = self.defaults | {k: v for k, v in sampling.items() if v is not None}
        check_sampling(max_new_tokens, **sampling)
        chat, model = self.chat, self.model
        tokens = chat.encode(chat.prompt(messages, enable_thinking, tools))[0].tolist()
        cut = self.cut_point(messages, tools, tokens)
        t0 = time.perf_counter()
        with torch.inference_mode():  # 只包住这一段：生成器在 yield 之间不替调用方开着 inference_mode
            state, mtp_state, hidden, start = self.resume(tokens, cut)
            if cut is not None and cut > start:  # 读到最后一个用户问题的末尾，留下一份
                hidden = self.feed(tokens, start, cut, state, mtp_state, hidden)
                self.saved = (tokens[:cut], copy_state(state), copy_state(mtp_state) if self.mtp else None, hidden)
        begin = start if cut is None else max(cut, start)
        self.fed = len(tokens) - start
        if self.mtp is not None:  # stream_mtp、stream 每产出一步前自己进入 inference_mode
            r = SpecResult()
            rounds = stream_mtp(model, self.mtp, [tokens[begin:]], max_new_tokens, chat.stop, None, seed=seed,
                                result=r, state=state, mtp_state=mtp_state, hidden=hidden, history=tokens[:begin],
                                **sampling)
            out = (t for emitted in rounds for t in emitted)
        else:
            r, out = None, stream(model, [tokens[begin:]], max_new_tokens, chat.stop, seed=seed, state=state,
                                  history=tokens[:begin], **sampling)
        counted = []

        def counting(tokens):
            for t in tokens:
                counted.append(t)
                yield t

        yield from chat.stream_text(counting(out))
        self.stats = dict(tokens=len(counted), seconds=time.perf_counter() - t0,  # drafted、hits：用了草稿头时才有
                          drafted=r.drafted if r else None, hits=r.hits if r else None)

    def cut_point(self, messages, tools, tokens):
        """提示词里最后一个用户问题结束的位置（token 下标），下一轮一定原样出现；没有对话模板时 None（不复用）。"""
        if not self.chat.templated:
            return None
        last = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        prefix = self.chat.encode(build_prompt(messages[: last + 1], tools=tools, add_generation_prompt=False))[0].tolist()
        return len(prefix) if tokens[: len(prefix)] == prefix else None

    def resume(self, tokens, cut):
        """从留下的那份接着（token 对得上时），否则从头：返回 (State, 草稿头的缓存, 隐藏状态, 已读到的位置)。"""
        if self.saved is not None and cut is not None:
            kept, state, mtp_state, hidden = self.saved
            if len(kept) <= cut and tokens[: len(kept)] == kept:
                return copy_state(state), copy_state(mtp_state) if self.mtp else None, hidden, len(kept)
        return State(self.model), AttentionState() if self.mtp is not None else None, None, 0

    def feed(self, tokens, start, end, state, mtp_state, hidden):
        return feed(self.model, self.mtp, tokens, start, end, state, mtp_state, hidden)


def feed(model, mtp, tokens, start, end, state, mtp_state, hidden):
    """主模型读 tokens[start:end]；有草稿头时它顺手读这一段的 (h_t, e_{t+1}) 对（最后一对要等下一个 token）。
    hidden：上次读到的最后一个位置的隐藏状态（从头读时 None）。返回这次最后一个位置的隐藏状态 [1, 1, h]。"""
    ids = torch.tensor([tokens[start:end]])
    h = model.hidden(ids, state)  # [1, n, h]
    if mtp is not None:
        if hidden is None:  # 从头读：第一对是 (h_0, e_1)
            pairs_h, pairs_e, first = h[:, :-1], ids[:, 1:], 0
        else:  # 接着读：第一对是上次最后一个位置的 (h_{start-1}, e_start)
            pairs_h, pairs_e, first = torch.cat([hidden, h[:, :-1]], 1), ids, start - 1
        if pairs_e.shape[1]:
            mtp(model.embed_tokens(pairs_e), pairs_h, first, mtp_state)
    return h[:, -1:]
