"""qwen：手写、可读、快速的 Qwen3.5 PyTorch 实现。

qwen/ 顶层的每个 .py 是课程的一章（或一章的附，如“第 13 章附”的 batch.py），文件开头写着它是第几章：按它读，顺序由
chapters() 从这些开头排出来，不另记一份。附录都在子包里，各按用途：fast/（CPU 上的快路径）、serve/（服务）、
conversation/（提示词与多轮对话）、sampling/（文法、提示词的对数概率）、tools/（对照、训练、起草词表）、bench/（基准）。

import qwen 只读各章；附录（qwen.fast 的快路径、Conversation）第一次用到时才读（PEP 562 的模块 __getattr__）：
读一章不会顺带读进附录。
"""

import importlib
import re
from pathlib import Path

from .batch import generate_batch
from .cache import State
from .chat import Chat, build_prompt
from .model import Model
from .mtp import MTP, generate_mtp
from .sample import Sampling, generate, stream
from .weights import Config, find_model, load_config, load_weights

__all__ = [
    "MTP", "Chat", "Config", "Conversation", "Model", "Sampling", "State", "build_prompt", "chapters", "find_model", "generate",
    "generate_batch", "generate_mtp", "load_config", "load_weights", "stream",
]

APPENDIX = {"Conversation": "conversation", "fast": "fast"}  # 名字 → 附录里的模块：第一次取时才导入


def __getattr__(name):
    if name not in APPENDIX:
        raise AttributeError(f"module 'qwen' has no attribute {name!r}")
    module = importlib.import_module(f".{APPENDIX[name]}", __name__)
    return module if name == APPENDIX[name] else getattr(module, name)


def chapters() -> list[str]:
    """课程的各章按阅读顺序（模块名）：qwen/ 顶层每个 .py 的文档以“第 N 章”或“第 N 章附”开头，按 N 排，附跟在它那一章之后。
    只读文件的开头，不导入它们；README 的章节表、测试都照它核对。"""
    found = []
    for file in Path(__file__).parent.glob("*.py"):
        if m := re.match(r'"""第 (\d+) 章(附)?', file.read_text(encoding="utf-8")):
            found.append((int(m[1]), bool(m[2]), file.stem))
    return [name for *_, name in sorted(found)]
