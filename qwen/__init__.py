"""qwen：手写、可读、快速的 Qwen3.5 PyTorch 实现。

按课程顺序阅读：weights → embedding → norm → mlp（与它旁边的 moe）→ rope → attention → deltanet → chunk
→ layer → model → cache → sample → chat → batch → mtp → vision。

import qwen 只读各章；附录（qwen.fast 的快路径、Conversation）第一次用到时才读（PEP 562 的模块 __getattr__）：
读一章不会顺带读进附录。
"""

import importlib

from .batch import generate_batch
from .cache import State
from .chat import Chat, build_prompt
from .model import Model
from .mtp import MTP, generate_mtp
from .sample import Sampling, generate, stream
from .weights import Config, find_model, load_config, load_weights

__all__ = [
    "MTP", "Chat", "Config", "Conversation", "Model", "Sampling", "State", "build_prompt", "find_model", "generate", "generate_batch",
    "generate_mtp", "load_config", "load_weights", "stream",
]

APPENDIX = {"Conversation": "conversation", "fast": "fast"}  # 名字 → 附录里的模块：第一次取时才导入


def __getattr__(name):
    if name not in APPENDIX:
        raise AttributeError(f"module 'qwen' has no attribute {name!r}")
    module = importlib.import_module(f".{APPENDIX[name]}", __name__)
    return module if name == APPENDIX[name] else getattr(module, name)
