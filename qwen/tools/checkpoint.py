"""附录 · 工具：按 cfg 的形状造随机权重、按发布检查点的布局存盘（测速度不必下载模型）。"""

import math
from pathlib import Path

import torch

from ..model import Model
from ..mtp import MTP
from .train import save_checkpoint
from ..weights import Config


# 随机权重的形状（python -m qwen.bench --size）：0.8B 是 Config 的默认值；9B、27B 是同一架构的大尺寸（27B 的全注意力
# 24 个查询头、4 个键值头，FFN 17408，输出头不与嵌入共用）
SIZES = {
    "0.8B": {},
    "9B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
               num_key_value_heads=4, linear_num_value_heads=32, tie_word_embeddings=False),
    "27B": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                num_key_value_heads=4, linear_num_value_heads=48, tie_word_embeddings=False),
    # 专家混合：40 层，每层 256 个专家（中间宽 512）里每个 token 用 8 个，外加共享专家；bfloat16 约 67 GB
    "35B-A3B": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                    linear_num_value_heads=32, tie_word_embeddings=False, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512),
}


TILE = 1 << 20  # tiled 时每个大张量由这么多个随机数铺满（4 MB：比缓存大，乘法时照样从内存读）


def random_checkpoint(path, cfg: Config, dtype=torch.bfloat16, seed: int = 0, tiled: bool = False) -> Path:
    """按 cfg 的形状造随机权重，按发布检查点的布局写到 path（含 mtp.*）。

    嵌入的每个元素取 N(0, 1)（与 norm 之后的隐藏状态同一尺度），写回残差流的三个投影（o_proj、out_proj、
    down_proj）缩小到 0.1 倍，像训练过的模型那样每层只微调残差。这样贪心续写的 top-1 与 top-2 之间差得远，
    不会被 bfloat16 的舍入（以及验证时一次算几行带来的舍入差异）改变；否则 24 万个随机 logits 几乎打平，
    “贪心续写”本身都不稳定，受控接受率的实验也就无从谈起。速度与权重的取值无关。
    张量写到哪个分片时才造（save_checkpoint 的 make）：9B、27B 的形状也只占一个分片（2 GB）的内存。
    tiled：只测速度时，大的张量由一小块（TILE 个）随机数铺满，造 0.8B 的形状快得多；贪心续写就不必当真了。
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(shape):  # N(0, 1)
        return torch.randn(shape, generator=gen)

    def fill(name, shape):
        if name.endswith("A_log"):
            return torch.empty(shape).uniform_(1, 16, generator=gen).log()
        if name.endswith("dt_bias"):
            return normal(shape) * 0.5
        if name.endswith("linear_attn.norm.weight"):
            return 1 + 0.1 * normal(shape)
        if len(shape) == 1:  # 零中心的 norm 权重
            return 0.1 * normal(shape)
        if name.endswith("embed_tokens.weight"):
            return normal(shape).to(dtype)
        scale = 0.1 if {"o_proj", "out_proj", "down_proj"} & set(name.split(".")[-2:]) else 1.0  # 含堆叠的专家
        return (normal(shape) * (scale / math.sqrt(shape[-1]))).to(dtype)  # 输入维在最后

    def make(name, meta):  # 写到它的分片时才造：名字去掉前缀（model.language_model.、mtp.），按同样的规则取值
        name, n = name.removeprefix("model.language_model.").removeprefix("mtp."), math.prod(meta.shape)
        if not tiled or n <= TILE or len(meta.shape) == 1:
            return fill(name, meta.shape)
        # 按同样的规则算好一小块（TILE 个）再铺满：逐元素的取值规则与铺满可以交换，只是少算、少转换几百 MB
        tile = fill(name, (max(1, TILE // meta.shape[-1]), meta.shape[-1])).flatten()  # 同样的最后一维：缩放照旧
        return tile.repeat(-(-n // len(tile)))[:n].view(meta.shape)

    tensors = {}
    for part, cls in (("model", Model), ("mtp", MTP)):
        with torch.device("meta"):
            module = cls(cfg)
        tensors[part] = {k: torch.empty(v.shape, device="meta", dtype=dtype if v.dim() > 1 else torch.float32)
                         for k, v in module.state_dict().items() if k != "lm_head.weight" or not cfg.tie_word_embeddings}
    return save_checkpoint(path, cfg, tensors["model"], tensors["mtp"], make=make)
