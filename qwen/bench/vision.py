"""附录 · 基准测试：看图（第 15 章）。python -m qwen.bench.vision [--rounds 3] [--size 448]

按 0.8B 的形状造随机权重（文本模型、草稿头与视觉塔：12 块、768 宽），一张 size×size 的 PNG 加 20 个 token 的问题，轮流量：
- 塔：我们的 VisionTower（bfloat16 与 float32）与 transformers 的 Qwen3_5VisionModel（同样的权重、同样的 dtype），
  输入是同样的小块（不含读图）；
- 第一个 token：从图的字节到第一个 token（读图、缩放、切块、塔、预填充、输出头），默认的快路径（qwen.fast.load）与
  --layout 给的另一种；同样长的纯文字提示词的预填充放在旁边，看图多花的就是两者之差；
- --llama-cpp DIR --gguf 文本.gguf --mmproj 塔.gguf（../shared/tools/llamacpp.sh 转出来的，同样的权重）：llama-mtmd-cli
  从开始编码图到退出的时间（它的日志时间戳），与它的 mmproj 编码时间，同样轮流测。
每一项取各轮的最小值；数字连同 CPU 与它的向量指令一起打印（report.machine）。
"""

import argparse
import io
import json
import re
import subprocess
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
from ..tools.checkpoint import random_checkpoint
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
    (path / "preprocessor_config.json").write_text(json.dumps({  # 发布的 0.8B 的那份
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor"}))
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


def transformers_first_token(path, dtype, ids, img):
    """transformers 的 Qwen3_5ForConditionalGeneration（同一个检查点、同样的 dtype）从图到第一个 token 的函数（含它的
    PIL 图像处理器）；没装 transformers 时 None。"""
    try:
        from transformers import Qwen3_5ForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:
        return None
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    proc = Qwen2VLImageProcessorPil(**json.loads((path / "preprocessor_config.json").read_text()))
    kinds = (ids == hf.config.image_token_id).int()

    def run():
        px = proc(images=[img], return_tensors="pt")
        hf.generate(input_ids=ids, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"], mm_token_type_ids=kinds,
                    max_new_tokens=1, do_sample=False)
    return run


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def llama_mtmd(args, png: Path) -> dict:
    """llama-mtmd-cli 看同一张图、生成一个 token → {第一个 token 的秒数, mmproj 编码的秒数}。第一个 token 从日志里
    “encoding mtmd batch” 的时间戳（进程启动起的 分.秒.毫秒.微秒）算到进程退出：不含加载，含退出时的收尾（略多算一点）。"""
    cmd = [f"{args.llama_cpp}/llama-mtmd-cli", "-m", args.gguf, "--mmproj", args.mmproj, "--image", str(png), "-n", "1",
           "-t", str(torch.get_num_threads()), "--temp", "0", "--chat-template", "chatml", "-p", "What is in this picture? " * 4]
    t0 = time.time()
    log = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stderr
    end = time.time() - t0
    m, s, ms, us = map(int, re.search(r"(\d+)\.(\d+)\.(\d+)\.(\d+) I encoding mtmd batch", log).groups())
    encode = int(re.search(r"encoding done in (\d+) ms", log).group(1)) / 1000
    return {"first": end - (m * 60 + s + ms / 1e3 + us / 1e6), "encode": encode}


def arguments(argv):
    p = argparse.ArgumentParser(prog="python -m qwen.bench.vision", description="看图的速度：塔本身与第一个 token")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=448, help="正方形图的边长（像素）")
    p.add_argument("--layout", default="packed", help="另测一种布局的第一个 token（默认 packed：oneDNN 打包）")
    p.add_argument("--llama-cpp", default=None, metavar="DIR", help="llama-mtmd-cli 所在的文件夹（llamacpp.sh bin）")
    p.add_argument("--gguf", default=None, help="文本模型的 GGUF（同样的权重）")
    p.add_argument("--mmproj", default=None, help="视觉塔的 GGUF（llamacpp.sh convert … mmproj）")
    p.add_argument("--json", default=None, help="把结果写进这个文件")
    return p.parse_args(argv)


def main(argv=None):
    args = arguments(argv)
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8))
    png = io.BytesIO()
    img.save(png, "PNG")
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        path = vision_checkpoint(Path(tmp))
        (Path(tmp) / "image.png").write_bytes(png.getvalue())
        model, _ = load(path)
        other, _ = load(path, layout=args.layout)
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
        jobs[f"第一个 token：图 + 问题（{model.layout}）"] = lambda: generate(model, ids, 1, images=tower.encode([png.getvalue()]))
        jobs[f"第一个 token：同样长的纯文字（{model.layout}）"] = lambda: generate(model, text, 1)
        jobs[f"第一个 token：图 + 问题（{other.layout}）"] = lambda: generate(other, ids, 1, images=tower.encode([png.getvalue()]))
        hf = transformers_first_token(path, model.dtype, ids, img)
        if hf is not None:
            jobs["第一个 token：transformers"] = hf
        for fn in jobs.values():  # 预热：编译、oneDNN 的第一次
            fn()
        times = {k: float("inf") for k in jobs}
        for _ in range(args.rounds):  # 轮流：带宽与频率在一分钟里就会变
            for k, fn in jobs.items():
                times[k] = min(times[k], seconds(fn))
            if args.llama_cpp:
                llama = llama_mtmd(args, Path(tmp) / "image.png")
                times["第一个 token：llama-mtmd-cli"] = min(times.get("第一个 token：llama-mtmd-cli", 1e9), llama["first"])
                times["塔：llama.cpp 的 mmproj"] = min(times.get("塔：llama.cpp 的 mmproj", 1e9), llama["encode"])
    report(args, times, f"{grid[1] * grid[2]} 块、{ids.shape[1] - QUESTION - 2} 个 token", model)


def report(args, times: dict, what: str, model) -> None:
    """打印（与按 --json 存下）每一项的最短时间。"""
    print(f"{machine()}；{args.size}×{args.size} 的图 = {what}，"
          f"加 {QUESTION} 个 token 的问题；模型 {model.dtype}，layout={model.layout}；{args.rounds} 轮取最小")
    for k, s in times.items():
        print(f"  {k:<28}{s * 1000:9.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "size": args.size, "ms": {k: s * 1000 for k, s in times.items()}},
                                              ensure_ascii=False, indent=2))


if __name__ == "__main__":
    main()
