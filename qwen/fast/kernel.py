"""附录 · 手写的 C++ 内核：分块布局的矩阵乘几行输入（matvec.cpp）、DeltaNet 层解码一个位置（deltanet.cpp）、
RMSNorm（norm.cpp），编译一次，用 ctypes 调用。

解码的矩阵乘法只有 1～5 行输入，时间都花在读权重上；matvec.cpp 是一个几十行的循环，逐块顺序读权重、乘加进每行的
累加器，每一行的求和顺序固定（验证的行与解码的行逐位相同，第 14 章）。它不包含 torch 的头文件，编译很快；
Kernel 用 ctypes 把张量的数据指针交给它（调用时放开 GIL）。整步编译的图（step.py）里它是算子 torch.ops.qwen_fast.matvec
（register_ops：图把它当外部调用）。加载权重时换布局、量化成 int8 或 int4 也在这里（to_blocks、quantize_int8、
quantize_int4），一遍读完。
deltanet.cpp 把 DeltaNet 层解码时的二三十个小运算合成一次调用（layers.py 的 FastDeltaNet.step），norm.cpp 把 RMSNorm 的
五六个小运算合成一次（FastRMSNorm），也都放开 GIL。

第一次用时拿这台机器的 C++ 编译器（linear.py 的 find_compiler）编译它，.so 存在 $XDG_CACHE_HOME/qwen/kernels/ 下，
文件名里是源码、编译器与 CPU 的指纹：换了其中任何一个就是另一个文件名，别的机器写下的文件从不加载（-march=native
编出的代码换一种 CPU 可能跑不了）。先写到临时文件再改名，几个进程同时编译也不会读到半个文件；坏的文件重新编译。
像 llama.cpp 的 CPU 后端一样：模型的图是一回事，读权重的内核是另一回事。
"""

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from .arena import Arena
from .records import read_record, record_file, write_record
from .sizes import BLOCK, QGROUP

SOURCES = [Path(__file__).with_name(f) for f in ("matvec.cpp", "deltanet.cpp", "norm.cpp", "amx.cpp", "attention.cpp",
                                                 "layer.cpp")]  # 编进同一个 .so
HEADERS = [Path(__file__).with_name("simd.h")]  # 几个源文件共用的向量小工具（改了它也要重新编译）
# 各自编成 .o、同时编译的几份：matvec.cpp 最大，分成浮点与整数两半各编一遍（QWEN_PART），两个核都用上
UNITS = [(SOURCES[0], ["-DQWEN_PART=1"]), (SOURCES[0], ["-DQWEN_PART=2"]), *((src, []) for src in SOURCES[1:])]
# 块的宽度与量化的组长由这里交给 C++（sizes.py 是唯一的出处）
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
         f"-DQWEN_BLOCK={BLOCK}", f"-DQWEN_QGROUP={QGROUP}"]
NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "i8"}  # 入口名字里的 dtype


def cpu_fingerprint() -> str:
    """CPU 的型号与指令集（Linux 读 /proc/cpuinfo；别处用 platform 给的）。"""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def kernel_file(cxx: str, flags=FLAGS) -> Path:
    """这台机器、这个编译器用 flags 编译 SOURCES 得到的 .so 该在哪儿。"""
    key = "\n".join([*(s.read_text() for s in SOURCES + HEADERS), cxx, str(os.stat(cxx).st_mtime_ns), cpu_fingerprint(), " ".join(flags)])
    return record_file("kernels") / f"matvec-{hashlib.sha256(key.encode()).hexdigest()[:20]}.so"


def build(cxx: str, out: Path, flags=FLAGS) -> None:
    """用 cxx（与 flags）把 SOURCES 编译成 out（先写临时文件，编好了再改名）。失败时 RuntimeError 带上编译器的报错。
    UNITS 的几份同时编译（各编成 .o，再链接；matvec.cpp 分两半编）。"""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    objs = [f"{tmp}.{i}.o" for i in range(len(UNITS))]
    try:
        jobs = [subprocess.Popen([cxx, "-c", str(src), "-o", obj, *flags, *extra], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True) for (src, extra), obj in zip(UNITS, objs)]
        errors = [(src, job.communicate()[1]) for (src, _), job in zip(UNITS, jobs)]  # 等每一个编完
        failed = [f"{src.name}：{err.strip()[-600:]}" for (src, err), job in zip(errors, jobs) if job.returncode != 0]
        if not failed:
            done = subprocess.run([cxx, *objs, "-o", tmp, *flags], capture_output=True, text=True)
            failed = [] if done.returncode == 0 else [f"链接：{done.stderr.strip()[-600:]}"]
        if failed:
            raise RuntimeError(f"编译 {'、'.join(s.name for s in SOURCES)} 失败：{'；'.join(failed)}")
        os.replace(tmp, out)
    finally:
        for f in [tmp, *objs]:
            if os.path.exists(f):
                os.remove(f)


def load_or_build(out: Path, cxx: str, flags=FLAGS) -> ctypes.CDLL:
    """加载 out；没有这个文件、或它坏了（加载时 OSError）就用 cxx 重新编译一次再加载。编译或加载失败时报错。"""
    try:
        return ctypes.CDLL(str(out))
    except OSError:
        build(cxx, out, flags)
        return ctypes.CDLL(str(out))


PTR, I64 = ctypes.c_void_p, ctypes.c_int64
ENTRIES = {  # matvec.cpp 的入口 → 参数类型（名字里是源与结果的 dtype）
    **{f"matvec_{t}": [PTR, I64, I64, I64, PTR, PTR, PTR, I64, I64] for t in ("f32", "bf16", "i8", "q4")},
    **{f"to_blocks_{s}_{d}": [PTR, I64, I64, I64, PTR] for s in ("f32", "bf16") for d in ("f32", "bf16")},
    **{f"quantize_int8_{t}": [PTR, I64, I64, PTR, PTR] for t in ("f32", "bf16")},
    **{f"quantize_int4_{t}": [PTR, I64, I64, I64, PTR, PTR] for t in ("f32", "bf16")},
    **{f"to_pairs_{t}": [PTR, I64, I64, I64, PTR] for t in ("f32", "bf16")},
    "rms_norm": [PTR, I64, I64, PTR, ctypes.c_float, PTR],
    "gemm_pairs_amx": [PTR, I64, I64, PTR, I64, PTR],
    "gemm_i8_amx": [PTR, I64, I64, PTR, PTR, I64, PTR],
    "gemm_q4_amx": [PTR, I64, I64, PTR, PTR, I64, PTR],
    "deltanet_step": [PTR, PTR, I64, I64, I64, I64, PTR, PTR, PTR, PTR, PTR],
    "causal_conv": [PTR, I64, I64, I64, I64, PTR, PTR, PTR, I64, I64, I64],
    "delta_chunks": [PTR, PTR, I64, I64, I64, I64, I64, PTR, PTR, PTR, PTR, I64, PTR],
    "mlp_block": [PTR, PTR, PTR, I64],
    "act_rows": [PTR, I64, I64, I64, PTR],
    "attention_prefill": [PTR, I64, I64, I64, I64, PTR, PTR, I64, I64, I64, PTR],
    "delta_layer": [PTR, PTR, PTR, I64, I64, PTR, PTR, PTR, PTR, PTR],
    "attention_layer": [PTR, PTR, PTR, I64, I64, PTR, PTR, I64, I64, PTR, PTR, I64, I64],
    "attention_step": [PTR, PTR, I64, I64, I64, I64, PTR, PTR, I64, I64, PTR, PTR, I64, I64, PTR],
}


class Lin(ctypes.Structure):
    """layer.cpp 的 Lin：一个分块布局的矩阵。kind：0 float32 块、1 bfloat16 块、2 一对一对的 bfloat16、3 int8、4 int4。"""
    _fields_ = [("kind", I64), ("blocks", I64), ("n_in", I64), ("n_out", I64), ("w", PTR), ("s", PTR)]


class DeltaNetParams(ctypes.Structure):
    """deltanet.cpp 的 DeltaNet：一个 DeltaNet 层的四个常量（指针：卷积核 [K, C]、−exp(A_log)、dt_bias、门控 RMSNorm 的
    权重）、门控 RMSNorm 的 eps 与形状（layers.py 的 speed_up_layer 填一次）。"""
    _fields_ = [("conv_w", PTR), ("neg_A", PTR), ("dt_bias", PTR), ("norm_w", PTR), ("eps", ctypes.c_float),
                ("Hk", I64), ("Hv", I64), ("Dk", I64), ("Dv", I64), ("K", I64)]


class AttentionParams(ctypes.Structure):
    """attention.cpp 的 Attention：一个注意力层的 q_norm、k_norm 的 1 + w（指针）与 eps、查询头、键值头、头的维数
    （H = 0：这一层不走 attention.cpp）。"""
    _fields_ = [("q_scale", PTR), ("k_scale", PTR), ("eps", ctypes.c_float), ("H", I64), ("Hkv", I64), ("D", I64)]


class MoeParams(ctypes.Structure):
    """layer.cpp 的 Moe：专家混合层的 E、top-k、专家的中间宽度，路由器（与共享专家的门拼成的 [E + 1, hidden]），E 个专家的
    gate_up 与 down（Lin 的数组：keep 留着它们，结构在，数组就在）。"""
    _fields_ = [("experts", I64), ("top_k", I64), ("inter", I64), ("router", Lin), ("gate_up", PTR), ("down", PTR)]


class LayerParams(ctypes.Structure):
    """layer.cpp 的 Layer：一个解码层的常量（layers.py 的 layer_params 填一次）。指针指向层里的张量：层在，它们就在。
    专家混合层：gate_up、down 是共享专家的，moe 指向 MoeParams；稠密的 MLP 是空指针。"""
    F32 = ctypes.c_float
    _fields_ = [("bf16", I64), ("hidden", I64), ("inter", I64), ("eps1", F32), ("eps2", F32),
                ("norm1", PTR), ("norm2", PTR), ("in_proj", Lin), ("out_proj", Lin), ("gate_up", Lin), ("down", Lin),
                ("delta", DeltaNetParams),
                ("attn", AttentionParams),
                ("moe", PTR)]


class Kernel:
    """编好的 matvec.cpp：三个函数，参数与结果都是张量。"""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        for name, args in ENTRIES.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
        # 有 AVX-512 BF16 的 CPU 上才编进去：bfloat16 的模型的矩阵按两个输入一对存放，一条 vdpbf16ps 乘加一对（matvec.cpp）
        self.pairs = getattr(lib, "matvec_pairs", None)
        if self.pairs is not None:
            self.pairs.argtypes, self.pairs.restype = [PTR, I64, I64, PTR, PTR, I64], None
        self.matvecs = {dtype: getattr(lib, f"matvec_{name}") for dtype, name in NAMES.items()}  # 按权重的 dtype
        self.matvecs[torch.uint8] = lib.matvec_q4  # int4：一个字节两个权重
        lib.matvec_width.restype = lib.matvec_fma.restype = lib.matvec_vnni.restype = ctypes.c_int
        self.width, self.fma = lib.matvec_width(), bool(lib.matvec_fma())  # 编出来的向量宽度（float32 个数）、有没有 FMA
        self.vnni = bool(lib.matvec_vnni())  # int4 的整数点积用不用 VNNI（vpdpbusd）
        self.amx = False  # 长的预填充用不用 AMX（amx.cpp）：load_kernel 试过块指令在这台机器上能跑才打开
        self.arena = Arena()  # 换好布局的矩阵一个挨一个地放在大页上（arena.py）：用这个 Kernel 加载的模型的权重

    @property
    def isa(self) -> str:
        """编进内核的向量指令：AVX-512（带 VNNI、BF16 时写上）、AVX2 VNNI、AVX2（8 宽、FMA）或 portable。"""
        name = "AVX-512" if self.width == 16 else "AVX2" if self.fma else "portable"
        return name + (" VNNI" if self.vnni else "") + (" BF16" if self.pairs is not None else "")

    def matvec(self, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] 乘分块布局的 blocks [B, in, 32]（int8 的是 to_quads 的 [B, in/4, 32, 4]、比例 scales [B, 32]；int4 的
        blocks 是 uint8、每个字节两个权重，scales [B, ⌈in/32⌉, 32] float16，见 linear.py 的 quantize_int4）→ [M, B·32]，
        dtype 同 x。"""
        if blocks.dtype == torch.bfloat16 and blocks.dim() == 4:  # 一对一对的 bfloat16（to_blocks 的 pairs）：输入也是 bfloat16
            return self.matvec_pairs(x, blocks)
        # 量化的块直接读 bfloat16 的输入（内核里量化它），别的读 float32；结果在内核里写成 bfloat16 或 float32
        x_bf16 = x.dtype == torch.bfloat16 and blocks.dtype in (torch.int8, torch.uint8)
        xin = x.contiguous() if x_bf16 else x.float().contiguous()
        y = torch.empty(x.shape[0], blocks.shape[0] * BLOCK, dtype=torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
        self.matvecs[blocks.dtype](xin.data_ptr(), x_bf16, x.shape[0], x.shape[1], blocks.data_ptr(),
                                   None if scales is None else scales.data_ptr(), y.data_ptr(), blocks.shape[0],
                                   y.dtype == torch.bfloat16)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def matvec_pairs(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """x [M, in] bfloat16 乘一对一对存放的 blocks [B, ⌈in/2⌉, 32, 2] → [M, B·32] bfloat16（vdpbf16ps）。"""
        if x.dtype != torch.bfloat16:
            raise TypeError(f"一对一对存放的 bfloat16 矩阵只乘 bfloat16 的输入（bfloat16 的模型），收到 {x.dtype}")
        xb = x.contiguous() if x.shape[1] % 2 == 0 else torch.nn.functional.pad(x, (0, 1))  # 奇数个输入：补一个 0
        y = torch.empty(x.shape[0], blocks.shape[0] * BLOCK, dtype=torch.bfloat16)
        self.pairs(xb.data_ptr(), x.shape[0], blocks.shape[1], blocks.data_ptr(), y.data_ptr(), blocks.shape[0])
        return y

    def gemm(self, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
        """长的预填充：x [M, in] bfloat16 乘分块布局的矩阵 → [M, B·32] bfloat16，在 AMX 上（amx.cpp）。blocks 是一对一对的
        bfloat16 [B, in/2, 32, 2]，int8（to_quads 的 [B, in/4, 32, 4]）带每个输出的比例 scales [B, 32]，或 int4（quantize_int4 的 uint8 块与
        float16 比例）：量化的一块一块地换成 bfloat16 再乘。
        in 要是 32 的倍数（调用方查）；行补到 32 的倍数再乘，多出的行丢掉。"""
        M = x.shape[0]
        xb = torch.nn.functional.pad(x.contiguous(), (0, 0, 0, -M % 32))
        y = torch.empty(xb.shape[0], blocks.shape[0] * BLOCK, dtype=torch.bfloat16)
        if blocks.dtype in (torch.int8, torch.uint8):
            gemm = self.lib.gemm_i8_amx if blocks.dtype == torch.int8 else self.lib.gemm_q4_amx
            gemm(xb.data_ptr(), xb.shape[0], xb.shape[1], blocks.data_ptr(), scales.data_ptr(), blocks.shape[0], y.data_ptr())
        else:
            self.lib.gemm_pairs_amx(xb.data_ptr(), xb.shape[0], xb.shape[1], blocks.data_ptr(), blocks.shape[0], y.data_ptr())
        return y[:M]

    def deltanet_step(self, params: DeltaNetParams, proj, conv, S, history: list | None = None):
        """DeltaNet 层 T 个相继的位置（deltanet.cpp）：params 是这一层的常量与形状，proj [B, T, P] float32（in_proj 的输出，
        最后一维连续），conv [B, K−1, C] 窗口，S [B, Hv, Dk, Dv] 就地更新成最后一个位置之后的；history：None，或 T−1 个
        与 S 同形状的张量，写进前 T−1 个位置各自之后的 S → (门控 RMSNorm 之后的输出 [B, T, Hv·Dv], 新窗口 [B, K−1, C])。"""
        B, T, _ = proj.shape
        out, window = torch.empty(B, T, params.Hv * params.Dv), torch.empty_like(conv)
        parts = None if history is None else (ctypes.c_void_p * max(T - 1, 1))(*(h.data_ptr() for h in history))
        self.lib.deltanet_step(ctypes.byref(params), proj.data_ptr(), proj.stride(0), proj.stride(1), B, T, conv.data_ptr(),
                               window.data_ptr(), S.data_ptr(), parts, out.data_ptr())
        return out, window

    def causal_conv(self, x: torch.Tensor, past: torch.Tensor, conv_w: torch.Tensor) -> torch.Tensor:
        """长的提示词的因果深度卷积 + SiLU（deltanet.cpp）：x [B, T, C] float32 或 bfloat16（最后一维连续，可以是 in_proj
        输出的一段），past [B, K−1, C] float32 窗口，conv_w [K, C] → [B, T, C] float32。"""
        B, T, C = x.shape
        if x.stride(-1) != 1 or x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float().contiguous()
        y = torch.empty(B, T, C)
        self.lib.causal_conv(x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), x.stride(1), T, past.data_ptr(),
                             conv_w.data_ptr(), y.data_ptr(), B, C, conv_w.shape[0])
        return y

    def delta_chunks(self, params: DeltaNetParams, proj, conv, beta, g, S, chunk: int) -> torch.Tensor:
        """长的提示词的 DeltaNet 层在 in_proj 与 out_proj 之间的一段（第 8 章的分块形式，deltanet.cpp）：proj [B, T, P] 是
        in_proj 的输出（float32 或 bfloat16，最后一维连续；qkv、z、b、a 依次排开），conv [B, K−1, C] float32 窗口，beta、g
        [B, T, Hv] float32，S [B, Hv, Dk, Dv] 就地更新 → 门控 RMSNorm 之后的输出 [B, T, Hv·Dv] float32。"""
        B, T, _ = proj.shape
        if proj.stride(-1) != 1 or proj.dtype not in (torch.float32, torch.bfloat16):
            proj = proj.float().contiguous()
        out = torch.empty(B, T, params.Hv * params.Dv)
        self.lib.delta_chunks(ctypes.byref(params), proj.data_ptr(), proj.dtype == torch.bfloat16, proj.stride(0), proj.stride(1),
                              B, T, conv.data_ptr(), beta.contiguous().data_ptr(), g.contiguous().data_ptr(), S.data_ptr(),
                              chunk, out.data_ptr())
        return out

    def attention_prefill(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, length: int) -> torch.Tensor:
        """长的提示词的注意力（attention.cpp，FlashAttention 的在线 softmax）：q [B, H, T, D] float32，缓存 k_buf、v_buf
        [B, Hkv, cap, D]（连续的 float32）的前 length 个位置（最后 T 个是这些查询自己）→ [B, T, H·D]（输出门之前）。"""
        B, H, T, D = q.shape
        q = q.contiguous()
        out = torch.empty(B, T, H * D)
        self.lib.attention_prefill(q.data_ptr(), B, H, T, D, k_buf.data_ptr(), v_buf.data_ptr(), k_buf.shape[1], k_buf.shape[2],
                                   length, out.data_ptr())
        return out

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU 的激活 silu(gate) · up（layer.cpp 的 act_rows，与 mlp_block 里的同一个）：gate_up [..., 2·inter]（bfloat16
        或 float32，gate 在前）→ [..., inter]，同 dtype。"""
        gu = gate_up.contiguous()
        inter = gu.shape[-1] // 2
        out = gu.new_empty(*gu.shape[:-1], inter)
        self.lib.act_rows(gu.data_ptr(), gu.dtype == torch.bfloat16, gu.numel() // gu.shape[-1], inter, out.data_ptr())
        return out

    def mlp_block(self, params: LayerParams, x: torch.Tensor) -> torch.Tensor:
        """一层的 MLP 那一半（layer.cpp）：x [..., hidden] float32 → x + down(act(gate_up(norm(x))))，每行各算各的。"""
        x = x.contiguous()
        out = torch.empty_like(x)
        self.lib.mlp_block(ctypes.byref(params), x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1])
        return out

    def delta_layer(self, params: LayerParams, x, conv, S, history: list | None, proj: torch.Tensor | None):
        """DeltaNet 层的一整层（layer.cpp）：x [B, T, hidden] float32，conv、S、history 同 deltanet_step；proj：None，或
        [B, T, in_proj 的输出] float32，写下 in_proj 的输出 → (这一层的输出 [B, T, hidden], 新窗口 [B, K−1, C])。"""
        (B, T, _), x = x.shape, x.contiguous()
        out, window = torch.empty_like(x), torch.empty_like(conv)
        parts = None if history is None else (ctypes.c_void_p * max(T - 1, 1))(*(h.data_ptr() for h in history))
        self.lib.delta_layer(ctypes.byref(params), x.data_ptr(), out.data_ptr(), B, T, conv.data_ptr(), window.data_ptr(),
                             S.data_ptr(), parts, None if proj is None else proj.data_ptr())
        return out, window

    def attention_layer(self, params: LayerParams, x, cos, sin, state) -> torch.Tensor:
        """注意力层的一整层（layer.cpp）：x [B, T, hidden] float32，cos、sin [T, rot] 或 [B, T, rot]，state 是这一层的
        AttentionState（缓冲区已留够位置，这 T 个写在 state.length 之后）→ 这一层的输出。"""
        (B, T, _), x = x.shape, x.contiguous()
        out, (cos, sin) = torch.empty_like(x), (t.float().contiguous() for t in (cos, sin))
        self.lib.attention_layer(ctypes.byref(params), x.data_ptr(), out.data_ptr(), B, T, cos.data_ptr(), sin.data_ptr(),
                                 T * cos.shape[-1] if cos.dim() == 3 else 0, cos.shape[-1], state.k_buf.data_ptr(),
                                 state.v_buf.data_ptr(), state.k_buf.shape[2], state.length)
        return out

    def attention_step(self, params: LayerParams, qkv, cos, sin, state) -> torch.Tensor:
        """注意力层投影之后、o_proj 之前的一段（attention.cpp）：qkv [B, T, ·]（模型的 dtype，最后一维连续），其余同
        attention_layer → 乘过输出门的结果 [B, T, H·D] float32。"""
        B, T, _ = qkv.shape
        qkv = qkv if qkv.stride(-1) == 1 and qkv.stride(0) == T * qkv.stride(1) else qkv.contiguous()
        a = params.attn
        out, (cos, sin) = torch.empty(B, T, a.H * a.D), (t.float().contiguous() for t in (cos, sin))
        self.lib.attention_step(ctypes.byref(a), qkv.data_ptr(), qkv.dtype == torch.bfloat16, qkv.stride(1), B, T,
                                cos.data_ptr(), sin.data_ptr(), T * cos.shape[-1] if cos.dim() == 3 else 0, cos.shape[-1],
                                state.k_buf.data_ptr(), state.v_buf.data_ptr(), state.k_buf.shape[2], state.length,
                                out.data_ptr())
        return out

    def rms_norm(self, x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., D] → float32 的 x / sqrt(mean(x²) + eps) · scale（norm.cpp），每行各算各的。"""
        xf = x.float().contiguous()
        y = torch.empty_like(xf)
        self.lib.rms_norm(xf.data_ptr(), xf.numel() // xf.shape[-1], xf.shape[-1], scale.data_ptr(), eps, y.data_ptr())
        return y

    def to_blocks(self, parts: list[torch.Tensor], dtype: torch.dtype, pairs: bool = False) -> torch.Tensor:
        """几个 [out_i, in] 的矩阵上下拼起来 → 分块布局 [⌈Σ out_i / 32⌉, in, 32]，dtype（float32 或 bfloat16），补零行。
        pairs：bfloat16 两个输入一对 [⌈Σ out_i / 32⌉, ⌈in/2⌉, 32, 2]（matvec_pairs 用；奇数个输入时补一个 0）。"""
        rows, n_in = sum(p.shape[0] for p in parts), parts[0].shape[1]
        B = -(-rows // BLOCK)
        shape = (B, -(-n_in // 2), BLOCK, 2) if pairs else (B, n_in, BLOCK)
        out = self.arena.empty(shape, torch.bfloat16 if pairs else dtype)
        out[-1, :, rows % BLOCK or BLOCK :] = 0  # 最后一块补的零行
        if pairs and n_in % 2:
            out[:, -1, :, 1] = 0
        row0 = 0
        for p in parts:
            src = readable(p)
            name = f"to_pairs_{NAMES[src.dtype]}" if pairs else f"to_blocks_{NAMES[src.dtype]}_{NAMES[dtype]}"
            getattr(self.lib, name)(src.data_ptr(), p.shape[0], n_in, row0, out.data_ptr())
            row0 += p.shape[0]
        return out

    def quantize_int4(self, parts, rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
        """几个 [out_i, in] 的矩阵（上下拼起来）→ 对称的 int4，每个输出每 32 个输入一个 float16 的比例：
        (q [⌈Σ out_i / 32⌉, 8·⌈in/32⌉, 64] uint8，scales [⌈Σ out_i / 32⌉, ⌈in/32⌉, 32] float16)，公式与布局见 linear.py 的
        quantize_int4。每次只读 rows 行：矩阵可以是还在文件里的 FileRows。"""
        total, n_in = sum(p.shape[0] for p in parts), parts[0].shape[1]
        B, groups = -(-total // BLOCK), -(-n_in // QGROUP)
        q = self.arena.empty((B, groups * QGROUP // 4, 2 * BLOCK), torch.uint8).fill_(0x88)  # 补的行与输入：q = 0
        scales = self.arena.empty((B, groups, BLOCK), torch.float16).zero_()
        row0 = 0
        for p in parts:
            for i in range(0, p.shape[0], rows):
                src = readable(p[i : i + rows].detach())
                getattr(self.lib, f"quantize_int4_{NAMES[src.dtype]}")(src.data_ptr(), src.shape[0], n_in, row0,
                                                                        q.data_ptr(), scales.data_ptr())
                row0 += src.shape[0]
        return q, scales

    def quantize_int8(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """对称的逐行 int8：(q [n, in] int8，s [n] float32)，公式见 linear.py 的 quantize_int8。"""
        src = readable(w)
        q, scale = torch.empty(w.shape, dtype=torch.int8), torch.empty(w.shape[0])
        getattr(self.lib, f"quantize_int8_{NAMES[src.dtype]}")(src.data_ptr(), w.shape[0], w.shape[1], q.data_ptr(),
                                                                scale.data_ptr())
        return q, scale


def readable(t: torch.Tensor) -> torch.Tensor:
    """内核读得了的样子：连续存放，float32 或 bfloat16（别的浮点 dtype，比如 float16，先转成 float32）。"""
    return t.contiguous() if t.dtype in (torch.float32, torch.bfloat16) else t.float().contiguous()


OPS = []  # register_ops 注册的算子库：对象留着，注册才留着（一个进程只注册一次）


def register_ops(kernel: Kernel) -> None:
    """把 kernel.matvec 注册成 torch.ops.qwen_fast.matvec，整步编译的图里用（图外直接调用 kernel.matvec，少一层分派）。"""
    if OPS:
        return
    lib = torch.library.Library("qwen_fast", "FRAGMENT")
    lib.define("matvec(Tensor x, Tensor blocks, Tensor? scales) -> Tensor")
    lib.impl("matvec", kernel.matvec, "CPU")
    torch.library.register_fake("qwen_fast::matvec", lib=lib)(fake_matvec)
    OPS.append(lib)


def fake_matvec(x, blocks, scales):
    """torch.compile 追踪整步的图时只需要输出的形状与 dtype。"""
    return x.new_empty(x.shape[0], blocks.shape[0] * BLOCK)


# 测试用：在这台机器上把内核编成更窄的向量（-march=native 给的是最宽的那种）。FMA 的几种宽度逐位相同。
# AVX2 VNNI（Alder Lake 一类：int4 的点积是 256 位的 vpdpbusd）只在有 AVX-VNNI 的机器上编得出来
NARROWER = {"AVX-512": ["-mno-avx512vnni", "-mno-avx512bf16"], "AVX2 VNNI": ["-mno-avx512f"],
            "AVX2": ["-mno-avx512f", "-mno-avxvnni"], "portable": ["-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-avxvnni"]}


def load_kernel(cxx: str, flags=FLAGS) -> Kernel:
    """加载这台机器编好的 matvec.cpp（没有就先编译），注册算子，返回 Kernel。缓存的文件夹用不了（只读的、或 XDG_CACHE_HOME
    是个文件）时编进临时文件夹里自己的那个（fallback_file），说一次（每个进程一个 RuntimeWarning）：照样用 C++ 内核。
    AMX 的试探用的是真的加载了的那个文件。"""
    out = kernel_file(cxx, flags)
    try:
        lib = load_or_build(out, cxx, flags)
    except OSError as e:  # 说一次（每个进程）：缓存在哪儿、为什么用不了、这次用的是什么
        fallback = fallback_file(out)
        warnings.warn(f"qwen：C++ 内核的缓存 {out.parent} 用不了（{e.strerror or e}）：编进 {fallback.parent}（临时文件夹，会被清掉），"
                      "照样用 C++ 内核；让 XDG_CACHE_HOME 指向一个能写的文件夹就能长久留下它", RuntimeWarning, stacklevel=2)
        out, lib = fallback, load_or_build(fallback, cxx, flags)
    kernel = Kernel(lib)
    kernel.amx = amx_usable(lib, out)
    register_ops(kernel)
    return kernel


def fallback_file(out: Path) -> Path:
    """缓存用不了时编到哪儿：临时文件夹里只有自己能写的 qwen-kernels-<uid>（这个进程之后几次加载、之后的进程都接着用，只编
    一次）；它是别人建的、或别人也能写（能换掉 .so）时，用一个新的私有临时文件夹。"""
    uid = os.getuid()  # Linux、macOS：C++ 内核本来就只在这些系统上编
    folder = Path(tempfile.gettempdir()) / f"qwen-kernels-{uid}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.stat()
        if info.st_uid == uid and not info.st_mode & 0o022:
            return folder / out.name
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="qwen-kernel-")) / out.name


# 子进程里试一次 AMX：只用标准库（不导入 torch，启动得快），32 × 64 的整数小矩阵，结果必须分毫不差
AMX_PROBE = """
import ctypes, struct, sys
lib = ctypes.CDLL(sys.argv[1])
if not lib.amx_enable():
    sys.exit(3)
M, K = 32, 64
bf = lambda v: struct.unpack('<I', struct.pack('<f', v))[0] >> 16
xs = [(m + 3 * k) % 5 - 2 for m in range(M) for k in range(K)]
ws = [(p + 2 * j + r) % 3 - 1 for p in range(K // 2) for j in range(32) for r in range(2)]
x = (ctypes.c_uint16 * len(xs))(*map(bf, xs))
w = (ctypes.c_uint16 * len(ws))(*map(bf, ws))
y = (ctypes.c_uint16 * (M * 32))()
lib.gemm_pairs_amx(x, ctypes.c_int64(M), ctypes.c_int64(K), w, ctypes.c_int64(1), y)
want = [sum(xs[m * K + k] * ws[(k // 2) * 64 + j * 2 + k % 2] for k in range(K)) for m in range(M) for j in range(32)]
sys.exit(0 if [bf(v) for v in want] == list(y) else 4)
"""


def amx_usable(lib: ctypes.CDLL, so: Path) -> bool:
    """编进了 AMX（amx.cpp）时：块指令在这台机器上能不能跑？先在子进程里试一次（虚拟机上块指令可能报 SIGILL：那时死的是
    子进程），结果按内核文件记在 record_file("amx.json")；能跑就向 Linux 申请本进程的块寄存器。不能跑：长的预填充照旧
    拼回普通布局交给 F.linear（oneDNN 自己也会挑 AMX）。"""
    lib.amx_compiled.restype = lib.amx_enable.restype = ctypes.c_int
    if not lib.amx_compiled():
        return False
    works = read_record("amx.json", so.name)
    if works is None:
        try:
            works = subprocess.run([sys.executable, "-c", AMX_PROBE, str(so)], timeout=60, capture_output=True).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            works = False
        write_record("amx.json", so.name, works)
    return bool(works) and bool(lib.amx_enable())
