"""附录 · 服务：把生成的 token 读回文字。思考放进 reasoning_content（与 vLLM 的 Qwen3 推理解析器一样），模型写的
<tool_call> 块变成 tool_calls（arguments 是 JSON 字符串，与 OpenAI、vLLM 相同），停止字符串命中时截断并结束。
流式时末尾可能是标记或停止字符串开头的一小段先不发，等下一个 token 再定。"""

import json
import re
import uuid

from ..streaming import TextStream

TOOL_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Reader:
    """token → 文字，再切成 reasoning_content、content 与工具调用。停止字符串命中时截断并结束。
    流式时每次 feed 返回可以发出的 (reasoning 片段, content 片段)；留着可能是标记或停止字符串开头的尾巴。"""

    def __init__(self, tk, thinking: bool, stops, tools: bool):
        self.text = TextStream(tk)
        self.stops = stops
        self.thinking = thinking
        self.in_reasoning = thinking
        self.tools = tools
        self.pending = ""  # 还没发出的文字
        self.reasoning = ""
        self.content = ""
        self.calls_text = ""  # <tool_call> 之后的文字：最后一起解析
        self.stopped = False
        self.matched = None  # 命中的停止字符串（Anthropic 的 stop_sequence）

    def feed(self, token=None, final=False):
        """再来一个 token（final：结束了，交出剩下的）→ 这次可以发出的 (reasoning 片段, content 片段)。"""
        self.pending += self.text.flush() if final else self.text.put(token)
        for s in self.stops:  # 停止字符串：它和它之后的都不要，生成也到此为止
            at = self.pending.find(s)
            if at >= 0:
                self.pending = self.pending[:at]
                self.stopped = final = True
                self.matched = s
        reasoning = content = ""
        if self.in_reasoning:
            at = self.pending.find("</think>")
            if at < 0:
                reasoning = self.emit(("</think>", *self.stops), final)
            else:
                reasoning = self.pending[:at]
                self.pending = self.pending[at + len("</think>"):]
                self.in_reasoning = False
        if not self.in_reasoning:
            at = self.pending.find("<tool_call>") if self.tools and not self.calls_text else -1
            if at >= 0 or self.calls_text:  # 工具调用：之后的文字攒起来，最后一起解析
                content = self.pending[: max(at, 0)]
                self.calls_text += self.pending[max(at, 0):]
                self.pending = ""
            else:
                content = self.emit((("<tool_call>",) if self.tools else ()) + tuple(self.stops), final)
        if self.thinking and not self.content:  # 模板在 </think> 之后空一行：正文从第一个不是换行的字开始
            content = content.lstrip("\n")
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def emit(self, marks, final: bool) -> str:
        """交出 pending，只留下末尾可能是某个标记开头的一段（结束时全交出）。"""
        keep = 0 if final else self.hold(marks)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out

    def hold(self, marks) -> int:
        """pending 末尾最长的、可能是某个标记开头的一段有多长（先不发）。"""
        best = 0
        for m in marks:
            for n in range(min(len(m) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(m[:n]):
                    best = n
                    break
        return best

    def tool_calls(self) -> list[dict]:
        calls = []
        for name, inner in TOOL_CALL.findall(self.calls_text):
            args = {}
            for key, value in PARAMETER.findall(inner):
                try:
                    args[key.strip()] = json.loads(value)
                except ValueError:
                    args[key.strip()] = value
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": name.strip(), "arguments": json.dumps(args, ensure_ascii=False)}})
        if self.calls_text and not calls:  # 写坏了的工具调用：原样当作文字交回去
            self.content += self.calls_text
        return calls
