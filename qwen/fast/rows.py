"""附录 · 快路径：留在文件里的词嵌入表。

打包之后输出头已有一份自己布局的副本，与它共用的嵌入表（0.8B 上 248320 × 1024，0.5 GB）就不必再放在内存里：
查表每个 token 只要一行，RowReader 按偏移从 safetensors 文件里直接读出那几行。safetensors 文件是 8 字节的头长度 n、
n 字节的 JSON 头（每个张量的 dtype、shape 与 data_offsets），再接原始字节，所以第 i 行在固定的偏移处。
不用内存映射：映射里读过的页会算进本进程的常驻内存，内核还会顺带映射周围的一大片。
所以模型在用的时候检查点文件要在。
"""

import json
import math
import os
import threading
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from ..weights import open_safetensors, safetensors_files

SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def tensor_file(path, part: str, key: str, index: dict | None = None) -> tuple[Path, str]:
    """一个张量在检查点的哪个文件里、全名是什么。key 去掉了前缀，如 part="model."、key="embed_tokens.weight"。
    index：tensor_index 建好的 {全名: 文件}（读很多张量时只读一遍各分片的文件头）。"""
    prefixes = ("model.language_model.", "model.") if part == "model." else (part,)
    for prefix in prefixes:
        if prefix + key in (names := index if index is not None else tensor_index(path)):
            return names[prefix + key], prefix + key
    raise ValueError(f"检查点 {path} 里没有张量 {key}（前缀 {' 或 '.join(prefixes)}）")


def tensor_index(path) -> dict:
    """检查点里每个张量的全名 → 它所在的文件。"""
    index = {}
    for file in safetensors_files(path):
        with open_safetensors(file) as f:
            index.update(dict.fromkeys(f.keys(), file))
    return index


def head_tensor(cfg) -> tuple[str, str]:
    """输出头在检查点里的 (部分, 名字)，给 tensor_file：共用嵌入时是嵌入表，不共用时在检查点的顶层。"""
    return ("model.", "embed_tokens.weight") if cfg.tie_word_embeddings else ("", "lm_head.weight")


def meta_tensor(file: Path, name: str, dtype: torch.dtype | None) -> torch.Tensor:
    """第 1 章 load_weights 的 read：只读文件头里的形状，返回同样形状与 dtype 的 meta 张量（规则同 read_tensor：
    矩阵用 dtype，其余浮点张量用 float32）。真的权重等到变换那一层时由 materialize 读出。"""
    with open_safetensors(file) as f:
        info = f.get_slice(name)
        shape, kind = info.get_shape(), info.get_dtype()
    if kind not in SAFETENSORS_DTYPES:
        raise ValueError(f"{file} 里的 {name} 是 {kind}：权重应是浮点张量（BF16、F16 或 F32）")
    floating = dtype or SAFETENSORS_DTYPES[kind]
    matrix = len(shape) == 2 or name.endswith("_proj")  # 矩阵与堆叠的专家 [E, out, in]
    return torch.empty(shape, dtype=floating if matrix else torch.float32, device="meta")


def materialize(root: nn.Module, path, part: str, prefix: str = "", raw: bool = False) -> None:
    """把 root（检查点里 part 那一部分：part="model." 或 "mtp."）里名字以 prefix 开头、还在 meta 设备上的参数从检查点
    读出来（dtype 与 meta 张量相同；raw 时矩阵保持文件里的 dtype，是文件映射的视图，换分块布局时 C++ 的 to_blocks
    读一遍就丢掉）。加载时快路径只读了形状（meta_tensor）；变换前一层一层地读，内存里同时只有一层的原始权重。
    每个文件只打开一次（一层有十几个小张量，每个都打开一次文件，就要各付一次打开文件、读文件头的开销）。
    专家混合层的专家（experts.gate_up_proj、down_proj）不在这里读：留在 meta 设备上，挂一个 ExpertReader，换布局时
    一个专家一个专家地读（内存里不必有整层的专家）。"""
    index = tensor_index(path)
    with ExitStack() as files:
        opened = {}

        def read(file, full):
            if file not in opened:
                opened[file] = files.enter_context(open_safetensors(file))
            return opened[file].get_tensor(full)

        for name, param in list(root.named_parameters(remove_duplicate=False)):
            if not name.startswith(prefix) or not param.is_meta:
                continue
            is_head = part == "model." and name == "lm_head.weight"
            module_name, _, leaf = name.rpartition(".")
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # 专家：换布局时一个一个地读（ExpertReader）
                dtype = None if raw else param.dtype
                root.get_submodule(module_name).reader = ExpertReader(path, part, module_name, index, dtype)
                continue
            where = head_tensor(root.cfg) if is_head else (part, name)
            tensor = read(*tensor_file(path, *where, index))
            if not (raw and (param.ndim == 2 or name.endswith("_proj"))):  # 转成 meta 张量的 dtype，拷进自己的内存
                own = tensor.to(param.dtype)
                tensor = own.clone() if own.data_ptr() == tensor.data_ptr() else own
            setattr(root.get_submodule(module_name), leaf, nn.Parameter(tensor, requires_grad=False))


class ExpertReader:
    """一层的专家留在检查点文件里：reader(e) 只读出第 e 个专家的 (gate_up [2I, hidden]、down [hidden, I])——堆叠存的
    （experts.gate_up_proj [E, 2I, hidden]）读第 e 段，按专家分开存的（experts.{e}.gate_proj.weight 等）读它的三个张量。
    换布局时一个专家一个专家地读、换掉：35B-A3B 一层的专家在 bfloat16 里有 1.6 GB，不必整层读进内存。按偏移直接读文件
    （RowReader），不用内存映射：映射里读过的页在文件关上之前都算进常驻内存，一层的专家读完就是 1.6 GB。
    dtype：转成它（None：文件里的 dtype）。"""

    def __init__(self, path, part: str, base: str, index: dict, dtype=None):
        self.path, self.part, self.base, self.index, self.dtype = path, part, base, index, dtype
        self.headers = {}  # 文件 → 它的文件头（分开存时一层有 768 个张量：每个文件的头只读一次）
        self.stacked = has_tensor(path, part, base + ".gate_up_proj", index)

    def read(self, key: str, e: int | None = None) -> torch.Tensor:
        file, full = tensor_file(self.path, self.part, key, self.index)
        if file not in self.headers:
            self.headers[file] = file_header(file)
        rows = RowReader(file, full, self.dtype, self.headers[file])
        shape = rows.tensor_shape if e is None else rows.tensor_shape[1:]
        return (rows.rows(0, rows.shape[0]) if e is None else rows.rows(e, e + 1)).view(shape)

    def __call__(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stacked:
            return self.read(self.base + ".gate_up_proj", e), self.read(self.base + ".down_proj", e)
        gate_up = torch.cat([self.read(f"{self.base}.{e}.{k}.weight") for k in ("gate_proj", "up_proj")])
        return gate_up, self.read(f"{self.base}.{e}.down_proj.weight")


def file_header(file) -> tuple[int, dict]:
    """safetensors 文件的头：(数据区在文件里的偏移, {张量名: dtype、shape、data_offsets})。"""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


def has_tensor(path, part: str, key: str, index: dict) -> bool:
    try:
        tensor_file(path, part, key, index)
        return True
    except ValueError:
        return False


class RowReader:
    """检查点里的一个张量，留在磁盘上：reader[ids] 只读出这几行（沿第一维；三维的堆叠专家 [E, out, in] 的一“行”是一个
    专家）。header：file_header 读好的文件头（读同一个文件里的很多张量时只读一次）。"""

    def __init__(self, file: str | os.PathLike, name: str, dtype: torch.dtype | None = None, header=None):
        self.file = open(file, "rb")  # 一直开着，对象回收时关闭
        self.lock = threading.Lock()  # 没有 os.pread 的系统上，seek 与 read 要成对地做
        data, head = header or file_header(file)
        info = head[name]
        if info["dtype"] not in SAFETENSORS_DTYPES or len(info["shape"]) < 2:
            raise ValueError(f"{file} 里的 {name} 是 {info['dtype']} {info['shape']}：按行读只支持二维以上的浮点张量")
        self.file_dtype = SAFETENSORS_DTYPES[info["dtype"]]
        self.tensor_shape = tuple(info["shape"])
        self.shape = (self.tensor_shape[0], math.prod(self.tensor_shape[1:]))  # [行数, 一行几个数]
        self.dtype = dtype or self.file_dtype
        self.row_bytes = self.shape[1] * self.file_dtype.itemsize
        self.start = data + info["data_offsets"][0]  # 这个张量的第 0 行在文件里的偏移

    def __del__(self):
        if hasattr(self, "file"):
            self.file.close()

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids 任意形状的整数张量 → [..., 列数]，dtype 为 self.dtype。"""
        flat, buf, first = ids.flatten().tolist(), bytearray(), 0
        for end in range(1, len(flat) + 1):  # 相邻的几行（起草词表的前几万个 id）一次读出
            if end == len(flat) or flat[end] != flat[end - 1] + 1:
                buf += self.read_at(self.start + flat[first] * self.row_bytes, (end - first) * self.row_bytes)
                first = end
        return torch.frombuffer(buf, dtype=self.file_dtype).view(*ids.shape, self.shape[1]).to(self.dtype)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """第 start…stop−1 行，一次连续读出：[stop − start, 列数]。"""
        buf = bytearray(self.read_at(self.start + start * self.row_bytes, (stop - start) * self.row_bytes))
        return torch.frombuffer(buf, dtype=self.file_dtype).view(stop - start, self.shape[1]).to(self.dtype)

    def read_at(self, offset: int, size: int) -> bytes:
        """从文件的 offset 处读 size 个字节。按位置读（os.pread）不动共享的文件指针：几个请求同时查嵌入时，
        先 seek 再 read 的两步会被别的线程插进来，读到别人的行。"""
        if not hasattr(os, "pread"):
            with self.lock:
                self.file.seek(offset)
                return self.file.read(size)
        parts = []
        while size > 0:
            part = os.pread(self.file.fileno(), size, offset)  # 大块可能一次读不完
            if not part:
                raise ValueError(f"{self.file.name} 比它的文件头记录的短：检查点可能没下载完，请重新下载")
            parts.append(part)
            offset += len(part)
            size -= len(part)
        return b"".join(parts)


class FileRows:
    """检查点里一个矩阵的一些行（ids，None 为全部），切片时才从文件读出那一段：int8 量化（quantize_int8 一次只取
    几千行）时内存里不必有整个 bfloat16 的矩阵。有 shape、dtype，能按行切片，BlockedLinear 就把它当权重用。"""

    def __init__(self, reader: RowReader, ids: torch.Tensor | None = None):
        self.reader, self.ids = reader, ids
        self.shape = (reader.shape[0] if ids is None else len(ids), reader.shape[1])
        self.dtype = reader.dtype

    def __getitem__(self, s: slice) -> torch.Tensor:
        start, stop, _ = s.indices(self.shape[0])
        return self.reader.rows(start, stop) if self.ids is None else self.reader[self.ids[start:stop]]


class FileEmbedding(nn.Module):
    """代替第 2 章的 Embedding：查表时从检查点文件按行读（RowReader），内存里没有这张表。"""

    def __init__(self, rows: RowReader):
        super().__init__()
        self.rows = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows[ids]  # [B, T] → [B, T, hidden]
