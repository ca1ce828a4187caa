"""主模型：与 transformers 的 logits 对齐、增量解码、参数量、bfloat16。"""

import pytest
import torch

from qwen import Config, Model, State, load_config, load_weights
from qwen.layer import RECURRENT_MAX_T

LENGTHS = [1, 2, 63, 64, 65, 130]


def prompt(vocab, T, seed=0):
    return torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny_model(tiny):
    """普通布局（不打包）：逐位与参考实现比，容差 1e-4。"""
    return Model.from_pretrained(tiny[0], dtype=torch.float32, pack=False)


@pytest.fixture(scope="module")
def packed_model(tiny):
    """默认加载：矩阵打包成 oneDNN 布局（累加顺序不同，差在 float32 舍入的量级）。"""
    model = Model.from_pretrained(tiny[0], dtype=torch.float32)
    mlp = model.layers[0].mlp
    assert mlp.up_proj.weight is None and mlp.gate_up.whole.packed is not None  # gate、up 拼成一个打包的矩阵
    assert mlp.down_proj.packed is not None and mlp.down_proj.weight is None
    assert model.lm_head.packed is not None and model.embed_tokens.weight is None  # 嵌入表留在文件里，按行读
    return model


@pytest.mark.parametrize("T", LENGTHS)
def test_logits_match_transformers_tiny(tiny, tiny_model, T):
    path, hf = tiny
    assert tiny_model.cfg.linear_num_value_heads > tiny_model.cfg.linear_num_key_heads
    ids = prompt(tiny_model.cfg.vocab_size, T, seed=T)
    with torch.no_grad():
        ref = hf(ids).logits
        ours = tiny_model(ids)
    assert ours.shape == ref.shape == (1, T, tiny_model.cfg.vocab_size)
    assert ref.abs().max() > 1.0  # logits 在 1 的量级，不是几乎全零
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def compiled_model(tiny):
    """compile=True：分块布局、编译的 matvec（1～8 行），每层处理 1、2 个或一整段 token 时整层编译（第 1、9、10 章）。"""
    model = Model.from_pretrained(tiny[0], dtype=torch.float32, compile=True)
    mlp = model.layers[0].mlp
    assert mlp.gate_up.whole.blocks is not None and mlp.gate_up.whole.packed is None
    assert mlp.down_proj.blocks is not None and mlp.down_proj.weight is None
    assert model.lm_head.blocks is not None and model.embed_tokens.weight is None
    assert all(layer.compiled is not None for layer in model.layers)
    return model


FAST_LAYOUTS = ["packed_model", "compiled_model"]


@pytest.mark.parametrize("which", FAST_LAYOUTS)
@pytest.mark.parametrize("T", LENGTHS + [8, 9, 32, 33])  # 分块布局：8 行以内编译的 matvec 一次乘完，9～32 行每 8 行一段，33 行起拼回普通布局
def test_fast_layout_logits_match_transformers(tiny, request, which, T):
    model = request.getfixturevalue(which)
    ids = prompt(model.cfg.vocab_size, T, seed=T)
    with torch.no_grad():
        ref = tiny[1](ids).logits
        ours = model(ids)
    assert (ours - ref).abs().max().item() <= 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("which", FAST_LAYOUTS)
@pytest.mark.parametrize("step", [1, 2, 3, 4])
def test_fast_layout_incremental_equals_one_shot(tiny_model, request, which, step):
    """一次喂 1～4 个 token（解码、验证草稿），与普通布局一次性前向一致。"""
    model = request.getfixturevalue(which)
    ids = prompt(512, 40, seed=step)
    with torch.no_grad():
        full = tiny_model(ids)
        state = State(model)
        parts = [model(ids[:, :30], state)]
        parts += [model(ids[:, i : i + step], state) for i in range(30, 40, step)]
    assert (torch.cat(parts, 1) - full).abs().max().item() <= 1e-3


@pytest.mark.parametrize("T", LENGTHS)
def test_logits_match_transformers_08b_widths(widths08b, T):
    path, hf = widths08b
    model = _w08b_model(path)
    cfg = model.cfg
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (1024, 8, 2, 256)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 16, 128)
    assert cfg.intermediate_size == 3584
    ids = prompt(cfg.vocab_size, T, seed=100 + T)
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model(ids)
    assert (ours - ref).abs().max().item() <= 1e-4


_cache = {}


def _w08b_model(path):
    if path not in _cache:
        _cache[path] = Model.from_pretrained(path, dtype=torch.float32, pack=False)
    return _cache[path]


def test_batch_rows_match_transformers(tiny, tiny_model):
    path, hf = tiny
    ids = torch.cat([prompt(512, 70, seed=s) for s in range(3)])
    with torch.no_grad():
        assert (tiny_model(ids) - hf(ids).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("split", [0, 1, 5, 63, 64, 70])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_equals_one_shot(tiny_model, split, step):
    """预填充一部分，再按 1、2、3 个 token 一次喂完剩下的：logits 与一次性前向相同。"""
    T = 80
    ids = prompt(512, T, seed=split * 10 + step)
    with torch.no_grad():
        full = tiny_model(ids)
        state = State(tiny_model)
        parts = [tiny_model(ids[:, :split], state)] if split else []
        for i in range(split, T, step):
            parts.append(tiny_model(ids[:, i : i + step], state))
    assert state.pos == T
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-4


def test_long_chunk_after_prefill_uses_chunked_form(tiny_model):
    """提示词之后再来一大段（> RECURRENT_MAX_T，走分块形式，带非零初始状态与卷积窗口）。"""
    ids = prompt(512, 150, seed=7)
    with torch.no_grad():
        full = tiny_model(ids)
        state = State(tiny_model)
        a = tiny_model(ids[:, :37], state)
        b = tiny_model(ids[:, 37 : 37 + RECURRENT_MAX_T + 1], state)
        c = tiny_model(ids[:, 37 + RECURRENT_MAX_T + 1 :], state)
    assert (torch.cat([a, b, c], dim=1) - full).abs().max().item() <= 1e-4


def test_compiled_decode_does_not_recompile(compiled_model):
    """compile=True：编译的层只按长度特化。KV 缓存扩容（第 256 个位置起）、卷积窗口、位置每步都变，都不引起重新编译
    （注意力在 Attention.attend 处断开，第 6、9 章）；否则每次重新编译要几秒。"""
    from torch._dynamo.utils import counters

    from qwen.sample import generate

    generate(compiled_model, prompt(512, 7, seed=1), 4)  # 预热：7 行的 matvec（预填充）与解码一个 token 的各层
    before = counters["stats"]["unique_graphs"]
    out = generate(compiled_model, prompt(512, 7, seed=2), 300)  # 越过 KV 缓存的第一次扩容
    assert len(out) == 300
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.parametrize("which,tol", [("tiny_model", 1e-4), ("compiled_model", 1e-3)])
def test_long_prompt_is_fed_in_pieces(tiny_model, request, which, tol):
    """带状态时长于一段（model.piece）的输入分段喂进去（第 10 章）：logits 与普通布局无状态的一次性前向相同。
    compile=True 时两整段走编译的层（第一段从空状态开始，第二段接着它的状态），剩下的 70 个 token 走普通路径。"""
    from qwen.model import COMPILED_PIECE, PREFILL_PIECE

    model = request.getfixturevalue(which)
    assert model.piece == (COMPILED_PIECE if which == "compiled_model" else PREFILL_PIECE)
    T = 2 * model.piece + 70
    ids = prompt(512, T, seed=11)
    with torch.no_grad():
        full = tiny_model(ids)
        state = State(model)
        pieces = model(ids, state)
    assert state.pos == T and state.layers[3].length == T  # 第 4 层是注意力层：KV 缓存有全部位置
    assert (pieces - full).abs().max().item() <= tol


def test_last_only_logits(tiny_model):
    ids = prompt(512, 20)
    with torch.no_grad():
        assert torch.allclose(tiny_model(ids, last=True), tiny_model(ids)[:, -1:], atol=1e-5)


def test_state_shapes(tiny_model):
    cfg = tiny_model.cfg
    state = State(tiny_model)
    with torch.no_grad():
        tiny_model(prompt(512, 10), state)
        tiny_model(prompt(512, 1), state)
    for t, s in zip(cfg.layer_types, state.layers):
        if t == "full_attention":
            assert s.k.shape == (1, cfg.num_key_value_heads, 11, cfg.head_dim) == s.v.shape
        else:
            conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
            assert s.conv.shape == (1, cfg.linear_conv_kernel_dim - 1, conv_dim) and s.conv.dtype == torch.float32
            assert s.S.shape == (1, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            assert s.S.dtype == torch.float32


def test_parameter_count_08b():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Config()  # 默认值就是 Qwen3.5-0.8B
    with torch.device("meta"):
        ours = Model(cfg)
        ref = Qwen3_5ForCausalLM(
            Qwen3_5TextConfig(
                vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                tie_word_embeddings=True,
            )
        )
    n_ours = sum(p.numel() for p in ours.parameters())  # 共用的嵌入只数一次
    n_ref = sum(p.numel() for p in ref.parameters())
    assert n_ours == n_ref == 752_393_024
    assert cfg.layer_types.count("full_attention") == 6
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [3, 7, 11, 15, 19, 23]


def test_bfloat16_greedy_agrees_with_float32(widths08b):
    path, _ = widths08b
    m32 = _w08b_model(path)
    m16 = Model.from_pretrained(path, dtype=torch.bfloat16)
    assert m16.layers[0].linear_attn.out_proj.dtype == torch.bfloat16
    assert m16.layers[0].linear_attn.A_log.dtype == torch.float32
    ids = prompt(m32.cfg.vocab_size, 64, seed=3)
    state = State(m16)
    with torch.no_grad():
        a = m32(ids).argmax(-1)
        b = m16(ids, state).argmax(-1)
    assert all(s.S.dtype == torch.float32 for s in state.layers if hasattr(s, "S"))
    agree = (a == b).float().mean().item()
    assert agree >= 0.95, agree


def test_config_flat_and_derived_layer_types():
    d = {"model_type": "qwen3_5_text", "num_hidden_layers": 8, "full_attention_interval": 4, "rope_theta": 5.0}
    cfg = Config.from_dict(d)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.rope_theta == 5.0


def test_nested_config_read(tiny):
    cfg = load_config(tiny[0])
    assert cfg.hidden_size == 128 and cfg.tie_word_embeddings and cfg.rotary_dim == 8
    assert cfg.rope_theta == 10_000_000.0


def test_load_weights_parts(tiny):
    path = tiny[0]
    text = load_weights(path, "model.", torch.bfloat16)
    assert "embed_tokens.weight" in text and not any(k.startswith(("visual", "language_model", "mtp")) for k in text)
    assert text["embed_tokens.weight"].dtype == torch.bfloat16
    assert text["layers.0.linear_attn.A_log"].dtype == torch.float32  # 一维参数保持 float32
    assert text["layers.0.linear_attn.conv1d.weight"].dtype == torch.float32  # 卷积核也是：它在 float32 里参与计算
    assert text["layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16  # 只有矩阵用计算 dtype
    mtp = load_weights(path, "mtp.")
    assert "fc.weight" in mtp and "layers.0.self_attn.q_proj.weight" in mtp and len(mtp) == 15


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_reader_matches_safetensors(tmp_path, dtype):
    """RowReader 按偏移从文件里读出的行，与 safetensors 读出的整个张量逐位相同；其他 dtype 照样转换。"""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from qwen.weights import RowReader

    table = torch.randn(300, 24).to(dtype)
    save_file({"a.bias": torch.randn(7), "b.table": table, "c": torch.randn(3, 5)}, str(tmp_path / "t.safetensors"))
    with safe_open(tmp_path / "t.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("b.table"), table)
    rows = RowReader(tmp_path / "t.safetensors", "b.table")
    ids = torch.tensor([[0, 299, 7], [7, 7, 150]])
    assert rows.shape == (300, 24) and rows.dtype == dtype
    assert torch.equal(rows[ids], table[ids])
    assert torch.equal(rows.head(10), table[:10])
    as32 = RowReader(tmp_path / "t.safetensors", "b.table", torch.float32)
    assert as32[ids].dtype == torch.float32 and torch.equal(as32[ids], table[ids].float())
    with pytest.raises(ValueError, match="二维"):
        RowReader(tmp_path / "t.safetensors", "a.bias")


def test_packed_model_keeps_embedding_in_file(tiny, tiny_model):
    """打包后嵌入表不在内存里：查表从文件读出的行与普通模型的嵌入逐位相同。"""
    packed = Model.from_pretrained(tiny[0], dtype=torch.float32)
    assert packed.embed_tokens.weight is None and packed.lm_head.weight is None
    ids = prompt(packed.cfg.vocab_size, 9, seed=5)
    assert torch.equal(packed.embed_tokens(ids), tiny_model.embed_tokens(ids))


# ---------- compile=True：分块布局与编译的 matvec（第 1 章） ----------


@pytest.mark.parametrize("out", [32, 45, 70])
def test_blocks_round_trip_and_eager_matvec(out):
    """to_blocks / from_blocks 互逆（out 不是 32 的倍数时补零行）；不编译的 matvec_blocks 与 F.linear 一致。"""
    from qwen.weights import BLOCK, from_blocks, matvec_blocks, to_blocks

    w = torch.randn(out, 24, generator=torch.Generator().manual_seed(out))
    blocks = to_blocks(w)
    assert blocks.shape == (-(-out // BLOCK), 24, BLOCK)
    assert torch.equal(blocks[0, :, 1], w[1])  # 第 0 块第 1 列就是第 1 个输出的权重
    assert torch.equal(from_blocks(blocks, out), w)
    x = torch.randn(3, 24)
    y = matvec_blocks(x, blocks)
    assert y.shape == (3, blocks.shape[0] * BLOCK)
    assert torch.allclose(y[:, :out], x @ w.T, atol=1e-5) and not y[:, out:].any()
    view = torch.randn(5, 30)[1:4, 6:]  # 不连续、有偏移的视图（像 h[:, -1:] 那样）：matvec 开头的 as_strided 不能弄丢偏移与步长
    assert torch.allclose(matvec_blocks(view, blocks)[:, :out], view @ w.T, atol=1e-5)


def test_compiled_bfloat16_matvec_matches_linear():
    """bfloat16 的分块 matvec（编译的）与 F.linear 差在 bfloat16 舍入之内，1～8 行都是。"""
    from qwen.weights import compile_matvec, to_blocks

    kernel = compile_matvec(torch.bfloat16)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    for rows in (1, 2, 3, 4, 8):
        base = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        for x in (base, torch.cat([base, base], 1)[:, 256:]):  # 连续的；有偏移、步长 512 的视图
            ref = x.float() @ w.float().T
            got = kernel(x, to_blocks(w)).float()
            assert ((got - ref).abs() <= 0.02 * ref.abs() + 0.1).all()
