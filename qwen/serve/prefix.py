"""附录 · 服务：留下的对话状态，按 token 前缀给之后的请求接着读。

与附录 conversation/ 的 Conversation 是同一个思路，只是跨请求、按 token 前缀查：对话的下一轮一定原样包含“到上一个
用户问题为止”的那段提示词（conversation.cut_point），从那里接着读，与从头读输出逐 token 相同。vLLM 的前缀缓存只能从块的
边界接着读；混合模型的 DeltaNet 状态没法截短，所以我们只在一个个用户问题的末尾留份。
"""

import threading
from collections import OrderedDict

import torch

from ..conversation import Resume


def state_bytes(*objs) -> int:
    """留下的状态占多少字节：里面所有张量之和。"""
    total = 0
    for obj in objs:
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, (list, tuple)):
            total += state_bytes(*obj)
        elif hasattr(obj, "__dict__"):
            total += state_bytes(*vars(obj).values())
    return total


class PrefixCache:
    """留下的状态：token 前缀 → 读到那里的 Resume（主模型的状态与草稿头这一边），最近最少用的先丢，总大小不超过
    limit 字节。存进去的、取出的都是复制：各请求改的是自己的那份。"""

    def __init__(self, limit: int):
        self.limit = limit
        self.items = OrderedDict()  # (tuple(tokens), 读过的图的摘要) → (Resume, 字节数)
        self.size = 0
        self.lock = threading.Lock()

    def put(self, resume: Resume):
        saved = resume.copy()
        size = state_bytes(saved)
        if size > self.limit:
            return
        with self.lock:
            key = (tuple(saved.tokens), tuple(saved.images))  # 同样的 token、不同的图是两份
            if key in self.items:
                self.size -= self.items.pop(key)[1]
            self.items[key] = (saved, size)
            self.size += size
            while self.size > self.limit:
                self.size -= self.items.popitem(last=False)[1][1]

    def longest(self, tokens, upto: int, images=None) -> Resume | None:
        """tokens[:upto] 之内最长的、读过的图（images：tokens 里的图）也相同的留下的前缀 → 它的 Resume（复制一份）；没有时 None。"""
        with self.lock:
            best = None
            for key, (saved, _) in self.items.items():
                n = len(key[0])
                if n <= upto and (best is None or n > len(best[0])) and tuple(tokens[:n]) == key[0] \
                        and saved.same_images(images, tokens):
                    best = key
            if best is None:
                return None
            self.items.move_to_end(best)
            saved = self.items[best][0]
        return saved.copy()
