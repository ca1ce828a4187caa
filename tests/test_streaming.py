"""第 12 章 streaming.py：流式输出的文字拼起来与一次解码的相同，半个汉字、半个 emoji 从不单独输出。"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen import Chat
from qwen.streaming import TextStream


@pytest.fixture(scope="module")
def chat(lively, model):  # 真实的 Qwen 分词器
    return Chat(model, lively[0])


TEXTS = ["你好，世界！长江很长。", "🚀🎉👍 emoji 😀🐉 混合 Transformer", "写一段 200 字的短文，介绍长江。🌊"]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decode_is_exact(chat, text):
    ids = chat.tk.encode(text).ids
    assert any("\ufffd" in chat.tk.decode([i]) for i in ids)  # 真的有 token 只是半个字符
    s = TextStream(chat.tk)
    pieces = [s.put(i) for i in ids] + [s.flush()]
    assert "".join(pieces) == chat.tk.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="长江你好世界🚀🎉😀🐉abc ，。\n", min_size=1, max_size=40))
def test_stream_decode_property(chat, text):
    ids = chat.tk.encode(text).ids
    s = TextStream(chat.tk)
    pieces = [s.put(i) for i in ids] + [s.flush()]
    assert "".join(pieces) == chat.tk.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
