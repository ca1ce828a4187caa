"""第 6 章 · 门控注意力：GQA、q/k 归一化、部分 RoPE、输出门与 KV 缓存。

Qwen3.5 每四层里有一层是“完整”的 softmax 注意力，在标准做法上加了三处改动：
1. 分组查询（GQA）：8 个查询头共用 2 组键值头，KV 缓存因此只有 1/4 大。
2. q_norm、k_norm：对每个头的查询和键各做一次零中心 RMSNorm，训练更稳。
3. 输出门：q_proj 的输出宽度翻倍，每个头先是 256 维查询、再是 256 维门 g，
   注意力结果乘以 sigmoid(g) 之后才进 o_proj，让每个头能“关掉”自己。

    q, g = split(q_proj(x)); q = rope(q_norm(q)); k = rope(k_norm(k_proj(x))); v = v_proj(x)
    out = o_proj(softmax(q kᵀ / sqrt(d) + 因果掩码) v * sigmoid(g))

解码时每步只算新 token 的 q、k、v，旧的 k、v 从缓存里取：这就是 KV 缓存（AttentionState）。
投影之后的注意力一律在 float32 里算，缓存也存 float32：CPU 上 bfloat16 的 scaled_dot_product_attention
慢得多，而缓存每个 token 每层只有 4 KB。

出处：输出门见 Qiu 等，“Gated Attention for Large Language Models: Non-linearity, Sparsity, and Attention-Sink-Free”
（2025）；分组查询见 Ainslie 等，“GQA”（2023）；q/k 归一化见 Henry 等，“Query-Key Normalization for Transformers”（2020）。
"""

import torch
import torch.nn.functional as F
from torch import nn

from .norm import RMSNorm
from .rope import apply_rope


class AttentionState:
    """一层注意力的 KV 缓存：k、v 形状 [B, kv_heads, 长度, head_dim]，沿第 2 维增长。

    底层是一块按倍数扩容的缓冲区，k、v 是它前 length 个位置的视图：追加一个 token
    不必把整段历史复制一遍（torch.cat 每步都会复制，代价随上下文变长）。
    截断（投机解码拒绝草稿时）只需改 length。
    """

    def __init__(self):
        self.k_buf = None  # [B, kv_heads, 容量, head_dim]
        self.v_buf = None
        self.length = 0

    @property
    def k(self):
        return None if self.k_buf is None else self.k_buf[:, :, : self.length]

    @property
    def v(self):
        return None if self.v_buf is None else self.v_buf[:, :, : self.length]

    def reserve(self, n: int, like: torch.Tensor) -> None:
        """让缓冲区至少容得下 n 个位置；like 是一段 k 的样子 [B, kv_heads, T, head_dim]（定 B、头数、维数与 dtype）。"""
        if self.k_buf is None or n > self.k_buf.shape[2]:
            cap = max(256, 2 * n)  # 容量翻倍：扩容次数只随长度对数增长
            new_k = like.new_empty(like.shape[0], like.shape[1], cap, like.shape[3])
            new_v = torch.empty_like(new_k)
            if self.length:
                new_k[:, :, : self.length] = self.k
                new_v[:, :, : self.length] = self.v
            self.k_buf, self.v_buf = new_k, new_v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """追加 T 个位置的 k、v [B, kv_heads, T, head_dim]，返回全部历史的视图。"""
        n = self.length + k.shape[2]
        self.reserve(n, k)
        self.k_buf[:, :, self.length : n] = k
        self.v_buf[:, :, self.length : n] = v
        self.length = n
        return self.k, self.v

    def truncate(self, length: int) -> None:
        """只保留前 length 个位置（投机解码回滚用）。"""
        self.length = min(self.length, length)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d * 2, bias=False)  # 查询与门，按头交错
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project(self, x):
        """三个投影读同一个输入：q（连同门）、k、v。"""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, cos, sin, state: AttentionState | None = None, valid=None):
        """x [B, T, hidden]；valid [B, L] 为真表示该位置是真实 token（批处理左填充时用）。"""
        out = self.mix(*self.project(x), cos, sin, state, valid)  # [B, T, H·D]
        return self.o_proj(out.to(x.dtype))  # [B, T, hidden]

    def mix(self, q, k, v, cos, sin, state: AttentionState | None = None, valid=None):
        """投影之后、o_proj 之前的一段：q（连同门）、k、v [B, T, ·] → 乘过输出门的注意力结果 [B, T, H·D]。"""
        B, T, _ = q.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = q.float(), k.float(), v.float()  # 注意力在 float32 里算
        q, gate = q.view(B, T, H, 2 * D).chunk(2, dim=-1)  # 每个头：[查询 256 | 门 256]
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(k.view(B, T, Hkv, D)).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(B, T, Hkv, D).transpose(1, 2)  # [B, Hkv, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q, k, v, state, valid)  # [B, T, H·D]
        return out * torch.sigmoid(gate.reshape(B, T, H * D))  # 输出门

    def attend(self, q, k, v, state: AttentionState | None, valid):
        """q [B, H, T, D]，新的 k、v [B, Hkv, T, D]：接上缓存，做带掩码的注意力，返回 [B, T, H·D]。"""
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        if state is not None:
            k, v = state.append(k, v)  # [B, Hkv, L, D]：L = 已缓存 + T
        L = k.shape[2]

        # 掩码：第 i 个新 token 的绝对位置是 L - T + i，只能看见位置 ≤ 它的键。
        mask = None
        if T > 1:
            mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)  # [T, L]
        if valid is not None:
            # 左填充的位置谁也不看；但填充位置自己总得看点什么，否则整行被遮住，softmax 得 NaN，
            # NaN 又会经过后面的层扩散。于是允许每个位置看它自己。
            own = torch.arange(L, device=q.device) == (L - T + torch.arange(T, device=q.device))[:, None]  # [T, L]
            keep = valid[:, None, None, :L] | own  # [B, 1, T, L]
            mask = keep if mask is None else mask & keep
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5, enable_gqa=H != Hkv)
        return out.transpose(1, 2).reshape(B, T, H * D)  # [B, T, H·D]
