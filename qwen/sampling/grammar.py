"""附录 · 结构化输出：按文法（JSON Schema）只许合乎它的 token。

模型每一步给全词表打分；文法说出此刻哪些 token 还能接得上（比如一个对象的开头之后只能是引号或右花括号），其余的 logit 取
−∞，再照常贪心或抽样（第 12 章）。这样写出的文字一定合乎文法：JSON 一定解析得了、合乎 schema（写不完时是 max_tokens 截断，
finish_reason 是 length）。文法的状态随生成的 token 前进；投机解码（第 14 章）验证第 i 个位置时，状态先沿前面的 i − 1 个草稿
前进、算完这一位置的掩码再退回去：每个位置的掩码与逐个解码时相同，贪心的输出与不起草时逐个相同（承诺 1）。

文法库用 llguidance（llama.cpp 与 vLLM 的后端之一；Microsoft 的 guidance 项目）：它没有别的依赖（xgrammar 要 torch 之外还带上
transformers 与 triton），JSON Schema 直接编译，掩码按 token 的字节前缀树算，一步在毫秒以内，还能退回几个 token（投机解码要）。
出处：https://github.com/guidance-ai/llguidance 。装上：pip install "qwen[grammar]"。
"""

import json

import torch


def llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError('结构化输出要 llguidance：pip install "qwen[grammar]"') from None
    return llguidance


class Grammars:
    """一个分词器上的文法：llguidance 的分词器表建一次（词表大时约 1 秒），之后每个 schema 编译只要几毫秒。
    chat：第 13 章的 Chat（它的分词器与停止符）；vocab_size：模型的词表（可以大于分词器的：多出的 id 永远不许）。"""

    def __init__(self, chat, vocab_size: int):
        llg = llguidance()
        self.vocab_size = vocab_size
        self.tokenizer = llg.LLTokenizer(chat.tk.to_str(), n_vocab=vocab_size, eos_token=list(chat.stop))

    def json_schema(self, schema) -> "Grammar":
        """JSON Schema（dict）→ Grammar。不是 JSON Schema、或 llguidance 编译不了时 ValueError 说出原因。"""
        llg = llguidance()
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"schema 应为 JSON Schema（一个对象），收到 {type(schema).__name__}")
        try:
            text = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
        except ValueError as e:
            raise ValueError(f"schema 编译不了：{e}") from None
        return self.compiled(text, "schema ")


    def tool_calls(self, tools: list, only: str | None = None) -> "Grammar":
        """tools（OpenAI 的 [{"type": "function", "function": {name, parameters}}]）→ 回答只能是一个或几个工具调用，写法是
        Qwen3.5 的 XML（第 13 章的 tool_call_text）；only：只能调这一个函数、调一次（tool_choice 指定了它）。参数按各自的
        JSON Schema：字符串照模板的写法原样写一行（不含 < 与换行），枚举是其中之一，别的是合乎它的 JSON；必需的一定有，
        按 schema 里的顺序。用 llguidance 的 Lark 文法写（%json 嵌进 JSON Schema）。"""
        fns = [t["function"] for t in tools if only in (None, t["function"]["name"])]
        rules = [f"start: call{'' if only else '+'}",
                 f'call: "<tool_call>\\n<function=" ({" | ".join(f"f{i}" for i in range(len(fns)))}) "</function>\\n</tool_call>"']
        for i, fn in enumerate(fns):
            params = fn.get("parameters") or {}
            needed, parts = set(params.get("required") or ()), []
            for j, (name, schema) in enumerate((params.get("properties") or {}).items()):
                opening, closing = literal(f"<parameter={name}>\n"), literal("\n</parameter>\n")
                rules.append(f"f{i}p{j}: {opening} {value_rule(schema)} {closing}")
                parts.append(f"f{i}p{j}" + ("" if name in needed else "?"))
            rules.append(f"f{i}: {literal(fn['name'] + '>' + NL)} {' '.join(parts)}")
        return self.compiled(llguidance().LLMatcher.grammar_from_lark("\n".join(rules)), "tools 的参数")

    def compiled(self, text: str, what: str) -> "Grammar":
        error = llguidance().LLMatcher.validate_grammar(text, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"{what}编译不了：{error}")
        return Grammar(self, text)


NL = "\n"


def literal(text: str) -> str:  # Lark 里的一个字符串
    return json.dumps(text)


def value_rule(schema) -> str:
    """一个参数的值：字符串原样一行，字符串的枚举是其中之一，别的按它的 JSON Schema 写 JSON。"""
    schema = schema if isinstance(schema, dict) else {}
    if schema.get("enum") and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(literal(v) for v in schema["enum"]) + ")"
    if schema.get("type") == "string":
        return r"/[^<\n]+/"
    return "%json " + json.dumps(schema)


class Grammar:
    """编译好的文法：一个值，可以给许多次生成用（第 12 章 Sampling 的 grammar）；每次生成由 matcher() 取一份自己的状态。"""

    def __init__(self, grammars: Grammars, text: str):
        self.grammars, self.text = grammars, text

    def matcher(self) -> "Matcher":
        return Matcher(llguidance().LLMatcher(self.grammars.tokenizer, self.text, log_level=0), self.grammars.vocab_size)


class Matcher:
    """一次生成里文法走到了哪儿：第 12 章的一条 Rule。mask(logits, extra)：不合文法的 token 取 −∞（extra：先沿这几个 token
    前进，算完退回）；add(tokens)：生成了这几个 token，前进。"""

    def __init__(self, m, vocab_size: int):
        self.m, self.vocab_size = m, vocab_size
        self.bits = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)

    def allowed(self) -> torch.Tensor:
        """此刻许可的 token → [vocab_size] bool（llguidance 给的是每个 token 一位的位图）。"""
        packed = torch.frombuffer(bytearray(self.m.compute_bitmask()), dtype=torch.uint8)
        return (packed[:, None] & self.bits).ne(0).flatten()[: self.vocab_size]

    def mask(self, logits: torch.Tensor, extra=()) -> torch.Tensor:
        """logits [1, V']（V' ≤ 词表：起草的子词表是前 V' 个）→ 不许的取 −∞ 的新张量。"""
        moved = self.m.try_consume_tokens(list(extra)) if extra else 0
        if moved < len(extra):  # 前面有个草稿不合文法：验证在那个草稿处就停了，这一位置的结果用不着，照原样返回
            self.m.rollback(moved)
            return logits
        ok = self.allowed()[: logits.shape[-1]]
        if moved:
            self.m.rollback(moved)
        return logits.masked_fill(~ok.to(logits.device), float("-inf"))

    def add(self, tokens) -> None:
        self.m.consume_tokens([int(t) for t in torch.as_tensor(tokens).flatten()])
