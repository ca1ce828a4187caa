"""服务里的图：OpenAI 的 image_url（data: URL）与本库逐 token 相同（旁边有别的请求也一样），留下的状态只给同样的图用，
坏的图与不支持的写法都是 4xx 与 OpenAI 的错误体，没有视觉塔的检查点也说清楚。"""

import base64
import io
import threading

import numpy as np
import pytest
import torch

from checkpoints import make_vision_checkpoint
from qwen import Chat, generate
from qwen.fast import load_draft, load_model
from qwen.vision import VisionTower, pictures

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
PIL = pytest.importorskip("PIL.Image")
from serving import NAME, check_error, post, start, stop  # noqa: E402  同一套起服务、发请求的工具


def data_url(seed, size=(64, 96), fmt="PNG") -> str:
    out = io.BytesIO()
    PIL.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(out, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(out.getvalue()).decode()


def image_message(url, text="图里有什么？"):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """带视觉塔的随机检查点上的服务（分块布局、草稿头）；max_prompt 小：图多了要 context_length_exceeded。"""
    from qwen.serve.api import Server
    from qwen.serve.engine import Engine

    path, _ = make_vision_checkpoint(tmp_path_factory.mktemp("served-vision"), seed=11, out_scale=1.0)
    model = load_model(path, dtype=torch.float32)
    engine = Engine(model, load_draft(model), slots=4, cache_mb=64)
    server = Server(NAME, max_tokens=256, max_prompt=400)
    server.ready(engine)
    url, uv = start(server)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120), engine, server, url
    stop(uv, server, keep_engine=False)


def library_answer(model, messages, n):
    """同一个提示词在本库里：build_prompt 写出占位，视觉塔看消息里的图（pictures），占位展开，贪心生成。"""
    chat = Chat(model)
    ids = chat.encode(chat.prompt(messages))
    images = VisionTower.from_pretrained(model.path, dtype=model.dtype).encode(pictures(messages))
    ids = images.expand(ids)
    return chat.decode(generate(model, ids, n, stop=chat.stop, images=images)), ids.shape[1]


def test_an_image_request_equals_the_library_even_beside_others(seen):
    client, engine, _, _ = seen
    messages = image_message(data_url(1))
    want, prompt_tokens = library_answer(engine.model, messages, 12)
    got, texts = {}, ["你好", "写一首诗", "def add(a, b):"]

    def ask(key, msgs):
        got[key] = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0)

    threads = [threading.Thread(target=ask, args=("image", messages))]
    threads += [threading.Thread(target=ask, args=(t, [{"role": "user", "content": t}])) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got["image"].choices[0].message.content == want
    assert got["image"].usage.prompt_tokens == prompt_tokens
    for t in texts:
        assert got[t].choices[0].message.content == library_answer_text(engine.model, t, 12)


def library_answer_text(model, text, n):
    chat = Chat(model)
    return chat.decode(generate(model, chat.encode(chat.prompt([{"role": "user", "content": text}])), n, stop=chat.stop))


def test_a_stored_state_is_reused_only_for_the_same_images(seen):
    client, engine, _, _ = seen
    engine.cache.items.clear()
    engine.cache.size = 0
    first = image_message(data_url(2))
    answer = client.chat.completions.create(model=NAME, messages=first, max_tokens=6, temperature=0)
    second = first + [{"role": "assistant", "content": answer.choices[0].message.content}, {"role": "user", "content": "再说说"}]
    resumed = client.chat.completions.create(model=NAME, messages=second, max_tokens=6, temperature=0)
    assert resumed.usage.prompt_tokens_details.cached_tokens > 0
    other = image_message(data_url(3)) + second[1:]  # 同样大小的另一张图：token 完全相同
    fresh = client.chat.completions.create(model=NAME, messages=other, max_tokens=6, temperature=0)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.usage.prompt_tokens == resumed.usage.prompt_tokens


BAD_IMAGES = [
    (image_message("https://example.com/cat.png"), "data: URL"),
    (image_message("data:image/png;base64,@@@"), "base64"),
    (image_message("data:image/png;base64," + base64.b64encode(b"plain text").decode()), "不是能识别的图像"),
    (image_message(data_url(4)[: len("data:image/png;base64,") + 280]), "读不了"),  # 截断的 PNG（base64 本身完整）
    (image_message(data_url(5, (2, 500))), "长宽比"),
    ([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}], "不支持 video_url"),
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(6)}}]},
      {"role": "user", "content": "hi"}], "系统消息不能带图"),
]


@pytest.mark.parametrize("messages,words", BAD_IMAGES, ids=["remote URL", "bad base64", "not an image", "truncated PNG",
                                                          "aspect over 200:1", "video", "image in the system message"])
def test_bad_images_get_openai_errors(seen, messages, words):
    _, engine, _, url = seen
    check_error(*post(url + "/v1/chat/completions", {"messages": messages}), 400, words)
    assert not engine.running and not engine.queue


def test_more_image_tokens_than_the_context_allows(seen):
    """一张 600×600 的 PNG（请求体 1.4 MB：比旧的 1 MB 上限大，照收）有 361 个 token，加上文字超过这个服务的 400。"""
    _, engine, _, url = seen
    body = {"messages": image_message(data_url(7, (600, 600)))}
    assert len(str(body)) > 1 << 20
    code, reply = post(url + "/v1/chat/completions", body)
    check_error(code, reply, 400, "上下文")
    assert reply["error"]["code"] == "context_length_exceeded"


def test_an_image_to_a_checkpoint_without_a_tower(seen, tmp_path):
    """demo 没有视觉塔：400，说它不能看图；服务接着回答别的请求。"""
    from qwen.serve.api import Server
    from qwen.serve.engine import Engine
    from serving import post as send

    server = Server(NAME, max_tokens=16)
    server.ready(Engine(load_model("demo", dtype=torch.float32), None, slots=1, cache_mb=8))
    url, uv = start(server)
    try:
        check_error(*send(url + "/v1/chat/completions", {"messages": image_message(data_url(8))}), 400, "不能看图")
        code, reply = send(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "def f("}], "max_tokens": 2})
        assert code == 200, reply
    finally:
        stop(uv, server, keep_engine=False)


def test_an_image_through_the_anthropic_and_responses_apis(seen):
    """同一张图、同一个问题：Anthropic 的 image 块（base64）与 Responses 的 input_image（data: URL）的贪心回答与提示词
    token 数，都与 chat completions 的相同。"""
    anthropic = pytest.importorskip("anthropic")
    client, _, _, url = seen
    image = data_url(4)
    want = client.chat.completions.create(model=NAME, messages=image_message(image), max_tokens=8, temperature=0)
    media, _, data = image[len("data:"):].partition(";base64,")
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}, {"type": "text", "text": "图里有什么？"}]
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    got = claude.messages.create(model="x", max_tokens=8, messages=[{"role": "user", "content": blocks}])
    assert got.content[0].text == want.choices[0].message.content
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == want.usage.prompt_tokens  # 接着读的另算
    parts = [{"type": "input_image", "image_url": image}, {"type": "input_text", "text": "图里有什么？"}]
    r = client.responses.create(model=NAME, input=[{"role": "user", "content": parts}], max_output_tokens=8, temperature=0)
    assert r.output_text == want.choices[0].message.content and r.usage.input_tokens == want.usage.prompt_tokens
