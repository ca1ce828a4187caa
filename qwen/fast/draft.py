"""附录 · 快路径上的草稿头：与主模型同样的布局，编译的图，只给起草词表打分。

第 14 章的 MTP 每起草一个 token 都乘一遍整个输出头（0.8B 上 248320 × 1024，比草稿头那一层还大）。换了布局的主模型
输出头里取不出任意几行，所以加载时从检查点文件里把起草词表（qwen/tools/vocab.py 挑的那些 token）的几行读出来，单独存一份
（draft_head）：起草只给它们打分，其余是 −∞。草稿只是猜测，主模型验证时仍看全词表，输出不变。
"""

import torch

from ..mtp import MAX_DRAFTS, MTP
from .layers import DECODE_LENGTHS, attach_blocks, speed_up_layer, speed_up_norms
from .linear import COMPILE_OPTIONS, BlockedLinear, fast_linear, gemv
from .rows import FileRows, RowReader, head_tensor, tensor_file
from .step import cache_offsets

# 每多起草一个 token 一轮多花几步普通解码（自动挑草稿数用，第 14 章 best_draft_count 的 round_cost），乘以 1/层数。打包的布局读一遍
# 权重就能算几行，多验证一行几乎不花钱：起草一次是草稿头的一层（主模型 L 层，约 1/L）加输出头的前 32768 行（0.8B 上又约
# 1/L），验证多一行约 0.5/L。分块布局上解码一步本身更快，起草与多验证的行相对更贵。warm_up 量出实际代价之前的初值。
PACKED_COST, BLOCKED_COST = 2.5, 6.0


class FastMTP(MTP):
    head_ids = None  # draft_head（起草词表的那几行输出头）是按哪个 draft_ids 读出的
    step = None  # layout="graphs" 时：forward 编译成的一张图（位置是 0 维张量，缓存的写读是 cached_attention）
    draft_ids = None  # 起草词表（升序的 token id）；None：全词表
    draft_note = "全词表"

    def forward(self, emb_next, hidden, start: int, state=None, shift: int = 0):
        B, T, _ = emb_next.shape
        if self.step is None or state is None or B != 1 or T not in DECODE_LENGTHS or not 0 < state.length == start or shift:
            return super().forward(emb_next, hidden, start, state, shift)  # 读过图之后（shift ≠ 0）不走图：只是草稿
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
        """只给起草词表打分：分块布局上是量化的分块布局（int4 的模型 int4，否则 int8），用同一个 C++ 的 matvec 乘；
        打包的路径上是普通布局，走 gemv。"""
        if self.head_ids is not self.draft_ids:
            raise ValueError("起草词表 draft_ids 在加载之后换过，加载时读出的输出头那几行对不上了：换起草词表请用 "
                             "qwen.fast.load_draft(model, path, draft_vocab=...) 重新加载")
        if isinstance(self.draft_head, BlockedLinear):
            return self.draft_head(x)  # [B, 1, n]
        return gemv(x, self.draft_head)


def speed_up_mtp(mtp: MTP, path, kernel=None, quantize=None, graphs: bool = False, dtype=None, vocab=(None, "全词表")):
    """把已读出（materialize 过）的草稿头换成 FastMTP：投影拼接、换布局；vocab：(起草词表, 一句说明)。"""
    mtp.fc = fast_linear([mtp.fc], kernel, quantize, dtype)
    speed_up_layer(mtp.layers[0], kernel, quantize, dtype)
    speed_up_norms(mtp, kernel if not graphs else None)
    if kernel is not None and not graphs:
        attach_blocks(mtp)
    mtp.__class__ = FastMTP
    mtp.draft_ids, mtp.draft_note = vocab
    each = (PACKED_COST if kernel is None else BLOCKED_COST) / mtp.cfg.num_hidden_layers
    mtp.round_cost = [1 + each * k for k in range(MAX_DRAFTS + 1)]
    if graphs:  # 起草一个 token、送进上一轮留下的几对：与主模型一样编译成一张图
        mtp.step = torch.compile(MTP.forward.__get__(mtp), dynamic=False, options=COMPILE_OPTIONS)
    mtp.draft_head = None  # 输出头里起草词表的那几行：从检查点读一份（主模型的输出头已换了布局）
    if mtp.draft_ids is not None:  # 分块布局上存成 int8，int4 的模型存成 int4（草稿只是猜测，量化误差只会偶尔少收一个草稿）
        rows = RowReader(*tensor_file(path, *head_tensor(mtp.cfg)), mtp.fc.dtype)
        mtp.draft_head = rows[mtp.draft_ids] if kernel is None else BlockedLinear(FileRows(rows, mtp.draft_ids), kernel,
                                                                                   quantize=quantize or "int8")
        mtp.head_ids = mtp.draft_ids
    return mtp
