"""第 15 章 vision.py：视觉塔与带图的提示词——像素、塔的输出、logits、贪心续写与 transformers 对照；投机解码与批处理逐位不变；坏输入。"""

import io
import json
import sys

import numpy as np
import pytest
import torch

from checkpoints import make_vision_checkpoint
from qwen import Model, State, generate, generate_batch, generate_mtp
from qwen.vision import ImageRows, VisionConfig, VisionTower, open_image, prepare

PIL = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """(路径, transformers 的 Qwen3_5ForConditionalGeneration)：发布布局，视觉塔是 0.8B 的宽度、2 个块。"""
    return make_vision_checkpoint(tmp_path_factory.mktemp("vision"), seed=7, out_scale=1.0)


@pytest.fixture(scope="module")
def tower(vision):
    return VisionTower.from_pretrained(vision[0])


def picture(h, w, seed=0):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def reference(vision, images):
    """transformers 的 PIL 图像处理器（按检查点的 preprocessor_config.json）→ pixel_values、image_grid_thw。"""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = json.loads((vision[0] / "preprocessor_config.json").read_text())
    return Qwen2VLImageProcessorPil(**config)(images=images, return_tensors="pt")


def prompt_ids(cfg, pieces):
    """pieces：整数（文字 token）或 "image"（一个占位 <|image_pad|>，两边是 vision_start / vision_end）→ [1, T]。"""
    ids = []
    for p in pieces:
        ids += [cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id] if p == "image" else [p]
    return torch.tensor([ids])


@pytest.mark.parametrize("size", [(300, 300), (257, 513), (20, 30), (4200, 4100)],
                         ids=["square", "non-square", "tiny (below the minimum)", "huge (above the maximum)"])
def test_pixels_equal_transformers(vision, size):
    img = picture(*size)
    ours, grid = prepare(img, VisionConfig.from_checkpoint(vision[0]))
    ref = reference(vision, [img])
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    assert torch.equal(ours, ref["pixel_values"])


@pytest.mark.parametrize("layout", ["one image", "two images in one message", "an image in a later turn"])
def test_logits_match_transformers(vision, tower, layout):
    """塔的输出与 logits 在参考实现自己的 float32 误差之内；后来的一轮带图：接着状态喂，位置从 max + 1 接着数。"""
    path, hf = vision
    model = Model.from_pretrained(path)
    cfg = tower.cfg
    imgs = [picture(64, 96, 1)] if layout == "one image" else [picture(64, 96, 1), picture(120, 90, 2)]
    text = {"one image": [10, "image", 11, 12],
            "two images in one message": [10, "image", 11, "image", 12, 13],
            "an image in a later turn": [10, "image", 11, 12, 13, 14, "image", 15, 16]}[layout]
    images = tower.encode(imgs)
    ids = images.expand(prompt_ids(cfg, text))
    ref = reference(vision, imgs)
    with torch.no_grad():
        feats = hf.model.visual(ref["pixel_values"], ref["image_grid_thw"]).pooler_output
        want = hf(input_ids=ids, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                  mm_token_type_ids=(ids == cfg.image_token_id).int()).logits
    assert (images.embeds - feats).abs().max() <= 1e-5 * feats.abs().max()
    if layout != "an image in a later turn":
        got = model(ids, **images.inputs(model, ids))  # 第 15 章给出向量与三维位置，第 10 章的模型只收这两样
    else:  # 第一轮读到第一张图之后几个 token，第二轮带着第二张图接着读
        cut = int((ids[0] == 13).nonzero()[0])  # 第一张图之后的 11、12 读进第一轮
        first, second = tower.encode(imgs[:1]), tower.encode(imgs[1:])
        state = State(model)
        a, b = ids[:, :cut], ids[:, cut:]
        got = torch.cat([model(a, state, **first.inputs(model, a, state)), model(b, state, **second.inputs(model, b, state))], 1)
        _, delta = hf.model.get_rope_index(ids, (ids == cfg.image_token_id).int(), ref["image_grid_thw"])
        assert state.shift == int(delta) < 0  # 图之后的文字：位置 = 读过的 token 数 + shift（transformers 的 rope_deltas）
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_greedy_after_an_image_equals_transformers_generate(vision, tower):
    path, hf = vision
    model = Model.from_pretrained(path)
    img = picture(80, 64, 3)
    images = tower.encode([img])
    ids = images.expand(prompt_ids(tower.cfg, [20, 21, "image", 22, 23]))
    ref = reference(vision, [img])
    want = hf.generate(input_ids=ids, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                       mm_token_type_ids=(ids == tower.cfg.image_token_id).int(), max_new_tokens=16, do_sample=False)
    got = generate(model, ids, 16, images=images)
    assert got == want[0, ids.shape[1]:].tolist()
    assert len(set(got)) > 3  # 续写不是一个 token 的重复：比的是真的生成


def test_an_moe_model_sees_images_like_transformers(tmp_path):
    """专家混合的多模态检查点（Qwen3_5MoeForConditionalGeneration 的布局，视觉塔加宽到 1152）：塔与 logits 在参考实现的误差
    之内，贪心续写与 transformers 的 generate 逐 token 相同；快路径（int4）上投机解码与普通贪心逐 token 相同。"""
    from qwen.fast import load

    moe = make_vision_checkpoint(tmp_path / "moe", seed=8, out_scale=1.0, moe=True, depth=1)
    path, hf = moe
    model, tower = Model.from_pretrained(path), VisionTower.from_pretrained(path)
    img = picture(64, 96, 5)
    images = tower.encode([img])
    ids = images.expand(prompt_ids(tower.cfg, [10, "image", 11, 12]))
    ref = reference(moe, [img])
    kw = dict(pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
              mm_token_type_ids=(ids == tower.cfg.image_token_id).int())
    with torch.no_grad():
        want = hf(input_ids=ids, **kw).logits
        assert (model(ids, **images.inputs(model, ids)) - want).abs().max() <= 1e-4 * want.abs().max()
        greedy = hf.generate(input_ids=ids, **kw, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert generate(model, ids, 12, images=images) == greedy and len(set(greedy)) > 3
    fast, mtp = load(path, dtype=torch.bfloat16, quantize="int4")
    images = VisionTower.from_pretrained(path, dtype=torch.bfloat16).encode([img])
    plain = generate(fast, ids, 20, images=images)
    assert generate_mtp(fast, mtp, ids, 20, draft_tokens=2, images=images)[0] == plain


def test_speculative_equals_plain_with_a_real_tower(vision):
    """bfloat16 的快路径与 bfloat16 的塔：投机解码与逐个解码逐 token 相同（每条快路径上、草稿有接受有拒绝的版本见
    test_exact.py 的 test_speculation_with_an_image_equals_greedy）。"""
    from qwen.fast import load

    model, mtp = load(vision[0], dtype=torch.bfloat16)
    tower = VisionTower.from_pretrained(vision[0], dtype=torch.bfloat16)
    images = tower.encode([picture(64, 64, 4)])
    ids = images.expand(prompt_ids(tower.cfg, [30, "image", 31, 32]))
    plain = generate(model, ids, 24, images=images)
    for k in (1, 3):
        spec, rounds, hits = generate_mtp(model, mtp, ids, 24, draft_tokens=k, images=images)
        assert spec == plain, (k, rounds, hits)


@pytest.mark.parametrize("fast", [False, True], ids=["plain", "blocked"])
def test_a_batch_row_with_an_image_equals_its_single_run(vision, tower, fast):
    from qwen.fast import load_model

    model = load_model(vision[0], dtype=torch.float32) if fast else Model.from_pretrained(vision[0])
    images = tower.encode([picture(64, 96, 5)])
    with_image = images.expand(prompt_ids(tower.cfg, [40, "image", 41]))[0]
    text = torch.tensor([42, 43, 44])
    rows = generate_batch(model, [with_image, text], 10, images=ImageRows([images, None]))
    alone = [generate(model, with_image[None], 10, images=images), generate(model, text[None], 10)]
    if fast:  # 快路径：每行与单独运行逐位相同
        assert rows == alone
    else:  # 普通模型：左填充只差舍入；这几个 token 上相同
        assert rows[0][:4] == alone[0][:4] and rows[1][:4] == alone[1][:4]


def png_bytes(img) -> bytes:
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("source,error", [
    (b"not an image at all", "不是能识别的图像"),
    (png_bytes(picture(64, 64))[:200], "读不了"),  # 截断的 PNG
    (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "不是能识别的图像"),  # Pillow 不认的格式
    (png_bytes(picture(2, 500)), "长宽比"),
    ("/no/such/file.png", "不存在"),
    (12345, "应是文件路径"),
], ids=["not an image", "truncated PNG", "unsupported format", "aspect over 200:1", "missing file", "wrong type"])
def test_bad_images_are_clear_errors(tower, source, error):
    with pytest.raises(ValueError, match=error):
        tower.encode([source])


def test_a_one_pixel_image_is_scaled_up_like_transformers(vision, tower):
    img = picture(1, 1)
    assert prepare(img, tower.cfg)[1] == (1, 16, 16) == tuple(reference(vision, [img])["image_grid_thw"][0].tolist())


def test_image_tokens_must_match_the_images(vision, tower):
    model = Model.from_pretrained(vision[0])
    images = tower.encode([picture(64, 64)])
    ids = prompt_ids(tower.cfg, [1, "image", 2])
    with pytest.raises(ValueError, match="请用 Images.expand"):
        images.inputs(model, ids)  # 占位没有展开
    with pytest.raises(ValueError, match="却给了 1 张图"):
        images.expand(prompt_ids(tower.cfg, [1, "image", "image"]))


@pytest.mark.parametrize("which", ["demo", "no tower tensors"])
def test_a_checkpoint_without_a_tower_says_so(tiny, which):
    """demo 没有 vision_config；tiny 有 vision_config、张量却对不上（不是视觉塔）：都说清楚它不能看图。"""
    with pytest.raises(ValueError, match="不能看图|视觉塔"):
        VisionTower.from_pretrained("demo" if which == "demo" else tiny[0])


def test_a_conversation_reuses_a_state_only_with_the_same_images(vision):
    """多轮对话：第二轮不重读第一轮的图；同样的文字、同样大小的另一张图（token 完全相同）从头读。输出都与从头读相同。"""
    from qwen import Chat, Conversation
    from qwen.fast import load

    model, mtp = load(vision[0], dtype=torch.float32)
    chat = Chat(model)

    def turn(img):
        return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "你好"}]}]

    def fresh(messages):
        return "".join(Conversation(chat, mtp).reply(messages, max_new_tokens=6, temperature=0))

    conv = Conversation(chat, mtp)
    first = "".join(conv.reply(turn(png_bytes(picture(64, 64, 8))), max_new_tokens=6, temperature=0))
    later = turn(png_bytes(picture(64, 64, 8))) + [{"role": "assistant", "content": first}, {"role": "user", "content": "再见"}]
    total = len(conv.encode(later, False, None)[0])
    assert "".join(conv.reply(later, max_new_tokens=6, temperature=0)) == fresh(later)
    assert conv.fed < total - 64  # 第一轮的图（64 个 token）没有重读
    other = turn(png_bytes(picture(64, 64, 9))) + later[1:]
    assert conv.encode(other, False, None)[0] == conv.encode(later, False, None)[0]  # token 一样，图不一样
    assert "".join(conv.reply(other, max_new_tokens=6, temperature=0)) == fresh(other)
    assert conv.fed == total


def test_without_pillow_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # 像没装 Pillow 那样：import PIL 失败
    with pytest.raises(ImportError, match=r'pip install "qwen\[vision\]"'):
        open_image(b"\x89PNG")


def png_header(width: int, height: int) -> bytes:
    """只有文件头的 PNG（IHDR 说它有 width×height 像素，后面没有像素数据）：不必真的造一张几亿像素的图。"""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def test_a_20000_by_20000_image_is_refused_before_it_is_decoded(tower):
    """4 亿像素：在读文件头时就拒绝（解码要 1.2 GB），说清楚要先缩小。"""
    with pytest.raises(ValueError, match="太大.*请先缩小"):
        tower.encode([png_header(20000, 20000)])


def test_cli_sees_an_image(vision, tmp_path, capsys, monkeypatch):
    """python -m qwen "…" --image PATH：回答与 Conversation 同一条消息相同；/image PATH 在交互式对话里给下一句话附图；
    读不了的图、没有视觉塔的检查点都是一行错误（退出码 1），交互式对话里说明之后接着对话。"""
    from qwen import Chat, Conversation
    from qwen.__main__ import main

    image = tmp_path / "a.png"
    picture(64, 80, 12).save(image)
    common = ["--model", str(vision[0]), "--max-new-tokens", "6", "--temperature", "0", "--dtype", "float32"]
    main(["图里有什么？", "--image", str(image), *common])
    out = capsys.readouterr().out
    from qwen.fast import load

    model, mtp = load(vision[0], dtype=torch.float32)
    message = [{"role": "user", "content": [{"type": "image", "image": str(image)}, {"type": "text", "text": "图里有什么？"}]}]
    assert out.strip() == "".join(Conversation(Chat(model), mtp).reply(message, max_new_tokens=6, temperature=0)).strip()
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {image}\n图里有什么？\n/image /no/such.png\n\n"))
    main(common)
    talk = capsys.readouterr()
    assert out.strip() in talk.out and "没有这个文件" in talk.err
    with pytest.raises(SystemExit, match="不存在"):
        main(["图里有什么？", "--image", str(tmp_path / "missing.png"), *common])
    with pytest.raises(SystemExit, match="不能看图"):
        main(["图里有什么？", "--image", str(image), "--model", "demo", *common[2:]])
