"""附录 · 快路径：几个请求共用一次读权重（拼行的约定）。

CPU 上解码一个 token 的时间几乎都花在读权重上（第 14 章）：读一遍权重乘几行，与乘一行差不多贵。所以同时在解码的几个
请求（服务器的连续批处理，qwen/serve）、左填充的几行（第 13 章的 generate_batch，padded.py）可以拼起来算：一层之内范数
与矩阵乘法对拼起来的行只算一次（C++ 的内核每行各用各的累加器，一行的结果与同时算几行无关），混合器的中间一段与 MLP 的
激活各用各的状态、逐个地算。所以拼起来的每一行与它单独前向时逐位相同（layer_many、layers_many）。

一次前向走到三处时可以与别的请求拼在一起，都在这里问“和谁一起算”（current()）：
- 主模型的全部解码层（step.py 的 FastModel.run_layers）：一件事；
- 草稿头的一层（layers.py 的 FastDecoderLayer.forward）；
- 层外的一个矩阵乘法（linear.py 的 BlockedLinear.matvec：输出头、草稿头的 fc 与起草词表的那几行）。
默认的回答是 ALONE：自己算，与没有这个约定时一模一样。服务器的 RowBatcher（qwen/serve/batcher.py）是另一种回答：
把这件事交给它的线程，等它把几个请求交上的同一件事一次算完（share）。两者是同样的三样东西：takes、share、matvec。

回答由运行请求的一方传下来：`with sharing(partner):` 之内（服务器的请求线程在 RowBatcher.member() 之内，它就是这样设的），
这个线程的前向都问它。章节的 stream、Run.stream 不带这个参数（章节不知道附录），所以它像 torch.inference_mode() 那样
随线程走（contextvars）。另开的线程要自己算时写明 `with sharing(ALONE):`（服务器读长提示词的线程就这样）：有的 Python
（自由线程的 3.14）让新线程继承开它的线程的设置。模型本身不被改动：同一个模型可以同时给几个线程、几个引擎用。
"""

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from .sizes import STEP_ROWS


class Alone:
    """默认：一个请求自己算。什么也不接（takes 为 False）：调用方照自己的路走（比如一层一次 C 调用，比拼行的逐个运算快）。"""

    def takes(self, key) -> bool:
        """这件事（key：模型、层）交不交给 share。"""
        return False

    def share(self, key, many, args):
        """一件事（key 是哪个模型、哪一层、哪个矩阵）：many(key, [args, …]) 一次算完几份、返回各自的结果。自己算就是一份。"""
        return many(key, [args])[0]

    def matvec(self, kernel, x, blocks, scales):
        return kernel.matvec(x, blocks, scales)


ALONE = Alone()
_current = ContextVar("qwen_sharing", default=ALONE)


def current():
    """这个线程此刻和谁一起算（sharing 设的；默认 ALONE）。编译的图里总是 ALONE：图里没有交接。"""
    return ALONE if torch.compiler.is_compiling() else _current.get()


@contextmanager
def sharing(partner):
    """这个线程之内（离开时复原）的前向都问 partner：服务器的 RowBatcher.member 用它。"""
    token = _current.set(partner)
    try:
        yield
    finally:
        _current.reset(token)


def can_share(x, state, valid) -> bool:
    """一层的这次前向能不能与别的请求拼在一起：一个序列、不多于 STEP_ROWS 个 token（DeltaNet 层走 C++ 的逐位置一步）、
    带状态、没有左填充、不求导。"""
    return x.shape[0] == 1 and x.shape[1] <= STEP_ROWS and state is not None and valid is None \
        and not torch.is_grad_enabled()


def can_join(model) -> bool:
    """这个模型的层能不能拼行：分块布局（矩阵有 blocks，C++ 的 matvec 乘）、不编译图（图里的运算拼不进来）。"""
    return hasattr(model.layers[0].ffn.down_proj, "blocks") and not getattr(model, "step_lengths", ())


def layers_many(model, parts):
    """几个请求的全部解码层：parts 是各自的 (x [1, T_i, hidden]，cos，sin，State)，返回各自的输出。逐层对所有请求
    调用一次 layer_many：每一层里每个请求的输出与它单独前向时逐位相同，全部层也就如此。只有一个请求时就是它单独的前向
    （每层一次 C 调用，比 layer_many 逐个运算地调用内核少几十次 Python 到 C 的来回）。"""
    if len(parts) == 1:
        x, cos, sin, state = parts[0]
        with sharing(ALONE):
            return [model.run_layers(x, cos, sin, state)]
    xs = [x for x, _, _, _ in parts]
    for i, layer in enumerate(model.layers):
        xs = layer_many(layer, [(x, cos, sin, state.layers[i]) for x, (_, cos, sin, state) in zip(xs, parts)])
    return xs


def layer_many(layer, parts):
    """几个请求的同一层一次算完：parts 是各自的 (x [1, T_i, hidden]，cos，sin，本层的状态)，返回各自的输出。
    范数、矩阵乘法（C++，每行各用各的累加器）与残差对拼起来的 ΣT_i 行只算一次——权重只读一遍；混合器的中间一段
    （mix、step：各用各的状态）与 MLP 的激活（有 exp）逐个请求地算，张量与它单独运行时形状相同。所以每个请求的输出与它
    单独前向（FastDecoderLayer.forward）时逐位相同，与同时算几个请求、谁在前谁在后无关。只有一个请求时就是它单独的前向。"""
    if len(parts) == 1:
        x, cos, sin, state = parts[0]
        with sharing(ALONE):
            return [layer(x, cos, sin, state)]
    sizes = [p[0].shape[1] for p in parts]
    x = join([p[0] for p in parts])  # [1, ΣT, hidden]
    h = layer.input_layernorm(x).to(layer.dtype)
    block = layer.block  # 分块布局、不编译图时 layer.cpp 要的这一层的常量
    if layer.layer_type == "linear_attention":
        mixer, out_proj = layer.linear_attn, layer.linear_attn.out_proj
        proj = apart(mixer.in_proj.matvec(h).float(), sizes)  # 各 [1, T_i, ·]
        outs = [mixer.mix(p.contiguous(), state) for p, (_, _, _, state) in zip(proj, parts)]
    else:
        mixer, out_proj = layer.self_attn, layer.self_attn.o_proj
        qkv = apart(mixer.qkv.matvec(h), sizes)
        outs = [mixer.step(block, y, cos, sin, state) if block is not None and block.attn.H and mixer.can_step(state, None)
                else mixer.mix(*y.split(mixer.qkv_sizes, dim=-1), cos, sin, state)
                for y, (_, cos, sin, state) in zip(qkv, parts)]
    x = x + out_proj.matvec(join(outs).to(layer.dtype)).float()
    if block is not None:  # 与 FastDecoderLayer.forward 里的同一个 C 调用，每行各算各的
        return apart(layer.ffn.down_proj.kernel.mlp_block(block, x), sizes)
    if layer.ffn is not layer.mlp:  # 专家混合（没有 layer.cpp 的常量时）：FastMoE 按专家分组，每行各算各的（experts.py）
        return apart(x + layer.mlp(layer.post_attention_layernorm(x).to(layer.dtype)).float(), sizes)
    gate_up = apart(layer.mlp.gate_up.matvec(layer.post_attention_layernorm(x).to(layer.dtype)), sizes)
    act = join([layer.mlp.act(y) for y in gate_up])  # [1, ΣT, intermediate]
    x = x + layer.mlp.down_proj.matvec(act).float()
    return apart(x, sizes)


def matvecs(blocks, args: list) -> list:
    """同一个矩阵乘几个请求的行：args 是各自的 (kernel, x [M_i, in], blocks, scales)，拼起来乘一次，再按请求切开。"""
    kernel, _, _, scales = args[0]
    x = args[0][1] if len(args) == 1 else torch.cat([a[1] for a in args])  # [ΣM, in]
    return kernel.matvec(x, blocks, scales).split([a[1].shape[0] for a in args])


def join(parts: list) -> torch.Tensor:
    """几个请求的 [1, T_i, ·] 沿 token 维拼起来；只有一个请求时就是它（解码一个请求时每层少几次复制与分派）。"""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def apart(x: torch.Tensor, sizes: list) -> list:
    """join 的逆：[1, ΣT_i, ·] 按各请求的 T_i 切开。"""
    return [x] if len(sizes) == 1 else list(x.split(sizes, dim=1))
