"""附录 · 训练：主模型与 MTP 草稿头一起学。

前面各章只做推理；这一章用同样的类（Model、MTP，分块形式的 DeltaNet 可以求导）从零训练一个
小小的 Qwen3.5，并像 Qwen 那样把 MTP 头当作辅助目标一起训练：

    主损失     L_main = CE(lm_head(h_t),                       x_{t+1})     h_t：最后一次 norm 之后
    MTP 损失   L_mtp  = CE(lm_head(mtp(e_{t+1}, h_t)),         x_{t+2})     e_{t+1}：x_{t+1} 的嵌入
    总损失     L = L_main + λ · L_mtp

语料是 Python 标准库自己的源码（每台装了 Python 的机器上都有，PSF 许可），按固定顺序读入，
跳过测试目录，并固定留出一部分文件从不参与训练，用来评估。分词器是在训练文件上现训的字节级 BPE，
几千个 token，加上 <|endoftext|>、<|im_start|>、<|im_end|>。

    python -m qwen.tools.train --out qwen/demo        # 本仓库附带的 demo 检查点就是这样训出来的（2 核约半小时）

结果按发布检查点的布局写出（config.json 嵌套 text_config，张量名 model.language_model.* 与 mtp.*，
tokenizer.json），于是 `--model demo` 能像真的 Qwen3.5 一样被加载、对话、投机解码。
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from dataclasses import fields
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model import Model
from ..mtp import MTP
from ..weights import Config

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# demo 模型：与 0.8B 同样的层型（三层 DeltaNet 配一层门控注意力），宽度小得多
DEMO = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    max_position_embeddings=4096,
    eos_token_id=0,
)


# ---------- 语料 ----------


def corpus_files() -> tuple[list[Path], list[Path]]:
    """标准库的 .py 文件，按路径排序；跳过测试与 site-packages。返回 (训练文件, 留出文件)。

    留出哪些文件由路径的 CRC32 决定（约 5%）：与文件顺序、Python 小版本无关，永远不参与训练。
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    heldout = [p for p in files if zlib.crc32(p.relative_to(root).as_posix().encode()) % 20 == 0]
    train = [p for p in files if zlib.crc32(p.relative_to(root).as_posix().encode()) % 20 != 0]
    return train, heldout


def read(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train_tokenizer(texts: list[str], vocab_size: int):
    """在训练文本上训一个字节级 BPE；特殊记号排在最前（id 0、1、2）。"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer)
    return tk


def encode(tk, texts: list[str]) -> torch.Tensor:
    """所有文件接成一条 token 流，文件之间插 <|endoftext|>。"""
    eot = tk.token_to_id("<|endoftext|>")
    ids = []
    for enc in tk.encode_batch(texts):
        ids += enc.ids + [eot]
    return torch.tensor(ids, dtype=torch.long)


# ---------- 损失 ----------


def losses(model: Model, mtp: MTP, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T] → (主损失, MTP 损失, MTP 预测 [B, T-2] 与目标相等的比例)。"""
    h = model.hidden(x)  # [B, T, h]：最后一次 norm 之后
    main = F.cross_entropy(model.lm_head(h[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    y = mtp(model.embed_tokens(x[:, 1:-1]), h[:, :-2], 0)  # 第 t 行：(e_{t+1}, h_t) → 猜 x_{t+2}
    logits = model.lm_head(y)
    extra = F.cross_entropy(logits.flatten(0, 1), x[:, 2:].flatten())
    return main, extra, (logits.argmax(-1) == x[:, 2:]).float().mean()


@torch.no_grad()
def evaluate(model, mtp, stream: torch.Tensor, T: int, n: int = 16) -> dict:
    """在留出的 token 流上等距取 n 段，返回主损失、MTP 损失与 MTP 的 top-1 准确率（教师强制）。"""
    model.eval(), mtp.eval()
    starts = torch.linspace(0, len(stream) - T - 1, n).long()
    batch = torch.stack([stream[s : s + T] for s in starts])
    out = {}
    for i in range(0, n, 8):
        m, e, acc = losses(model, mtp, batch[i : i + 8])
        for k, v in (("loss", m), ("mtp_loss", e), ("mtp_top1", acc)):
            out[k] = out.get(k, 0.0) + float(v) * len(batch[i : i + 8]) / n
    model.train(), mtp.train()
    return out


def progress(step: int, total: int, text: str, width: int = 24) -> None:
    done = int(width * step / total)
    print(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} {text}", end="", file=sys.stderr, flush=True)


# ---------- 训练 ----------


def train(out: Path, steps: int | None = 1000, minutes: float | None = None, batch: int = 16, seq: int = 256,
          lr: float = 3e-3, mtp_weight: float = 0.5, seed: int = 0, vocab_size: int = DEMO["vocab_size"]) -> dict:
    """训练并写出检查点；返回留出集上的指标。

    同样的 seed 与 steps 得到同样的模型（数据顺序、初值都由 seed 决定）。steps 为 None 时按 minutes
    的时间预算估出步数：那样就取决于机器的速度，不再可复现。
    """
    torch.manual_seed(seed)
    train_files, heldout_files = corpus_files()
    print(f"语料：标准库 {len(train_files)} 个训练文件，{len(heldout_files)} 个留出文件", file=sys.stderr)
    train_texts = read(train_files)
    tk = train_tokenizer(train_texts, vocab_size)
    data, held = encode(tk, train_texts), encode(tk, read(heldout_files))
    print(f"分词器：{tk.get_vocab_size()} 个 token；训练 {len(data):,} 个 token，留出 {len(held):,} 个",
          file=sys.stderr)

    cfg = Config(**{**DEMO, "vocab_size": tk.get_vocab_size()})
    model, mtp = Model(cfg), MTP(cfg)
    with torch.no_grad():  # 从零训练的初值：矩阵 N(0, 0.02)，写回残差流的投影再按层数缩小
        for name, p in [*model.named_parameters(), *mtp.named_parameters()]:
            if p.ndim == 2:
                std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers) if name.split(".")[-2] in (
                    "o_proj", "out_proj", "down_proj") else 0.02
                p.normal_(0, std)
    params = [*model.parameters(), *mtp.parameters()]
    n_params = sum(p.numel() for p in params)
    print(f"模型：{n_params / 1e6:.2f}M 参数（含 MTP 头），层型 {cfg.layer_types}", file=sys.stderr)

    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    model.train(), mtp.train()

    def step_once(i, total):
        for group in opt.param_groups:  # 预热 100 步，然后余弦衰减到 lr/10
            warm = min(1.0, (i + 1) / 100)
            group["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / total)))
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts])
        main, extra, acc = losses(model, mtp, x)
        loss = main + mtp_weight * extra
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return main.item(), extra.item(), acc.item()

    t0 = time.perf_counter()
    if steps is None:  # 先跑几步量速度，再按时间预算定总步数（学习率的余弦需要事先知道总步数）
        for i in range(5):
            step_once(i, 1000)
        steps = max(10, int(minutes * 60 / ((time.perf_counter() - t0) / 5)))
        print(f"按 {minutes:g} 分钟的预算训练 {steps} 步", file=sys.stderr)
    t0, ema = time.perf_counter(), None
    for i in range(steps):
        main, extra, acc = step_once(i, steps)
        ema = (main, extra, acc) if ema is None else tuple(0.95 * a + 0.05 * b for a, b in zip(ema, (main, extra, acc)))
        if i % 10 == 0 or i == steps - 1:
            speed = (i + 1) * batch * seq / (time.perf_counter() - t0)
            progress(i + 1, steps, f"loss {ema[0]:.3f}  mtp {ema[1]:.3f}  mtp@1 {ema[2]:.1%}  {speed:,.0f} token/s")
    print(file=sys.stderr)

    metrics = evaluate(model, mtp, held, seq)
    print(f"留出集：主模型损失 {metrics['loss']:.3f}（困惑度 {math.exp(metrics['loss']):.1f}），"
          f"MTP 损失 {metrics['mtp_loss']:.3f}，MTP top-1 准确率 {metrics['mtp_top1']:.1%}", file=sys.stderr)

    dtype = torch.bfloat16  # 发布检查点也是 bfloat16：文件小一半
    model_sd = {k: v.to(dtype) if v.ndim > 1 else v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    mtp_sd = {k: v.to(dtype) if v.ndim > 1 else v for k, v in mtp.state_dict().items()}
    save_checkpoint(out, cfg, model_sd, mtp_sd, extra_text_config={"dtype": "bfloat16", "bos_token_id": None})
    tk.save(str(Path(out) / "tokenizer.json"))
    return {**metrics, "steps": steps, "train_tokens": steps * batch * seq, "params": n_params}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m qwen.tools.train", description="从零训练一个带 MTP 头的小 Qwen3.5（标准库源码）")
    p.add_argument("--out", default="qwen/demo", help="检查点写到这里")
    p.add_argument("--steps", type=int, default=1000, help="训练步数（每步 batch × seq 个 token）")
    p.add_argument("--minutes", type=float, default=None, help="改用时间预算估步数（不可复现）")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = None if args.minutes else args.steps
    metrics = train(Path(args.out), steps, args.minutes, args.batch, args.seq, args.lr, seed=args.seed)
    print(f"已写出 {args.out}：{metrics}")



def save_checkpoint(path: str | os.PathLike, cfg: Config, model: dict, mtp: dict | None = None,
                    extra_text_config: dict | None = None, shard_bytes: int = 2 << 30, make=None) -> Path:
    """按发布检查点的布局写出：config.json 嵌套 text_config，张量名 model.language_model.* 与 mtp.*，
    分片加索引。model、mtp 是去掉前缀的 {名字: 张量}（共用嵌入时不含 lm_head.weight）。
    make：给了时张量可以是 meta 的（只有形状与 dtype），写到它的分片时才由 make(全名, 张量) 造出来——几十 GB 的
    随机检查点一个分片一个分片地造，内存里只有一个分片。"""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k if k == "lm_head.weight" else "model.language_model." + k: v for k, v in model.items()}  # 输出头在顶层
    tensors.update({"mtp." + k: v for k, v in (mtp or {}).items()})
    shards, size = [[]], 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        shard = {k: (make(k, tensors[k]) if make else tensors[k]).contiguous() for k in names}
        save_file(shard, str(path / file), metadata={"format": "pt"})
        del shard
        weight_map.update({k: file for k in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
    skip = {"mrope_section", *(moe if not cfg.num_experts else ())}  # mrope_section 写在 rope_parameters 里；稠密的不写专家
    text = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in skip}
    kind = "qwen3_5_moe" if cfg.num_experts else "qwen3_5"  # 专家混合：35B-A3B 的 model_type
    text.update(model_type=kind + "_text", mtp_num_hidden_layers=1 if mtp else 0,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                 "partial_rotary_factor": cfg.partial_rotary_factor,
                                 "mrope_section": cfg.mrope_section, "mrope_interleaved": True})  # 第 5 章的 M-RoPE
    text.update(extra_text_config or {})
    architecture = "Qwen3_5MoeForConditionalGeneration" if cfg.num_experts else "Qwen3_5ForConditionalGeneration"
    config = {"architectures": [architecture], "model_type": kind,
              "tie_word_embeddings": cfg.tie_word_embeddings, "text_config": text}
    (path / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return path

if __name__ == "__main__":
    main()
