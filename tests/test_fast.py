"""附录 qwen.fast：每条快路径给出与普通路径相同的结果（float32 下 logits 差在舍入之内、token 逐个相同）。"""

import ctypes
import platform
import time
import warnings

import pytest
import torch

from qwen import Model, State, generate
from qwen.fast import load_draft, load_model
from qwen.deltanet import recurrent_gated_delta_rule, state_after
from qwen.fast.layers import DECODE_LENGTHS, chunk_rule, recurrent_in_place
from qwen.fast.linear import (BLOCK, KERNEL_ROWS, BlockedLinear, PackedLinear, dequantize_int4, from_blocks, load_matvec,
                              matvec_blocks, quantize_int8, to_blocks)
from qwen.fast.rows import FileEmbedding, FileRows, RowReader

from checkpoints import WIDTHS_08B, make_checkpoint, prompt
from test_chunk import inputs

LENGTHS = [1, 2, 63, 64, 65, 130]


@pytest.fixture(scope="module")
def packed_model(tiny):
    """默认加载：矩阵打包成 oneDNN 布局（累加顺序不同，差在 float32 舍入的量级）。"""
    model = load_model(tiny[0], layout="packed", dtype=torch.float32)
    mlp = model.layers[0].mlp
    assert isinstance(mlp.gate_up, PackedLinear) and not hasattr(mlp, "up_proj")  # gate、up 拼成一个打包的矩阵
    assert isinstance(mlp.down_proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    assert isinstance(model.embed_tokens, FileEmbedding)  # 嵌入表留在文件里，按行读
    return model




@pytest.fixture(scope="module")
def compiled_model(tiny):
    """layout="graphs"：分块布局、C++ 的 matvec，解码与验证 1～4 个草稿的一步编译成图（附录 step.py）。"""
    model = load_model(tiny[0], layout="graphs", dtype=torch.float32)
    mlp = model.layers[0].mlp
    assert isinstance(mlp.gate_up, BlockedLinear) and isinstance(mlp.down_proj, BlockedLinear)
    assert isinstance(model.lm_head, BlockedLinear) and isinstance(model.embed_tokens, FileEmbedding)
    assert model.step_lengths == DECODE_LENGTHS  # 解码与验证：全部层编译成一张图（附录 step.py）
    return model


@pytest.fixture(scope="module")
def blocked_model(tiny):
    """默认（compile=None，能编译 C++ 时）：分块布局、C++ 的 matvec，DeltaNet 层解码时是 C++ 的 deltanet_step。"""
    model = load_model(tiny[0], dtype=torch.float32)
    assert model.layers[0].linear_attn.step_kernel is not None
    return model


@pytest.mark.parametrize("dtype,quantize", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "int8"),
                                            (torch.bfloat16, "int4")])
def test_layers_of_several_requests_at_once_equal_each_alone(tiny, dtype, quantize):
    """服务时几个请求的同一层一次算完（qwen/fast/share.py 的 layer_many，服务与左填充的批处理共用）：解码的 1 个 token、验证的 3 个（记历史）、
    短提示词的 7 个拼在一起，每个请求每一层的输出与它单独前向时逐位相同，之后的状态也是。单独前向时 DeltaNet 层整层
    一次 layer.cpp 的调用，拼在一起时逐个运算地调用同样的内核：两者也逐位相同。"""
    from qwen.attention import AttentionState
    from qwen.cache import copy_state, keep_history
    from qwen.fast.share import layer_many

    model, lengths = load_model(tiny[0], dtype=dtype, quantize=quantize), [1, 3, 7, 1]
    assert all(layer.block is not None for layer in model.layers)  # 单独前向走 layer.cpp
    with torch.inference_mode():
        states = [State(model) for _ in lengths]
        for i, state in enumerate(states[:-1]):  # 最后一个请求从头开始（还没有状态）
            model.hidden(prompt(model.cfg.vocab_size, 5 + 3 * i, seed=i), state)
        keep_history(states[1])
        alone = [copy_state(state) for state in states[:-1]] + [State(model)]
        keep_history(alone[1])
        xs = [model.embed_tokens(prompt(model.cfg.vocab_size, T, seed=10 + i)).float() for i, T in enumerate(lengths)]
        tables = [model.rope(torch.arange(state.pos, state.pos + T)) for state, T in zip(states, lengths)]
        for j, layer in enumerate(model.layers):
            many = layer_many(layer, [(x, *t, state.layers[j]) for x, t, state in zip(xs, tables, states)])
            solo = [layer(x, *t, state.layers[j]) for x, t, state in zip(xs, tables, alone)]
            assert all(torch.equal(a, b) for a, b in zip(many, solo)), f"第 {j} 层"
            for a, b in zip(states, alone):
                a, b = a.layers[j], b.layers[j]
                pairs = [(a.k, b.k), (a.v, b.v)] if isinstance(a, AttentionState) else [(a.conv, b.conv), (a.S, b.S)]
                assert all(torch.equal(u, w) for u, w in pairs), f"第 {j} 层的状态"
            xs = many


FAST_LAYOUTS = ["packed_model", "blocked_model", "compiled_model"]


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
    """一次喂 1～4 个 token（解码、验证草稿），与普通布局一次性前向一致。缓存的长度跨过 256：注意力的两种算法都用到，
    分块布局上 attention.cpp 的 softmax 从一段变成两段。"""
    model = request.getfixturevalue(which)
    ids = prompt(512, 262, seed=step)
    with torch.no_grad():
        full = tiny_model(ids)
        state = State(model)
        parts = [model(ids[:, :250], state)]
        parts += [model(ids[:, i : i + step], state) for i in range(250, 262, step)]
    assert (torch.cat(parts, 1) - full).abs().max().item() <= 1e-3




def test_compiled_decode_does_not_recompile(compiled_model):
    """layout="graphs"：编译的层只按长度特化。KV 缓存扩容（第 256 个位置起）、卷积窗口、位置每步都变，都不引起重新编译
    （注意力在 Attention.attend 处断开，第 6、9 章）；否则每次重新编译要几秒。"""
    from torch._dynamo.utils import counters

    from qwen.sample import generate

    generate(compiled_model, prompt(512, 7, seed=1), 4)  # 预热：7 行的 matvec（预填充）与解码一个 token 的各层
    before = counters["stats"]["unique_graphs"]
    out = generate(compiled_model, prompt(512, 7, seed=2), 300)  # 越过 KV 缓存的第一次扩容
    assert len(out) == 300
    assert counters["stats"]["unique_graphs"] == before




def test_compiled_speculation_equals_greedy_without_recompiling(lively):
    """layout="graphs" 的路径：warm_up 编译好解码、验证 1～4 个草稿、草稿头送进 1～5 对的各张图，并量出起草的代价；
    之后投机解码（固定 k 与自动挑 k）与普通模型的贪心逐 token 相同，并且不再编译任何图。lively 的贪心续写多样
    （tiny 的总在重复一两个 token，相同说明不了什么）。"""
    from torch._dynamo.utils import counters

    from qwen.fast import FastMTP, warm_up
    from qwen.fast.warm import valid_round_cost
    from qwen.mtp import speculate
    from qwen.sample import generate

    model = load_model(lively[0], layout="graphs", dtype=torch.float32)
    plain = Model.from_pretrained(lively[0], dtype=torch.float32)
    mtp = load_draft(model, lively[0], draft_vocab=300)
    assert isinstance(mtp, FastMTP) and mtp.step is not None
    warm_up(model, mtp)
    assert valid_round_cost(mtp.round_cost) and mtp.round_cost[-1] < 40  # 量出的：[1, r₁…r₄]，随 k 不减
    before = counters["stats"]["unique_graphs"]
    for T, k in ((9, 1), (40, 2), (12, 3), (30, 4), (70, None)):
        ids = prompt(512, T, seed=700 + T)
        r = speculate(model, mtp, ids, 30, draft_tokens=k)
        want = generate(plain, ids, 30)
        assert r.tokens == want and r.drafted > 0 and len(set(want)) >= 10
    assert counters["stats"]["unique_graphs"] == before


def test_compiler_check_is_cached_on_disk(tiny, tmp_path, monkeypatch):
    """compile=None（默认）时先问 can_compile：第一次真的试着编译；失败时在标准错误上说为什么、退回什么（一个
    RuntimeWarning），并按要编的东西（源码、编译器、CPU 的指纹）记在 $XDG_CACHE_HOME/qwen/compiler.json，之后不再试，
    用 oneDNN 打包的布局。源码变了（比如装上了原先缺的内核文件）就重新试；记录坏了也重新试。"""
    import qwen.fast.kernel as kernel
    import qwen.fast.linear as linear

    tries = []

    def broken(cxx=None):
        tries.append(cxx)
        raise RuntimeError("编译 norm.cpp 失败：没有这个文件")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(linear, "load_matvec", broken)
    with pytest.warns(RuntimeWarning, match="退回 oneDNN.*norm.cpp"):
        assert not linear.can_compile()
    with pytest.warns(RuntimeWarning, match="norm.cpp.*compiler.json"):
        assert not linear.can_compile()
    assert len(tries) == 1 and "norm.cpp" in (tmp_path / "qwen" / "compiler.json").read_text()
    with pytest.warns(RuntimeWarning):
        model = load_model(tiny[0], dtype=torch.float32)
    assert isinstance(model.lm_head, PackedLinear) and len(tries) == 1
    (tmp_path / "fixed.cpp").write_text("// 装好了的源码\n")
    monkeypatch.setattr(kernel, "SOURCES", [*kernel.SOURCES, tmp_path / "fixed.cpp"])
    with pytest.warns(RuntimeWarning):
        assert not linear.can_compile() and len(tries) == 2  # 源码换了：重新试
    (tmp_path / "qwen" / "compiler.json").write_text("{不是 JSON")  # 坏的记录：重新试
    with pytest.warns(RuntimeWarning):
        assert not linear.can_compile() and len(tries) == 3


def test_unwritable_cache_still_gets_the_kernel(tiny, tmp_path, monkeypatch):
    """缓存的文件夹写不了（XDG_CACHE_HOME 指向一个文件：root 也建不了里面的文件夹）：内核编进临时文件夹，默认照样是
    分块布局的快模型，不悄悄退回 oneDNN；说一次（一个 RuntimeWarning，不是几段 traceback）缓存在哪儿、为什么用不了、
    这次编在哪儿。"""
    from qwen.fast.step import FastModel

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = load_model(tiny[0], dtype=torch.float32)
    assert isinstance(model, FastModel)
    texts = {str(w.message) for w in said}
    assert len(texts) == 1 and "用不了（Not a directory）" in texts.pop() and all(w.category is RuntimeWarning for w in said)


@pytest.mark.parametrize("which,tol", [("tiny_model", 1e-4), ("compiled_model", 1e-3)])
def test_long_prompt_is_fed_in_pieces(tiny_model, request, which, tol):
    """带状态时长于一段（model.piece）的输入分段喂进去（第 10 章）：logits 与普通布局无状态的一次性前向相同。
    layout="graphs" 时两整段走编译的层（第一段从空状态开始，第二段接着它的状态），剩下的 70 个 token 走普通路径。"""
    from qwen.fast.layers import COMPILED_PIECE
    from qwen.model import PREFILL_PIECE

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




def test_bfloat16_logits_stay_close_to_float32(widths08b):
    """bfloat16 的打包模型（0.8B 的宽度）对 float32 的普通模型：64 个 token 的 logits 相对误差 ‖Δ‖/‖logits‖ 在 bfloat16
    舍入的量级（量出来约 2%，界 4%）；DeltaNet 的记忆 S 与 A_log 仍是 float32。（这个检查点上 float32 的 argmax 几乎总是
    输入的那个 token，比 argmax 是否一致说明不了什么，所以比 logits。）"""
    path, _ = widths08b
    m32 = Model.from_pretrained(path, dtype=torch.float32)
    m16 = load_model(path, layout="packed", dtype=torch.bfloat16)
    assert m16.dtype == torch.bfloat16  # 打包的布局（oneDNN 不支持 bfloat16 的机器上是普通模型）
    assert m16.layers[0].linear_attn.A_log.dtype == torch.float32
    ids = prompt(m32.cfg.vocab_size, 64, seed=3)
    state = State(m16)
    with torch.no_grad():
        a = m32(ids)
        b = m16(ids, state)
    assert all(s.S.dtype == torch.float32 for s in state.layers if hasattr(s, "S"))
    assert ((a - b).norm() / a.norm()).item() <= 0.04


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_reader_matches_safetensors(tmp_path, dtype):
    """RowReader 按偏移从文件里读出的行，与 safetensors 读出的整个张量逐位相同（相邻的几行一次读出，跨过 ids 的行界也是）；
    其他 dtype 照样转换。"""
    from safetensors import safe_open
    from safetensors.torch import save_file


    table = torch.randn(300, 24).to(dtype)
    save_file({"a.bias": torch.randn(7), "b.table": table, "c": torch.randn(3, 5)}, str(tmp_path / "t.safetensors"))
    with safe_open(tmp_path / "t.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("b.table"), table)
    rows = RowReader(tmp_path / "t.safetensors", "b.table")
    ids = torch.tensor([[0, 1, 2, 299, 7], [8, 7, 7, 150, 151]])
    assert rows.shape == (300, 24) and rows.dtype == dtype
    assert torch.equal(rows[ids], table[ids])
    assert torch.equal(rows.rows(3, 10), table[3:10])
    assert torch.equal(FileRows(rows)[5:9], table[5:9]) and torch.equal(FileRows(rows, torch.tensor([7, 2]))[1:], table[2:3])
    as32 = RowReader(tmp_path / "t.safetensors", "b.table", torch.float32)
    assert as32[ids].dtype == torch.float32 and torch.equal(as32[ids], table[ids].float())
    with pytest.raises(ValueError, match="二维"):
        RowReader(tmp_path / "t.safetensors", "a.bias")


def test_row_reader_and_records_are_safe_across_threads(tmp_path, monkeypatch):
    """服务器里几个请求同时用模型：8 个线程同时按行读同一个文件，每个读到的都是自己要的行（按位置读，不共用文件指针）；
    8 个线程同时往同一个记录文件里加 key，一个也不丢，文件始终是完整的 JSON。"""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import save_file

    from qwen.fast.linear import read_record, record_file, write_record

    table = torch.arange(2000 * 16, dtype=torch.float32).view(2000, 16)
    save_file({"t": table}, str(tmp_path / "t.safetensors"))
    rows = RowReader(tmp_path / "t.safetensors", "t")

    def lookups(seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(300):
            ids = torch.randint(0, 2000, (3,), generator=gen)
            assert torch.equal(rows[ids], table[ids])
        return True

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(lookups, range(8)))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def writes(t):
        for i in range(20):
            write_record("r.json", f"{t}-{i}", i)
        return True

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(writes, range(8)))
    assert all(read_record("r.json", f"{t}-{i}") == i for t in range(8) for i in range(20))
    assert sorted(p.name for p in record_file("r.json").parent.iterdir()) == ["r.json", "r.json.lock"]  # 没有留下临时文件


def test_gemv_leaves_onednn_alone(monkeypatch):
    """打包的路径上一行 bfloat16 的输入乘普通布局的权重（起草词表那几行），不去开关进程级的 oneDNN 标志：
    别的请求此刻做的矩阵乘法不受影响。"""
    from qwen.fast.linear import gemv

    def refuse(*args, **kwargs):
        raise AssertionError("gemv 不该改 oneDNN 的开关")

    monkeypatch.setattr(torch.backends.mkldnn, "set_flags", refuse)
    w = torch.randn(300, 64).bfloat16()
    x = torch.randn(1, 1, 64).bfloat16()
    got = gemv(x, w)
    assert got.shape == (1, 1, 300) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), x.float() @ w.float().T, rtol=0.02, atol=0.05)
    assert torch.allclose(gemv(x.expand(2, 1, 64), w).float(), (x.float() @ w.float().T).expand(2, 1, 300), rtol=0.02, atol=0.05)


def test_packed_model_keeps_embedding_in_file(tiny, tiny_model):
    """打包后嵌入表不在内存里：查表从文件读出的行与普通模型的嵌入逐位相同。"""
    packed = load_model(tiny[0], layout="packed", dtype=torch.float32)
    assert not hasattr(packed.embed_tokens, "weight") and not hasattr(packed.lm_head, "weight")
    ids = prompt(packed.cfg.vocab_size, 9, seed=5)
    assert torch.equal(packed.embed_tokens(ids), tiny_model.embed_tokens(ids))


# ---------- layout="graphs"：分块布局与编译的 matvec ----------


@pytest.mark.parametrize("out", [32, 45, 70])
def test_blocks_round_trip_and_matvec(out):
    """to_blocks / from_blocks 互逆（out 不是 32 的倍数时补零行）；matvec_blocks（定义）与 F.linear 一致，
    C++ 的 matvec 与它一致，输入是有偏移、不连续的视图（像 h[:, -1:] 那样）也对。"""
    w = torch.randn(out, 24, generator=torch.Generator().manual_seed(out))
    blocks = to_blocks(w)
    assert blocks.shape == (-(-out // BLOCK), 24, BLOCK)
    assert torch.equal(blocks[0, :, 1], w[1])  # 第 0 块第 1 列就是第 1 个输出的权重
    assert torch.equal(from_blocks(blocks, out), w)
    x = torch.randn(5, 30)[1:5, 6:]  # [4, 24] 的视图
    y = matvec_blocks(x, blocks)
    assert y.shape == (4, blocks.shape[0] * BLOCK)
    assert torch.allclose(y[:, :out], x @ w.T, atol=1e-5) and not y[:, out:].any()
    assert torch.allclose(load_matvec().matvec(x, blocks), y, atol=1e-5)


def test_matvec_rows_do_not_depend_on_how_many_are_computed_together():
    """C++ 的 matvec 每一行与单独乘它时逐位相同，不论一次乘几行、怎样分组（AVX2 上 3 行一组、余 1 时第一组 4 行，AVX-512
    上 8 行一组）、一次乘相邻的几块（行少时 2 或 4 块），float32、bfloat16、int8、int4 的块都是：投机解码验证的行、服务时拼在一起的
    请求都靠这一点。300 个输出是 10 块（最后一块补零行）：4 块一次的有两组，剩下的逐块乘。"""
    kernel = load_matvec()
    w = torch.randn(300, 112, generator=torch.Generator().manual_seed(9))  # 112 = 3.5 组 int4 的比例
    x = torch.randn(17, 112, generator=torch.Generator().manual_seed(10))
    for blocks, s in weight_kinds(kernel, w):
        alone = torch.cat([kernel.matvec(x[i : i + 1], blocks, s) for i in range(17)])
        for rows in (2, 3, 4, 5, 7, 8, 9, 10, 13, 17):
            assert torch.equal(kernel.matvec(x[:rows], blocks, s), alone[:rows]), (blocks.dtype, rows)


def test_bfloat16_pairs_keep_each_row_its_own():
    """有 AVX-512 BF16 的 CPU 上，bfloat16 的模型的矩阵两个输入一对存放，一条 vdpbf16ps 乘加一对（matvec.cpp 的 Pair）：
    每一行仍与单独乘它时逐位相同（1～17 行，8 行一组）；与定义（float32 的矩阵乘法）只差在求和与输出的舍入之内；
    奇数个输入时补的那一个不改结果，拼回普通布局（dense，长的预填充用）是原来的矩阵。"""
    kernel = load_matvec()
    if kernel.pairs is None:
        pytest.skip("这台 CPU 没有 AVX-512 BF16：bfloat16 的矩阵照常按一个输入一行存放")
    for n_in in (112, 113):
        w = torch.randn(300, n_in, generator=torch.Generator().manual_seed(n_in)).bfloat16()
        x = torch.randn(17, n_in, generator=torch.Generator().manual_seed(n_in + 1)).bfloat16()
        linear = BlockedLinear(w, kernel)
        assert linear.blocks.shape == (10, (n_in + 1) // 2, 32, 2)
        alone = torch.cat([linear(x[i : i + 1]) for i in range(17)])
        for rows in (2, 3, 4, 5, 7, 8, 9, 13, 17):
            assert torch.equal(linear(x[:rows]), alone[:rows]), (n_in, rows)
        assert torch.allclose(alone.float(), x.float() @ w.float().t(), rtol=1e-2, atol=0.05)
        assert torch.equal(linear.dense(), w)


def test_fast_chunk_rule_is_the_recurrence():
    """快路径的分块形式（块长 DELTA_CHUNK = 32，第 8 章 64）：100 个 token 的输出与最终状态与逐 token 递推相同（float32 的
    舍入之内）；要逐位置状态时（40 个 token：比快路径的块长，不比第 8 章的长）照第 8 章的块长，给得出每个位置之后的 S。"""
    q, k, v, g, beta, S0 = inputs(100, seed=3)
    o1, S1, _ = recurrent_gated_delta_rule(q, k, v, g, beta, S0)
    o2, S2, _ = chunk_rule(q, k, v, g, beta, S0)
    assert (o1 - o2).abs().max().item() <= 1e-4 and (S1 - S2).abs().max().item() <= 1e-4
    _, S, parts = chunk_rule(*(t[:, :, :40] for t in (q, k, v, g, beta)), S0, keep_all=True)
    assert (state_after(parts, 39) - S).abs().max().item() <= 1e-4


def test_prefill_rows_in_pieces_are_each_row_alone():
    """行多时（预填充）matvec 一段一段地乘（一段的输入约 256 KB，留在 L2 里）：输入维 4100 时 float32 一段 8 行、一对一对的
    bfloat16 一段 24 行，70 行跨了几段；int8、int4 在有 AVX-512 VNNI 时换成 16 行一片的内核（输入维 129 组分成 9 段，最后一片
    只有 6 行）。每一行仍与单独乘它时逐位相同。一对一对的 bfloat16 多于 32 行也走这个内核（不拼回普通布局），与定义只差在
    求和与输出的舍入之内。"""
    kernel = load_matvec()
    w = torch.randn(100, 4100, generator=torch.Generator().manual_seed(11))
    x = torch.randn(70, 4100, generator=torch.Generator().manual_seed(12))
    kinds = weight_kinds(kernel, w)
    if kernel.pairs is not None:
        kinds.append((BlockedLinear(w.bfloat16(), kernel).blocks, None))
    for blocks, s in kinds:
        xs = x.bfloat16() if blocks.dim() == 4 and blocks.dtype == torch.bfloat16 else x
        alone = torch.cat([kernel.matvec(xs[i : i + 1], blocks, s) for i in range(70)])
        assert torch.equal(kernel.matvec(xs, blocks, s), alone), (blocks.dtype, blocks.dim())
    if kernel.pairs is not None:
        linear = BlockedLinear(w.bfloat16(), kernel)
        y = linear(x.bfloat16())
        assert torch.equal(y, torch.cat([linear(x[i : i + 1].bfloat16()) for i in range(70)]))
        assert torch.allclose(y.float(), x.bfloat16().float() @ w.bfloat16().float().t(), rtol=1e-2, atol=0.5)


def weight_kinds(kernel, w):
    """w 的四种分块：float32、bfloat16、int8（带比例）、int4（带每 32 个输入的比例）→ [(blocks, scales)]。"""
    int8, int4 = BlockedLinear(w, kernel, quantize="int8"), BlockedLinear(w, kernel, quantize="int4")
    return [(kernel.to_blocks([w], torch.float32), None), (kernel.to_blocks([w.bfloat16()], torch.bfloat16), None),
            (int8.blocks, int8.scales), (int4.blocks, int4.scales)]


@pytest.fixture(scope="module")
def narrower(tmp_path_factory):
    """这台机器上另编出的更窄的内核（没有 VNNI 的 AVX-512、AVX2 VNNI、AVX2，不用 FMA 的 portable）中它跑得了的：
    ISA → Kernel。编进本模块自己的文件夹，两个测试共用（编一种要几十秒）。"""
    from qwen.fast.kernel import FLAGS, NARROWER, Kernel, load_or_build
    from qwen.fast.linear import find_compiler

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("更窄的向量宽度是 x86 的编译选项")
    cxx, native, folder = find_compiler(), load_matvec(), tmp_path_factory.mktemp("narrower")
    out = {}
    for isa, extra in NARROWER.items():
        if isa == native.isa or (isa.startswith("AVX-512") and native.width == 8):
            continue  # 这台机器的就是它，或者这台机器没有 AVX-512
        kernel = Kernel(load_or_build(folder / f"{isa}.so", cxx, [*FLAGS, *extra]))
        if isa == "AVX2 VNNI" and kernel.isa == "AVX2":
            continue  # 这台机器没有 AVX-VNNI：编出来的就是 AVX2 那一种
        assert kernel.isa == isa
        out[isa] = kernel
    return out


def test_every_vector_width_computes_the_same_rows(narrower):
    """内核按这台机器最宽的向量编译（-march=native：有 AVX-512 就是 16 宽，有 VNNI 时 int4 用 vpdpbusd）；更窄的每一种
    （narrower）有 FMA 的逐位相同（每个输出都是自己的累加器、同样的求和顺序，宽度只改每条指令算几个输出；int4 的整数
    点积是精确的），不用 FMA 的先乘后加、各舍入一次，与定义 matvec_blocks 差在舍入之内。70 行 × 4100 个输入时各种宽度都
    一段一段地乘（预填充），段长随宽度的组长而变，结果照样相同。"""
    native = load_matvec()
    for (out, n_in), row_counts in (((300, 96), (1, 2, 4, 9)), ((40, 4100), (70,))):
        w = torch.randn(out, n_in, generator=torch.Generator().manual_seed(11))
        x = torch.randn(max(row_counts), n_in, generator=torch.Generator().manual_seed(12))
        kinds = weight_kinds(native, w)
        for isa, narrow in narrower.items():
            for blocks, s in kinds:
                for rows in row_counts:
                    want, got = native.matvec(x[:rows], blocks, s), narrow.matvec(x[:rows], blocks, s)
                    if narrow.fma:
                        assert torch.equal(got, want), (isa, blocks.dtype, rows)
                    else:
                        tol = 1e-4 * max(1, n_in // 96)  # 先乘后加各舍入一次：误差随输入个数长
                        assert torch.allclose(got, matvec_blocks(x[:rows], blocks, s), atol=tol), (isa, blocks.dtype, rows)


def test_every_vector_width_runs_the_long_prompt_kernels_alike(narrower):
    """长的提示词的三个内核（DeltaNet 的 delta_chunks、注意力、激活，simd.h 的 16 宽向量）：更窄的每一种有 FMA 的与这台
    机器的逐位相同（AVX2 上一个 16 宽的向量是两半、各一条 FMA），不用 FMA 的只差舍入。"""
    from qwen.fast.kernel import DeltaNetParams

    native, g = load_matvec(), torch.Generator().manual_seed(0)
    Hk, Hv, D, T = 2, 4, 32, 100
    C = 2 * Hk * D + Hv * D
    proj = torch.randn(1, T, C + Hv * D + 2 * Hv, generator=g).bfloat16()
    beta, decay = torch.rand(1, T, Hv, generator=g), -3 * torch.rand(1, T, Hv, generator=g)
    conv_w, zeros, norm_w = 0.3 * torch.randn(4, C, generator=g), torch.zeros(Hv), torch.ones(D)
    params = DeltaNetParams(conv_w.data_ptr(), zeros.data_ptr(), zeros.data_ptr(), norm_w.data_ptr(), 1e-6, Hk, Hv, D, D, 4)
    past = torch.randn(1, 3, C, generator=g)
    q, k_buf, v_buf = (torch.randn(shape, generator=g) for shape in ((1, 8, 70, 32), (1, 2, 160, 32), (1, 2, 160, 32)))

    def run(kernel):
        S = torch.zeros(1, Hv, D, D)
        out = kernel.delta_chunks(params, proj, past, beta, decay, S, 32)
        return out, S, kernel.attention_prefill(q, k_buf, v_buf, 115), kernel.act(proj[..., :64].contiguous())

    want = run(native)
    for isa, narrow in narrower.items():
        for got, ref in zip(run(narrow), want):
            assert torch.equal(got, ref) if narrow.fma else torch.allclose(got.float(), ref.float(), atol=1e-4), isa


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_every_vector_width_decodes_and_speculates(lively, narrower, monkeypatch, quantize):
    """更窄的每一种内核跑整个模型（matvec、deltanet_step、rms_norm 都是它的）：bfloat16 与 int8、int4 的权重，贪心解码
    多样，投机解码（知道答案的草稿器，草稿常被接受）与同一个内核的普通贪心逐 token 相同：验证的行就是解码的行，在
    每一种向量宽度上都成立，不只是这台机器最宽的那种。"""
    import importlib

    from qwen.bench import OracleDrafter
    from qwen.mtp import speculate

    assert narrower or pytest.skip("这台机器只有最窄的一种")
    loading = importlib.import_module("qwen.fast.load")  # 模块（qwen.fast.load 这个名字是同名的函数）
    for isa, kernel in narrower.items():
        monkeypatch.setattr(loading, "load_matvec", lambda kernel=kernel: kernel)
        model = loading.load_model(lively[0], dtype=torch.bfloat16, quantize=quantize)
        assert model.layers[0].mlp.down_proj.kernel is kernel
        mtp = loading.load_draft(model)
        ids = prompt(model.cfg.vocab_size, 40, seed=7)
        plain = generate(model, ids, 24)
        assert len(set(plain)) >= 6, (isa, plain)
        r = speculate(model, OracleDrafter(mtp, ids[0].tolist() + plain, 0.6, seed=1), ids, 24, draft_tokens=3)
        assert r.tokens == plain and r.hits > 0, isa


def test_quantized_matvecs_are_faster_than_bfloat16():
    """int8 的块读的字节是 bfloat16 的一半，int4 的是 28%：一个放不进缓存的矩阵（16384 × 4096，bfloat16 128 MB）解码
    一行时，两种量化的 matvec 都明显更快（宽松的界：不到 bfloat16 的 0.8 倍时间）。三种轮流量 7 次、取中位数：内存
    带宽一分钟里会变好几成。int8 的转换曾经走编译器的通用向量转换，比 bfloat16 慢 7 倍，这个测试就是为它写的。"""
    kernel = load_matvec()
    w = torch.randn(16384, 4096, generator=torch.Generator().manual_seed(13)).bfloat16()
    kinds = {"bf16": BlockedLinear(w, kernel), **{q: BlockedLinear(w, kernel, quantize=q) for q in ("int8", "int4")}}
    del w
    x = torch.randn(1, 4096).bfloat16()
    times = {name: [] for name in kinds}
    for _ in range(7):
        for name, linear in kinds.items():
            t0 = time.perf_counter()
            for _ in range(3):
                linear.matvec(x)
            times[name].append(time.perf_counter() - t0)
    median = {k: sorted(v)[3] for k, v in times.items()}
    assert median["int8"] < 0.8 * median["bf16"] and median["int4"] < 0.8 * median["bf16"], median


def test_int4_is_q4_0_with_float16_scales():
    """int4 的公式（linear.py 的 quantize_int4）：每个输出每 32 个输入一组，s = float16(m / −8)，m 是组里绝对值最大的那个
    权重，q = clamp(round(w / s), −8, 7)；输入维不是 32 的倍数时最后一组短一些，全零的组 s = 0。拼回普通布局（长的
    预填充）就是 q·s。C++ 的 matvec 是 int_reference 的整数点积（输入每 32 个一组量化成 int8），1～9 行都与它一致；
    它离 float32 的输入乘反量化的权重约 0.5%（输入的量化误差）。"""
    kernel = load_matvec()
    w = torch.randn(70, 200, generator=torch.Generator().manual_seed(14)).bfloat16()  # 70：补零行；200 = 6 组 + 8 个
    w[3, 32:64] = 0
    linear = BlockedLinear(w, kernel, quantize="int4")
    assert linear.blocks.shape == (3, 56, 64) and linear.scales.shape == (3, 7, 32)
    groups = torch.nn.functional.pad(w.float(), (0, 24)).view(70, 7, 32)
    m = groups.gather(2, groups.abs().argmax(2, keepdim=True))  # 每组绝对值最大的那个（带符号）
    s = (m / -8).half().float()
    q = torch.where(s == 0, 0, (groups / s).round()).clamp(-8, 7)
    want = (q * s).flatten(1)[:, :200]
    assert torch.equal(from_blocks(dequantize_int4(linear.blocks, linear.scales, 200), 70), want)
    assert (want[3, 32:64] == 0).all() and torch.equal(linear.dense().float(), want.bfloat16().float())
    x = torch.randn(9, 200, generator=torch.Generator().manual_seed(15))
    got, ref = kernel.matvec(x, linear.blocks, linear.scales), matvec_blocks(x, linear.blocks, linear.scales)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4)
    exact = x @ want.T
    assert (got[:, :70] - exact).norm() / exact.norm() < 0.01


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_compiled_bfloat16_matvec_matches_linear(quantize):
    """bfloat16 的分块矩阵（C++ 的 matvec）与 F.linear 差在 bfloat16 舍入之内，1～8 行与长的预填充都是。
    int8 的 q·s 离原来的权重不超过半个量化步长 s/2；长的预填充乘反量化的权重 q·s，几行的 matvec 是 int_reference 的整数
    点积（输入每 32 个一组量化成 int8），离 float32 的输入乘 q·s 约 0.5%。"""
    kernel = load_matvec()
    w = torch.randn(70, 256, generator=torch.Generator().manual_seed(0)).bfloat16()  # 70：最后一块补零行
    q, scale = quantize_int8(w, kernel)
    assert q.dtype == torch.int8 and ((q.float() * scale[:, None] - w.float()).abs() <= scale[:, None] / 2 + 1e-6).all()
    assert torch.equal(scale, w.float().abs().amax(1) / 127)  # C++ 的量化就是 docstring 里的公式
    assert torch.equal(q, torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8))
    ref_w = w.float() if quantize is None else q.float() * scale[:, None]
    linear = BlockedLinear(w, kernel, quantize=quantize)
    assert (linear.scales is None) == (quantize is None)
    for rows in (1, 2, 3, 4, 8, 40) if quantize is None else (1, 3, 40):  # int8：一行、多行、拼回普通布局各一种
        base = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        for x in (base, torch.cat([base, base], 1)[:, 256:]):  # 连续的；有偏移、步长 512 的视图
            ref = x.float() @ ref_w.T
            got = linear(x).float()
            assert got.shape == (rows, 70)
            if quantize and (rows <= KERNEL_ROWS or not linear.amx_rows(x)):  # 输入也量化（没有 AMX 时长的也是）：约 0.5%
                want = matvec_blocks(x.float(), linear.blocks, linear.scales)[:, :70]
                assert torch.allclose(got, want.bfloat16().float(), rtol=1e-2, atol=1e-2)
                assert (got - ref).norm() / ref.norm() < 0.01
            else:
                assert ((got - ref).abs() <= 0.02 * ref.abs() + 0.1).all()


@pytest.fixture(scope="module")
def varied08b(tmp_path_factory):
    """0.8B 的宽度、两层（DeltaNet 与注意力各一），写回残差流的投影尺度 1：每个位置的 argmax 各不相同、几乎从不是输入的
    那个 token（widths08b 上 argmax 几乎总是输入的 token，比 argmax 一致说明不了什么）。"""
    two = WIDTHS_08B | dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return make_checkpoint(tmp_path_factory.mktemp("varied08b"), seed=4, out_scale=1.0, **two)[0]


@pytest.mark.parametrize("quantize, dtype, tol, agreeing", [("int8", torch.int8, 0.08, 0.85), ("int4", torch.uint8, 0.45, 0.45)])
def test_quantized_logits_stay_close_and_greedy_agrees(varied08b, quantize, dtype, tol, agreeing):
    """量化的模型（0.8B 的宽度，全部矩阵含输出头，float32 计算）对普通的 float32 模型：预填充 64 个 token 与之后逐个
    解码时，logits 的相对误差 ‖Δ‖/‖logits‖ 都在 tol 以内（随机权重的量化误差比训练过的大得多：int4 约三分之一），
    argmax 至少 agreeing 相同；这个检查点的 argmax 多样、几乎不是输入的 token（先查），所以一致不是白给的：错的量化
    （比例错位、半字节颠倒）是 100% 量级的误差，argmax 几乎全错。"""
    path = varied08b
    m32 = Model.from_pretrained(path, dtype=torch.float32)
    mq = load_model(path, quantize=quantize, dtype=torch.float32)
    assert mq.lm_head.blocks.dtype == dtype and mq.layers[0].mlp.down_proj.blocks.dtype == dtype
    ids = prompt(m32.cfg.vocab_size, 64, seed=3)
    s32, sq = State(m32), State(mq)
    with torch.inference_mode():
        a, b = m32(ids, s32), mq(ids, sq)
        assert len(set(a.argmax(-1)[0].tolist())) >= 48 and (a.argmax(-1) == ids).float().mean() <= 0.1  # 不是白给的
        assert (a - b).norm() / a.norm() <= tol
        agree = (a.argmax(-1) == b.argmax(-1)).sum().item()
        for _ in range(4):
            token = a[:, -1:].argmax(-1)
            a, b = m32(token, s32), mq(token, sq)
            assert (a - b).norm() / a.norm() <= tol
            agree += int(a.argmax() == b.argmax())
    assert agree / 68 >= agreeing


@pytest.mark.parametrize("kw, message", [
    (dict(quantize="int2"), "只能是 None、"), (dict(quantize="int8", layout="packed"), "不能与 layout='packed'"),
    (dict(quantize="int8", layout="plain"), "不能与 layout='plain'"), (dict(layout="fast"), "layout 应为 auto 或"),
])
def test_bad_quantize_is_refused(tiny, kw, message):
    with pytest.raises(ValueError, match=message):
        load_model(tiny[0], dtype=torch.float32, **kw)



# ---------- 就地更新的 DeltaNet 递推 ----------


@pytest.mark.parametrize("T", [1, 2, 3])
@pytest.mark.parametrize("keep_all", [False, True])
def test_recurrent_in_place_equals_the_chapter(T, keep_all):
    """重排成只读一遍 S 的递推与第 7 章的公式结果相同；推理时就地更新传入的 S。keep_all 时每个位置之后的 S 各是一份：
    只有第一步写进传入的 S（投机解码至少留下第一个 token，S₀ 用不着）。"""
    q, k, v, g, beta, S0 = inputs(T, seed=T)
    o1, S1, p1 = recurrent_gated_delta_rule(q, k, v, g, beta, S0, keep_all=keep_all)
    with torch.inference_mode():
        o2, S2, p2 = recurrent_in_place(q, k, v, g, beta, S0, keep_all=keep_all)
    assert (o1 - o2).abs().max() <= 1e-5 and (S1 - S2).abs().max() <= 1e-5
    if keep_all:
        assert len(p2) == T and all((a - b).abs().max() <= 1e-5 for a, b in zip(p1, p2))
        assert len({s.data_ptr() for s in p2}) == T  # 后面的位置没有覆盖前面的
        assert p2[0].data_ptr() == S0.data_ptr()  # 第一步就地
    else:
        assert S2.data_ptr() == S0.data_ptr()  # 真的就地：返回的就是传入的那块内存


def test_recurrent_in_place_is_differentiable():
    """求导时不就地改 S（反向传播要用每一步的旧 S）：梯度与第 7 章的递推相同，传入的 S 不变。"""
    q, k, v, g, beta, S0 = inputs(3)
    before, grads = S0.clone(), []
    for rule in (recurrent_gated_delta_rule, recurrent_in_place):
        kk, vv = k.clone().requires_grad_(True), v.clone().requires_grad_(True)
        o, S, _ = rule(q, kk, vv, g, beta, S0)
        (o.sum() + S.sum()).backward()
        grads.append(torch.cat([kk.grad.flatten(), vv.grad.flatten()]))
    assert torch.equal(S0, before)
    assert (grads[0] - grads[1]).abs().max().item() <= 1e-4


def test_untied_output_head_on_every_path(tmp_path):
    """输出头不与嵌入共用的检查点（lm_head.weight 在顶层）：快路径逐层读出时读的是它自己的输出头，不是嵌入表；
    普通、打包、int8 的 logits 都与 transformers 一致（int8 的相对误差在 10% 以内），起草词表的那几行也取自它。"""
    path, hf = make_checkpoint(tmp_path, seed=5, tie=False)
    ids = prompt(512, 20, seed=5)
    with torch.no_grad():
        ref = hf(ids).logits
    for kw, tol in ((dict(layout="plain"), 1e-4), (dict(layout="packed"), 1e-3), (dict(quantize="int8"), None)):
        model = load_model(path, dtype=torch.float32, **kw)
        assert not model.cfg.tie_word_embeddings
        with torch.inference_mode():
            got = model(ids)
        if tol is None:
            assert (got - ref).norm() / ref.norm() <= 0.1  # 量化误差（权重与输入）约 7%；错读成嵌入表时是 100% 量级
        else:
            assert (got - ref).abs().max() <= tol
    packed = load_model(path, layout="packed", dtype=torch.float32)
    mtp = load_draft(packed, draft_vocab=[3, 9, 40])
    x = torch.randn(1, 1, model.cfg.hidden_size)
    with torch.inference_mode():
        assert torch.allclose(mtp.draft_logits(packed, x)[..., [3, 9, 40]], x @ hf.lm_head.weight[[3, 9, 40]].T, atol=1e-5)


def test_kernel_cache_is_per_machine_and_rebuilt_when_broken(tmp_path, monkeypatch):
    """C++ 的 matvec 缓存在 $XDG_CACHE_HOME/qwen/kernels/：换了 CPU、编译器或源码就是另一个文件（别处写下的从不加载）；
    文件坏了（加载时 OSError）就重新编译一次，而不是崩溃。"""
    import qwen.fast.kernel as kernel
    from qwen.fast.linear import find_compiler

    cxx = find_compiler()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    here = kernel.kernel_file(cxx)
    assert here.parent == tmp_path / "qwen" / "kernels"
    monkeypatch.setattr(kernel, "cpu_fingerprint", lambda: "另一种 CPU")
    assert kernel.kernel_file(cxx) != here
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernel, "SOURCES", [tmp_path / "matvec.cpp"])
    (tmp_path / "matvec.cpp").write_text("// 改过的源码\n")
    assert kernel.kernel_file(cxx) != here
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    here.parent.mkdir(parents=True)
    here.write_bytes(b"not a shared library")  # 坏的文件（比如写到一半被打断的旧版本）
    fixed = kernel.Kernel(kernel.load_or_build(here, cxx))  # 重新编译（一两秒），能用
    w, x = torch.randn(40, 16), torch.randn(2, 16)
    assert torch.allclose(fixed.matvec(x, fixed.to_blocks([w], torch.float32))[:, :40], x @ w.T, atol=1e-5)


def test_float32_model_keeps_bfloat16_blocks_exactly():
    """float32 的模型读 bfloat16 的检查点：分块布局仍存 bfloat16（读的字节少一半），C++ 的 matvec 算出的与存成 float32
    逐位相同（bfloat16 转 float32 是精确的）。拼回普通布局要把整个矩阵转一遍 dtype，所以这样的块每个行数都走 C++ 的。"""
    kernel = load_matvec()
    w = torch.randn(70, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    half = BlockedLinear([w], kernel, dtype=torch.float32)
    full = BlockedLinear([w.float()], kernel, dtype=torch.float32)
    assert half.blocks.dtype == torch.bfloat16 and full.blocks.dtype == torch.float32 and half.dtype == torch.float32
    assert half.kernel_rows == float("inf") and full.kernel_rows == KERNEL_ROWS
    for rows in (1, 3, 5, 40):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        want = kernel.matvec(x, full.blocks)[:, :70]
        assert half(x).dtype == torch.float32 and torch.equal(half(x), want), rows
    assert torch.allclose(half(x), full(x), atol=1e-4)  # 40 行：float32 的块拼回普通布局交给 F.linear



@pytest.mark.parametrize("quantize", [None, "int4"])
def test_a_layers_matrices_lie_one_after_another(widths08b, quantize):
    """分块布局的矩阵放在加载它的 Kernel 的 Arena 里（arena.py）：一层的矩阵（int4 连同比例）在内存里一个挨一个，解码时
    读的是一条连续的流；各是各的 storage（编译的图不把挨着的两个当成别名），也不与别的张量重叠。"""
    model = load_model(widths08b[0], dtype=torch.bfloat16, quantize=quantize)  # 0.8B 的宽度：每个矩阵 1～15 MB
    mats = [m for m in model.layers[0].modules() if isinstance(m, BlockedLinear)]
    tensors = [m.blocks for m in mats] + ([m.scales for m in mats] if quantize == "int4" else [])
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert len(spans) >= 4 and all(0 <= b[0] - a[1] < 64 for a, b in zip(spans, spans[1:])), spans
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)

def test_long_prefill_on_amx_reads_the_pairs_as_they_are(monkeypatch):
    """有 AMX 的 CPU（amx.cpp）：长的预填充直接乘一对一对存放的块，不拼回普通布局；结果与 F.linear 乘原矩阵只差在
    bfloat16 的舍入之内（两者都在 float32 里求和），行数不是 32 的倍数也对。块指令跑不了时（记成不能用）退回拼回 + F.linear。"""
    kernel = load_matvec()
    if not kernel.amx:
        pytest.skip("这台 CPU 没有 AMX（或块指令在这里跑不了）：长的预填充拼回普通布局交给 F.linear")
    w = torch.randn(200, 96, generator=torch.Generator().manual_seed(5)).bfloat16()
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(6)).bfloat16()
    for quantize in ("int8", "int4", None):  # 量化的：每块先在 L2 里换成与 dense() 逐位相同的 bfloat16，再乘
        linear = BlockedLinear(w, kernel, quantize=quantize, dtype=torch.bfloat16)
        dense = torch.nn.functional.linear(x, linear.dense()).float()
        got = linear(x[None])[0]  # 70 行 > KERNEL_ROWS：AMX
        assert got.shape == (70, 200) and got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), dense, rtol=1e-2, atol=1e-2), quantize
        eye = torch.eye(96, dtype=torch.bfloat16)  # 每行只有一个 1：乘出来就是矩阵的一行，换成的 bfloat16 与 dense() 逐位相同
        assert torch.equal(kernel.gemm(eye, linear.blocks, linear.scales)[:, :200], linear.dense().t()), quantize
    calls = []
    monkeypatch.setattr(type(kernel), "gemm", lambda self, *a: calls.append(1) or pytest.fail("不该用 AMX"))
    monkeypatch.setattr(kernel, "amx", False)
    assert torch.equal(linear(x[None])[0], torch.nn.functional.linear(x, w)) and not calls


def test_amx_that_traps_is_remembered_and_not_used(tmp_path, monkeypatch):
    """块指令先在子进程里试（虚拟机上可能 SIGILL：死的是子进程）；试的结果按内核文件记在 amx.json。记成不能用时不再试，
    这个进程也不用 AMX；子进程死掉（这里用一个立刻 SIGILL 的解释器代替）就记成不能用。"""
    from qwen.fast import kernel as kernels
    from qwen.fast.linear import find_compiler
    from qwen.fast.records import read_record, write_record

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    so = kernels.kernel_file(find_compiler())
    lib = kernels.load_or_build(so, find_compiler())
    lib.amx_compiled.restype = ctypes.c_int
    if not lib.amx_compiled():
        pytest.skip("这台 CPU 没有 AMX：内核里没有编进块指令")
    write_record("amx.json", so.name, False)
    assert kernels.amx_usable(lib, so) is False
    (tmp_path / "qwen" / "amx.json").unlink()
    crash = tmp_path / "crash"
    crash.write_text("#!/bin/sh\nkill -ILL $$\n")
    crash.chmod(0o755)
    monkeypatch.setattr(kernels.sys, "executable", str(crash))
    assert kernels.amx_usable(lib, so) is False and read_record("amx.json", so.name) is False


def test_long_prompt_convolution_in_cpp_equals_the_chapter():
    """长的提示词（分块形式）的因果卷积在 deltanet.cpp 里一遍算完：输入是 in_proj 输出里的一段（bfloat16、行步长大于
    通道数），接在别的窗口之后，结果与第 7 章的拼接 + 四次乘加 + SiLU 只差在 float32 的舍入之内（PyTorch 的乘加可能合成
    FMA），新窗口逐位相同。"""
    from qwen.deltanet import DeltaNetState, GatedDeltaNet
    from qwen.fast.layers import FastDeltaNet
    from qwen.weights import Config

    torch.manual_seed(0)
    cfg = Config(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, num_hidden_layers=1)
    plain = GatedDeltaNet(cfg)
    plain.conv1d.weight.data.normal_()
    fast = GatedDeltaNet(cfg)
    fast.load_state_dict(plain.state_dict())
    fast.__class__, fast.step_kernel = FastDeltaNet, load_matvec()
    fast.step_consts = (fast.conv1d.weight[:, 0].t().float().contiguous(),)
    C = 2 * fast.key_dim + fast.value_dim
    proj = torch.randn(2, 70, C + 40).bfloat16()
    x = proj[..., :C]  # 一段视图，像 project 切出的 qkv
    after = DeltaNetState()
    after.conv = torch.randn(2, cfg.linear_conv_kernel_dim - 1, C)  # 前面已经读过一段
    with torch.inference_mode():
        for state in (None, after):
            got, got_full = fast.causal_conv(x, state)
            want, want_full = plain.causal_conv(x, state)
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6) and torch.equal(got_full[:, -3:], want_full[:, -3:])


def test_long_prompt_chunks_in_cpp_equal_the_chapter():
    """长的提示词的 DeltaNet（q、k 归一化与第 8 章的分块形式）在 deltanet.cpp 里一个头一次走完：值头多于键头、两行、接在
    已有的状态之后、最后一块不满。输出与新状态离第 7 章的逐 token 递推不比第 8 章的分块形式（PyTorch）远多少，窗口逐位相同；
    切成块长整数倍的两段分两次喂，与一次喂完逐位相同。"""
    from qwen.chunk import chunk_gated_delta_rule
    from qwen.deltanet import DeltaNetState, GatedDeltaNet
    from qwen.fast.kernel import DeltaNetParams
    from qwen.fast.layers import DELTA_CHUNK, STEP_ROWS, FastDeltaNet, fuse
    from qwen.weights import Config

    torch.manual_seed(0)
    cfg = Config(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=48, num_hidden_layers=1)
    fast = GatedDeltaNet(cfg)
    for w in (fast.conv1d.weight, fast.A_log, fast.dt_bias, fast.norm.weight):
        w.data.normal_()
    fast.__class__, fast.step_kernel = FastDeltaNet, load_matvec()
    fuse(fast, "in_proj", ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"], fast.step_kernel)
    fast.step_consts = tuple(t.detach().float().contiguous() for t in (
        fast.conv1d.weight[:, 0].t(), -fast.A_log.exp(), fast.dt_bias, fast.norm.weight))
    fast.step_params = DeltaNetParams(*(t.data_ptr() for t in fast.step_consts), fast.norm.eps, 2, 4, 32, 48, 4)
    cut = (STEP_ROWS // DELTA_CHUNK + 1) * DELTA_CHUNK  # 两段都长于 STEP_ROWS（更短的逐个位置地走）
    x = torch.randn(2, 2 * cut + 5, 64)

    def start():  # 前面已经读过一段：窗口与记忆都不是 0
        state = DeltaNetState()
        state.conv = torch.randn(2, 3, 2 * 64 + 4 * 48, generator=torch.Generator().manual_seed(1))
        state.S = torch.randn(2, 4, 32, 48, generator=torch.Generator().manual_seed(2)) * 0.1
        return state

    with torch.inference_mode():
        states = [start() for _ in range(4)]
        want = GatedDeltaNet.forward(fast, x, states[0], rule=recurrent_gated_delta_rule)  # 第 7 章
        chapter = GatedDeltaNet.forward(fast, x, states[1], rule=chunk_gated_delta_rule)  # 第 8 章
        got = fast(x, states[2])
        halves = torch.cat([fast(x[:, :cut], states[3]), fast(x[:, cut:], states[3])], 1)
    err = lambda a, b: (a - b).abs().max().item()
    assert 0 < err(got, want) <= 2 * err(chapter, want) + 1e-6
    assert err(states[2].S, states[0].S) <= 2 * err(states[1].S, states[0].S) + 1e-6
    assert torch.equal(states[2].conv, states[1].conv)
    assert torch.equal(halves, got) and torch.equal(states[3].S, states[2].S)


def test_long_prompt_attention_in_cpp_equals_sdpa():
    """长的提示词的注意力（attention.cpp，在线 softmax）：两行、4 个查询头共用一个键值头、缓存里已有 45 个位置、70 个查询
    （最后一片不满 32 个）、缓存有空余的容量，与 SDPA 加因果掩码只差 float32 的舍入；缓存里已有的位置也看得见。"""
    kernel = load_matvec()
    B, H, Hkv, T, D, L, cap = 2, 8, 2, 70, 32, 115, 160
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, T, D, generator=g)
    k_buf, v_buf = torch.randn(B, Hkv, cap, D, generator=g) * 2, torch.randn(B, Hkv, cap, D, generator=g)
    got = kernel.attention_prefill(q, k_buf, v_buf, L)
    mask = torch.ones(T, L, dtype=torch.bool).tril(L - T)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k_buf[:, :, :L].double(), v_buf[:, :, :L].double(),
                                                            attn_mask=mask, enable_gqa=True)
    assert (got - want.transpose(1, 2).reshape(B, T, H * D)).abs().max().item() <= 1e-5


def test_the_structs_shared_by_two_sources_are_written_the_same():
    """DeltaNet、Attention 两个结构各写在两处（deltanet.cpp / attention.cpp 与 layer.cpp，各自编译）：一字不差，ctypes 的
    DeltaNetParams、AttentionParams 与它们逐个字段同名、同序。"""
    import re
    from pathlib import Path

    from qwen.fast.kernel import AttentionParams, DeltaNetParams

    src = Path(__file__).resolve().parents[1] / "qwen/fast"
    layer = (src / "layer.cpp").read_text()
    for name, own, params in (("DeltaNet", "deltanet.cpp", DeltaNetParams), ("Attention", "attention.cpp", AttentionParams)):
        pattern = re.compile(r"struct %s \{\n(.*?)\n\};" % name, re.S)
        body = pattern.search((src / own).read_text()).group(1)
        assert pattern.search(layer).group(1) == body, name
        fields = re.findall(r"(\w+)(?=[,;])", re.sub(r"//.*", "", body))
        assert fields == [f for f, _ in params._fields_], (name, fields)
