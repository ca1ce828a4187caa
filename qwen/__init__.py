"""qwen：手写、可读、快速的 Qwen3.5 PyTorch 实现。

按课程顺序阅读：weights → embedding → norm → mlp → rope → attention → deltanet → chunk
→ layer → model → cache → sample → chat → batch → mtp → vision。
"""

from .batch import generate_batch
from .cache import State
from .chat import Chat, build_prompt
from .conversation import Conversation
from .model import Model
from .mtp import MTP, generate_mtp
from .sample import Sampling, generate, stream
from .weights import Config, find_model, load_config, load_weights

__all__ = [
    "MTP", "Chat", "Config", "Conversation", "Model", "Sampling", "State", "build_prompt", "find_model", "generate", "generate_batch",
    "generate_mtp", "load_config", "load_weights", "stream",
]
