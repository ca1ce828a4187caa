"""附录 · 基准测试：按 cfg 的形状造随机权重、按发布检查点的布局存盘（测速度不必下载模型）。"""

import math
from pathlib import Path

import torch

from ..model import Model
from ..mtp import MTP
from ..train import save_checkpoint
from ..weights import Config


def random_checkpoint(path, cfg: Config, dtype=torch.bfloat16, seed: int = 0) -> Path:
    """按 cfg 的形状造随机权重，按发布检查点的布局写到 path（含 mtp.*）。

    嵌入的每个元素取 N(0, 1)（与 norm 之后的隐藏状态同一尺度），写回残差流的三个投影（o_proj、out_proj、
    down_proj）缩小到 0.1 倍，像训练过的模型那样每层只微调残差。这样贪心续写的 top-1 与 top-2 之间差得远，
    不会被 bfloat16 的舍入（以及验证时一次算几行带来的舍入差异）改变；否则 24 万个随机 logits 几乎打平，
    “贪心续写”本身都不稳定，受控接受率的实验也就无从谈起。速度与权重的取值无关。
    """
    gen = torch.Generator().manual_seed(seed)

    def fill(name, shape):
        if name.endswith("A_log"):
            return torch.empty(shape).uniform_(1, 16, generator=gen).log()
        if name.endswith("dt_bias"):
            return torch.randn(shape, generator=gen) * 0.5
        if name.endswith("linear_attn.norm.weight"):
            return 1 + 0.1 * torch.randn(shape, generator=gen)
        if len(shape) == 1:  # 零中心的 norm 权重
            return 0.1 * torch.randn(shape, generator=gen)
        if name.endswith("embed_tokens.weight"):
            return torch.randn(shape, generator=gen).to(dtype)
        scale = 0.1 if name.split(".")[-2] in ("o_proj", "out_proj", "down_proj") else 1.0
        return (torch.randn(shape, generator=gen) * (scale / math.sqrt(math.prod(shape[1:])))).to(dtype)

    tensors = {}
    for part, cls in (("model", Model), ("mtp", MTP)):
        with torch.device("meta"):
            module = cls(cfg)
        names = {k: v.shape for k, v in module.state_dict().items() if k != "lm_head.weight" or not cfg.tie_word_embeddings}
        tensors[part] = {k: fill(k, shape) for k, shape in names.items()}
    return save_checkpoint(path, cfg, tensors["model"], tensors["mtp"])
