"""第 1 章 · 权重：配置、找到检查点、按需读取张量。

一个 Hugging Face 检查点就是一个文件夹：`config.json` 描述模型的形状，
`*.safetensors` 装着张量（大模型切成几个分片，由 `model.safetensors.index.json`
记录每个张量在哪个分片里）。Qwen3.5 发布的是多模态包装：语言模型的配置嵌在
`text_config` 里，张量名以 `model.language_model.` 开头，旁边还有视觉塔
`model.visual.*`（我们不读）和 MTP 草稿头 `mtp.*`（第 14 章用）。

safetensors 的好处是可以“按名字懒读取”：只打开文件头，需要哪个张量才把它从
磁盘映射进来。所以以 bfloat16 加载 0.8B 时，内存里从来不会出现 float32 副本。
我们只用 safetensors：`torch.load` 会执行 pickle 里的任意代码，不能拿来读别人给的文件。

权重读进来之后怎么摆，决定了 CPU 上解码有多快。解码一个 token 要把全部权重从内存读一遍，
速度的上限是“权重字节数 ÷ 内存带宽”。PyTorch 在 CPU 上做 bfloat16 矩阵乘法时交给 oneDNN，
而 oneDNN 每次调用都先把 [out, in] 的权重重排成它的分块布局：权重实际被读写了三遍。
Linear.pack() 在加载时把这个重排只做一次，之后每次调用只读一遍权重，而且 1 到 8 行输入
（投机解码一次验证几个 token）花的时间几乎一样。几个读同一输入的矩阵（q、k、v 投影）还可以拼成一个再打包（Fused）。
没打包、只有一行输入的 bfloat16 矩阵（比如草稿头用的输出头前几行）走 PyTorch 自带的 gemv（gemv()），
它对一行最快。这是本书唯一的“性能布局”，只影响速度，不影响结果。
打包之后输出头已有一份打包的副本，与它共用的嵌入表就不必再放在内存里：RowReader 按行从文件里读。

还有一种可选的布局（from_pretrained(..., compile=True)）：把 [out, in] 的权重按 32 个输出切成块，
每块 [in, 32] 连续存放（Linear.block()），1 到 8 行输入（解码、验证草稿）由 torch.compile 生成的一个小循环算
（9 到 32 行时每 8 行一段）：
逐块顺序读权重，每读 32 个数就乘加进每行的 32 个累加器。读内存的方式简单到底，1 行时实测比打包的 oneDNN
快 1.1～1.5 倍（机器越空闲差得越多）；代价是每种行数第一次用到时要编译几秒，更多行（长的预填充）时要先拼回普通布局
再交给 F.linear（每次多一份复制，所以预填充按较长的段喂，见第 10 章的 COMPILED_PIECE）。
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

REPO_ID = "Qwen/Qwen3.5-0.8B"
# 下载时只取这些文件：配置、权重、分片索引、分词器与对话模板；不要视觉预处理等无关文件。
NEEDED_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
]
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")  # 多模态包装 / 纯文本
DEMO_PATH = Path(__file__).parent / "demo"  # 随包附带的小检查点（附录“训练”一章训出来的），离线也能用


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
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = True  # 输出头与词嵌入共用一个矩阵
    mtp_num_hidden_layers: int = 1
    eos_token_id: int | None = 248044
    layer_types: list[str] = field(default_factory=list)  # 每层 "linear_attention" 或 "full_attention"
    full_attention_interval: int = 4  # 没给 layer_types 时：第 i 层在 (i+1) % 4 == 0 时是全注意力

    def __post_init__(self):
        if not self.layer_types:
            n = self.full_attention_interval
            self.layer_types = [
                "full_attention" if (i + 1) % n == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types 有 {len(self.layer_types)} 项，但 num_hidden_layers = {self.num_hidden_layers}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads 必须是 linear_num_key_heads 的整数倍")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # 0.8B：256 × 0.25 = 64

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """从 config.json 的内容构造；嵌套的 text_config 与扁平的写法都接受。"""
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"这不是 Qwen3.5 的检查点：config.json 的 model_type 是 {model_type!r}，"
                f"需要 {' 或 '.join(repr(t) for t in MODEL_TYPES)}"
            )
        text = dict(d.get("text_config") or d)
        # 词嵌入是否共享：多模态包装把它写在顶层。
        if "tie_word_embeddings" in d and "tie_word_embeddings" not in text:
            text["tie_word_embeddings"] = d["tie_word_embeddings"]
        # RoPE 参数：新版写在 rope_parameters 里，旧版散在顶层。
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in rope and key not in text:
                text[key] = rope[key]
        eos = text.get("eos_token_id", d.get("eos_token_id"))
        text["eos_token_id"] = eos[0] if isinstance(eos, list) else eos
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in text.items() if k in names and v is not None})


def load_config(path: str | os.PathLike) -> Config:
    """读取文件夹里的 config.json。"""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} 里没有 config.json：这不是一个 Hugging Face 检查点文件夹。"
            f"请指向含 config.json 与 *.safetensors 的文件夹（例如 {REPO_ID} 的本地副本）。"
        )
    with open(file, encoding="utf-8") as f:
        return Config.from_dict(json.load(f))


def find_model(path: str | os.PathLike | None = None) -> Path:
    """找到检查点文件夹：显式路径（"demo" 是随包附带的小模型）> 环境变量 QWEN_MODEL > 本地 HF 缓存 > 下载。"""
    if path is None:
        path = os.environ.get("QWEN_MODEL") or None
    if path is not None and str(path) == "demo":
        if not (DEMO_PATH / "config.json").is_file():
            raise FileNotFoundError(f"demo 检查点不在 {DEMO_PATH}：用 python -m qwen.train --out {DEMO_PATH} 训练一个")
        return DEMO_PATH
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_dir():
            raise FileNotFoundError(f"模型路径 {p} 不存在或不是文件夹")
        return p

    from huggingface_hub import snapshot_download  # 只在需要时导入

    try:  # 先只看本地缓存，不碰网络
        return Path(snapshot_download(REPO_ID, allow_patterns=NEEDED_FILES, local_files_only=True))
    except Exception:
        pass
    try:  # 再下载（约 1.7 GB，带 huggingface_hub 的进度条）
        return Path(snapshot_download(REPO_ID, allow_patterns=NEEDED_FILES))
    except Exception as e:
        raise FileNotFoundError(
            f"找不到模型 {REPO_ID}：本地 Hugging Face 缓存里没有，下载也失败了（{type(e).__name__}）。"
            f"离线时请把检查点文件夹传给 path 参数或 --model，或设置环境变量 QWEN_MODEL=/path/to/Qwen3.5-0.8B。"
        ) from None


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """检查点的所有 safetensors 文件：有索引就按索引，否则取单个 model.safetensors。"""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{path} 的分片索引提到的文件不存在：{', '.join(missing)}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise ValueError(
            f"{path} 里只有 .bin/.pt（pickle）格式的权重。本项目只读 safetensors："
            "pickle 文件可以执行任意代码。请使用 safetensors 格式的检查点。"
        )
    raise FileNotFoundError(f"{path} 里没有 *.safetensors 权重文件")


def part_prefixes(part: str) -> tuple[str, ...]:
    """一个“部分”在检查点里可能用的前缀。文本模型在多模态包装里是 model.language_model.。"""
    if part == "model.":
        return ("model.language_model.", "model.")
    return (part,)


def load_weights(path: str | os.PathLike, part: str = "model.", dtype: torch.dtype | None = None) -> dict:
    """读出检查点的一个部分，去掉前缀后返回 {名字: 张量}。

    part="model." 取文本模型（lm_head.weight 若存在也一并返回），part="mtp." 取草稿头。
    model.visual.* 永远不读。dtype 给定时，浮点的矩阵转成 dtype；其余张量（各种 norm 的权重、
    A_log、dt_bias 这些一维的，还有 [C, 1, 4] 的卷积核）用 float32：它们很小，却直接决定数值精度，
    而且本来就在 float32 里参与计算，存成 float32 也省得每一步再转一次。
    """
    prefixes = part_prefixes(part)
    out = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.startswith("model.visual."):
                    continue  # 视觉塔：不读
                prefix = next((p for p in prefixes if name.startswith(p)), None)
                if prefix is not None:
                    key = name[len(prefix):]
                elif part == "model." and name == "lm_head.weight":
                    key = name
                else:
                    continue
                if key in out:
                    continue  # model.language_model.x 优先于 model.x
                out[key] = read_tensor(file, name, dtype)
    return out


def tensor_file(path: str | os.PathLike, part: str, key: str) -> tuple[Path, str]:
    """一个张量在检查点的哪个文件里、全名是什么。key 去掉了前缀，如 part="model."、key="embed_tokens.weight"。"""
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            names = set(f.keys())
        for prefix in part_prefixes(part):
            if prefix + key in names:
                return file, prefix + key
    raise ValueError(f"检查点 {path} 里没有张量 {key}（前缀 {' 或 '.join(part_prefixes(part))}）")


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class RowReader:
    """检查点里的一个二维张量，留在磁盘上：reader[ids] 只读出这几行。

    打包的模型用它装词嵌入表（第 2、10 章）：输出头已经有一份打包的副本，查表每个 token 只要一行，
    没必要在内存里再放一份 0.5 GB 的普通布局。safetensors 文件是 8 字节的头长度 n、n 字节的 JSON 头
    （每个张量的 dtype、shape 与 data_offsets），再接原始字节，所以第 i 行在固定的偏移处，直接读出来即可。
    不用内存映射：映射里读过的页会算进本进程的常驻内存，内核还会顺带映射周围的一大片。
    """

    def __init__(self, file: str | os.PathLike, name: str, dtype: torch.dtype | None = None):
        self.file = open(file, "rb")  # 一直开着，对象回收时关闭
        n = int.from_bytes(self.file.read(8), "little")
        info = json.loads(self.file.read(n))[name]
        if info["dtype"] not in SAFETENSORS_DTYPES or len(info["shape"]) != 2:
            raise ValueError(f"{file} 里的 {name} 是 {info['dtype']} {info['shape']}：按行读只支持二维的浮点张量")
        self.file_dtype = SAFETENSORS_DTYPES[info["dtype"]]
        self.shape = tuple(info["shape"])  # [行数, 列数]
        self.dtype = dtype or self.file_dtype
        self.row_bytes = self.shape[1] * self.file_dtype.itemsize
        self.start = 8 + n + info["data_offsets"][0]  # 这个张量的第 0 行在文件里的偏移

    def __del__(self):
        if hasattr(self, "file"):
            self.file.close()

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids 任意形状的整数张量 → [..., 列数]，dtype 为 self.dtype。"""
        buf = bytearray()
        for i in ids.flatten().tolist():
            self.file.seek(self.start + i * self.row_bytes)
            buf += self.file.read(self.row_bytes)
        return torch.frombuffer(buf, dtype=self.file_dtype).view(*ids.shape, self.shape[1]).to(self.dtype)

    def head(self, n: int) -> torch.Tensor:
        """前 n 行，一次连续读出：[n, 列数]。"""
        self.file.seek(self.start)
        buf = bytearray(self.file.read(n * self.row_bytes))
        return torch.frombuffer(buf, dtype=self.file_dtype).view(n, self.shape[1]).to(self.dtype)


def read_tensor(file: Path, name: str, dtype: torch.dtype | None) -> torch.Tensor:
    """读一个张量到自己的内存里。

    safetensors 把文件映射进内存，读到的张量是映射的视图；只要映射还在，读过的页都算在本进程的常驻内存里。
    所以每个张量单独打开一次、拷出来、关掉：内存里只有我们真正留下的那一份（打包后旧的那份也能真正释放）。
    """
    with safe_open(file, framework="pt") as f:
        t = f.get_tensor(name)
        out = cast(t, dtype)
        return out.clone() if out.data_ptr() == t.data_ptr() else out


def save_checkpoint(path: str | os.PathLike, cfg: Config, model: dict, mtp: dict | None = None,
                    extra_text_config: dict | None = None, shard_bytes: int = 2 << 30) -> Path:
    """按发布检查点的布局写出：config.json 嵌套 text_config，张量名 model.language_model.* 与 mtp.*，
    分片加索引。model、mtp 是去掉前缀的 {名字: 张量}（共用嵌入时不含 lm_head.weight）。"""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {"model.language_model." + k: v for k, v in model.items()}
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
        save_file({k: tensors[k].contiguous() for k in names}, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    half = cfg.rotary_dim // 2  # 多模态 RoPE 的三段（文本里三段位置相同，等价于普通 RoPE）
    section = [round(half * 11 / 32), round(half * 11 / 32), half - 2 * round(half * 11 / 32)]
    text = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    text.update(model_type="qwen3_5_text", mtp_num_hidden_layers=1 if mtp else 0,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                 "partial_rotary_factor": cfg.partial_rotary_factor,
                                 "mrope_section": section, "mrope_interleaved": True})
    text.update(extra_text_config or {})
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "tie_word_embeddings": cfg.tie_word_embeddings, "text_config": text}
    (path / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return path


def cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """矩阵（二维）转成计算用的 dtype；其余的浮点参数（一维的 norm 权重等、三维的卷积核）一律 float32。"""
    if not t.is_floating_point():
        return t
    if t.ndim != 2:
        return t.float()
    return t if dtype is None else t.to(dtype)


def check_state_dict(expected: dict[str, torch.Size], got: dict[str, torch.Tensor], what: str) -> None:
    """在交给 load_state_dict 之前检查名字和形状，报出能看懂的错误。"""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing or unexpected:
        lines = [f"{what} 的张量与模型对不上："]
        if missing:
            lines.append(f"  缺少 {len(missing)} 个：{', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))
        if unexpected:
            lines.append(
                f"  多出 {len(unexpected)} 个：{', '.join(unexpected[:10])}" + (" ..." if len(unexpected) > 10 else "")
            )
        lines.append("  检查点与 config.json 是否来自同一个模型？")
        raise ValueError("\n".join(lines))
    for name, shape in expected.items():
        if tuple(got[name].shape) != tuple(shape):
            raise ValueError(
                f"{what} 的张量 {name} 形状不对：检查点里是 {tuple(got[name].shape)}，"
                f"按 config.json 应为 {tuple(shape)}"
            )


PAD_ROWS = 4  # 打包的 bfloat16 矩阵乘法：不足这么多行时补零行（见 Linear.forward）
BLOCK = 32  # 分块布局（Linear.block）每块的输出个数
BLOCK_ROWS = 8  # 分块布局：编译的 matvec_blocks 一次最多乘这么多行输入（解码 1 行，验证 k 个草稿 k + 1 行）
KERNEL_ROWS = 32  # 分块布局：不超过这么多行时每 8 行一段用 matvec_blocks（每段读一遍权重），更多行时（预填充）
# 拼回普通布局走 F.linear。拼回一次（复制整个矩阵，F.linear 里 oneDNN 再重排一遍）有固定的代价，行少时不划算。
# 实测 0.8B 预填充 9 个 token 313 → 169 ms，24 个 348 → 284 ms，32 个打平，48 个时分段慢约 7%；
# 草稿头补上几轮没起草时攒下的 9～10 对（第 14 章）：起草一次 11 → 7.6 ms


def to_blocks(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] → [⌈out/32⌉, in, 32]：第 b 块是第 32b…32b+31 个输出的权重，按输入维连续存放。out 不是 32 的倍数时补零行。"""
    out, n_in = weight.shape
    if out % BLOCK:
        weight = F.pad(weight, (0, 0, 0, -out % BLOCK))  # 补到 32 的倍数（0.8B 的矩阵都不用补：少一份临时副本）
    return weight.view(-1, BLOCK, n_in).transpose(1, 2).contiguous()


def from_blocks(blocks: torch.Tensor, out: int) -> torch.Tensor:
    """to_blocks 的逆：[⌈out/32⌉, in, 32] → [out, in] 的矩阵（复制一份）。

    复制成转置的 [in, out]（每块的 32 个数原样搬过去，比逐个转置成 [out, in] 快两倍多），返回它的转置视图：
    F.linear 收到的就是 [in, out] 按行存放的普通矩阵乘法。"""
    return blocks.permute(1, 0, 2).reshape(blocks.shape[1], -1)[:, :out].t()


def matvec_blocks(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [M, in]（M 很小）乘分块布局的权重 → [M, ⌈out/32⌉·32]。在 float32 里累加。

    y[m, 32b + j] = Σ_i x[m, i] · blocks[b, i, j]。每行一个归约、共用同一次权重读取：torch.compile 把它们
    生成进同一个循环（对每块、每个 i，读 32 个权重，乘加进 M 行各自的 32 个累加器），权重只从内存读一遍。
    不编译时它也是对的，只是每行都要物化一个与权重一样大的中间结果，很慢。

    第一行看似什么也没做：torch.compile 会把算出 x 的逐元素运算（比如层里的 RMSNorm：开方、除法）内联进
    这个循环，于是权重的每一块都把它们重算一遍（两行输入时一整步因此慢约 15%）。as_strided 要求输入是一块真实的内存，
    编译器只好先把 x 算好存下来（M × in 个数），循环里只剩读权重、乘加。
    """
    x = torch.as_strided(x, x.shape, x.stride())  # 不改变 x 的值，只是让 torch.compile 先把它物化（见上）
    w = blocks.float()  # [B, in, 32]
    rows = [(w * x[m].float()[None, :, None]).sum(1).flatten() for m in range(x.shape[0])]  # 每个 [B·32]
    return torch.stack(rows).to(x.dtype)


COMPILE_OPTIONS = {"cpp.enable_floating_point_contract_flag": "fast"}  # 生成的 C++ 里允许把乘、加合成 FMA


def compile_matvec(dtype: torch.dtype = torch.float32):
    """matvec_blocks 的编译版本。dynamic=True：各种形状的矩阵共用一份代码，每种行数 M 各编译一次（几秒；
    编译结果缓存在磁盘上，下次启动快得多）；-ffp-contract=fast 让编译器把乘、加合成一条 FMA 指令（4 行时快约三成）。
    dtype 是权重的 dtype：加载时先按它编译一行输入的版本。"""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # 测试里各种小模型的形状也各算一次
    kernel = torch.compile(matvec_blocks, dynamic=True, options=COMPILE_OPTIONS)
    try:  # 现在就编译一次（一行输入），缺 C++ 编译器之类的问题在加载时就报出来，而不是在第一次生成时
        with torch.inference_mode():  # 编译结果按求导模式分开缓存：这里编译的就是生成时（inference_mode）要用的那份
            kernel(torch.ones(1, 8, dtype=dtype), torch.ones(2, 8, BLOCK, dtype=dtype))
    except Exception as e:
        raise RuntimeError(
            f"compile=True 需要 torch.compile 在这台机器上生成并编译 C++ 代码（要装 g++ 或 clang），但失败了："
            f"{type(e).__name__}: {str(e)[:300]}。不加 compile=True 就用默认的 oneDNN 打包布局。"
        ) from None
    return kernel


class Linear(nn.Linear):
    """nn.Linear（无偏置也行），多一个 pack()：把权重一次性重排成 oneDNN 的分块布局。

    打包之后 forward 用 oneDNN 的 linear 直接读打包好的权重，原来的 weight 释放（设为 None）。
    打包只用于推理：打包后的权重不参与求导，也不在 state_dict 里。
    """

    packed = None  # oneDNN 布局的权重；None 表示没打包，走普通的 F.linear
    blocks = None  # 分块布局的权重（block()）；kernel 是乘它的编译函数
    kernel = None

    @property
    def dtype(self) -> torch.dtype:
        for w in (self.packed, self.blocks, self.weight):
            if w is not None:
                return w.dtype
        raise ValueError("这个 Linear 没有权重（已并进某个 Fused）")

    def pack(self, rows: int = 4) -> None:
        """rows 是预计的输入行数（oneDNN 按它挑布局），实际行数多少都能算。"""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows)
        self.weight = None  # 释放普通布局的那一份：内存里只留一份权重

    def block(self, kernel) -> None:
        """换成分块布局（to_blocks），不超过 KERNEL_ROWS 行输入时用 kernel（compile_matvec() 的结果）每 8 行一段地乘。"""
        self.blocks = to_blocks(self.weight.detach())
        self.kernel = kernel
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:  # 分块布局（compile=True）
            x2 = x.reshape(-1, x.shape[-1])  # [M, in]
            M = x2.shape[0]
            if M <= KERNEL_ROWS:
                if M <= BLOCK_ROWS:
                    y = self.kernel(x2, self.blocks)  # [M, ⌈out/32⌉·32]
                else:  # 每 8 行一段（复制成自己的一份：编译的代码按输入的起始偏移特化，偏移为 0 就不必多编译）
                    pieces = (x2[i : i + BLOCK_ROWS].clone() for i in range(0, M, BLOCK_ROWS))
                    y = torch.cat([self.kernel(p, self.blocks) for p in pieces])
                y = y[:, : self.out_features]  # [M, out]：去掉补的零行
                y = y if self.bias is None else y + self.bias
            else:  # 预填充：拼回普通布局交给 F.linear（每次多一份复制）
                y = F.linear(x2, from_blocks(self.blocks, self.out_features), self.bias)
            return y.reshape(*x.shape[:-1], -1)
        if self.packed is not None:  # 打包的（CPU 上默认）：用 oneDNN 读打包好的权重
            rows = x.numel() // x.shape[-1]
            if rows < PAD_ROWS and x.dtype == torch.bfloat16:
                # 打包布局的 bfloat16 内核读权重的速度随行数上升，到 4 行才最快（实测 1 行约 29 GB/s，4 行约 35 GB/s）；
                # 算 4 行与算 1 行读的是同样多的权重：补几行零，算完丢掉
                x4 = F.pad(x.reshape(rows, -1), (0, 0, 0, PAD_ROWS - rows))  # [4, in]
                return self.onednn(x4)[:rows].reshape(*x.shape[:-1], -1)
            return self.onednn(x)
        if x.numel() == x.shape[-1] and x.dtype == torch.bfloat16 and not x.is_cuda:
            return gemv(x, self.weight, self.bias)  # 只有一行、普通权重：PyTorch 自己的 gemv 最快
        return F.linear(x, self.weight, self.bias)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Fused(nn.Module):
    """几个读同一个输入的 Linear（如 q_proj、k_proj、v_proj），调用时返回各自的输出。

    没打包时就是逐个调用。pack() 把它们的权重上下拼成一个矩阵再打包：解码一步少几次调用，
    一次连续读一大块内存也比分几次读快（0.8B 的 24 层：186 个矩阵变成 96 个，实测读权重快约 10%）。
    参数仍然属于原来那几个 Linear，名字与检查点一致；拼好的矩阵不在 state_dict 里。
    """

    def __init__(self, *linears: Linear):
        super().__init__()
        self.parts = linears  # 普通元组：不注册成子模块，它们已经是上一级模块的成员
        self.sizes = [m.out_features for m in linears]
        self.whole = None  # 拼接并打包后的 Linear

    def forward(self, x: torch.Tensor) -> tuple:
        if self.whole is None:
            return tuple(m(x) for m in self.parts)
        return self.whole(x).split(self.sizes, dim=-1)

    def pack(self, rows: int = 4, kernel=None) -> None:
        """拼成一个矩阵再打包；kernel 给定时换成分块布局（Linear.block）而不是 oneDNN 的打包。"""
        with torch.device("meta"):
            whole = Linear(self.parts[0].in_features, sum(self.sizes), bias=False)
        whole.weight = nn.Parameter(torch.cat([m.weight.detach() for m in self.parts]), requires_grad=False)
        for m in self.parts:
            m.weight = None  # 拼好之后各自那份就不要了
        whole.pack(rows) if kernel is None else whole.block(kernel)
        self.whole = whole


def gemv(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """一行输入乘普通布局的权重。CPU 上的 bfloat16 绕开 oneDNN（它每次都先重排权重），用 PyTorch 自带的 gemv，
    读一遍权重就算完；其他情况就是 F.linear。草稿头（输出头的前几万行，第 14 章）与没打包的模型走这里。
    开关 oneDNN 的是进程级的标志：别的线程若在同一时刻做矩阵乘法，也会短暂地不用 oneDNN（结果不变，只是慢些）。"""
    if x.dtype != torch.bfloat16 or x.is_cuda:
        return F.linear(x, weight, bias)
    enabled = torch.backends.mkldnn.set_flags(False)[0]
    try:
        return F.linear(x, weight, bias)
    finally:
        torch.backends.mkldnn.set_flags(enabled)


def preferred_dtype() -> torch.dtype:
    """默认的计算 dtype：CPU 支持 bfloat16 指令（oneDNN 能用）时用 bfloat16——读的字节少一半；否则 float32。"""
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def num_params(module: nn.Module) -> int:
    """参数个数，打包后释放了普通权重的矩阵也算上。"""
    packed = sum(m.packed.numel() if m.packed is not None else m.out_features * m.in_features
                 for m in module.modules()
                 if isinstance(m, Linear) and m.weight is None and (m.packed is not None or m.blocks is not None))
    return sum(p.numel() for p in module.parameters()) + packed


def can_pack(weight: torch.Tensor) -> bool:
    """这台机器、这个 dtype 能不能打包：只在 CPU 上，且 oneDNN 支持该 dtype。"""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def pack_linears(module: nn.Module, kernel=None) -> int:
    """把 module 里的矩阵打包：先把每个 Fused 组拼成一个矩阵，再打包其余的 Linear。
    kernel 给定时（compile=True，见 compile_matvec）换成分块布局而不是 oneDNN 的打包。
    返回打包了几个矩阵；这台机器不支持时什么也不做，返回 0。"""
    linears = [m for m in module.modules() if isinstance(m, Linear) and m.weight is not None]
    if not linears or (kernel is None and not can_pack(linears[0].weight)):
        return 0
    groups = [m for m in module.modules() if isinstance(m, Fused) and m.whole is None]
    for g in groups:
        g.pack(kernel=kernel)
    rest = [m for m in linears if m.weight is not None]  # 已并进某个 Fused 的，weight 已是 None
    for m in rest:
        m.pack() if kernel is None else m.block(kernel)
    return len(groups) + len(rest)
