"""qwen：手写、可读、快速的 Qwen3.5 PyTorch 实现。

按课程顺序阅读：weights → embedding → norm → mlp → rope → attention → deltanet → chunk
→ layer → model → cache。
"""

from .cache import State
from .model import Model
from .weights import Config, find_model, load_config, load_weights

__all__ = ["Config", "Model", "State", "find_model", "load_config", "load_weights"]
