"""附录 · 快路径：矩阵乘法的三种布局。

解码一个 token 要把全部权重从内存读一遍，速度的上限是“权重字节数 ÷ 内存带宽”；矩阵乘法怎么读权重决定了离上限多远。

- PackedLinear（compile=False，或这台机器编译不了时）：PyTorch 在 CPU 上把 bfloat16 矩阵乘法交给 oneDNN，而 oneDNN 每次调用都先把 [out, in] 的权重
  重排成它的分块布局：权重实际被读写了三遍。加载时重排一次（_reorder_linear_weight），之后每次只读一遍，
  1 到 8 行输入（投机解码一次验证几个 token）读的都是同样一遍权重。bfloat16 内核在 4 行时读得最快，不足 4 行就补零行。
- BlockedLinear（默认，能编译时）：把权重按 32 个输出切成块，每块 [in, 32] 连续存放；torch.compile 为 matvec_blocks
  生成一个小循环：逐块顺序读权重，每读 32 个数就乘加进每行的 32 个累加器。两个线程各自顺序读自己那一半，硬件预取最顺手。
  行数多时（长的预填充）每个乘加读到的权重少，就先拼回普通布局交给 F.linear。
- gemv：一行输入乘普通布局的权重时绕开 oneDNN，用 PyTorch 自己的 gemv（草稿头给输出头的前几万行打分时用）。

几个读同一输入的矩阵（q/k/v，gate/up，DeltaNet 的四个输入投影）拼成一个再换布局：调用少了，一次连续读一大块也更快。
所有布局只影响速度，输出只差浮点舍入。性能数字见 docs/performance.md。
"""

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

PAD_ROWS = 4  # 打包的 bfloat16 内核：不足这么多行时补零行
BLOCK = 32  # 分块布局每块的输出个数
BLOCK_ROWS = 8  # 编译的 matvec_blocks 一次最多乘这么多行（解码 1 行，验证 k 个草稿 k + 1 行）
SPLIT = 4  # matvec_blocks 把输入维分成几段、各用一个累加器（每一行都一样：行的结果与同时算几行无关）
WARM_ROWS = 5  # 1～5 行（解码、验证 1～4 个草稿）的内核由 warm_up 编译好；更多的行补到 8 的倍数，不再编译别的行数
KERNEL_ROWS = 32  # 不超过这么多行时每 8 行一段用 matvec_blocks；更多行时拼回普通布局（拼回一次有固定的代价）
# 生成的 C++ 里不把乘、加合成 FMA：合不合成由编译器对每段代码各自决定，同一行在不同的图里可能一处合成、一处不合成，
# 结果就差一点（投机解码验证的行与单独解码的行必须逐位相同，见第 14 章）
COMPILE_OPTIONS = {"cpp.enable_floating_point_contract_flag": "off"}
# 整步的图（step.py）：小的运算（norm、逐元素）只用一个线程。行少的时候生成的代码会把一个归约拆给两个线程各加一半，
# 拆不拆随行数而变；矩阵乘法的输出多，照样按输出分给各个线程
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


def from_blocks(blocks: torch.Tensor, out: int) -> torch.Tensor:
    """to_blocks 的逆，复制一份：[⌈out/32⌉, in, 32] → [out, in]。复制成转置的 [in, out]（每块的 32 个数原样搬过去，
    比逐个转置快），返回它的转置视图：F.linear 收到的就是 [in, out] 按行存放的普通矩阵乘法。"""
    return blocks.permute(1, 0, 2).reshape(blocks.shape[1], -1)[:, :out].t()


def matvec_blocks(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, S, in/S]（M 很小，输入维切成 S 段）乘分块布局的权重 blocks [B, S, in/S, 32] → [M, B·32]，在 float32 里累加。

    y[m, 32b + j] = Σ_s Σ_i x[m, s, i] · blocks[b, s, i, j]。每段各用一个累加器（一个累加器时循环被乘加的延迟卡住），
    最后按固定的顺序 ((p₀ + p₁) + p₂) + p₃ 加起来。torch.compile 把 M 行的归约生成进同一个循环，权重只读一遍；
    每一行的求和顺序都与只算这一行时相同：验证 k 个草稿时的每一行与单独解码那个 token 逐位相同（第 14 章）。
    不编译时它也是对的，只是每行都要物化一个与权重一样大的中间结果，很慢。
    第一行不改变 x：torch.compile 会把算出 x 的逐元素运算（比如层里的 RMSNorm）内联进这个循环，权重的每一块都把它们
    重算一遍；as_strided 要求输入是一块真实的内存，编译器只好先把 x 算好存下来，循环里只剩读权重、乘加。
    输入维由调用方切好（都是视图）：在函数里切（in // 4）的话，动态形状生成的循环每一步都要重算这个除法，大矩阵慢一倍。
    int8 的权重（quantize="int8"）带每个输出的比例 scales [B, 32]：累加完再乘，归约里只有整数转浮点、乘加。
    """
    x = torch.as_strided(x, x.shape, x.stride())
    w = blocks.float()  # [B, S, in/S, 32]
    rows = []
    for m in range(x.shape[0]):
        parts = (w * x[m].float()[None, :, :, None]).sum(2)  # [B, S, 32]：每段的部分和
        y = parts[:, 0]
        for s in range(1, parts.shape[1]):
            y = y + parts[:, s]  # 各段按固定顺序相加
        rows.append((y if scales is None else y * scales).flatten())
    return torch.stack(rows).to(x.dtype)  # [M, B·32]


# matvec_blocks 的编译版本：dynamic=True，各种形状的矩阵共用一份代码，每种行数 M 各编译一次（结果缓存在磁盘上）
KERNEL = torch.compile(matvec_blocks, dynamic=True, options=COMPILE_OPTIONS)


@torch.library.custom_op("qwen_fast::matvec", mutates_args=())
def matvec(x: torch.Tensor, blocks: torch.Tensor, scales: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, in]（M ≤ KERNEL_ROWS）乘分块布局的 blocks [B, S, in/S, 32]（输入维已切成 S 段）→ [M, B·32]：每 8 行一段
    交给编译的 KERNEL。包成自定义算子，整步的图（step.py）把它当黑盒：矩阵乘法在哪张图里都是这同一份
    代码，图里其余的运算也不会与它融合（融合的方式随行数而变，见 STEP_OPTIONS）。"""
    if x.shape[0] <= BLOCK_ROWS:
        return KERNEL(x.reshape(x.shape[0], blocks.shape[1], -1), blocks, scales)
    # 多于一段时每段复制成自己的一份：编译的代码按输入的起始偏移特化，偏移为 0 就不必多编译
    return torch.cat([KERNEL(x[i : i + BLOCK_ROWS].clone().reshape(-1, blocks.shape[1], x.shape[1] // blocks.shape[1]),
                             blocks, scales) for i in range(0, x.shape[0], BLOCK_ROWS)])


@matvec.register_fake
def _(x, blocks, scales):
    return x.new_empty(x.shape[0], blocks.shape[0] * BLOCK)


def compile_matvec(dtype: torch.dtype = torch.float32):
    """试一试编译的 KERNEL，返回它（BlockedLinear 有它才用分块布局）。加载时先按权重的 dtype 编译一行输入的版本：
    缺 C++ 编译器之类的问题在加载时就报出来，而不是在第一次生成时。"""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # 测试里各种小模型的形状
    probe = torch.compile(matvec_blocks, dynamic=True, options=COMPILE_OPTIONS)  # 与 KERNEL 同一份代码（缓存共用）
    try:
        with torch.inference_mode():  # 编译结果按求导模式分开缓存：编译的就是生成时要用的那份
            probe(torch.ones(1, SPLIT, 2, dtype=dtype), torch.ones(2, SPLIT, 2, BLOCK, dtype=dtype))  # 一行输入的版本
    except Exception as e:
        raise RuntimeError(
            f"compile=True 需要 torch.compile 在这台机器上生成并编译 C++ 代码（要装 g++ 或 clang），但失败了："
            f"{type(e).__name__}: {str(e)[:300]}。compile=False 就用 oneDNN 打包的布局。"
        ) from None
    return KERNEL


def record_file(name: str) -> Path:
    """记在磁盘上的测量结果（能不能编译、起草的代价）：$XDG_CACHE_HOME/qwen/<name>（默认 ~/.cache/qwen/）。"""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen" / name


def read_record(name: str, key: str):
    """record_file(name) 里 key 对应的值；没有记录、记录坏了或 key 对不上时 None。"""
    try:
        record = json.loads(record_file(name).read_text())
        return record.get(key) if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def write_record(name: str, key: str, value) -> None:
    """把 key → value 加进 record_file(name)；写不了（只读的家目录）就算了，下次再测一遍。"""
    file = record_file(name)
    try:
        record = json.loads(file.read_text())
        record = record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        record = {}
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(record | {key: value}, ensure_ascii=False, indent=1))
    except OSError:
        pass


def can_compile() -> bool:
    """from_pretrained 默认（compile=None）用不用编译的分块布局：torch.compile 能在这台机器上生成并编译 C++ 才用。
    第一次真的编译一个小 matvec 试试，结果按 torch 版本与编译器（路径、修改时间）记在 record_file("compiler.json") 里：
    之后加载不再试；装上或换了编译器、换了 torch，记录对不上，就重新试一次。"""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        cxx = shutil.which(get_cpp_compiler())
    except Exception:  # 找不到任何 C++ 编译器时 inductor 自己就报错
        cxx = None
    if cxx is None:
        return False
    key = f"torch {torch.__version__} · {cxx} · {os.stat(cxx).st_mtime_ns}"
    works = read_record("compiler.json", key)
    if works is None:  # 没有记录（或编译器、torch 换了）：试一次
        try:
            compile_matvec(torch.float32)
            works = True
        except RuntimeError:
            works = False
        write_record("compiler.json", key, works)
    return works


def quantize_int8(weight: torch.Tensor, rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """对称的逐输出通道 int8：W ≈ q · s，s = max|W 的这一行| / 127 → (q [out, in] int8, s [out] float32)。
    每次只把 rows 行转成 float32 算：输出头整个转一遍要 1 GB 的临时内存。"""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0])
    for i in range(0, weight.shape[0], rows):
        w = weight[i : i + rows].detach().float()
        s = scale[i : i + rows] = w.abs().amax(1).clamp(min=1e-12) / 127  # 全零的行比例取个极小值，q 还是 0
        q[i : i + rows] = torch.round(w / s[:, None]).clamp(-127, 127)
    return q, scale


class BlockedLinear(nn.Module):
    """分块布局的矩阵（to_blocks），不超过 KERNEL_ROWS 行输入时用 kernel（compile_matvec() 的结果）每 8 行一段地乘。
    quantize="int8"：权重存成 int8 的块加每个输出一个 float32 比例（quantize_int8），字节数是 bfloat16 的一半。"""

    def __init__(self, weight: torch.Tensor, kernel, bias=None, quantize: str | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        if quantize == "int8":
            q, scale = quantize_int8(weight)
            self.blocks, self.scales = to_blocks(q), F.pad(scale, (0, -len(scale) % BLOCK), value=1.0).view(-1, BLOCK)
        else:
            self.blocks, self.scales = to_blocks(weight.detach()), None  # [B, in, 32]；[B, 32] 或 None
        self.kernel, self.bias = kernel, bias

    def dense(self) -> torch.Tensor:
        """拼回普通布局 [out, in]（int8 的乘回比例），长的预填充交给 F.linear。"""
        w = from_blocks(self.blocks, self.out_features)
        return w if self.scales is None else (w * self.scales.flatten()[: self.out_features, None]).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [M, in]
        M = x2.shape[0]
        if M > KERNEL_ROWS:  # 预填充：拼回普通布局交给 F.linear（每次多一份复制）
            y = F.linear(x2, self.dense(), self.bias)
        else:
            if M > WARM_ROWS and not torch.compiler.is_compiling():  # 图外更多的行（预填充的短段）补零行到 8 的倍数
                x2 = F.pad(x2, (0, 0, 0, -M % BLOCK_ROWS))
            split = SPLIT if self.in_features % SPLIT == 0 else 1  # 输入维切成几段（见 matvec_blocks）
            y = torch.ops.qwen_fast.matvec(x2, self.blocks.view(len(self.blocks), split, -1, BLOCK), self.scales)
            y = y[:M, : self.out_features]  # [M, out]：去掉补的零行与零列
            y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], -1)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """一行输入乘普通布局的权重：CPU 上的 bfloat16 暂时关掉 oneDNN（它每次都先重排权重），走 PyTorch 自带的 gemv。
    开关 oneDNN 的是进程级的标志：别的线程若在同一时刻做矩阵乘法，也会短暂地不用 oneDNN（结果不变，只是慢些）。"""
    if x.dtype != torch.bfloat16 or x.is_cuda:
        return F.linear(x, weight)
    enabled = torch.backends.mkldnn.set_flags(False)[0]
    try:
        return F.linear(x, weight)
    finally:
        torch.backends.mkldnn.set_flags(enabled)


def can_pack(weight: torch.Tensor) -> bool:
    """这台机器、这个 dtype 能不能打包：只在 CPU 上，且 oneDNN 支持该 dtype。"""
    if weight.device.type not in ("cpu", "meta") or not torch.backends.mkldnn.is_available():  # meta：还在文件里
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def fast_linear(linears, kernel=None, quantize: str | None = None) -> nn.Module:
    """几个读同一输入的 nn.Linear（一个也行）的权重上下拼成一个，换成分块布局（给了 kernel；quantize="int8" 时存成
    int8）或打包的布局。"""
    def cat(ts):
        return ts[0].detach() if len(ts) == 1 else torch.cat([t.detach() for t in ts])  # 一个时不复制（输出头有 0.5 GB）

    weight = cat([m.weight for m in linears])
    bias = None if linears[0].bias is None else cat([m.bias.float() for m in linears])
    return PackedLinear(weight, bias) if kernel is None else BlockedLinear(weight, kernel, bias, quantize)
