"""起草词表（qwen/tools/vocab.py）：默认规则在真实的 Qwen 分词器上覆盖中英文，数出来的表存在检查点旁边，坏的输入报错。"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from qwen.tools.vocab import VOCAB_FILE, draft_vocabulary, main

QWEN_TOKENIZER = Path(__file__).resolve().parents[2] / "shared/reference/qwen-tokenizer-151k.json"

CHINESE = [
    "长江是中国最长的河流，全长约6300公里，流经青海、西藏、四川、云南、重庆、湖北、湖南、江西、安徽、江苏和上海，"
    "最后注入东海。长江流域是中国经济最发达的地区之一，三峡大坝是世界上最大的水电站。",
    "Transformer 是一种基于注意力机制的神经网络结构，2017 年由 Google 的研究者在论文《Attention Is All You Need》中"
    "提出。它抛弃了循环结构，完全依靠自注意力来建模序列中各个位置之间的关系，因此可以并行训练。",
    "投机解码先让一个便宜的草稿模型猜出后面几个词，再让大模型一次前向把这些猜测全部验证一遍：猜对的前缀直接收下，"
    "第一个猜错的位置换成大模型自己的选择。",
    "今天天气很好，我们决定去公园散步。公园里有很多人在跑步、打太极拳，还有小朋友在放风筝。中午我们在湖边的小餐馆"
    "吃了一碗牛肉面，味道非常不错。",
]
ENGLISH = [
    "The Yangtze is the longest river in China and the third longest in the world. It flows for about 6,300 "
    "kilometres from the glaciers of the Tibetan Plateau to the East China Sea at Shanghai, and its basin is home to "
    "nearly a third of the country's population.",
    "A transformer is a neural network architecture based on the attention mechanism. It was introduced in 2017 by "
    "researchers at Google in the paper \"Attention Is All You Need\". Instead of processing a sequence step by step, "
    "it lets every position attend to every other position, which makes training highly parallel.",
    "Speculative decoding uses a small draft model to guess the next few tokens, and then the large model checks all "
    "of the guesses in a single forward pass. Every guess that matches is kept, and the first mismatch is replaced by "
    "the large model's own choice, so the output is exactly the same as ordinary decoding.",
    "We went for a walk in the park this morning. The weather was lovely, children were flying kites near the lake, "
    "and an old man was feeding the ducks. Afterwards we had lunch at a small noodle shop around the corner.",
]


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    if not QWEN_TOKENIZER.is_file():
        pytest.skip("没有 ../shared/reference/qwen-tokenizer-151k.json")
    folder = tmp_path_factory.mktemp("qwen151k")
    shutil.copy(QWEN_TOKENIZER, folder / "tokenizer.json")
    return folder


def coverage(tk, texts, ids) -> float:
    tokens = [i for t in texts for i in tk.encode(t).ids]
    keep = set(ids.tolist())
    return sum(i in keep for i in tokens) / len(tokens)


def test_default_vocabulary_covers_chinese_and_english(qwen_folder):
    """真实的 Qwen 词表上：前 32768 个 id 只盖住中文段落的四成；默认规则（前 49152 个 id 加上全部中文 token）
    盖住中文与英文段落的 token 都在 95% 以上，而不到词表的一半。"""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(qwen_folder / "tokenizer.json"))
    ids, note = draft_vocabulary(qwen_folder, 151936)
    assert coverage(tk, CHINESE, torch.arange(32768)) < 0.5  # 旧的做法：中文的 token 大多在后面
    assert coverage(tk, CHINESE, ids) >= 0.95 and coverage(tk, ENGLISH, ids) >= 0.95
    assert 49152 < len(ids) < 0.5 * 151936 and torch.equal(ids, ids.sort().values)
    assert "中文" in note and str(len(ids)) in note


def test_counted_vocabulary_is_saved_beside_the_checkpoint(tiny, tmp_path, capsys):
    """python -m qwen.tools.vocab 数自己的文本：出现过的 token 按次数排在前面，其余按默认规则补齐；存成 draft_vocab.json，
    之后 draft_vocabulary("auto") 就用它。"""
    from tokenizers import Tokenizer

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny[0], folder)
    text = tmp_path / "texts.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 5 + "print(add(1, 2))\n", encoding="utf-8")
    main([str(text), "--model", str(folder), "--size", "50"])
    assert "覆盖" in capsys.readouterr().out
    saved = json.loads((folder / VOCAB_FILE).read_text())["ids"]
    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    counts = torch.bincount(torch.tensor(tk.encode(text.read_text()).ids))
    seen = int((counts > 0).sum())
    assert len(saved) == 50 and len(set(saved)) == 50
    assert set(saved[:seen]) == set(counts.nonzero().flatten().tolist())
    assert all(counts[a] >= counts[b] for a, b in zip(saved[: seen - 1], saved[1:seen]))  # 按次数从多到少
    ids, note = draft_vocabulary(folder, 512)
    assert sorted(saved) == ids.tolist() and VOCAB_FILE in note


@pytest.mark.parametrize("value, message", [
    ("all", "auto"), (True, "一串"), (0, "至少为 1"), ([], "非空"), ([1, 2.5], "整数"), ([3, 3], "重复"),
    ([1, 512], "不在词表里"), (torch.tensor([-1]), "不在词表里"),
])
def test_bad_draft_vocab_is_refused(tiny, value, message):
    with pytest.raises(ValueError, match=message):
        draft_vocabulary(tiny[0], 512, value)


def test_broken_vocabulary_file_is_refused(tiny, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny[0], folder)
    (folder / VOCAB_FILE).write_text('{"ids": [1, 2')
    with pytest.raises(ValueError, match="draft_vocab.json 读不了.*删掉它"):
        draft_vocabulary(folder, 512)
    (folder / VOCAB_FILE).write_text('{"ids": [1, 600]}')
    with pytest.raises(ValueError, match="600 不在词表里"):
        draft_vocabulary(folder, 512)


def test_vocabulary_command_errors(tiny, tmp_path):
    with pytest.raises(SystemExit, match="读不了文本文件"):
        main([str(tmp_path / "missing.txt"), "--model", str(tiny[0]), "--out", str(tmp_path / "v.json")])
    with pytest.raises(SystemExit, match="没有 tokenizer.json"):
        main([str(tmp_path / "missing.txt"), "--model", str(tmp_path)])
