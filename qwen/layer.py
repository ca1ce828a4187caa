"""第 9 章 · 解码层：前置归一化的残差块，两种“混合器”二选一。

    x = x + mixer(input_layernorm(x))          mixer：门控注意力 或 Gated DeltaNet
    x = x + mlp(post_attention_layernorm(x))    mlp：第 4 章的 SwiGLU，或专家混合（第 4 章附：MoE 的检查点）

Qwen3.5-0.8B 的 24 层按 [DeltaNet, DeltaNet, DeltaNet, 注意力] 重复 6 次。
DeltaNet 层在这里决定用哪种形式：解码或验证一到三个 token 用逐 token 递推（几个小运算），
更多时（预填充、投机解码验证更多 token）用分块并行：运算次数与长度无关。

残差流 x 一直是 float32：bfloat16 里连加 48 次会一点点丢掉精度。进矩阵乘法之前才转成权重的 dtype。
"""

import torch
from torch import nn

from .attention import Attention
from .chunk import chunk_gated_delta_rule
from .deltanet import GatedDeltaNet, recurrent_gated_delta_rule
from .mlp import MLP
from .moe import SparseMoE
from .norm import RMSNorm

RECURRENT_MAX_T = 3  # 不超过这么多 token 时走递推：几步小运算比分块的固定开销便宜，而且递推顺手留下每个位置之后的记忆


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
        self.mlp = SparseMoE(cfg) if cfg.num_experts else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        """矩阵乘法用的 dtype：权重的 dtype（bfloat16 或 float32）。"""
        return self.ffn.down_proj.weight.dtype

    @property
    def ffn(self) -> MLP:
        """一个稠密的 SwiGLU：稠密层的 mlp，专家混合层的共享专家（它的 dtype 就是这一层矩阵的 dtype）。"""
        return getattr(self.mlp, "shared_expert", self.mlp)

    def delta_rule(self, T: int):
        """一次喂 T 个 token 时 DeltaNet 用哪种形式（两者结果相同，只是快慢不同）。"""
        return recurrent_gated_delta_rule if T <= RECURRENT_MAX_T else chunk_gated_delta_rule

    def forward(self, x, cos, sin, state=None, valid=None):
        """x [B, T, hidden] float32；cos、sin 来自 rope_tables；state 是本层的缓存；valid [B, L] 标出真实 token。"""
        x = x + self.mixer(self.input_layernorm(x).to(self.dtype), cos, sin, state, valid).float()  # 分支先转成 float32 再加
        return x + self.mlp(self.post_attention_layernorm(x).to(self.dtype)).float()

    def mixer(self, h, cos, sin, state=None, valid=None):
        """归一化之后的 h [B, T, hidden]（权重的 dtype）过这一层的混合器。"""
        if self.layer_type == "linear_attention":
            T = h.shape[1]
            return self.linear_attn(h, state, None if valid is None else valid[:, -T:], rule=self.delta_rule(T))
        return self.self_attn(h, cos, sin, state, valid)
