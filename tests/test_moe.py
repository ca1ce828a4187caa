"""第 4 章 moe.py：专家混合（路由器、top-k 与重新归一、专家、共享专家与它的门）与 transformers 的 Qwen3_5Moe 相同；
两种存法（堆叠、按专家分开）读出同一个模型；坏的检查点一行说清是哪个张量；快路径上的批处理与单独运行逐位相同。"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_moe_checkpoint, prompt
from qwen import MTP, Model, generate, generate_batch
from qwen.fast import load as load_fast
from qwen.moe import route


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory):
    """主干按专家分开存（FP8 版的布局）、MTP 层堆叠存（Qwen3.6 的布局）：权重与 lively_moe 不同，布局正相反。"""
    return make_moe_checkpoint(tmp_path_factory.mktemp("per_expert"), seed=6, main_layout="per_expert", mtp_layout="stacked")


def test_route_keeps_the_top_k_and_renormalises():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    w, idx = route(logits, 2)
    p = torch.softmax(logits, -1)[0]
    assert idx.tolist() == [[1, 3]]
    assert torch.allclose(w, torch.stack([p[1], p[3]])[None] / (p[1] + p[3]))


def test_the_layer_equals_the_reference(lively_moe):
    """一层的专家混合（256 个专家里每个 token 选 8 个，外加共享专家）与 transformers 的 Qwen3_5MoeSparseMoeBlock 相同。"""
    path, hf = lively_moe
    ours = Model.from_pretrained(path).layers[1].mlp
    x = torch.randn(2, 9, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf.model.layers[1].mlp(x)
        assert (ours(x) - theirs).abs().max() <= 1e-5 * theirs.abs().max()


@pytest.mark.parametrize("which", ["lively_moe", "per_expert"])
def test_logits_and_greedy_equal_the_reference(request, which):
    """两种存法：整个模型的 float32 logits 在参考实现自己的误差之内，贪心续写与 transformers 的 generate 逐 token 相同。"""
    path, hf = request.getfixturevalue(which)
    model = Model.from_pretrained(path)
    ids = prompt(model.cfg.vocab_size, 40, seed=1)
    with torch.no_grad():
        ref = hf(ids).logits
        assert (model(ids) - ref).abs().max() <= 2e-5 * ref.abs().max()
        theirs = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)[0, 40:].tolist()
    assert generate(model, ids, 16) == theirs and len(set(theirs)) >= 4


@pytest.mark.parametrize("which", ["lively_moe", "per_expert"])
def test_the_draft_head_is_an_moe_layer_and_matches_the_formula(request, which):
    """MTP 头的那一层也是专家混合层（按专家分开存或堆叠存都读得出）：照公式用 transformers 的 Qwen3_5MoeDecoderLayer 独立算。"""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm, Qwen3_5MoeTextRotaryEmbedding,
    )

    path, hf = request.getfixturevalue(which)
    model = Model.from_pretrained(path)
    mtp = MTP.from_pretrained(model.cfg, path)
    raw = {}
    for f in sorted(path.glob("*.safetensors")):
        raw.update({k[4:]: v.float() for k, v in load_file(f).items() if k.startswith("mtp.")})
    if "layers.0.mlp.experts.down_proj" not in raw:  # 按专家分开存：拼成 transformers 的堆叠参数
        E = model.cfg.num_experts
        raw["layers.0.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
            [raw.pop(f"layers.0.mlp.experts.{e}.{k}_proj.weight") for k in ("gate", "up")]) for e in range(E)])
        raw["layers.0.mlp.experts.down_proj"] = torch.stack([raw.pop(f"layers.0.mlp.experts.{e}.down_proj.weight")
                                                             for e in range(E)])
    c = hf.config.__class__(**{**hf.config.to_dict(), "layer_types": ["full_attention"], "num_hidden_layers": 1})
    layer = Qwen3_5MoeDecoderLayer(c, 0).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in raw.items() if k.startswith("layers.0.")})
    norms = {n: Qwen3_5MoeRMSNorm(c.hidden_size, c.rms_norm_eps) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    for n, m in norms.items():
        m.weight.data = raw[f"{n}.weight"]
    ids = prompt(model.cfg.vocab_size, 30, seed=4)
    T = ids.shape[1] - 1
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state[:, :T]
        x = torch.cat([norms["pre_fc_norm_embedding"](hf.model.embed_tokens(ids[:, 1:])),
                       norms["pre_fc_norm_hidden"](h)], -1) @ raw["fc.weight"].T
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        pos = Qwen3_5MoeTextRotaryEmbedding(c)(x, torch.arange(T)[None])
        ref = norms["norm"](layer(x, position_embeddings=pos, attention_mask=mask))
        ours = mtp(model.embed_tokens(ids[:, 1:]), model.hidden(ids)[:, :T], 0, None)
    assert ref.abs().max() > 0.5
    assert (ours - ref).abs().max().item() <= 1e-4


def rewrite(src, dst, change):
    """把检查点 src 复制到 dst，张量经 change({名字: 张量}) 改过（单个文件，不带索引）。"""
    dst.mkdir()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    save_file(change(tensors), str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


EXPERTS = "model.language_model.layers.1.mlp.experts"


@pytest.mark.parametrize("change, message", [
    (lambda t: {k: v for k, v in t.items() if k != "mtp.layers.0.mlp.experts.7.up_proj.weight"},
     "缺少张量 layers.0.mlp.experts.7.up_proj.weight"),
    (lambda t: {**t, "mtp.layers.0.mlp.experts.3.down_proj.weight": torch.zeros(5, 5)},
     "layers.0.mlp.experts.3.down_proj.weight 形状不对：检查点里是 (5, 5)"),
    (lambda t: {**t, EXPERTS + ".down_proj": t[EXPERTS + ".down_proj"][:-1]},
     "张量 layers.1.mlp.experts.down_proj 形状不对"),
    (lambda t: {**t, "model.language_model.layers.1.mlp.down_proj.weight": torch.zeros(4, 4)},
     "有稠密 MLP 的张量 layers.1.mlp.down_proj.weight，config.json 却说每层 256 个专家"),
])
def test_a_broken_expert_tensor_is_named(lively_moe, tmp_path, change, message):
    bad = rewrite(lively_moe[0], tmp_path / "bad", change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model = Model.from_pretrained(bad)
        MTP.from_pretrained(model.cfg, bad)


def test_a_dense_config_with_expert_tensors_is_named(lively_moe, tmp_path):
    bad = rewrite(lively_moe[0], tmp_path / "bad", lambda t: t)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "qwen3_5"
    del config["text_config"]["num_experts"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="有专家混合的张量 layers.0.mlp.experts.down_proj，config.json 却是稠密的"):
        Model.from_pretrained(bad)
    with pytest.raises(ValueError, match="有专家混合的张量"):
        load_fast(bad)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_batch_rows_equal_single_runs_on_the_fast_path(lively_moe, quantize):
    """快路径（bfloat16、int8、int4）上左填充的批处理：每行与它单独运行逐 token 相同；两种存法读出的快模型给同样的 logits。"""
    model, _ = load_fast(lively_moe[0], dtype=torch.bfloat16, quantize=quantize, draft=False)
    prompts = [prompt(model.cfg.vocab_size, n, seed=n)[0] for n in (1, 9, 40, 70)]
    alone = [generate(model, p[None], 16) for p in prompts]
    assert all(len(set(out)) >= 4 for out in alone), alone
    assert generate_batch(model, prompts, 16) == alone


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_a_decoded_token_reads_only_its_experts(lively_moe, quantize):
    """解码一个 token 只读它的 k = 8 个专家（加上共享专家）：先看它在每层选了谁，再把其余 248 个专家的权重全改成垃圾，
    再解码同一个 token：logits 一位不差（快路径的 C++ 与 Python 两条路都是）。"""
    model, _ = load_fast(lively_moe[0], dtype=torch.float32, quantize=quantize, draft=False)  # float32 的路由分数：不会打平
    ids = prompt(model.cfg.vocab_size, 1, seed=3)
    chosen = []  # 每层选中的专家：从 Python 那条路（求导开着时走它）的 gate_up 调用记下来
    for layer in model.layers:
        for e, m in enumerate(layer.mlp.gate_up):
            m.register_forward_hook(lambda m, i, o, e=e, at=len(chosen): chosen[at].add(e))
        chosen.append(set())
    python_path = model(ids)
    assert [len(c) for c in chosen] == [8] * len(model.layers)
    with torch.inference_mode():
        before = model(ids)
        for layer, c in zip(model.layers, chosen):
            for e in set(range(256)) - c:
                for m in (layer.mlp.gate_up[e], layer.mlp.down[e]):
                    m.blocks.fill_(77 if m.blocks.dtype == torch.uint8 else 1e4)  # int4：每个字节两个 −3
        assert torch.equal(model(ids), before)
    assert torch.equal(model(ids), python_path)


def test_graphs_is_refused_with_a_reason(lively_moe):
    with pytest.raises(ValueError, match='专家混合的检查点：layout="graphs" 还不能'):
        load_fast(lively_moe[0], layout="graphs")
