"""第 10 章 · 模型：把各章拼起来，并从检查点加载。

    logits = lm_head(norm(layers(embed_tokens(ids))))

embed_tokens 查表得到向量；24 个解码层逐层加工；最后一次零中心 RMSNorm；lm_head 与 embed_tokens 共用一个矩阵。

`model(ids, state)` 一次处理 T 个新 token，返回每个位置的 logits，并把 state.pos 前移 T：预填充、逐 token 解码、
投机解码一次验证几个 token，都是同一个调用。state 为 None 时是无缓存的一次性前向（训练与测试用）。

加载：先在 meta 设备上搭出模型骨架（不分配内存），读出检查点张量、核对名字与形状，再用 load_state_dict(assign=True)
把张量直接“装”进去，内存里始终只有一份权重。附录 qwen.fast.load 用同一个 load_pretrained 先只读形状，
再一层一层地读出权重、换成 CPU 上快的布局（像 gpt-fast 的 _load_model）。
"""

import torch
from torch import nn

from .embedding import Embedding
from .layer import DecoderLayer
from .moe import stack_experts
from .norm import RMSNorm
from .rope import mrope_tables, rope_tables
from .weights import Config, check_state_dict, find_model, load_config, load_weights

PREFILL_PIECE = 256  # 带状态的长输入按这么多个 token 一段喂：中间张量的内存峰值随段长、而不随提示词长度增长


class Model(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.piece = PREFILL_PIECE  # 长输入分段喂的段长
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # 共用同一个参数

    dtype = property(lambda self: self.layers[0].dtype)  # 权重的 dtype（bfloat16 或 float32）

    def check_ids(self, ids, state) -> torch.Tensor:
        """把输入整理成 [B, T] 的 long 张量，不合法时给出清楚的错误（不做任何取整之类的默默转换）。"""
        try:
            ids = torch.as_tensor(ids, device=self.norm.weight.device)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"ids 应为整数 token id 组成的张量或（嵌套的）列表，收到 {type(ids).__name__}：{str(ids)[:60]!r}"
                             "；文字请先用分词器（Chat.encode）变成 id") from None
        if ids.numel() == 0:
            raise ValueError("ids 是空的：至少要有一个 token")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"ids 应为整数 token id，收到 {ids.dtype} 的张量：不会替你取整，请先转成整数（.long()）")
        ids = ids.long()[None] if ids.ndim == 1 else ids.long()  # [T] → [1, T]
        if ids.ndim != 2:
            raise ValueError(f"ids 应为 [batch, 长度] 的二维张量，收到形状 {tuple(ids.shape)}")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"token id 超出词表范围 [0, {self.cfg.vocab_size})")
        pos = state.pos if state is not None else 0
        if pos + ids.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(f"序列太长：已有 {pos} 个位置，再加 {ids.shape[1]} 个超过 "
                             f"max_position_embeddings = {self.cfg.max_position_embeddings}")
        return ids

    def hidden(self, ids, state=None, embeds=None, positions=None) -> torch.Tensor:
        """最后一次 norm 之后的隐藏状态 [B, T, hidden]（MTP 草稿头要用它）。输入默认从 ids 查嵌入、位置从 state 数起；
        也可以直接给（transformers 的 inputs_embeds、position_ids）：embeds [B, T, hidden]，positions [B, T] 或三个分量的
        [3, B, T]（第 5 章的 M-RoPE）。给了位置时，之后的 token 从 max(位置) + 1 接着数（state.shift 记下它与 pos 之差）。"""
        ids = self.check_ids(ids, state)
        B, T = ids.shape
        x = self.embed_tokens(ids) if embeds is None else embeds  # [B, T, hidden]：权重的 dtype，最后的隐藏状态转回它
        p = self.positions(T, state, ids.device) if positions is None else positions
        step, out = (self.piece if state is not None else T), []  # 带状态时分段预填充：与一次喂完完全等价
        for i in range(0, T, step):
            n = min(step, T - i)
            valid = None if state is None or state.valid is None else state.extend_valid(n)  # [B, pos + n]：批处理的左填充
            cos, sin = self.rope(p[..., i : i + n].contiguous())  # 每段是连续的张量：与只喂这一段时逐位相同
            h = self.run_layers(x[:, i : i + n].float().contiguous(), cos, sin, state, valid)  # 残差流用 float32
            out.append(self.norm(h).to(x.dtype))
            if state is not None:
                state.pos += n
        if state is not None and positions is not None:  # shift = max(位置) + 1 − 下一个 token 的 pos（左填充时每行一个）
            ends = positions.reshape(-1, B, T).amax((0, 2)) + 1 - (state.pos if state.valid is None else state.pos - state.pad)
            state.shift = int(ends[0]) if state.valid is None else ends
        return out[0] if len(out) == 1 else torch.cat(out, 1)

    def positions(self, T: int, state, device=None) -> torch.Tensor:
        """T 个新 token 的 RoPE 位置 [T]：pos + shift 起；左填充时 [B, T]，每行从自己的第一个真实 token 数起。"""
        if state is None:
            return torch.arange(T, device=device)
        p = torch.arange(state.pos, state.pos + T, device=device)
        p = p if state.valid is None else p - state.pad[:, None]
        return p + (state.shift[:, None] if torch.is_tensor(state.shift) else state.shift)

    def run_layers(self, x, cos, sin, state=None, valid=None) -> torch.Tensor:  # 各层用状态里自己的那一份
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if state is None else state.layers[i], valid)
        return x

    def rope(self, positions):  # 各位置的 RoPE 表 cos、sin（第 5 章）：[T]、[B, T]，或三个分量的 [3, B, T]
        if positions.ndim < 3:
            return rope_tables(self.cfg, positions)
        return mrope_tables(self.cfg, positions if positions.shape[1] > 1 else positions[:, 0])  # 一行时同上 [T, d]

    def forward(self, ids, state=None, last: bool = False, embeds=None, positions=None) -> torch.Tensor:
        """logits [B, T, vocab]（float32）；last=True 时只算最后一个位置 [B, 1, vocab]，预填充省下大量计算。"""
        h = self.hidden(ids, state, embeds, positions)
        return self.lm_head(h[:, -1:] if last else h).float()

    @classmethod
    def from_pretrained(cls, path=None, dtype: torch.dtype = torch.float32, **old) -> "Model":
        """从检查点文件夹（或 find_model 找到的 Qwen3.5-0.8B）加载本章的普通模型：nn.Linear、nn.Parameter，可以训练、
        修改权重。CPU 上快的布局（oneDNN 打包、C++ 的 matvec、int8）是附录的变换：model, mtp = qwen.fast.load(path)。"""
        path = find_model(path)
        return load_pretrained(cls, load_config(path), path, "model.", dtype, "文本模型", old)


def load_pretrained(cls, cfg, path, part: str, dtype, what: str, old=None, read=None) -> nn.Module:
    """在 meta 设备上搭出 cls(cfg) 的骨架（只有形状，没有内存），读出检查点的 part 部分（第 1 章），核对名字与形状，
    用 load_state_dict(assign=True) 把张量直接装进去。Model 与第 14 章的 MTP 都这样加载；read 是附录用的：先只读形状。"""
    if old:  # 旧版的 pack、compile、quantize：说清楚换成了什么，而不是默默忽略
        raise ValueError(f"from_pretrained 不再收 {', '.join(old)}：它只加载本章的普通模型；快的布局与量化请用附录的 "
                         "qwen.fast.load(path, layout=..., quantize=...)")
    path = find_model(path)
    with torch.device("meta"):
        module = cls(cfg)
    module.path = path
    sd = load_weights(path, part, dtype, read)
    if not sd:
        raise ValueError(f"检查点 {path} 里没有 {part}* 张量：它没有{what}")
    sd = stack_experts(sd, cfg, f"检查点 {path} 的{what}") if part in ("model.", "mtp.") else sd  # 专家：第 4 章附
    tied = part == "model." and cfg.tie_word_embeddings  # 共用嵌入：检查点里没有 lm_head.weight
    if tied:
        sd.pop("lm_head.weight", None)
    expected = {k: v.shape for k, v in module.state_dict().items() if not (tied and k == "lm_head.weight")}
    check_state_dict(expected, sd, f"检查点 {path} 的{what}")
    module.load_state_dict(sd, strict=not tied, assign=True)
    del sd  # 此后只有模型引用这些张量（附录变换时每换掉一个矩阵，旧的那份立刻释放）
    if tied:
        module.lm_head.weight = module.embed_tokens.weight  # assign 之后重新绑定：共用一个参数
    return module.eval()
