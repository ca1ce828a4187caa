"""附录 · 检查点自己的对话模板：微调过的检查点与后继的型号（Qwen3.6、Qwen3.8……）带着自己的 chat_template。

第 13 章的 build_prompt 是照发布的 Qwen3.5 模板手写的，课程讲的是它；检查点的模板与发布的逐字相同（比 SHA-256）时仍走它。
不同时——多了默认的系统轮、自己的参数（preserve_thinking、reasoning_effort……）、别的写法——按检查点自己的模板渲染，
与 transformers 的 apply_chat_template、vLLM、llama-server --jinja 一样：jinja2 的 ImmutableSandboxedEnvironment（下载来的
模板碰不到 Python 的对象），同样的全局量（raise_exception、strftime_now、带参数的 tojson、namespace、loop controls）。

下载来的模板是别人写的程序，所以设了界：渲染出的文字至多 MAX_CHARS 个字，至多 MAX_SECONDS 秒（每次调函数、取属性时看一眼
钟）；模板自己 raise_exception 的话原样作为错误说明。出处：transformers 的 utils/chat_template_utils.py；
jinja2 的沙箱文档 https://jinja.palletsprojects.com/en/stable/sandbox/ 。
"""

import hashlib
import json
import time
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

RELEASED = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"  # 发布的模板去掉首尾空白后的 SHA-256
MAX_CHARS = 4 * 2**20  # 渲染出的提示词至多这么多个字
MAX_SECONDS = 2.0  # 渲染一次至多这么多秒


class TemplateError(ValueError):
    """模板渲染不了：它自己 raise_exception 的说明、超出界限、碰了沙箱不许碰的东西。服务把它作为 400 的说明。"""


def specials(folder) -> dict:
    """tokenizer_config.json 里的 bos_token、eos_token、unk_token、pad_token（有的话）：transformers 把它们也交给模板。"""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out = {k: v.get("content") if isinstance(v, dict) else v for k in ("bos_token", "eos_token", "unk_token", "pad_token")
           if (v := config.get(k) if isinstance(config, dict) else None) is not None}
    return {k: v for k, v in out.items() if isinstance(v, str)}


def is_released(text: str) -> bool:
    return hashlib.sha256(text.strip().encode("utf-8")).hexdigest() == RELEASED


class Bounded(ImmutableSandboxedEnvironment):
    """jinja2 的不可变沙箱，加一个钟：每次调函数、取属性、取下标时看是否过了 deadline（空转的循环也要做这些）。"""
    deadline = float("inf")

    def check(self):
        if time.monotonic() > self.deadline:
            raise TemplateError(f"渲染超过 {MAX_SECONDS:g} 秒：停下了（模板里可能有很长的循环）")

    def call(self, context, obj, *args, **kwargs):
        self.check()
        return super().call(context, obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        self.check()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self.check()
        return super().getitem(obj, argument)

    intercepted_binops = frozenset(["*", "**"])  # 'x' * 10**10 一下子就要 10 GB：乘之前先看结果多大

    def call_binop(self, context, operator, left, right):
        self.check()
        sized = [len(x) for x in (left, right) if isinstance(x, (str, list, tuple))]
        count = [x for x in (left, right) if isinstance(x, int)]
        if operator == "*" and sized and count and sized[0] * count[0] > MAX_CHARS or operator == "**" and abs(right) > 4096:
            raise TemplateError(f"{left!r:.20} {operator} {right!r:.20} 太大了")
        return super().call_binop(context, operator, left, right)


class Namespace(jinja2.utils.Namespace):
    """模板里的 namespace(…)：不许存下划线开头的名字（同 transformers：碰不到 CPython 的内部）。"""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            Namespace.check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        Namespace.check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace 里不能存下划线开头的名字 {name!r}")


class Template:
    """检查点自己的（与发布的不同的）对话模板，编译一次。text：模板的文字；where：它在哪个文件里（错误说明里用）；
    specials：tokenizer_config.json 里的 bos_token、eos_token 等（transformers 也交给模板）。"""

    def __init__(self, text: str, where: str, specials: dict | None = None):
        if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
            raise ImportError(f"渲染检查点的对话模板要 jinja2 >= 3.1.6（旧版本有沙箱逃逸），这里是 {jinja2.__version__}："
                              "pip install -U jinja2")
        self.where, self.specials = where, specials or {}
        self.env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self.env.filters["tojson"] = tojson
        self.env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                                namespace=Namespace)
        try:
            self.template = self.env.from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{where} 的对话模板第 {e.lineno} 行解析不了：{e.message}") from None

    def render(self, messages, tools=None, add_generation_prompt=True, **kwargs) -> str:
        """消息 → 提示词文字（与 transformers 的 apply_chat_template(tokenize=False) 相同）。渲染不了：TemplateError。"""
        variables = self.specials | kwargs | {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
        self.env.deadline, out, size = time.monotonic() + MAX_SECONDS, [], 0
        try:
            for piece in self.template.generate(**variables):
                out.append(piece)
                size += len(piece)
                if size > MAX_CHARS:
                    raise TemplateError(f"渲染出的文字超过 {MAX_CHARS} 个字：停下了")
        except TemplateError as e:
            raise TemplateError(f"{self.where} 的对话模板：{e}") from None
        except SecurityError as e:
            raise TemplateError(f"{self.where} 的对话模板碰了沙箱不许碰的东西：{e}") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"{self.where} 的对话模板：{e.message or e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError, OverflowError) as e:
            raise TemplateError(f"{self.where} 的对话模板渲染时出错（{type(e).__name__}: {e}）") from None
        return "".join(out)


def raise_exception(message):  # 模板里的 raise_exception('…')：它的说明就是错误的说明
    raise TemplateError(str(message))


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # 同 transformers：不转义 HTML，可带参数
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
