"""附录 · 起草词表：草稿头给哪些 token 打分。

草稿头每猜一个 token 都要乘一遍输出头（0.8B 上 248320 × 1024，比草稿头那一层还大）。只给一部分 token 打分，读的权重
就少得多；草稿只是猜测，主模型验证时仍看全词表，输出不变——词表外的 token 草稿头猜不到，只是少收几个草稿。
所以要挑的是“文本里最常出现的那些 token”：

- 默认（auto）：检查点旁边有 draft_vocab.json（本模块的命令从用户自己的文本数出来的，见下）就用它；否则从分词器推：
  BPE 的 id 大体按合并的先后编号，英文与代码的常见片段都在前面，取前 49152 个；中文的 token 却是后来整批加进词表的，
  几乎都在 32768 之后（Qwen 的词表里 26160 个含汉字或中文标点的 token，只有 193 个在前 32768），所以把含汉字、
  中文标点或全角符号的 token 全部加上。没有 tokenizer.json 时只取前 49152 个 id。
- 一个整数 n：前 n 个 id；一串 id：就用这些；None：全词表。

从自己的文本数一张表（FR-Spec、SGLang 的 --speculative-token-map、llama.cpp 的 d2t 都是这个思路：按模型自己输出里的
频率排）：

    python -m qwen.tools.vocab --model PATH 文本1.txt 文本2.txt …   # 存成 PATH/draft_vocab.json，之后 auto 就用它

表里先是这些文本里出现过的 token（按次数从多到少），再用上面的默认规则补到 --size 个。
"""

import argparse
import json
import re
import sys
from pathlib import Path

import torch

VOCAB_FILE = "draft_vocab.json"
COMMON_IDS = 49152  # 默认规则里取前这么多个 id
SIZE = 49152  # 数出来的表默认多大
CHINESE = re.compile("[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]")  # 中文标点、汉字、全角


def tokenizer_ids(folder: Path, vocab_size: int) -> tuple[torch.Tensor, str]:
    """默认规则：前 COMMON_IDS 个 id，加上分词器里全部含汉字或中文标点的 token。→ (升序的 id, 说明)。"""
    common = torch.arange(min(COMMON_IDS, vocab_size))
    file = folder / "tokenizer.json"
    if not file.is_file():
        return common, f"前 {len(common)} 个 id（检查点里没有 tokenizer.json，认不出中文的 token）"
    from tokenizers import Tokenizer

    try:  # 不是 JSON、不是分词器的文件：说出是哪个文件（同第 13 章的 Chat）
        tk = Tokenizer.from_file(str(file))
    except Exception as e:
        raise ValueError(f"{file} 读不了（{e}）：文件可能被截断或改坏了，请重新下载它") from None
    pieces = tk.decode_batch([[i] for i in range(COMMON_IDS, min(tk.get_vocab_size(), vocab_size))])
    chinese = [COMMON_IDS + i for i, s in enumerate(pieces) if CHINESE.search(s)]
    ids = torch.cat([common, torch.tensor(chinese, dtype=torch.long)])
    return ids, f"前 {len(common)} 个 id，加上其后 {len(chinese)} 个含汉字或中文标点的 token"


def check_ids(ids, vocab_size: int, where: str) -> torch.Tensor:
    """一串 token id → 升序、不重复的 LongTensor；不是整数、越界或重复时报错（说明出自 where）。"""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{where}：起草词表要是一串非空的整数 token id")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{where}：token id {bad[0]} 不在词表里（0…{vocab_size - 1}）")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}：起草词表里有重复的 token id")
    return torch.tensor(sorted(ids), dtype=torch.long)


def draft_vocabulary(folder, vocab_size: int, draft_vocab="auto") -> tuple[torch.Tensor | None, str]:
    """qwen.fast.load 的 draft_vocab → (起草打分的 token id（升序），None 为全词表；一句说明)。"""
    folder = Path(folder)
    if draft_vocab == "auto" and (folder / VOCAB_FILE).is_file():
        file = folder / VOCAB_FILE
        try:
            ids = json.loads(file.read_text(encoding="utf-8"))["ids"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{file} 读不了（{type(e).__name__}）：它应是 python -m qwen.tools.vocab 写的 {{\"ids\": [...]}}；"
                             "删掉它就用默认的起草词表") from None
        ids, note = check_ids(ids, vocab_size, str(file)), f"{VOCAB_FILE}（从文本数出来的）"
    elif draft_vocab == "auto":
        ids, note = tokenizer_ids(folder, vocab_size)
    elif draft_vocab is None:
        ids, note = None, "全词表"
    elif isinstance(draft_vocab, int) and not isinstance(draft_vocab, bool):
        if draft_vocab < 1:
            raise ValueError(f"draft_vocab 至少为 1（前 n 个 id），收到 {draft_vocab}")
        ids, note = torch.arange(min(draft_vocab, vocab_size)), f"前 {min(draft_vocab, vocab_size)} 个 id"
    elif isinstance(draft_vocab, str):
        raise ValueError(f'draft_vocab 是 "auto"、整数 n、一串 token id 或 None，收到 {draft_vocab!r}')
    else:
        ids, note = check_ids(draft_vocab, vocab_size, "draft_vocab"), "给定的 token id"
    if ids is None or len(ids) >= vocab_size:
        return None, "全词表"
    return ids, f"{len(ids)} 个 token（共 {vocab_size}）：{note}"


def count_tokens(tokenizer_file: Path, files, vocab_size: int) -> torch.Tensor:
    """这些文本文件里每个 token 出现的次数 → [vocab_size] 的计数（模型词表之外的 id 不算）。"""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(tokenizer_file))
    counts = torch.zeros(max(tk.get_vocab_size(), vocab_size), dtype=torch.long)
    for f in files:
        try:
            text = Path(f).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"读不了文本文件 {f}（{type(e).__name__}）：要 UTF-8 的纯文本") from None
        ids = torch.tensor(tk.encode(text).ids, dtype=torch.long)
        counts += torch.bincount(ids, minlength=len(counts))[: len(counts)]
    return counts[:vocab_size]


def ranked_vocabulary(counts: torch.Tensor, fill: torch.Tensor, size: int) -> list[int]:
    """出现过的 token 按次数从多到少，再用 fill（默认规则的 id）里还没有的补到 size 个。"""
    seen = torch.argsort(counts, descending=True, stable=True)[: int((counts > 0).sum())].tolist()[:size]
    have = set(seen)
    return seen + [i for i in fill.tolist() if i not in have][: size - len(seen)]


def coverage(counts: torch.Tensor, ids) -> float:
    """计数里有多大比例的 token 在 ids 里。"""
    return float(counts[torch.as_tensor(ids)].sum() / counts.sum().clamp(min=1))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m qwen.tools.vocab", description="从文本数出起草词表，存在检查点旁边")
    p.add_argument("files", nargs="+", help="UTF-8 文本文件（用户自己的文本，或模型生成的回答）")
    p.add_argument("--model", required=True, help="检查点文件夹（要有 tokenizer.json 与 config.json）")
    p.add_argument("--size", type=int, default=SIZE, help=f"表里放多少个 token（默认 {SIZE}）")
    p.add_argument("--out", default=None, help=f"存到哪里（默认 MODEL/{VOCAB_FILE}）")
    args = p.parse_args(argv)
    from ..weights import load_config

    try:
        folder = Path(args.model)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{folder} 里没有 tokenizer.json：数 token 要检查点自带的分词器")
        if args.size < 1:
            raise ValueError(f"--size 至少为 1，收到 {args.size}")
        vocab_size = load_config(folder).vocab_size
        counts = count_tokens(folder / "tokenizer.json", args.files, vocab_size)
        default, _ = tokenizer_ids(folder, vocab_size)
        ids = ranked_vocabulary(counts, default, min(args.size, vocab_size))
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"错误：{e}")
    out = Path(args.out or folder / VOCAB_FILE)
    out.write_text(json.dumps({"ids": ids, "texts": [str(f) for f in args.files], "tokens": int(counts.sum())}))
    print(f"数了 {int(counts.sum())} 个 token（{int((counts > 0).sum())} 种）。默认的起草词表（{len(default)} 个）"
          f"覆盖其中 {coverage(counts, default):.1%}；新表 {len(ids)} 个，覆盖 {coverage(counts, ids):.1%}。存到 {out}")


if __name__ == "__main__":
    main()
