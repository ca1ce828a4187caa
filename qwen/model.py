"""第 10 章 · 模型：把各章拼起来，并从检查点加载。

    logits = lm_head(norm(layers(embed_tokens(ids))))

embed_tokens 查表得到向量；24 个解码层逐层加工；最后一次零中心 RMSNorm；
lm_head 与 embed_tokens 共用一个矩阵，给词表里每个词打分。

`model(ids, state)` 一次处理 T 个新 token，返回每个位置的 logits，并把 state.pos 前移 T：
预填充、逐 token 解码、投机解码一次验证几个 token，都是同一个调用。
state 为 None 时是无缓存的一次性前向（训练与测试用）。

加载：先在 meta 设备上搭出模型骨架（不分配内存），读出检查点张量、核对名字与形状，
再用 load_state_dict(assign=True) 把张量直接“装”进去，内存里始终只有一份权重。
"""

import torch
from torch import nn

from .embedding import Embedding
from .layer import DECODE_LENGTHS, DecoderLayer
from .norm import RMSNorm
from .rope import rope_tables
from .weights import (Config, Linear, RowReader, can_pack, check_state_dict, compile_matvec,
                      find_model, load_config, load_weights, pack_linears, preferred_dtype, tensor_file)


# 带状态的长输入按这么多个 token 一段喂：中间张量的内存峰值随段长、而不随提示词长度增长。
# 512 个 token 的提示词实测（同一个模型上交替测）：段长 256 比 128 快 4%，比 512 快约 2%。
# compile=True 时每段要把分块的矩阵拼回普通布局一次（第 1 章），段长 512 比 256 快约 9%（2.05 对 2.25 s）
PREFILL_PIECE = 256
COMPILED_PIECE = 512


class Model(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.piece = PREFILL_PIECE  # 长输入分段喂的段长（compile=True 时是 COMPILED_PIECE）
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # 共用同一个参数

    def check_ids(self, ids, state) -> torch.Tensor:
        """把输入整理成 [B, T] 的 long 张量，不合法时给出清楚的错误。"""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.norm.weight.device)
        if ids.ndim == 1:
            ids = ids[None]  # [T] → [1, T]
        if ids.ndim != 2:
            raise ValueError(f"ids 应为 [batch, 长度] 的二维张量，收到形状 {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise ValueError("ids 是空的：至少要有一个 token")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"token id 超出词表范围 [0, {self.cfg.vocab_size})")
        pos = state.pos if state is not None else 0
        if pos + ids.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(
                f"序列太长：已有 {pos} 个位置，再加 {ids.shape[1]} 个超过 "
                f"max_position_embeddings = {self.cfg.max_position_embeddings}"
            )
        return ids

    def hidden(self, ids, state=None) -> torch.Tensor:
        """最后一次 norm 之后的隐藏状态 [B, T, hidden]（MTP 草稿头要用它）。"""
        ids = self.check_ids(ids, state)
        B, T = ids.shape
        if state is not None and T > self.piece:  # 分段预填充：与一次喂完完全等价（状态本来就是为增量设计的）
            return torch.cat([self.hidden(ids[:, i : i + self.piece], state) for i in range(0, T, self.piece)], 1)
        pos = state.pos if state is not None else 0
        positions = torch.arange(pos, pos + T, device=ids.device)  # [T]
        valid = None
        if state is not None and state.valid is not None:  # 批处理：左填充
            valid = state.extend_valid(T)  # [B, pos + T]
            positions = positions - state.pad[:, None]  # [B, T]：每行从自己的第一个真实 token 数起
        cos, sin = rope_tables(self.cfg, positions)
        x = self.embed_tokens(ids).float()  # [B, T, hidden]：残差流用 float32
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if state is None else state.layers[i], valid)
        if state is not None:
            state.pos += T
        return self.norm(x).to(self.lm_head.dtype)

    def forward(self, ids, state=None, last: bool = False) -> torch.Tensor:
        """logits [B, T, vocab]（float32）；last=True 时只算最后一个位置 [B, 1, vocab]，预填充省下大量计算。"""
        h = self.hidden(ids, state)
        if last:
            h = h[:, -1:]
        return self.lm_head(h).float()

    @classmethod
    def from_pretrained(cls, path=None, dtype: torch.dtype | None = None, pack: bool = True,
                        compile: bool = False) -> "Model":
        """从检查点文件夹（或 find_model 找到的 Qwen3.5-0.8B）加载。

        dtype 默认 preferred_dtype()：CPU 支持 bfloat16 时用 bfloat16，否则 float32。

        pack=True（默认）时在 CPU 上把矩阵打包成 oneDNN 布局（第 1 章的 Linear.pack 与 Fused）：
        只影响速度与内存，不影响结果。输出头也打包之后，嵌入表不再留在内存里，查表时从检查点文件按行读
        （第 1 章的 RowReader），所以模型活着的时候检查点文件要在。要训练或修改权重时用 pack=False。

        compile=True（可选，CPU 上、要有 C++ 编译器）换成第 1 章的分块布局：解码与验证（1～8 行，至多 32 行时分段）的矩阵乘法由
        torch.compile 生成的循环来算；解码一个 token、验证 1～4 个草稿、长提示词的一整段时每层再整层编译
        （第 9 章的 DecoderLayer.compiled），几十个小运算并成几个循环。bfloat16 的普通解码快五到七成，预填充差不多；
        每种长度第一次用到时要编译（缓存为空时加载、生成、长提示词、投机解码合计约两分钟，之后每个新进程约 12 秒）。
        结果只差舍入。
        """
        path = find_model(path)
        cfg = load_config(path)
        dtype = dtype or preferred_dtype()
        with torch.device("meta"):
            model = cls(cfg)  # 只有形状，没有内存
        sd = load_weights(path, "model.", dtype)
        expected = {k: v.shape for k, v in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            expected.pop("lm_head.weight")  # 共用嵌入：检查点里没有它
            sd.pop("lm_head.weight", None)
        check_state_dict(expected, sd, f"检查点 {path}")
        model.load_state_dict(sd, strict=False, assign=True)
        del sd  # 此后只有模型引用这些张量：打包时每换掉一个矩阵，旧的那份立刻释放
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight  # assign 之后重新绑定
        kernel = compile_matvec(dtype) if compile and model.lm_head.weight.device.type == "cpu" else None
        if kernel is not None or (pack and can_pack(model.lm_head.weight)):
            # 先打包最大的输出头，再把嵌入表留在文件里、查表时按行读（第 2 章）：
            model.lm_head.pack() if kernel is None else model.lm_head.block(kernel)
            model.embed_tokens.weight = None  # 普通布局的那 0.5 GB 这就释放，之后打包各层时内存峰值低一些
            model.embed_tokens.rows = RowReader(*tensor_file(path, "model.", "embed_tokens.weight"), dtype)
            pack_linears(model, kernel)
        if kernel is not None:  # 每层（连同分块的 matvec）编译，用于这几种固定长度（第 9 章）：
            model.piece = COMPILED_PIECE
            for layer in model.layers:  # 解码一个 token、验证几个草稿、长提示词的一整段
                layer.compile_for(DECODE_LENGTHS + (model.piece,))
        model.path = path
        return model.eval()
