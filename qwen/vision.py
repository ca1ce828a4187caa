"""第 15 章 · 看图：检查点自带的视觉塔，把一张图变成语言模型读的几百个 token。

Qwen3.5 的每个检查点都是多模态的，0.8B 也一样：`model.visual.*` 是一个视觉 Transformer（ViT），它的输出顶替提示词里
`<|image_pad|>` 的嵌入，语言模型像读文字一样读它。一张图走四步：
1. 准备（prepare）：缩放到两边都是 32 的倍数、面积在范围内（smart_resize，双三次插值），归一化到 [-1, 1]，
   切成 16×16 的小块；静止的图当作两帧相同的视频（temporal_patch_size = 2），每块 3·2·16·16 = 1536 个数。
2. 嵌入：每块一个线性映射（patch_embed，就是步长等于核宽的 Conv3d）加上学到的位置表：48×48 的表双线性插值到这张图的网格。
3. 12 个 ViT 块：LayerNorm → 注意力 → LayerNorm → MLP（gelu tanh）。注意力不带因果掩码，只在同一张图之内，
   位置用二维 RoPE：每个头 64 维里一半按行号、一半按列号旋转（第 5 章的 apply_rope）。
4. 合并（merger）：相邻 2×2 块拼成一个 3072 维向量 → Linear → GELU → Linear → 1024 维，一个 token 管 32×32 个像素。

语言模型这边（第 5、10 章）：第 10 章的模型只收向量与位置；这一章给出它们（image_inputs）：图像 token 的向量换成塔的
输出，位置是三维的 (t, h, w)：从图前的位置起，按它在合并网格里的行、列数；图之后的文字从 max(位置) + 1 接着数。
消息里的图：pictures(messages)，与第 13 章的 build_prompt 写出占位的顺序相同。

出处：Wang 等，“Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any Resolution”（2024：动态分辨率、
M-RoPE）；Dosovitskiy 等，“An Image is Worth 16x16 Words”（ViT，2021）；transformers 的 qwen3_5 与 qwen2_vl 图像处理器。
"""

import base64
import hashlib
import io
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .model import load_pretrained
from .rope import apply_rope, inverse_frequencies, tables
from .weights import find_model

class TooManyImageTokens(ValueError):
    """图像的 token 放不进上下文（服务回 context_length_exceeded）。"""


@dataclass
class VisionConfig:
    """视觉塔与图像准备的超参数：config.json 的 vision_config、顶层的 token id、preprocessor_config.json。默认值是 0.8B。"""
    depth: int = 12
    hidden_size: int = 768
    num_heads: int = 12
    intermediate_size: int = 3072
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 1024
    num_position_embeddings: int = 2304
    in_channels: int = 3
    rope_theta: float = 10000.0
    image_token_id: int = 248056  # 这几个 id 从 config.json 读：别的检查点可以不同
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    video_token_id: int = 248057
    image_mean: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    min_pixels: int = 65536  # preprocessor_config.json 的 size.shortest_edge（按像素数算）
    max_pixels: int = 16777216  # size.longest_edge

    @classmethod
    def from_checkpoint(cls, path) -> "VisionConfig":
        path, names = Path(path), {f.name for f in fields(cls)}
        top = json.loads((path / "config.json").read_text(encoding="utf-8"))
        if not isinstance(top.get("vision_config"), dict):
            raise ValueError(f"{path} 的 config.json 里没有 vision_config：这个检查点没有视觉塔，不能看图（换多模态的检查点，"
                             "如 Qwen/Qwen3.5-0.8B）")
        d = {**top["vision_config"], **{k: top[k] for k in names if k.endswith("token_id") and k in top}}
        d["rope_theta"] = (d.get("rope_parameters") or {}).get("rope_theta", cls.rope_theta)
        pre = path / "preprocessor_config.json"
        if pre.is_file():
            p = json.loads(pre.read_text(encoding="utf-8"))
            d.update({k: p[k] for k in ("image_mean", "image_std", "patch_size", "temporal_patch_size") if k in p})
            d.update({"spatial_merge_size": p.get("merge_size", d.get("spatial_merge_size", 2)),
                      "min_pixels": (p.get("size") or {}).get("shortest_edge", cls.min_pixels),
                      "max_pixels": (p.get("size") or {}).get("longest_edge", cls.max_pixels)})
        return cls(**{k: v for k, v in d.items() if k in names})


def pictures(messages) -> list:
    """消息里的图（那一段本身：{"type": "image", "image": …} 或 OpenAI 的 {"type": "image_url", …}），按出现的顺序：
    第 13 章的 build_prompt 为每张写一个占位，视觉塔按同样的顺序看它们。系统消息不能带图（build_prompt 会说）。"""
    kinds = ("image", "image_url")
    return [c for m in messages if isinstance(m, dict) and m.get("role") != "system" and isinstance(m.get("content"), list)
            for c in m["content"] if isinstance(c, dict) and any(k in c or c.get("type") == k for k in kinds)]


def source_of(part):
    """消息里的一个图像分段（pictures 取出的）→ 图的来源：{"image": 路径、bytes 或 PIL 图像}，或 OpenAI 的
    {"image_url": {"url": …}}：data: URL 解出 bytes；http(s) 不替你下载（本地的服务不替客户端上网）。"""
    src = part.get("image", part.get("image_url"))
    src = src.get("url") if isinstance(src, dict) else src
    if isinstance(src, str) and src.startswith(("http://", "https://")):
        raise ValueError("不会替你下载远程图像：请把图编成 data: URL（data:image/png;base64,…）发来，或给本地文件的路径")
    if isinstance(src, str) and src.startswith("data:"):
        head, _, data = src.partition(",")
        if not head.endswith(";base64"):
            raise ValueError(f"data: URL 应是 base64 编码的图像（data:image/png;base64,…），收到 {head[:40]!r}")
        try:
            return base64.b64decode(data, validate=True)
        except ValueError:
            raise ValueError("data: URL 里的 base64 不合法：请重新编码这张图") from None
    return src[len("file://"):] if isinstance(src, str) and src.startswith("file://") else src


def open_image(src):
    """路径、bytes 或 PIL 图像 → RGB 的 PIL 图像；读不了的给出说得清的错误。"""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ImportError('读图要 Pillow：pip install "qwen[vision]"') from None
    if isinstance(src, Image.Image):
        return src.convert("RGB")
    if isinstance(src, (str, Path)) and not Path(src).is_file():
        raise ValueError(f"图像文件 {src} 不存在")
    if not isinstance(src, (str, Path, bytes, bytearray)):
        raise ValueError(f"图像应是文件路径、bytes 或 PIL 图像，收到 {type(src).__name__}")
    name = "图像数据" if isinstance(src, (bytes, bytearray)) else f"图像文件 {src}"
    try:  # 只读文件头就知道尺寸：超过 Pillow 的上限（约 1.8 亿像素）的图在解码前拒绝，内存有界
        img = Image.open(io.BytesIO(src) if isinstance(src, (bytes, bytearray)) else src)
        return img.convert("RGB")
    except UnidentifiedImageError:
        raise ValueError(f"{name} 不是能识别的图像（支持 PNG、JPEG、WebP 等 Pillow 能读的格式）") from None
    except Image.DecompressionBombError as e:
        raise ValueError(f"{name} 太大（{e}）：请先缩小它（模型最多看 1600 万像素）") from None
    except (OSError, SyntaxError) as e:
        raise ValueError(f"{name} 读不了（{e}）：文件可能被截断或损坏") from None


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """缩放后的 (高, 宽)：两边都是 factor（= 16 × 2）的倍数，面积在 [min_pixels, max_pixels] 内，长宽比尽量不变。"""
    if max(h, w) / min(h, w) > 200:
        raise ValueError(f"图像的长宽比 {max(h, w) / min(h, w):.0f}:1 超过 200:1（{w}×{h}）：请裁剪后再发")
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:  # 太大：按面积缩小，向下取整
        beta = math.sqrt(h * w / max_pixels)
        hb, wb = max(factor, math.floor(h / beta / factor) * factor), max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < min_pixels:  # 太小：放大，向上取整
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


def prepare(img, cfg: VisionConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """RGB 图像 → (小块 [块数, 3·2·16·16] float32, 网格 (1, 高的块数, 宽的块数))。小块按 2×2 合并块的顺序排列。"""
    from PIL import Image
    import numpy as np

    P, m = cfg.patch_size, cfg.spatial_merge_size
    h, w = smart_resize(img.height, img.width, P * m, cfg.min_pixels, cfg.max_pixels)
    x = torch.from_numpy(np.asarray(img.resize((w, h), Image.BICUBIC), dtype=np.uint8).copy())  # [h, w, 3]
    x = (x.permute(2, 0, 1).double() * (1 / 255)).float()  # [3, h, w]，0..1
    x = (x - torch.tensor(cfg.image_mean)[:, None, None]) / torch.tensor(cfg.image_std)[:, None, None]  # 约 -1..1
    gh, gw = h // P, w // P
    x = x.view(3, gh // m, m, P, gw // m, m, P).permute(1, 4, 2, 5, 0, 3, 6)  # [行块, 列块, m, m, 3, P, P]
    x = x[..., None, :, :].expand(*x.shape[:5], cfg.temporal_patch_size, P, P)  # 静止的图：同一帧重复两次
    return x.reshape(gh * gw, -1), (1, gh, gw)


class VisionBlock(nn.Module):
    """x = x + proj(attn(norm1(x)))；x = x + mlp(norm2(x))。注意力只在同一张图之内（lengths 分开），不带因果掩码。"""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.heads = c.num_heads
        self.norm1, self.norm2 = nn.LayerNorm(c.hidden_size, eps=1e-6), nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(c.hidden_size, 3 * c.hidden_size), nn.Linear(c.hidden_size, c.hidden_size)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.mlp.linear_fc2 = nn.Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x, cos, sin, lengths):
        N, C = x.shape  # [块数, hidden]
        q, k, v = self.attn.qkv(self.norm1(x)).view(N, 3, self.heads, -1).permute(1, 2, 0, 3)  # 各 [heads, N, 64]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # 二维 RoPE（第 5 章）：cos、sin [N, 64]，转满 64 维
        out = torch.cat([F.scaled_dot_product_attention(*(p[None] for p in parts))[0] for parts in  # 每张图各自做注意力；
                         zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1))], dim=1)  # 四维的输入走 flash 内核
        x = x + self.attn.proj(out.transpose(0, 1).reshape(N, C))
        return x + self.mlp.linear_fc2(F.gelu(self.mlp.linear_fc1(self.norm2(x)), approximate="tanh"))


class VisionTower(nn.Module):
    """model.visual.*：小块 [N, 1536] 与各图的网格 → 语言模型的 token 向量 [N/4, out_hidden_size]。"""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.cfg = c
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel, stride=kernel)  # 每块一个线性映射
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)  # 48×48 的位置表
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = nn.Module()
        wide = c.hidden_size * c.spatial_merge_size**2  # 2×2 块拼起来：3072
        self.merger.norm = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.merger.linear_fc1, self.merger.linear_fc2 = nn.Linear(wide, wide), nn.Linear(wide, c.out_hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.merger.linear_fc2.weight.dtype

    def grid_tables(self, grids):
        """每张图的位置表（插值到它的网格）[N, hidden] 与二维 RoPE 的 cos、sin [N, head_dim]，都按合并块的顺序。"""
        c, m = self.cfg, self.cfg.spatial_merge_size
        side = int(c.num_position_embeddings**0.5)
        table = self.pos_embed.weight.float().T.reshape(1, -1, side, side)  # [1, hidden, 48, 48]
        d = c.hidden_size // c.num_heads // 2  # 一半维度给行号，一半给列号
        inv_freq = inverse_frequencies(d, c.rope_theta)
        pos, angles = [], []
        for t, h, w in grids:
            p = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
            order = lambda a: a.reshape(-1, h // m, m, w // m, m).permute(1, 3, 2, 4, 0).reshape(h * w, -1)
            rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            hw = order(torch.stack([rows, cols]).float())  # [h·w, 2]：每块的 (行, 列)
            pos.append(order(p).repeat(t, 1))
            angles.append(torch.cat([hw[:, :1] * inv_freq, hw[:, 1:] * inv_freq], -1).repeat(t, 1))
        return torch.cat(pos), *tables(torch.cat(angles))  # cos、sin [N, head_dim]：前后两半同一组角度

    def forward(self, pixels: torch.Tensor, grids) -> torch.Tensor:
        w = self.patch_embed.proj.weight
        x = F.linear(pixels.to(w.dtype), w.flatten(1), self.patch_embed.proj.bias)  # [N, hidden]：Conv3d 就是这个
        pos, cos, sin = self.grid_tables(grids)
        x = x + pos.to(x.dtype)  # 与 transformers 相同：位置表先转成塔的 dtype 再加
        lengths = [t * h * w for t, h, w in grids]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        x = self.merger.norm(x).view(-1, self.merger.linear_fc1.in_features)  # [N/4, 3072]：相邻的 4 块是一个 2×2
        return self.merger.linear_fc2(F.gelu(self.merger.linear_fc1(x)))  # [N/4, out_hidden_size]

    def encode(self, sources, most: int | None = None) -> "Images":
        """几张图（路径、bytes、PIL 图像，或消息里的图像分段）→ Images：塔的输出、各自的网格与内容的摘要。
        most：至多几个图像 token（上下文还剩的）；多了在算塔之前就是 TooManyImageTokens。"""
        prepared = [prepare(open_image(source_of(s) if isinstance(s, dict) else s), self.cfg) for s in sources]
        n = sum(t * h * w for _, (t, h, w) in prepared) // self.cfg.spatial_merge_size**2
        if most is not None and n > most:
            raise TooManyImageTokens(f"{len(prepared)} 张图一共 {n} 个 token，超过上下文还剩的 {max(most, 0)} 个：请少发几张图、"
                                     "把图缩小，或缩短对话")
        with torch.inference_mode():
            embeds = self(torch.cat([p for p, _ in prepared]), [g for _, g in prepared])
        digests = [hashlib.sha256(p.numpy().tobytes()).hexdigest()[:16] for p, _ in prepared]
        return Images(embeds, [g for _, g in prepared], self.cfg, digests)

    @classmethod
    def from_pretrained(cls, path=None, dtype: torch.dtype = torch.float32) -> "VisionTower":
        """读检查点里的 model.visual.*（与第 10 章的 Model 一样加载）。"""
        path = find_model(path)
        tower = load_pretrained(cls, VisionConfig.from_checkpoint(path), path, "model.visual.", dtype, "视觉塔，不能看图")
        return tower.to(dtype)  # 范数、偏置、卷积核也用 dtype：塔里的运算都在它里面算（与 transformers 相同）


@dataclass
class Images:
    """一个提示词里的几张图：塔的输出 embeds [Σ token 数, hidden]、各自的网格 (t, h, w)（以块计）、内容摘要。"""
    embeds: torch.Tensor
    grids: list
    cfg: VisionConfig
    digests: list

    def counts(self) -> list[int]:  # 每张图占几个 token：网格 / (2×2)
        return [t * h * w // self.cfg.spatial_merge_size**2 for t, h, w in self.grids]

    def expand(self, ids: torch.Tensor, prefix: bool = False) -> torch.Tensor:
        """ids [1, T]：每张图的一个 <|image_pad|> 展开成它的 token 数个（transformers 的处理器在文字上做同样的事）。
        prefix=True：ids 是提示词的前一段，只有前几张图的占位。"""
        pads = (ids[0] == self.cfg.image_token_id).nonzero()[:, 0].tolist()
        if len(pads) > len(self.grids) or len(pads) < len(self.grids) and not prefix:
            raise ValueError(f"提示词里有 {len(pads)} 个图像占位 <|image_pad|>，却给了 {len(self.grids)} 张图")
        parts, last = [], 0
        for i, n in zip(pads, self.counts()):
            parts += [ids[0, last:i], ids.new_full((n,), self.cfg.image_token_id)]
            last = i + 1
        return torch.cat(parts + [ids[0, last:]])[None]

    def part(self, ids: list, a: int, b: int) -> "Images | None":
        """展开过的 ids 里 [a, b) 这一段的图（一张图的 token 总在同一段里）；这一段没有图时 None。"""
        pad = self.cfg.image_token_id
        k0, k = ids[:a].count(pad), ids[a:b].count(pad)  # 这段之前、之内各有几个图像 token
        ends = torch.tensor(self.counts()).cumsum(0).tolist()
        i, j = sum(e <= k0 for e in ends), sum(e <= k0 + k for e in ends)  # 这段里的是第 i 到 j − 1 张
        if k == 0:
            return None
        return Images(self.embeds[k0 : k0 + k], self.grids[i:j], self.cfg, self.digests[i:j])

    def place(self, x: torch.Tensor, ids: torch.Tensor, start: int):
        """一行 ids [T] 与它的嵌入 x [T, h]：图像 token 的向量换成塔的输出 → (x, 三维位置 [3, T])；文字的三个分量相同。"""
        where = (ids == self.cfg.image_token_id).nonzero()[:, 0].tolist()
        if len(where) != self.embeds.shape[0]:
            raise ValueError(f"提示词里有 {len(where)} 个图像 token，{len(self.grids)} 张图却有 {self.embeds.shape[0]} 个："
                             "请用 Images.expand 展开占位")
        x, m = x.clone(), self.cfg.spatial_merge_size
        x[where] = self.embeds.to(x.dtype)
        positions, cur, done, k = [], start, 0, 0  # cur：下一个位置；done：已排好的 token；k：第几个图像 token
        for (t, h, w), n in zip(self.grids, self.counts()):
            a = where[k]
            if where[k + n - 1] != a + n - 1:
                raise ValueError("一张图的 token 在提示词里不连续：占位要用 Images.expand 整段展开")
            positions.append(torch.arange(cur, cur + a - done).expand(3, -1))  # 图前的文字
            cur += a - done
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h // m), torch.arange(w // m), indexing="ij"))
            positions.append(grid.reshape(3, -1) + cur)  # (t, 行, 列) 从 cur 起
            cur, done, k = cur + max(h, w) // m, a + n, k + n  # 图之后的文字从 max(位置) + 1 接着数
        positions.append(torch.arange(cur, cur + len(ids) - done).expand(3, -1))
        return x, torch.cat(positions, 1).to(x.device)  # [T, h]、[3, T]

    def inputs(self, model, ids, state=None) -> dict:
        """一个提示词 ids [1, T] 里的这几张图 → 第 10 章 model.hidden 的 embeds 与 positions（见 image_inputs）。"""
        return image_inputs(model, ids, state, [self])


@dataclass
class ImageRows:
    """批处理（第 13 章附的 generate_batch）每行的图：rows[b] 是第 b 行的 Images 或 None。"""
    rows: list

    def inputs(self, model, ids, state=None) -> dict:
        return image_inputs(model, ids, state, self.rows)


def image_inputs(model, ids, state, rows) -> dict:
    """ids [B, T]（占位已展开）与每行的图 → 第 10 章 model.hidden 的输入：embeds [B, T, hidden]（图像 token 的向量换成塔的
    输出）与三维位置 [3, B, T]（接着 state 数：左填充的位置不动，每行从它第一个真实 token 数起；文字的三个分量相同）。"""
    ids = model.check_ids(ids, state)
    B, T = ids.shape
    if len(rows) != B:
        raise ValueError(f"images 应是每行一个（Images 或 None），收到 {len(rows)} 个，提示词有 {B} 行")
    base, x = model.positions(T, state, ids.device).expand(B, T), model.embed_tokens(ids)  # [B, T]、[B, T, hidden]
    lead = [0] * B if state is None or state.valid is None else (state.pad - state.pos).clamp(min=0).tolist()
    xs, ps = list(x), [p.expand(3, -1) for p in base]  # 每行：左填充不动，真实 token 里放进图
    for b, (im, a) in enumerate(zip(rows, lead)):
        if im is not None:
            xb, pb = im.place(x[b, a:], ids[b, a:], int(base[b, a]))
            xs[b], ps[b] = torch.cat([x[b, :a], xb]), torch.cat([ps[b][:, :a], pb], 1)
    return {"embeds": torch.stack(xs), "positions": torch.stack(ps, 1)}
