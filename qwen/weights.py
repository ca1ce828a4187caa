"""第 1 章 · 权重：配置、找到检查点、安全地读取张量。

一个 Hugging Face 检查点就是一个文件夹：`config.json` 描述模型的形状，`*.safetensors` 装着张量（大模型切成几个分片，
由 `model.safetensors.index.json` 记录每个张量在哪个分片里）。Qwen3.5 发布的是多模态包装：语言模型的配置嵌在 `text_config`
里，张量名以 `model.language_model.` 开头，旁边还有视觉塔 `model.visual.*`（第 15 章）和 MTP 草稿头 `mtp.*`（第 14 章）。

safetensors 可以“按名字懒读取”：只打开文件头，要哪个张量才从磁盘映射进来，所以以 bfloat16 加载时不会出现 float32 副本。
我们只用 safetensors：`torch.load` 会执行 pickle 里的任意代码，不能拿来读别人给的文件。坏的输入（缺文件、截断的文件、
写错的配置、别的模型的检查点）都要给出说得清的错误：说出是哪个文件、哪个字段，该怎么办。
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

REPO_ID = "Qwen/Qwen3.5-0.8B"
NEEDED_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",  # 下载时只取这些
                "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"]
MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")  # 稠密、专家混合：多模态包装 / 纯文本
DEMO_PATH = Path(__file__).parent / "demo"  # 随包附带的小检查点（附录“训练”一章训出来的），离线也能用
REPO_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # Hugging Face 的仓库名：组织/模型


@dataclass
class Config:
    """语言模型的全部超参数。默认值就是 Qwen3.5-0.8B。"""

    vocab_size: int = 248320
    hidden_size: int = 1024
    intermediate_size: int = 3584  # SwiGLU MLP 的中间宽度
    num_hidden_layers: int = 24
    num_attention_heads: int = 8  # 全注意力层：查询头
    num_key_value_heads: int = 2  # 全注意力层：键值头（GQA）
    head_dim: int = 256
    linear_num_key_heads: int = 16  # DeltaNet 层：q、k 头数
    linear_num_value_heads: int = 16  # DeltaNet 层：v 头数（≥ k 头数）
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4  # 因果深度卷积的核宽
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25  # 只旋转每个头的前 25% 维（256 → 64）
    mrope_section: list[int] = field(default_factory=lambda: [11, 11, 10])  # M-RoPE：32 个频率里给 t、h、w 各几个
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = True  # 输出头与词嵌入共用一个矩阵
    mtp_num_hidden_layers: int = 1
    eos_token_id: int | None = 248044
    layer_types: list[str] = field(default_factory=list)  # 每层 "linear_attention" 或 "full_attention"
    full_attention_interval: int = 4  # 没给 layer_types 时：第 i 层在 (i+1) % 4 == 0 时是全注意力
    num_experts: int = 0  # 专家混合（第 4 章附）：每层几个专家；0 是稠密的 MLP
    num_experts_per_tok: int = 8  # 每个 token 用几个专家（top-k）
    moe_intermediate_size: int = 512  # 每个专家的中间宽度
    shared_expert_intermediate_size: int = 512  # 共享专家的中间宽度

    def __post_init__(self):
        kinds = {"int": int, "float": (int, float), "bool": bool, "int | None": (int, type(None)), "list[str]": list, "list[int]": list}
        for f in fields(self):  # 配置是用户给的文件：类型不对就在这里说清楚，而不是在 torch 深处报错
            v = getattr(self, f.name)
            if not isinstance(v, kinds[f.type]) or (isinstance(v, bool) and f.type != "bool"):
                raise ValueError(f"config.json 的 {f.name} 应为 {f.type}，收到 {v!r}（{type(v).__name__}）")
            low = 0 if f.name in ("mtp_num_hidden_layers", "num_experts") else 1  # 至少为 1：0 会在 torch 深处除以零
            high = 1 if f.name == "partial_rotary_factor" else float("inf")  # 浮点数为正、有限；旋转的比例不超过 1
            if f.type == "int" and v < low or f.type == "float" and not (0 < v <= high and v < float("inf")):
                raise ValueError(f"config.json 的 {f.name} 不能是 {v!r}")
        if not self.layer_types:
            self.layer_types = ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types 有 {len(self.layer_types)} 项，但 num_hidden_layers = {self.num_hidden_layers}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads 必须是 linear_num_key_heads 的整数倍")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok = {self.num_experts_per_tok} 多于 num_experts = {self.num_experts}")

    rotary_dim = property(lambda self: int(self.head_dim * self.partial_rotary_factor))  # 0.8B：256 × 0.25 = 64

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """从 config.json 的内容构造；嵌套的 text_config 与扁平的写法都接受。"""
        model_type = d.get("model_type") if isinstance(d, dict) else None
        if model_type not in MODEL_TYPES:
            raise ValueError(f"这不是 Qwen3.5 的检查点：config.json 的 model_type 是 {model_type!r}，"
                             f"需要 {' 或 '.join(repr(t) for t in MODEL_TYPES)}")
        text = d.get("text_config") or d
        rope = (text.get("rope_parameters") or text.get("rope_scaling") or {}) if isinstance(text, dict) else None
        if not isinstance(rope, dict):  # 新版的 rope_theta、partial_rotary_factor 写在 rope_parameters 里
            raise ValueError(f"{'rope_parameters' if isinstance(text, dict) else 'text_config'} 应是 {{字段: 值}} 的对象")
        text = {"tie_word_embeddings": d.get("tie_word_embeddings"), **text}  # 多模态包装把它写在顶层
        text.update({k: rope[k] for k in ("rope_theta", "partial_rotary_factor", "mrope_section") if k in rope and k not in text})
        eos = text.get("eos_token_id", d.get("eos_token_id"))
        text["eos_token_id"] = eos[0] if isinstance(eos, list) and eos else eos
        return cls(**{k: v for k, v in text.items() if k in {f.name for f in fields(cls)} and v is not None})


def load_config(path: str | os.PathLike) -> Config:
    """读取文件夹里的 config.json。"""
    if not (file := Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{path} 里没有 config.json：请指向含 config.json 与 *.safetensors 的检查点文件夹（如 {REPO_ID} 的本地副本）")
    try:
        return Config.from_dict(json.loads(file.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} 不是合法的 JSON（{e}）：文件可能被截断或改坏了，请重新下载或修正它") from None
    except ValueError as e:  # 配置本身不对（别的模型、写错的字段）：带上文件名
        raise ValueError(f"{file}：{e}") from None


def find_model(path: str | os.PathLike | None = None) -> Path:
    """找到检查点文件夹：显式路径（"demo" 是随包附带的小模型；不是文件夹的 "Qwen/Qwen3.5-35B-A3B" 这样的仓库名先找
    本地 HF 缓存、再下载）> 环境变量 QWEN_MODEL > 本地 HF 缓存里的 Qwen3.5-0.8B > 下载它。"""
    path = path if path is not None else os.environ.get("QWEN_MODEL") or None
    p = DEMO_PATH if str(path) == "demo" else Path(path or ".").expanduser()
    repo = REPO_ID if path is None else str(path) if REPO_NAME.fullmatch(str(path)) and not p.exists() else None
    if repo is None:
        if not p.is_dir():
            raise FileNotFoundError(f"模型路径 {p} 不存在或不是文件夹")
        return p
    from huggingface_hub import snapshot_download  # 只在需要时导入
    for local in (True, False):  # 先只看本地缓存，不碰网络；再下载（0.8B 约 1.7 GB，带 huggingface_hub 的进度条）
        try:
            return Path(snapshot_download(repo, allow_patterns=NEEDED_FILES, local_files_only=local))
        except Exception as e:
            error = e
    raise FileNotFoundError(f"找不到模型 {repo}：它不是本地的文件夹，本地 Hugging Face 缓存里没有，下载也失败了（{type(error).__name__}）。"
                            f"离线时请把检查点文件夹传给 path 参数或 --model，或设置环境变量 QWEN_MODEL=/path/to/检查点")


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """检查点的所有 safetensors 文件：有索引就按索引，否则取文件夹里的 *.safetensors。"""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:  # 不是 JSON、没有 weight_map、它不是 {张量名: 分片文件名}
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            missing = [s for s in shards if not (path / s).is_file()]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} 不是有效的分片索引（{type(e).__name__}: {e}）：应是含 weight_map 的 JSON，请重新下载它") from None
        if missing:
            raise FileNotFoundError(f"{path} 的分片索引提到的文件不存在：{', '.join(missing)}")
        return [path / s for s in shards]
    if files := sorted(path.glob("*.safetensors")):
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise ValueError(f"{path} 里只有 .bin/.pt（pickle）格式的权重：pickle 能执行任意代码，本项目只读 safetensors，请换用这种格式")
    raise FileNotFoundError(f"{path} 里没有 *.safetensors 权重文件")


def open_safetensors(file: Path):
    """safe_open，但坏文件（下载中断、被截断）报出文件名和该怎么办。"""
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{file} 不是完整的 safetensors 文件（{e}）：可能下载中断或被截断，请删掉它重新下载") from None


def load_weights(path: str | os.PathLike, part: str = "model.", dtype: torch.dtype | None = None, read=None) -> dict:
    """读出检查点的一个部分，去掉前缀后返回 {名字: 张量}（每个用 read_tensor 读；附录传自己的 read，先只读形状）。
    part="model." 取文本模型（lm_head.weight 若存在也一并返回），part="mtp." 取草稿头。dtype 给定时矩阵转成 dtype；
    其余的浮点张量（norm 权重、A_log、dt_bias、卷积核）用 float32：它们很小，却直接决定数值精度。"""
    prefixes = ("model.language_model.", "model.") if part == "model." else (part,)  # 多模态包装里文本模型的前缀
    out = {}
    for file in safetensors_files(path):
        with open_safetensors(file) as f:
            names = list(f.keys())
        for name in names:
            prefix = next((p for p in prefixes if name.startswith(p)), None)
            if prefix is not None and (part != "model." or not name.startswith("model.visual.")):  # 视觉塔是第 15 章的
                key = name[len(prefix):]
            elif (key := name) != "lm_head.weight" or part != "model.":
                continue
            if key not in out:  # model.language_model.x 优先于 model.x
                out[key] = (read or read_tensor)(file, name, dtype)
    return out


def read_tensor(file: Path, name: str, dtype: torch.dtype | None) -> torch.Tensor:
    """读一个张量到自己的内存里（文件映射的视图读过的页都算进常驻内存）；矩阵（含堆叠的专家）用 dtype，其余用 float32。"""
    with open_safetensors(file) as f:
        if not (t := f.get_tensor(name)).is_floating_point():
            raise ValueError(f"{file} 里的 {name} 是 {t.dtype}：权重应是浮点张量（BF16、F16 或 F32）")
        out = t.to(dtype or t.dtype) if t.ndim == 2 or name.endswith("_proj") else t.float()
        return out.clone() if out.data_ptr() == t.data_ptr() else out


def check_state_dict(expected: dict[str, torch.Size], got: dict[str, torch.Tensor], what: str) -> None:
    """在交给 load_state_dict 之前检查名字和形状，报出能看懂的错误。"""
    lines = [f"{what} 的张量与模型对不上："]
    lines += [f"  {word} {len(names)} 个：{', '.join(names[:10])}" + (" ..." if len(names) > 10 else "") for word, names
              in (("缺少", sorted(set(expected) - set(got))), ("多出", sorted(set(got) - set(expected)))) if names]
    if len(lines) > 1:
        raise ValueError("\n".join(lines + ["  检查点与 config.json 是否来自同一个模型？"]))
    for name, shape in expected.items():
        if tuple(got[name].shape) != tuple(shape):
            raise ValueError(f"{what} 的张量 {name} 形状不对：检查点里是 {tuple(got[name].shape)}，按 config.json 应为 {tuple(shape)}")
