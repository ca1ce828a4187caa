"""附录 · 基准测试：看图（第 15 章）。python -m qwen.bench.vision [--rounds 3] [--size 448]

按 0.8B 的形状造随机权重（文本模型、草稿头与视觉塔：12 块、768 宽），一张 size×size 的 PNG 加 20 个 token 的问题，轮流量：
- 塔：我们的 VisionTower（bfloat16 与 float32）与 transformers 的 Qwen3_5VisionModel（同样的权重、同样的 dtype），
  输入是同样的小块（不含读图）；
- 第一个 token：从图的字节到第一个 token（读图、缩放、切块、塔、预填充、输出头），默认的快路径（qwen.fast.load）；
  同样长的纯文字提示词的预填充放在旁边，看图多花的就是两者之差。
每一项取各轮的最小值；数字连同 CPU 与它的向量指令一起打印（report.machine）。
"""

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ..fast import load
from ..sample import generate
from ..vision import VisionConfig, VisionTower, prepare
from ..weights import Config
from .checkpoint import random_checkpoint
from .report import machine

QUESTION = 20  # 问题的 token 数


def vision_checkpoint(path: Path, seed: int = 0) -> Path:
    """0.8B 形状的随机检查点，加上视觉塔（model.visual.*，0.8B 的宽度）、vision_config 与 preprocessor_config.json。"""
    random_checkpoint(path, Config(), torch.bfloat16, seed)
    c, gen = VisionConfig(), torch.Generator().manual_seed(seed + 1)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in VisionTower(c).state_dict().items()}
    tensors = {"model.visual." + k: (torch.randn(s, generator=gen) / (s[-1] ** 0.5 if len(s) > 1 else 10)).to(torch.bfloat16)
               for k, s in shapes.items()}
    save_file(tensors, str(path / "model-visual.safetensors"), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "model-visual.safetensors" for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((path / "config.json").read_text())
    config.update(image_token_id=c.image_token_id, vision_start_token_id=c.vision_start_token_id,
                  vision_end_token_id=c.vision_end_token_id, video_token_id=c.video_token_id,
                  vision_config={"model_type": "qwen3_5_vision", "depth": c.depth, "hidden_size": c.hidden_size,
                                 "num_heads": c.num_heads, "intermediate_size": c.intermediate_size,
                                 "out_hidden_size": c.out_hidden_size, "hidden_act": "gelu_pytorch_tanh",
                                 "patch_size": c.patch_size, "spatial_merge_size": c.spatial_merge_size,
                                 "temporal_patch_size": c.temporal_patch_size, "num_position_embeddings": 2304})
    (path / "config.json").write_text(json.dumps(config))
    (path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                                                               "size": {"shortest_edge": 65536, "longest_edge": 16777216}}))
    return path


def transformers_tower(tower: VisionTower, dtype):
    """transformers 的 Qwen3_5VisionModel，装上与 tower 相同的权重；没装 transformers 时 None。"""
    try:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    except ImportError:
        return None
    c = tower.cfg
    cfg = Qwen3_5VisionConfig(depth=c.depth, hidden_size=c.hidden_size, num_heads=c.num_heads, out_hidden_size=c.out_hidden_size,
                              intermediate_size=c.intermediate_size, num_position_embeddings=c.num_position_embeddings)
    cfg._attn_implementation = "sdpa"
    hf = Qwen3_5VisionModel(cfg).eval()
    hf.load_state_dict(tower.state_dict())
    return hf.to(dtype)


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m qwen.bench.vision", description="看图的速度：塔本身与第一个 token")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=448, help="正方形图的边长（像素）")
    p.add_argument("--json", default=None, help="把结果写进这个文件")
    args = p.parse_args(argv)
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8))
    png = io.BytesIO()
    img.save(png, "PNG")
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        path = vision_checkpoint(Path(tmp))
        model, _ = load(path)
        towers = {str(d).split(".")[1]: VisionTower.from_pretrained(path, dtype=d) for d in (torch.bfloat16, torch.float32)}
        pixels, grid = prepare(img, towers["float32"].cfg)
        theirs = {k: transformers_tower(t, t.dtype) for k, t in towers.items()}
        images = towers[str(model.dtype).split(".")[1]].encode([png.getvalue()])
        cfg = images.cfg
        question = torch.randint(0, 1000, (QUESTION,), generator=torch.Generator().manual_seed(0)).tolist()
        ids = images.expand(torch.tensor([[cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id, *question]]))
        text = torch.randint(0, 1000, ids.shape, generator=torch.Generator().manual_seed(1))
        tower = towers[str(model.dtype).split(".")[1]]
        jobs = {f"塔 {k}（我们）": (lambda t=t: t(pixels, [grid])) for k, t in towers.items()}
        jobs.update({f"塔 {k}（transformers）": (lambda t=t: t(pixels.to(t.dtype), torch.tensor([grid])))
                     for k, t in theirs.items() if t is not None})
        jobs["第一个 token：图 + 问题"] = lambda: generate(model, ids, 1, images=tower.encode([png.getvalue()]))
        jobs["第一个 token：同样长的纯文字"] = lambda: generate(model, text, 1)
        for fn in jobs.values():  # 预热：编译、oneDNN 的第一次
            fn()
        times = {k: float("inf") for k in jobs}
        for _ in range(args.rounds):  # 轮流：带宽与频率在一分钟里就会变
            for k, fn in jobs.items():
                times[k] = min(times[k], best(fn, 1))
    print(f"{machine()}；{args.size}×{args.size} 的图 = {grid[1] * grid[2]} 块、{ids.shape[1] - QUESTION - 2} 个 token，"
          f"加 {QUESTION} 个 token 的问题；模型 {model.dtype}，layout={model.layout}；{args.rounds} 轮取最小")
    for k, s in times.items():
        print(f"  {k:<28}{s * 1000:9.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "size": args.size, "ms": {k: s * 1000 for k, s in times.items()}},
                                              ensure_ascii=False, indent=2))


if __name__ == "__main__":
    main()
