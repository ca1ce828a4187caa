"""附录 · 加载快的模型：先只读形状、再一层一层地读出权重、换成 CPU 上快的布局（像 gpt-fast 的 _load_model）。

    model, mtp = qwen.fast.load(path)                       # 这台机器上最快的布局，有草稿头就一起读
    model, mtp = qwen.fast.load(path, quantize="int8")      # 矩阵存成 int8：读的字节少一半
    model, mtp = qwen.fast.load(path, quantize="int4")      # 4 位、每 32 个输入一个比例：是 bfloat16 的 28%

layout 一个参数选矩阵怎么存、怎么乘，每个值只有一个意思（LAYOUTS）；quantize 另选权重的格式。第 10 章的
Model.from_pretrained 只加载普通模型；这里用它的 load_pretrained 在 meta 设备上搭骨架、核对名字与形状（只读形状，
不读权重），再由 speed_up_model 一层一层地读出、换掉：内存里不必同时有整个模型的原始权重。草稿头跟着主模型的
model.layout 与 model.quantized 走。
"""

import ctypes

import torch
from torch import nn

from ..model import Model, load_pretrained
from ..mtp import MTP
from ..tools.vocab import draft_vocabulary
from ..weights import find_model, load_config, load_weights
from .draft import speed_up_mtp
from .layers import COMPILED_PIECE, DECODE_LENGTHS, PackedModel, attach_blocks, speed_up_layer, speed_up_norms
from .linear import BlockedLinear, PackedLinear, can_compile, can_pack, fast_linear, load_matvec
from .rows import FileEmbedding, FileRows, RowReader, head_tensor, materialize, meta_tensor, tensor_file
from .step import FastModel

LAYOUTS = {  # layout 的值 → 它是什么（命令行与第 14 章的实验打印）
    "plain": "普通的 nn.Linear（各章的模块）",
    "packed": "oneDNN 打包的布局",
    "blocked": "分块布局、C++ 的 matvec",
    "graphs": "分块布局、C++ 的 matvec，解码一步编译成图",
}
QUANTIZE = (None, "int8", "int4")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}  # 命令行的名字


def preferred_dtype() -> torch.dtype:
    """默认的计算 dtype：CPU 支持 bfloat16 指令（oneDNN 能用）时用 bfloat16——读的字节少一半；否则 float32。"""
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def resolve(layout: str = "auto", quantize=None, dtype=None) -> tuple[str, torch.dtype]:
    """检查 layout、quantize、dtype 的组合，把 "auto" 换成这台机器上最快的布局 → (layout, dtype)。不合法的组合是一个
    清楚的 ValueError，从不默默换成别的。"""
    if layout != "auto" and layout not in LAYOUTS:
        raise ValueError(f"layout 应为 auto 或 {', '.join(LAYOUTS)} 之一，收到 {layout!r}")
    if quantize not in QUANTIZE:
        raise ValueError(f'quantize 只能是 None、"int8" 或 "int4"，收到 {quantize!r}')
    if dtype not in (None, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype 只能是 torch.bfloat16 或 torch.float32，收到 {dtype}")
    if quantize and layout in ("plain", "packed"):
        raise ValueError(f'quantize="{quantize}" 的矩阵乘法是 C++ 的 matvec：要 layout="blocked" 或 "graphs"，'
                         f"不能与 layout={layout!r} 一起用")
    if layout == "plain":
        return layout, dtype or torch.float32
    dtype = dtype or preferred_dtype()
    if layout == "auto":  # 编得出 C++ 的 matvec 就用分块布局；编不了时 can_compile 说一次原因与代价
        if can_compile():
            layout = "blocked"
        elif quantize:
            raise ValueError(f'quantize="{quantize}" 要 C++ 的 matvec，这台机器编译不了它（原因见上面的警告）')
        else:
            layout = "packed" if can_pack(torch.empty(0, dtype=dtype, device="meta")) else "plain"
    if layout == "packed" and not can_pack(torch.empty(0, dtype=dtype, device="meta")):
        raise ValueError(f"这台机器的 oneDNN 不支持 {dtype} 的打包布局：换 dtype=torch.float32 或 layout=\"plain\"")
    return layout, dtype


def load(path=None, layout: str = "auto", quantize: str | None = None, dtype: torch.dtype | None = None,
         draft: bool = True, draft_vocab="auto") -> tuple[Model, MTP | None]:
    """加载文本模型与草稿头（draft=False，或检查点没有 mtp.* 时草稿头是 None）→ (model, mtp)。
    layout：auto（默认：这台机器上最快的）或 LAYOUTS 之一；quantize：None、"int8" 或 "int4"（分块布局上）；dtype：默认
    plain 是 float32，其余在 CPU 支持时 bfloat16；draft_vocab：起草时打分的 token（qwen/tools/vocab.py）。"""
    model = load_model(path, layout, quantize, dtype)
    return model, load_draft(model, draft_vocab=draft_vocab) if draft else None


def load_model(path=None, layout: str = "auto", quantize: str | None = None, dtype=None) -> Model:
    """只加载文本模型（参数同 load）。返回的模型带着 model.layout 与 model.quantized：草稿头照它们加载。"""
    layout, dtype = resolve(layout, quantize, dtype)
    path = find_model(path)
    if layout == "graphs" and load_config(path).num_experts:
        raise ValueError(f'{path} 是专家混合的检查点：layout="graphs" 还不能把按专家分组的一步编译成图，'
                         '请用 layout="blocked"（默认的 auto 就是它）')
    if layout == "plain":
        model = Model.from_pretrained(path, dtype)
    else:  # 只读形状：speed_up_model 一层一层地读出真的权重
        shapes = load_pretrained(Model, load_config(path), path, "model.", dtype, "文本模型", read=meta_tensor)
        model = speed_up_model(shapes, path, layout, quantize)
    model.layout, model.quantized = layout, quantize
    return model


def load_draft(model, path=None, draft_vocab="auto") -> MTP | None:
    """model 的草稿头（检查点里的 mtp.*），与它同样的布局与量化；检查点没有草稿头时返回 None。"""
    path = find_model(path if path is not None else model.path)
    if not load_weights(path, "mtp.", None, meta_tensor):  # 只看名字与形状：没有 mtp.* 就是没有草稿头
        return None
    layout = getattr(model, "layout", "plain")
    if layout == "plain":
        if draft_vocab not in ("auto", None):
            raise ValueError("起草词表是快路径（qwen.fast）的优化：普通布局的草稿头给全词表打分，不收 draft_vocab")
        return MTP.from_pretrained(model.cfg, path, model.dtype)
    vocab = draft_vocabulary(path, model.cfg.vocab_size, draft_vocab)
    mtp = load_pretrained(MTP, model.cfg, path, "mtp.", model.dtype, " MTP 草稿头", read=meta_tensor)
    kernel = None if layout == "packed" else load_matvec()
    raw = kernel is not None and not model.quantized  # 分块布局：矩阵按文件里的 dtype 读，换布局时一起转
    materialize(mtp, path, "mtp.", raw=raw)  # 草稿头只有一层
    mtp = speed_up_mtp(mtp, path, kernel, model.quantized, layout == "graphs", model.dtype, vocab)
    release_memory()
    return mtp


def speed_up_model(model: Model, path, layout: str, quantize=None) -> Model:
    """把只读了形状的 Model（meta 张量）一层一层地读出、换成 layout 的布局，返回同一个对象。"""
    kernel = None if layout == "packed" else load_matvec()
    some = model.layers[0].ffn.down_proj.weight
    dtype, raw = some.dtype, kernel is not None and not quantize  # 分块布局：矩阵按文件里的 dtype 读，换布局时一起转
    # 先换最大的输出头，嵌入表留在文件里（从不读进内存）；之后一层一层地读出、换掉。量化的输出头从文件里
    # 一段一段地读出来量化（FileRows）：内存里不必有整个 bfloat16 的输出头
    if quantize:
        model.lm_head = BlockedLinear(FileRows(RowReader(*tensor_file(path, *head_tensor(model.cfg)), dtype)),
                                      kernel, quantize=quantize)
    else:
        materialize(model, path, "model.", "lm_head.", raw=raw)
        model.lm_head = fast_linear([model.lm_head], kernel, dtype=dtype)
    model.embed_tokens = FileEmbedding(RowReader(*tensor_file(path, "model.", "embed_tokens.weight"), dtype))
    materialize(model, path, "model.", "norm.")
    for i, layer in enumerate(model.layers):
        materialize(model, path, "model.", f"layers.{i}.", raw=raw)
        speed_up_layer(layer, kernel, quantize, dtype)
        release_memory()  # 这一层的原始权重已经释放：还给操作系统，下一层的临时内存不再往上垒
    speed_up_norms(model, kernel)  # layout="graphs" 时 compile_steps 再把 C++ 的换回 PyTorch 的运算（图里用）
    model.__class__ = PackedModel if kernel is None else FastModel
    if kernel is not None:
        model.piece = COMPILED_PIECE
        attach_blocks(model)  # 解码一层几次 C 调用（layer.cpp）；compile_steps 再拿掉（图里用 PyTorch 的运算）
    if layout == "graphs":  # 解码一步（全部层）编译成图：解码一个 token、验证几个草稿
        model.compile_steps(DECODE_LENGTHS)
    return model


def release_memory() -> None:
    """把已经释放、但 glibc 还留在堆里的内存还给操作系统（malloc_trim）。几 MB 到几十 MB 的张量一块块释放之后，
    glibc 多半留着它们备用：常驻内存不降，下一层的临时张量又另占新的。别的 C 库上什么也不做。"""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def describe(model) -> str:
    """一句话说 model 走哪条路径（命令行与第 14 章的实验打印）。"""
    quantized = getattr(model, "quantized", None)
    return LAYOUTS[getattr(model, "layout", "plain")] + (f"，{quantized} 的矩阵" if quantized else "")


def num_params(module: nn.Module) -> int:
    """参数个数，换了布局、不再是 nn.Parameter 的矩阵也算上。"""
    fast = sum(m.out_features * m.in_features for m in module.modules() if isinstance(m, (PackedLinear, BlockedLinear)))
    return sum(p.numel() for p in module.parameters()) + fast
