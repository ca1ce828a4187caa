"""第 13 章 · 对话：分词器、Qwen3.5 的对话格式、流式输出中文。

模型只认 token id。分词器（检查点里的 tokenizer.json，用 `tokenizers` 库读）把文字切成 id，
再把 id 拼回文字。Qwen 用字节级 BPE：一个 token 是若干字节，一个汉字（UTF-8 三个字节）或 emoji
（四个字节）可能被切到两三个 token 里。所以流式输出时不能每来一个 token 就解码打印：
半个汉字会变成替换符 “�”。做法是攒着，等解码结果不再以 “�” 结尾再输出新增的部分。

对话格式是 ChatML：每轮 `<|im_start|>{角色}\\n{内容}<|im_end|>\\n`，最后以
`<|im_start|>assistant\\n` 请模型接话。Qwen3.5 有“思考”模式：模型先在 <think>…</think> 里推理。
0.8B 默认不思考，模板用一个空的 `<think>\\n\\n</think>\\n\\n` 表达；要思考时只开一个 `<think>\\n`。
"""

from pathlib import Path

import torch

from .sample import stream

ROLES = ("system", "user", "assistant")


def strip_thinking(content: str) -> str:
    """历史里助手回答的思考部分不再放回提示词（与官方模板一致）。"""
    if "</think>" in content:
        content = content.split("</think>")[-1].lstrip("\n")
    return content


def build_prompt(messages, enable_thinking: bool = False) -> str:
    """把 [{"role": ..., "content": ...}, ...] 渲染成 Qwen3.5 的对话提示词。"""
    if not messages:
        raise ValueError("messages 是空的：至少要有一条用户消息")
    parts = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"第 {i} 条消息的角色 {role!r} 未知：应为 {', '.join(ROLES)} 之一")
        if not isinstance(content, str):
            raise ValueError(f"第 {i} 条消息的 content 应为字符串")
        if role == "assistant":
            content = strip_thinking(content)
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    parts.append("<think>\n" if enable_thinking else "<think>\n\n</think>\n\n")
    return "".join(parts)


class TextStream:
    """把逐个到来的 token 变成可以安全打印的文字片段。

    只解码最近一段（prefix 之后的 token），所以每步代价与回答长度无关。
    prefix..read 是已经输出过的 token；新文字 = decode(prefix:) 减去 decode(prefix:read)。
    """

    def __init__(self, tk):
        self.tk = tk
        self.ids = []
        self.prefix = 0
        self.read = 0

    def put(self, token: int) -> str:
        self.ids.append(token)
        old = self.tk.decode(self.ids[self.prefix : self.read], skip_special_tokens=False)
        new = self.tk.decode(self.ids[self.prefix :], skip_special_tokens=False)
        if len(new) > len(old) and not new.endswith("\ufffd"):  # 末尾没有半个字符
            self.prefix, self.read = self.read, len(self.ids)
            return new[len(old) :]
        return ""

    def flush(self) -> str:
        """结束时输出剩下的（若真的是不完整的字节，也只好原样交出）。"""
        old = self.tk.decode(self.ids[self.prefix : self.read], skip_special_tokens=False)
        new = self.tk.decode(self.ids[self.prefix :], skip_special_tokens=False)
        self.prefix = self.read = len(self.ids)
        return new[len(old) :]


class Chat:
    def __init__(self, model, path=None):
        from tokenizers import Tokenizer

        path = Path(path if path is not None else getattr(model, "path", "."))
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"{path} 里没有 tokenizer.json：对话需要检查点自带的分词器文件")
        self.model = model
        self.path = path
        self.tk = Tokenizer.from_file(str(file))
        self.stop = [i for i in (self.tk.token_to_id("<|im_end|>"), self.tk.token_to_id("<|endoftext|>")) if i is not None]
        # 有对话模板的检查点（Qwen3.5 本身）按 ChatML 组织提示词；没有模板的（比如只学过代码的 demo 模型）
        # 不懂对话格式，提示词原样喂给它，让它续写
        config = path / "tokenizer_config.json"
        self.templated = (path / "chat_template.jinja").is_file() or (
            config.is_file() and "chat_template" in config.read_text(encoding="utf-8"))

    def prompt(self, messages, enable_thinking: bool = False) -> str:
        """对话消息 → 提示词文字：有模板时用 build_prompt，否则把各条消息的内容原样接起来。"""
        if self.templated:
            return build_prompt(messages, enable_thinking)
        if not messages:
            raise ValueError("messages 是空的：至少要有一条用户消息")
        return "".join(m["content"] for m in messages if m.get("role") != "system")

    def encode(self, text: str) -> torch.Tensor:
        """文字 → [1, T] 的 id 张量（特殊记号如 <|im_start|> 按一个 token 识别）。"""
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if not ids:
            raise ValueError("提示词是空的")
        return torch.tensor([ids])

    def decode(self, ids) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=False)

    def stream_text(self, tokens):
        """把 token 的迭代器变成文字片段的迭代器；停止符不输出。"""
        out = TextStream(self.tk)
        for t in tokens:
            if t in self.stop:
                break
            piece = out.put(t)
            if piece:
                yield piece
        rest = out.flush()
        if rest:
            yield rest

    def reply(self, messages, enable_thinking=False, max_new_tokens=512, **sampling):
        """对一组消息流式产出助手的回答（文字片段）。"""
        ids = self.encode(self.prompt(messages, enable_thinking))
        return self.stream_text(stream(self.model, ids, max_new_tokens, self.stop, **sampling))
