"""附录 · 快路径（机房）：把加载好的普通模型变换成 CPU 上快的样子。

章节里的模型是普通的 torch 模块；Model.from_pretrained() 与 MTP.from_pretrained() 默认把加载好的模型交给
这里的 speedup()，像 gpt-fast 的 quantize.py 变换一个普通模型那样，换掉模块或属性，章节不知道它的存在：

- linear.py：矩阵的布局。这台机器能编译 C++ 时（默认，见 can_compile）按 32 个输出分块、由 C++ 的 matvec 来乘
  （BlockedLinear；kernel.py 编译 matvec.cpp 一次）；否则（或 compile=False）打包成 oneDNN 布局（PackedLinear）。
  读同一输入的几个投影拼成一个矩阵。
- rows.py：输出头换了布局之后，与它共用的嵌入表留在检查点文件里，查表时按行读（FileEmbedding）。
- layers.py：各层换成改写了几个小方法的子类：拼接的投影、就地更新的 DeltaNet 递推、按键值头分组的解码注意力。
- step.py：编译的路径上，解码与验证的一步（全部层）编译成一张图（FastModel）。
- 本文件：变换本身、草稿头的编译与只给起草词表打分（FastMTP），以及 warm_up：用之前把各张图编译好，
  并量出这台机器上多起草一个 token 的代价（自动挑草稿数用）。

变换只影响速度与内存，输出与普通路径只差浮点舍入。每条快路径上一行的结果与同时算几行无关：投机解码验证的每一行与单独
解码那个 token 时逐位相同（第 14 章的承诺，tests/test_exact.py）。为什么快、快多少、逐位相同怎么做到，见 docs/performance.md。
"""

import ctypes
import time

import torch
from torch import nn

from ..attention import AttentionState
from ..cache import State, copy_state, keep_history
from ..mtp import MAX_DRAFTS, MTP, SpecResult, stream_mtp
from ..sample import stream
from .layers import COMPILED_PIECE, DECODE_LENGTHS, PackedModel, speed_up_layer, speed_up_norms
from .linear import (COMPILE_OPTIONS, BlockedLinear, PackedLinear, can_compile, can_pack, load_matvec,
                     fast_linear, gemv, read_record, write_record)
from .rows import FileEmbedding, FileRows, RowReader, head_tensor, materialize, meta_tensor, tensor_file
from .step import FastModel, cache_offsets

# 每多起草一个 token 一轮多花几步普通解码（自动挑草稿数用，第 14 章的 best_draft_count）。打包的布局读一遍权重就能
# 算几行，多验证一行几乎不花钱：起草一次是草稿头的一层（主模型 L 层，约 1/L）加输出头的前 32768 行（0.8B 上又约 1/L），
# 验证多一行约 0.5/L。编译的路径上解码一步本身更快，起草与多验证的行相对更贵。这只是 warm_up 量出实际代价之前的初值。
PACKED_COST, COMPILED_COST = 2.5, 6.0  # 乘以 1/层数


def preferred_dtype() -> torch.dtype:
    """默认的计算 dtype：CPU 支持 bfloat16 指令（oneDNN 能用）时用 bfloat16——读的字节少一半；否则 float32。"""
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def speedup(module, path, compile: bool | None = None, quantize: str | None = None):
    """变换一个已加载的 Model 或 MTP（path 是它的检查点文件夹），返回同一个对象。这台机器用不了时原样返回。
    compile=None：这台机器能编译 C++（can_compile）就用分块布局与 C++ 的 matvec，否则 oneDNN 打包的布局；
    compile=True：分块布局，另把解码与验证的一步用 torch.compile 编译成图（warm_up 时编译，第一次要几分钟）；
    compile=False：oneDNN 打包的布局。
    quantize="int8"：全部矩阵（含输出头）存成逐输出通道的 int8（quantize_int8），只在分块布局上有。"""
    if quantize not in (None, "int8"):
        raise ValueError(f'quantize 只能是 None 或 "int8"，收到 {quantize!r}')
    some = next(m.weight for m in module.modules() if isinstance(m, nn.Linear))
    on_cpu = some.device.type in ("cpu", "meta")  # meta：刚读了形状，权重在文件里，读出来就在 CPU 上
    blocked = can_compile() if compile is None else compile  # 分块布局要这台机器编得出 C++ 的 matvec
    if quantize and not (blocked and on_cpu):
        raise ValueError('quantize="int8" 的矩阵乘法是 C++ 的 matvec（matvec.cpp）：要这台机器能编译 C++（见 can_compile），'
                         "不能与 compile=False 或别的设备一起用")
    part = "mtp." if isinstance(module, MTP) else "model."
    if not on_cpu or not (blocked or can_pack(some)):
        materialize(module, path, part)  # 不变换：整个读出来，就是章节里的普通模型
        return module
    kernel = load_matvec() if blocked else None
    dtype, raw = some.dtype, kernel is not None and not quantize  # 分块布局：矩阵按文件里的 dtype 读，换布局时一起转
    if isinstance(module, MTP):
        materialize(module, path, part, raw=raw)  # 草稿头只有一层
        return speed_up_mtp(module, path, kernel, quantize, graphs=compile is True, dtype=dtype)
    model = module
    # 先换最大的输出头，嵌入表留在文件里（从不读进内存）；之后一层一层地读出、换掉。int8 的输出头从文件里
    # 一段一段地读出来量化（FileRows）：内存里不必有整个 bfloat16 的输出头
    if quantize:
        model.lm_head = BlockedLinear(FileRows(RowReader(*tensor_file(path, *head_tensor(model.cfg)), some.dtype)),
                                      kernel, quantize=quantize)
    else:
        materialize(model, path, part, "lm_head.", raw=raw)
        model.lm_head = fast_linear([model.lm_head], kernel, dtype=dtype)
    model.embed_tokens = FileEmbedding(RowReader(*tensor_file(path, "model.", "embed_tokens.weight"), some.dtype))
    materialize(model, path, part, "norm.")
    for i, layer in enumerate(model.layers):
        materialize(model, path, part, f"layers.{i}.", raw=raw)
        speed_up_layer(layer, kernel, quantize, dtype)
        release_memory()  # 这一层的原始权重已经释放：还给操作系统，下一层的临时内存不再往上垒
    speed_up_norms(model, kernel)  # compile=True 时 compile_steps 再把 C++ 的换回 PyTorch 的运算（图里用）
    model.__class__ = PackedModel if kernel is None else FastModel
    if kernel is not None:
        model.piece = COMPILED_PIECE
    if compile is True:  # 只有明说要编译，才把解码一步（全部层）编译成图：解码一个 token、验证几个草稿
        model.compile_steps(DECODE_LENGTHS)
    return model


class FastMTP(MTP):
    head_ids = None  # draft_head（起草词表的那几行输出头，speed_up_mtp 读出）是按哪个 draft_ids 读出的
    step = None  # 编译的路径上：forward 编译成的一张图（位置是 0 维张量，缓存的写读是 cached_attention）

    def forward(self, emb_next, hidden, start: int, state=None):
        B, T, _ = emb_next.shape
        if self.step is None or state is None or B != 1 or T not in DECODE_LENGTHS or not 0 < state.length == start:
            return super().forward(emb_next, hidden, start, state)
        with cache_offsets([state], start, T) as pos:  # 按 [T, h] 重排成标准步长再进图：切片的步长各不相同，图会按步长特化
            out = self.step(emb_next.reshape(T, -1)[None], hidden.reshape(T, -1)[None], pos, state)
        return out

    def draft_logits(self, model, x):
        """x [B, 1, h] → 全词表的 float32 logits；有起草词表 draft_ids 时只给它们打分（读的权重少得多），其余是 −∞。"""
        if self.draft_ids is None:
            return model.lm_head(x).float()
        sub = self.draft_scores(x).float()  # [B, 1, n]
        return sub.new_full((*sub.shape[:-1], model.cfg.vocab_size), -torch.inf).index_copy_(-1, self.draft_ids, sub)

    def draft_scores(self, x):
        """只给起草词表打分。换了布局的输出头里取不出任意几行，所以加载时从检查点文件把这几行读出来（draft_head）：
        分块布局上换成 int8 的分块布局，用同一个 C++ 的 matvec 乘；打包的路径上是普通布局，一行输入走 gemv。"""
        if self.head_ids is not self.draft_ids:
            raise ValueError("起草词表 draft_ids 在加载之后换过，加载时读出的输出头那几行对不上了：换起草词表请用 "
                             "MTP.from_pretrained(..., draft_vocab=...) 重新加载")
        if isinstance(self.draft_head, BlockedLinear):
            return self.draft_head(x)  # [B, 1, n]
        return gemv(x, self.draft_head)


def release_memory() -> None:
    """把已经释放、但 glibc 还留在堆里的内存还给操作系统（malloc_trim）。几 MB 到几十 MB 的张量一块块释放之后，
    glibc 多半留着它们备用：常驻内存不降，下一层的临时张量又另占新的。别的 C 库上什么也不做。"""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def speed_up_mtp(mtp: MTP, path, kernel=None, quantize=None, graphs: bool = False, dtype=None) -> MTP:
    mtp.fc = fast_linear([mtp.fc], kernel, quantize, dtype)
    speed_up_layer(mtp.layers[0], kernel, quantize, dtype)
    speed_up_norms(mtp, kernel if not graphs else None)
    mtp.__class__ = FastMTP
    mtp.draft_cost = (PACKED_COST if kernel is None else COMPILED_COST) / mtp.cfg.num_hidden_layers
    if graphs:  # 起草一个 token、送进上一轮留下的几对：与主模型一样编译成一张图
        mtp.step = torch.compile(MTP.forward.__get__(mtp), dynamic=False, options=COMPILE_OPTIONS)
    mtp.draft_head = None  # 输出头里起草词表的那几行：从检查点读一份（主模型的输出头已换了布局）
    if mtp.draft_ids is not None:  # 编译的路径上是 int8 的分块布局（草稿只是猜测，量化误差只会偶尔少收一个草稿）
        rows = RowReader(*tensor_file(path, *head_tensor(mtp.cfg)), mtp.fc.dtype)
        mtp.draft_head = rows[mtp.draft_ids] if kernel is None else BlockedLinear(FileRows(rows, mtp.draft_ids), kernel,
                                                                                   quantize="int8")  # [n, h] 或分块
        mtp.head_ids = mtp.draft_ids
    release_memory()
    return mtp


def num_params(module: nn.Module) -> int:
    """参数个数，换了布局、不再是 nn.Parameter 的矩阵也算上。"""
    fast = sum(m.out_features * m.in_features for m in module.modules() if isinstance(m, (PackedLinear, BlockedLinear)))
    return sum(p.numel() for p in module.parameters()) + fast


def is_compiled(model) -> bool:
    """model 的解码一步是不是 torch.compile 编译的图（compile=True）。"""
    return isinstance(model, FastModel) and bool(model.step_lengths)


def same_layout(model):
    """给草稿头的 compile 参数，让它与主模型走同一条路径：编译的图 True，分块布局 None，其余 False。"""
    return True if is_compiled(model) else (None if isinstance(model, FastModel) else False)


def layout(model) -> str:
    """一句话说 model 走哪条路径（命令行与第 14 章打印）。"""
    if isinstance(model, FastModel):
        return "分块布局、C++ 的 matvec" + ("，解码一步编译成图" if is_compiled(model) else "")
    return "oneDNN 打包的布局" if isinstance(model, PackedModel) else "普通的 nn.Linear"


@torch.inference_mode()
def warm_up(model, mtp=None, calibrate: bool | str = True) -> float:
    """把解码与投机解码要用的图都编译好（第一次在这台机器上要一会儿，之后从磁盘缓存读），返回用了几秒。
    calibrate 且有草稿头时，再量一量一轮投机解码在这台机器上比一步普通解码贵多少，设给 mtp.draft_cost（见 measure_draft_cost）；
    量出的值按模型的配置、dtype、布局、线程数记在 record_file("draft_cost.json") 里，之后直接用（删掉这个文件就重新量）。
    calibrate="recorded"：只用记下的值，没有就保留初值，不当场量（命令行：第一个回答不等这十几秒）。
    不编译的布局（打包、普通）没有图要编译，只做校准。"""
    t0 = time.perf_counter()
    ids = torch.arange(1, 9)[None] % model.cfg.vocab_size  # 随便 8 个 token
    state = State(model)
    hidden = model.hidden(ids, state)  # 预填充（8 行的 matvec）
    if is_compiled(model):
        for T in model.step_lengths:  # 解码 1 个 token；验证 1～4 个草稿（记历史的那一版）
            s = copy_state(state)
            if T > 1:
                keep_history(s)
            model(ids[:, :T], s)
    if mtp is not None and isinstance(mtp, FastMTP) and mtp.step is not None:
        cache = AttentionState()
        mtp(model.embed_tokens(ids), hidden, 0, cache)  # 草稿头读提示词（不编译）
        for T in DECODE_LENGTHS:  # 起草一个 token；送进上一轮留下的几对
            c = copy_state(cache)
            mtp(model.embed_tokens(ids[:, :T]), hidden[:, :T], 8, c)
        mtp.draft_logits(model, hidden[:, :1])
    if mtp is not None and calibrate:
        int8 = getattr(model.lm_head, "scales", None) is not None
        key = (f"{model.cfg} · {model.dtype}{' · int8' if int8 else ''} · {layout(model)} · 草稿词表 {mtp.draft_note} · "
               f"{torch.get_num_threads()} 线程 · torch {torch.__version__}")
        cost = read_record("draft_cost.json", key)
        if not isinstance(cost, float) and calibrate != "recorded":  # 没量过这种设置：量一次，记下来（之后的运行用同一个值，带种子的采样才可复现）
            cost = measure_draft_cost(model, mtp, ids)
            write_record("draft_cost.json", key, cost)
        mtp.draft_cost = cost if isinstance(cost, float) else mtp.draft_cost
    return time.perf_counter() - t0


def measure_draft_cost(model, mtp, ids, rounds: int = 3) -> float:
    """这台机器上每多起草一个 token，一轮投机解码多花几步普通解码（第 14 章 best_draft_count 的 cost）。
    量的是真实的循环：普通解码每产出一个 token 的间隔 t₀；固定起草 k = 1…4 个时每一轮（起草、验证、提交）的间隔 t，
    记下这一轮真的起草了几个（预算快用完时会少）。按 t / t₀ = 1 + cost·k 做最小二乘。头两次产出不算：
    一次是预填充，一次是草稿头第一次读提示词（不走编译的图）。"""
    def gaps(generator):
        times, t = [], None
        for _ in generator:
            now = time.perf_counter()
            times.append(None if t is None else now - t)
            t = now
        return times[2:]  # 第 0 个是预填充结束，第 1 个间隔含草稿头读提示词

    plain = sorted(gaps(stream(model, ids, rounds + 3)))
    t0 = plain[len(plain) // 2]  # 中位数：机器上别的进程插进来的那几步不算
    xs, ys = [], []
    for k in range(1, MAX_DRAFTS + 1):
        r = SpecResult()
        times = gaps(stream_mtp(model, mtp, ids, 2 + rounds * (k + 1), draft_tokens=k, result=r))
        for (drafted, _, _), t in zip(r.trace[1:], times):
            xs.append(drafted)
            ys.append(t / t0 - 1)
    return max(sum(x * y for x, y in zip(xs, ys)) / max(sum(x * x for x in xs), 1), 0.01)
