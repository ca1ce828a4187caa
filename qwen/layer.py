"""第 9 章 · 解码层：前置归一化的残差块，两种“混合器”二选一。

    x = x + mixer(input_layernorm(x))          mixer：门控注意力 或 Gated DeltaNet
    x = x + mlp(post_attention_layernorm(x))

Qwen3.5-0.8B 的 24 层按 [DeltaNet, DeltaNet, DeltaNet, 注意力] 重复 6 次。
DeltaNet 层在这里决定用哪种形式：解码或验证一到三个 token 用逐 token 递推（几个小运算），
更多时（预填充、投机解码验证更多 token）用分块并行：运算次数与长度无关。

解码一个 token 时，一层是几十个只有几千个数的小运算，每个都有几微秒的固定开销。
compile=True 时（第 10 章）几种固定的长度（解码 1 个 token、验证 1～4 个草稿的 2～5 个、长提示词的一整段）交给
torch.compile（compiled）：形状固定，整层的逐元素运算并成几个 C++ 循环。注意力层的缓存与注意力本身
（Attention.attend）不编译：缓存长度每步都变。
"""

import torch
from torch import nn

from .attention import Attention
from .chunk import chunk_gated_delta_rule
from .deltanet import GatedDeltaNet, recurrent_gated_delta_rule
from .mlp import MLP
from .norm import RMSNorm
from .weights import COMPILE_OPTIONS

RECURRENT_MAX_T = 3  # 不超过这么多 token 时走递推：几步小运算比分块的固定开销便宜（3 个时打平；验证草稿要记回滚历史时，
# 递推把逐步的 S 留下，拒绝时不必重建：验证 3 个 token 的一轮快 0.5～4 ms；4 个时 compile=True 下又慢了）
DECODE_LENGTHS = (1, 2, 3, 4, 5)  # compile=True 时整层编译的短长度：解码 1 个 token，验证 1～4 个草稿（第 14 章每轮最多起草 4 个）


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        elif layer_type == "full_attention":
            self.self_attn = Attention(cfg)
        else:
            raise ValueError(f"未知的层类型 {layer_type!r}：应为 'linear_attention' 或 'full_attention'")
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    compiled = None  # compile=True 时（第 10 章）：compute 的编译版本
    compiled_lengths = ()  # 哪些 token 数走编译版本，每种各编译一次（形状固定）

    def compile_for(self, lengths) -> None:
        """compile=True（第 10、14 章）：一次喂 lengths 里这几种 token 数时，改走 compute 的编译版本。"""
        self.compiled = torch.compile(self.compute, dynamic=False, options=COMPILE_OPTIONS)
        self.compiled_lengths = tuple(lengths)

    def forward(self, x, cos, sin, state=None, valid=None):
        """x [B, T, hidden] float32；cos、sin 来自 rope_tables；state 是本层的缓存；valid [B, L] 标出真实 token。"""
        if self.compiled is not None and x.shape[1] in self.compiled_lengths and state is not None and valid is None:
            return self.compiled(x, cos, sin, state)
        return self.compute(x, cos, sin, state, valid)

    def compute(self, x, cos, sin, state=None, valid=None):
        """本层的计算（forward 的参数与返回值）。"""
        dtype = self.mlp.down_proj.dtype  # 矩阵乘法用权重的 dtype（bfloat16 或 float32）
        h = self.input_layernorm(x).to(dtype)
        if self.layer_type == "linear_attention":
            T = x.shape[1]
            rule = recurrent_gated_delta_rule if T <= RECURRENT_MAX_T else chunk_gated_delta_rule
            h = self.linear_attn(h, state, None if valid is None else valid[:, -T:], rule=rule)
        else:
            h = self.self_attn(h, cos, sin, state, valid)
        # 残差流 x 保持 float32：bfloat16 里连加 48 次会一点点丢掉精度。h 先显式转成 float32 再加，
        # 结果与混合 dtype 的加法相同，但 CPU 上混合 dtype 的逐元素运算走慢路径（解码一步差约 0.7 ms）
        x = x + h.float()
        return x + self.mlp(self.post_attention_layernorm(x).to(dtype)).float()
