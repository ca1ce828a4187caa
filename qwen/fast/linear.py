"""附录 · 快路径：矩阵乘法的三种布局。

解码一个 token 要把全部权重从内存读一遍，速度的上限是“权重字节数 ÷ 内存带宽”；矩阵乘法怎么读权重决定了离上限多远。

- PackedLinear（layout="packed"，或这台机器编译不了 C++ 时）：PyTorch 在 CPU 上把 bfloat16 矩阵乘法交给 oneDNN，而 oneDNN
  每次调用都先把 [out, in] 的权重重排成它的分块布局：权重实际被读写了三遍。加载时重排一次（_reorder_linear_weight），之后每次只读一遍，
  1 到 8 行输入（投机解码一次验证几个 token）读的都是同样一遍权重。bfloat16 内核在 4 行时读得最快，不足 4 行就补零行。
- BlockedLinear（layout="blocked" 与 "graphs"，能编译 C++ 时默认）：把权重按 32 个输出切成块，每块 [in, 32] 连续存放；matvec.cpp 的小循环（kernel.py
  编译一次）逐块顺序读权重，每读 32 个数就乘加进每行的 32 个累加器。两个线程各自顺序读自己那一半，硬件预取最顺手。
  行数多时（长的预填充）每个乘加读到的权重少，就先拼回普通布局交给 F.linear；有 AVX-512 BF16 时一对一对存放的
  bfloat16（vdpbf16ps）与 int8、int4（vpdpbusd）不拼回，matvec 一段一段地乘全部行（不比 oneDNN 慢，见 docs/performance.md）。
- gemv：一行输入乘普通布局的权重时绕开 oneDNN，用 PyTorch 自己的 gemv（草稿头给输出头的前几万行打分时用）。

几个读同一输入的矩阵（q/k/v，gate/up，DeltaNet 的四个输入投影）拼成一个再换布局：调用少了，一次连续读一大块也更快。
所有布局只影响速度，输出只差浮点舍入。性能数字见 docs/performance.md。
"""

import os
import shutil
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from . import kernel as kernels
from .sizes import BLOCK, KERNEL_ROWS, PAD_ROWS, QGROUP  # 各管什么：sizes.py 的表
from .share import current
from .records import read_record, record_file, write_record  # 也从这里导出（qwen.fast、测试从 .linear 引用它们）

# 编译的图（step.py 的整步、草稿头）生成的 C++ 里不把乘、加合成 FMA：合不合成由编译器对每段代码各自决定，同一行在
# 不同的图里可能一处合成、一处不合成，结果就差一点（投机解码验证的行与单独解码的行必须逐位相同，见第 14 章）
COMPILE_OPTIONS = {"cpp.enable_floating_point_contract_flag": "off"}
# 整步的图：小的运算（norm、逐元素）只用一个线程。行少的时候生成的代码会把一个归约拆给两个线程各加一半，拆不拆随行数而变
STEP_OPTIONS = COMPILE_OPTIONS | {"cpp.min_chunk_size": 1 << 15}


class PackedLinear(nn.Module):
    """oneDNN 布局的矩阵：y = x Wᵀ (+ b)。只用于推理，权重不在 state_dict 里。"""

    def __init__(self, weight: torch.Tensor, bias=None, rows: int = PAD_ROWS):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)  # rows：oneDNN 按预计的行数挑布局
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < PAD_ROWS and x.dtype == torch.bfloat16:  # 算 4 行与算 1 行读的是同样多的权重：补几行零，算完丢掉
            x4 = F.pad(x.reshape(rows, -1), (0, 0, 0, PAD_ROWS - rows))  # [4, in]
            return self.onednn(x4)[:rows].reshape(*x.shape[:-1], -1)
        return self.onednn(x)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def to_blocks(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] → [⌈out/32⌉, in, 32]：第 b 块是第 32b…32b+31 个输出的权重，按输入维连续存放。out 不是 32 的倍数时补零行。"""
    out, n_in = weight.shape
    if out % BLOCK:
        weight = F.pad(weight, (0, 0, 0, -out % BLOCK))
    return weight.view(-1, BLOCK, n_in).transpose(1, 2).contiguous()


def to_quads(q: torch.Tensor, kernel) -> torch.Tensor:
    """int8 的 [out, in] → [⌈out/32⌉, ⌈in/32⌉·8, 32, 4]：一块 32 个输出，输入 4 个一份，第 b 块第 p 份的 [j, t] 是第 32b + j 个
    输出、第 4p + t 个输入（matvec.cpp 的 Int8：一条 vpdpbusd 乘一份里 16 个输出的 4 个输入）。补的输出与输入是 0。
    放在 kernel 的 Arena 里（arena.py：与别的矩阵一个挨一个，在大页上）。"""
    out, n_in = q.shape
    q = F.pad(q, (0, -n_in % QGROUP, 0, -out % BLOCK))
    quads = kernel.arena.empty((q.shape[0] // BLOCK, q.shape[1] // 4, BLOCK, 4), q.dtype)
    return quads.copy_(q.view(-1, BLOCK, q.shape[1] // 4, 4).transpose(1, 2))


def from_blocks(blocks: torch.Tensor, out: int, n_in: int | None = None) -> torch.Tensor:
    """to_blocks 的逆，复制一份：[⌈out/32⌉, in, 32] → [out, in]。复制成转置的 [in, out]（每块的 32 个数原样搬过去，
    比逐个转置快），返回它的转置视图：F.linear 收到的就是 [in, out] 按行存放的普通矩阵乘法。
    几个输入一份的 [B, P, 32, r]（Kernel.to_blocks 的 pairs，r = 2；int8 的 to_quads，r = 4）也是一次复制：第 rp + t 个
    输入、第 32b + j 个输出是 blocks[b, p, j, t]，排成 [P, r, B, 32] 就是 [in, out]，再去掉补的输入（n_in）。"""
    if blocks.dim() == 4:
        return blocks.permute(1, 3, 0, 2).reshape(-1, blocks.shape[0] * BLOCK)[:n_in, :out].t()
    return blocks.permute(1, 0, 2).reshape(blocks.shape[1], -1)[:, :out].t()


def unpair(blocks: torch.Tensor, n_in: int) -> torch.Tensor:
    """[B, ⌈in/2⌉, 32, 2] → [B, in, 32]：一对里前一个是第 2p 个输入、后一个是第 2p+1 个。"""
    return blocks.transpose(2, 3).reshape(blocks.shape[0], -1, BLOCK)[:, :n_in]


def matvec_blocks(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] 乘分块布局的权重 blocks [B, in, 32] → [M, B·32]：y[m, 32b + j] = Σ_i x[m, i] · blocks[b, i, j]（int8、int4 的
    输入也量化，见 int_reference）。这是它的定义，写成 PyTorch 给人读、给测试对照；真正用的是 matvec.cpp 里同一个公式的
    C++ 循环（torch.ops.qwen_fast.matvec，见 kernel.py）。"""
    if blocks.dtype in (torch.int8, torch.uint8):
        return int_reference(x, blocks, scales)
    if blocks.dim() == 4:
        blocks = unpair(blocks, x.shape[1])
    y = torch.einsum("mi,bij->mbj", x.float(), blocks.float())  # [M, B, 32]
    return y.flatten(1).to(x.dtype)


def int4_codes(q: torch.Tensor) -> torch.Tensor:
    """int4 的块 q [B, 8G, 64] uint8 → 整数 q [B, 32G, 32]（−8…7；G 组、32G 是补齐的输入维）。一份 64 个字节是一块的
    4 个输入：第 4j + t 个字节的低 4 位是第 j 个输出、第 t 个输入，高 4 位是第 j + 16 个输出（存的是 q + 8）。"""
    B, P, _ = q.shape
    lo, hi = (q & 15).view(B, P, 16, 4), (q >> 4).view(B, P, 16, 4)  # [B, 份, 输出 j, 输入 t]
    w = torch.cat([lo, hi], dim=2).transpose(2, 3).reshape(B, 4 * P, 32)  # [B, 输入, 32 个输出]
    return w.to(torch.int32) - 8


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, n_in: int) -> torch.Tensor:
    """int4 的块 → float32 的块 [B, in, 32]：w = q · s（scales [B, ⌈in/32⌉, 32] float16，每 32 个输入一个）。"""
    return (int4_codes(q).float() * scales.float().repeat_interleave(QGROUP, dim=1))[:, :n_in]


def int_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8、int4 的 matvec 的定义（matvec.cpp 的 matvec_int 是它的 C++ 循环）：x 每 32 个输入一组量化成 int8，
    dx = max|x| / 127，xq = round(x / dx)；每组的整数和 Σ q·xq 乘 dx（int4 还乘这一组的比例），各组相加；int8 最后乘
    每个输出的比例。q：int8 的 to_quads 块 [B, 8G, 32, 4]（scales [B, 32]），或 int4 的块 [B, 8G, 64] uint8。"""
    M, n_in = x.shape
    G = q.shape[1] // 8
    xg = F.pad(x.float(), (0, G * QGROUP - n_in)).view(M, G, QGROUP)
    dx = xg.abs().amax(-1, keepdim=True) / 127  # [M, G, 1]
    xq = torch.where(dx == 0, 0, torch.round(xg / dx))
    codes = q.transpose(2, 3) if q.dtype == torch.int8 else int4_codes(q)  # [B, 8G, 4, 32] 或 [B, 32G, 32]
    codes = codes.reshape(q.shape[0], G, QGROUP, BLOCK).double()  # [B, G, 32 个输入, 32 个输出]
    dots = torch.einsum("mgi,bgij->mbgj", xq.double(), codes) * dx.double()[:, None]  # 每组的整数和（double 里是精确的）乘 dx
    if q.dtype == torch.int8:
        y = dots.sum(2) * scales.double()
    else:
        y = (dots * scales.double()[None]).sum(2)  # [M, B, 32]
    return y.flatten(1).to(x.dtype)


def load_matvec(cxx: str | None = None):
    """加载（第一次在这台机器上先编译，之后从缓存读）C++ 的 matvec，返回 kernel.Kernel；BlockedLinear 有它才用分块布局。
    cxx：C++ 编译器，默认 find_compiler() 找到的那个。失败时 RuntimeError 说明原因与办法。"""
    try:
        return kernels.load_kernel(cxx or find_compiler())
    except Exception as e:
        raise RuntimeError(
            f"分块布局（layout=\"blocked\" 或 \"graphs\"）要用这台机器的 C++ 编译器（g++ 或 clang）编译 qwen/fast/matvec.cpp "
            f"并加载，但失败了：{type(e).__name__}: {str(e)[:300]}。layout=\"packed\" 就用 oneDNN 打包的布局。"
        ) from None


def find_compiler() -> str | None:
    """这台机器的 C++ 编译器的完整路径（环境变量 CXX，否则 g++、c++、clang++ 里先找到的）；没有时 None。
    不问 inductor：导入它很慢，而默认路径根本用不到它。"""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def can_compile() -> bool:
    """qwen.fast.load 默认（layout="auto"）用不用分块布局：这台机器有 C++ 编译器、编得出并加载得了内核才用（第一次编译，
    之后从缓存加载）。编不了时在标准错误上说一次什么失败了、退回什么（warnings，每个进程一次），并把失败按要编的
    东西记在 record_file("compiler.json") 里——键是内核文件名里的指纹（源码、编译器、CPU、编译选项），之后加载不再试；
    源码（比如装上了缺的文件）、编译器或 CPU 换了，键就对不上，重新试一次。"""
    cxx = find_compiler()
    if cxx is None:
        return fall_back("这台机器没有 C++ 编译器（g++、c++、clang++，或环境变量 CXX）")
    try:
        key = kernels.kernel_file(cxx).name
    except OSError as e:  # 内核的源码不在（装得不完整）
        return fall_back(f"读不了内核的源码：{e}")
    recorded = read_record("compiler.json", key)
    if isinstance(recorded, str):
        return fall_back(f"{recorded}（记在 {record_file('compiler.json')}，删掉它就重新试）")
    try:
        load_matvec(cxx)
        return True
    except RuntimeError as e:
        write_record("compiler.json", key, str(e))
        return fall_back(str(e))


def fall_back(reason: str) -> bool:
    """默认路径用不了 C++ 内核：说一次为什么、代价是什么，返回 False（用 oneDNN 打包的布局）。"""
    warnings.warn(f"qwen：用不了 C++ 内核，退回 oneDNN 打包的布局——解码更慢，int8 量化与服务时共用读权重都没有了"
                  f"（见 docs/performance.md）。原因：{reason}", RuntimeWarning, stacklevel=3)
    return False


def quantize_int8(weight, kernel, rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """对称的逐输出通道 int8：W ≈ q · s，s = max|W 的这一行| / 127（全零的行取个极小值，q 还是 0），
    q = round(W / s) → (q [out, in] int8, s [out] float32)。算的是 kernel（matvec.cpp）里同一个公式的 C++ 循环；
    每次只读 rows 行：权重可以是还在文件里的 FileRows，内存里不必有整个 bfloat16 的输出头。"""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0])
    for i in range(0, weight.shape[0], rows):
        q[i : i + rows], scale[i : i + rows] = kernel.quantize_int8(weight[i : i + rows].detach())
    return q, scale


def quantize_int4(parts, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """对称的 int4，每个输出每 32 个输入一组（像 llama.cpp 的 Q4_0）：m 是这一组里绝对值最大的那个权重（带符号），
    s = float16(m / −8)，q = clamp(round(w / s), −8, 7)——m 自己正好是 −8，16 个值都用上。几个 [out_i, in] 的矩阵
    （parts，上下拼起来）→ 分块的 (q [B, 8·⌈in/32⌉, 64] uint8，一个字节两个权重，见 int4_codes；
    scales [B, ⌈in/32⌉, 32] float16)。乘的时候输入也每 32 个一组量化成 int8，整数点积（int_reference）。
    每个权重 4 位、每 32 个另有 16 位的比例：4.5 位，是 bfloat16 的 28%。算的是 kernel（matvec.cpp）里的 C++ 循环，
    每次只读几千行（parts 可以是还在文件里的 FileRows）。"""
    return kernel.quantize_int4(parts)


class BlockedLinear(nn.Module):
    """分块布局的矩阵（to_blocks），不超过 kernel_rows 行输入时用 kernel（load_matvec() 给的 C++ 算子）乘。
    weight 可以是几个读同一输入的矩阵（上下拼起来），换布局时顺便转成 dtype（C++ 的 to_blocks 一遍完成）。
    quantize="int8"：权重存成 int8 的块加每个输出一个 float32 比例（quantize_int8），字节数是 bfloat16 的一半；
    quantize="int4"：4 位的块加每 32 个输入一个 float16 比例（quantize_int4），是 bfloat16 的 28%。"""

    def __init__(self, weight, kernel, bias=None, quantize: str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        parts = list(weight) if isinstance(weight, (list, tuple)) else [weight]
        self.out_features, self.in_features = sum(p.shape[0] for p in parts), parts[0].shape[1]
        self.dtype = dtype or parts[0].dtype
        if quantize == "int4":
            self.blocks, self.scales = quantize_int4(parts, kernel)
        elif quantize == "int8":
            q, scale = quantize_int8(parts[0] if len(parts) == 1 else torch.cat([p.detach() for p in parts]), kernel)
            self.blocks, self.scales = to_quads(q, kernel), F.pad(scale, (0, -len(scale) % BLOCK), value=1.0).view(-1, BLOCK)
        else:  # [B, in, 32]。float32 的模型、bfloat16 的检查点：块仍存 bfloat16（转成 float32 是精确的，内核读时才转），
            # 结果与存 float32 逐位相同，读的字节少一半
            # bfloat16 的模型、CPU 有 AVX-512 BF16：两个输入一对存放，vdpbf16ps 乘（输入本来就是 bfloat16）
            exact = self.dtype == torch.float32 and all(p.dtype == torch.bfloat16 for p in parts)
            pairs = self.dtype == torch.bfloat16 and kernel.pairs is not None
            self.blocks = kernel.to_blocks([p.detach() for p in parts], torch.bfloat16 if exact else self.dtype, pairs)
            self.scales = None
        self.kernel, self.bias = kernel, bias
        # 多于 KERNEL_ROWS 行时拼回普通布局交给 F.linear。两种情形总用 C++ 的（见 docs/performance.md）：CPU 没有 bfloat16
        # 指令时 oneDNN 不接手，PyTorch 自带的 bfloat16 矩阵乘法比 C++ 的 matvec 慢得多；块的 dtype 与模型的不同
        # （float32 的模型、bfloat16 或 int8 的块）时每次拼回都要把整个矩阵转一遍 dtype，这一遍抵掉了 F.linear 省下的
        # 一对一对的 bfloat16 也总用 C++ 的：vdpbf16ps 的内核几百行时与 oneDNN 一样快、几十行时更快，还省了拼回的那一遍
        # （数字见 docs/performance.md）；预填充的每一行因此与单独解码它时逐位相同
        fast_gemm = self.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
        plain = self.blocks.dtype == self.dtype and self.blocks.dim() == 3
        self.kernel_rows = KERNEL_ROWS if fast_gemm and plain else float("inf")

    def dense(self) -> torch.Tensor:
        """拼回普通布局 [out, in]（int8 的乘回比例，int4 的反量化），长的预填充交给 F.linear。"""
        if self.blocks.dtype == torch.uint8:
            return from_blocks(dequantize_int4(self.blocks, self.scales, self.in_features), self.out_features).to(self.dtype)
        w = from_blocks(self.blocks, self.out_features, self.in_features)
        return w.to(self.dtype) if self.scales is None else (w * self.scales.flatten()[: self.out_features, None]).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [M, in]
        M = x2.shape[0]
        if M > KERNEL_ROWS and self.amx_rows(x2):  # 预填充、CPU 有 AMX：直接乘分块布局（amx.cpp），不拼回（int8、int4 也是）
            y = self.kernel.gemm(x2, self.blocks, self.scales)[:, : self.out_features]
            return (y if self.bias is None else y + self.bias).reshape(*x.shape[:-1], -1)
        if M > self.kernel_rows:  # 预填充：拼回普通布局交给 F.linear（每次多一份复制）
            return F.linear(x2, self.dense(), self.bias).reshape(*x.shape[:-1], -1)
        return self.matvec(x)

    def amx_rows(self, x2: torch.Tensor) -> bool:
        """长的预填充能不能在 AMX 上乘：内核试过块指令能跑、输入是 bfloat16、个数是 32 的倍数，矩阵是一对一对存放的
        bfloat16、int8 或 int4。"""
        kind = self.blocks.dim() == 4 or self.blocks.dtype in (torch.int8, torch.uint8)
        return self.kernel.amx and kind and self.in_features % 32 == 0 and x2.dtype == torch.bfloat16

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """不论几行都用 C++ 的 matvec 乘：每一行的结果与同时乘几行无关（拼起来的几个请求的行要这样，见 share.py）。
        整步编译的图里用注册的算子；图外问这个线程和谁一起算（share.py 的 current：默认自己调用 kernel，服务时输出头、
        草稿头的 fc 这些层外的矩阵与别的请求拼行）。"""
        x2 = x.reshape(-1, x.shape[-1])
        if torch.compiler.is_compiling():
            y = torch.ops.qwen_fast.matvec(x2, self.blocks, self.scales)
        else:
            y = current().matvec(self.kernel, x2, self.blocks, self.scales)
        y = y[:, : self.out_features]  # 去掉补的零列
        return (y if self.bias is None else y + self.bias).reshape(*x.shape[:-1], -1)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """几行输入（起草时通常一行）乘普通布局的权重 [out, in]。CPU 上 bfloat16 的 F.linear 走 oneDNN，每次先重排一遍权重；
    torch.mv 走 PyTorch 自带的 gemv，不重排。不去开关 oneDNN：那是进程级的标志，几个请求同时用模型时会互相影响。"""
    if x.dtype != torch.bfloat16 or x.is_cuda:
        return F.linear(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.stack([torch.mv(weight, r) for r in rows])  # [M, out]
    return out.view(*x.shape[:-1], weight.shape[0])


def can_pack(weight: torch.Tensor) -> bool:
    """这台机器、这个 dtype 能不能打包：只在 CPU 上，且 oneDNN 支持该 dtype。"""
    if weight.device.type not in ("cpu", "meta") or not torch.backends.mkldnn.is_available():  # meta：还在文件里
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def fast_linear(linears, kernel=None, quantize: str | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """几个读同一输入的 nn.Linear（一个也行）的权重上下拼成一个，换成分块布局（给了 kernel；quantize="int8" 时存成
    int8）或打包的布局。dtype：分块布局的权重转成它（权重可以还是检查点文件里的 dtype）。"""
    def cat(ts):
        return ts[0].detach() if len(ts) == 1 else torch.cat([t.detach() for t in ts])  # 一个时不复制（输出头有 0.5 GB）

    bias = None if linears[0].bias is None else cat([m.bias.float() for m in linears])
    if kernel is None:
        return PackedLinear(cat([m.weight for m in linears]), bias)
    return BlockedLinear([m.weight for m in linears], kernel, bias, quantize, dtype)
