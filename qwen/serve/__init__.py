"""附录 · 从模型到引擎：OpenAI 兼容的服务。从里到外读：

- batcher.py：几个请求的同一层一次算完（连续批处理），每个请求的输出与它单独运行时逐位相同；
- schedule.py：调度的决定：谁加入一步、一步算哪一件、长提示词怎么读、起不起草；
- engine.py：引擎。一个请求一个线程，跑单个请求的代码；prefix.py 留下的对话状态按 token 前缀给之后的请求接着用；
- api.py：HTTP 层（FastAPI）。请求 ↔ token，流式的 SSE，OpenAI 的错误体；坏的请求、走掉的客户端、别的网站的网页都伤不到它
  （它引用的 access、body、messages、requests、reader、sse、listen 各管一件事）。

    python -m qwen serve --model demo        # 然后：curl http://127.0.0.1:8000/v1/chat/completions ...
"""

from .batcher import RowBatcher, row_batcher
from .engine import Closed, Engine, Request

__all__ = ["Closed", "Engine", "Request", "RowBatcher", "row_batcher"]
