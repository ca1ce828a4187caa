"""第 12 章附 · 流式输出文字：token 一个个地来，文字一段段地出，半个汉字不出。

第 12 章的 stream 逐个产出 token 的 id；要边生成边打印，就得把它们拼回文字（第 13 章的分词器 decode）。Qwen 用字节级 BPE：
一个汉字是 UTF-8 的三个字节，可能切进两三个 token，只解码到一半时得到的是替换字符 “�”。所以攒着：新来的 token 让文字
变长、且不再以 “�” 结尾时，才输出多出来的那一段（transformers 的 TextStreamer、vLLM 的增量解码是同样的办法）。
每一步只解码最近的一小段（从 prefix 起），代价与回答多长无关。
"""


class TextStream:
    """把逐个到来的 token 变成能安全打印的文字片段：新文字 = decode(ids[prefix:]) 减去 decode(ids[prefix:read])。"""

    def __init__(self, tk):
        self.tk, self.ids = tk, []  # 到来的全部 token
        self.prefix = self.read = 0  # 只解码从 prefix 起的（每步的代价与回答多长无关）；prefix..read 已经输出过

    def put(self, token: int) -> str:
        self.ids.append(token)
        old, new = (self.tk.decode(self.ids[self.prefix : end], skip_special_tokens=False) for end in (self.read, None))
        if len(new) > len(old) and not new.endswith("\ufffd"):  # 末尾没有半个字符
            self.prefix, self.read = self.read, len(self.ids)
            return new[len(old) :]
        return ""

    def flush(self) -> str:  # 结束时输出剩下的（若真的是不完整的字节，也只好原样交出）
        old, new = (self.tk.decode(self.ids[self.prefix : end], skip_special_tokens=False) for end in (self.read, None))
        self.prefix = self.read = len(self.ids)
        return new[len(old) :]
