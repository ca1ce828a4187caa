"""测试用检查点：用 transformers 搭一个随机的 Qwen3.5，按发布检查点的布局存盘。

布局与 Qwen/Qwen3.5-0.8B 一致：config.json 里嵌套 text_config、model_type "qwen3_5"；
张量名在 model.language_model. 下；共用嵌入所以没有 lm_head.weight；两个分片加索引；
另有 mtp.* 与 model.visual.* 张量（加载文本模型时必须跳过）。
所有权重都是随机且“不平凡”的：norm 权重、A_log、dt_bias 也不例外，
否则测试分不出 w 与 1 + w。

也可以在命令行里用：python tests/checkpoints.py OUT_DIR [--tiny|--08b-widths]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from qwen.chat import TOOLS_PROMPT

TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # 值头多于键头
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
)

# 0.8B 的全部宽度，只是层数少：3 个 DeltaNet 层 + 1 个注意力层
WIDTHS_08B = dict(
    vocab_size=1024,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)


def hf_config(tie: bool = True, **overrides):
    from transformers import Qwen3_5TextConfig

    kw = dict(TINY)
    kw.update(overrides)
    kw.setdefault("max_position_embeddings", 4096)
    return Qwen3_5TextConfig(
        **kw,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        eos_token_id=kw["vocab_size"] - 1,
    )


OUT_SCALE = 0.1


@torch.no_grad()
def randomize(module: torch.nn.Module, gen: torch.Generator, out_scale: float = OUT_SCALE) -> None:
    """把每个参数都换成随机值，尺度让 logits 在 1 的量级。

    out_scale 是写回残差流的三个投影的相对尺度。小（0.1）时模型平稳，适合与参考实现比 logits，
    但贪心续写几乎总在重复上一个 token（嵌入与输出头共用）；大（1.0）时续写多样，适合测生成。
    """
    for name, p in module.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.5, 8.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif name.endswith("linear_attn.norm.weight"):  # 普通权重，围绕 1
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        elif "norm" in name:  # 零中心：围绕 0 的偏移
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:  # 也是输出头：1/sqrt(hidden) 使 logits 的标准差约为 1
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        else:
            fan_in = p.shape[-1]  # 矩阵 [out, in]、堆叠的专家 [E, out, in]、卷积核 [C, 1, K]
            # 写回残差流的投影小一些：像训练过的模型那样每层只微调残差，而不是把它整个打乱
            scale = out_scale if {"o_proj", "out_proj", "down_proj"} & set(name.split(".")[-2:]) else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * (scale / math.sqrt(fan_in)))


def mtp_tensors(cfg, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """随机的 MTP 草稿头：fc、两个 pre_fc_norm、一个全注意力解码层（专家混合的检查点里是专家混合层）、norm。"""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    c = cfg.__class__(**{**cfg.to_dict(), "layer_types": ["full_attention"], "num_hidden_layers": 1})
    layer = (Qwen3_5MoeDecoderLayer if hasattr(cfg, "num_experts") else Qwen3_5DecoderLayer)(c, 0)
    randomize(layer, gen)
    h = cfg.hidden_size
    out = {f"mtp.layers.0.{k}": v.clone() for k, v in layer.state_dict().items()}
    out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) / math.sqrt(2 * h)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{n}.weight"] = 0.3 * torch.randn(h, generator=gen)
    return out


def make_checkpoint(path, seed: int = 0, mtp: bool = True, dtype=torch.float32, tokenizer: bool = True,
                    out_scale: float = OUT_SCALE, tie: bool = True, **overrides):
    """在 path 写一个随机检查点，返回 (path, transformers 模型)。tie=False：输出头不与嵌入共用，存在检查点顶层的
    lm_head.weight（更大的 Qwen3.5 是这样）。"""
    from transformers import Qwen3_5ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    cfg = hf_config(tie, **overrides)
    torch.manual_seed(seed)
    hf = Qwen3_5ForCausalLM(cfg).float().eval()
    randomize(hf, gen, out_scale)

    tensors = {}
    for k, v in hf.state_dict().items():
        if k == "lm_head.weight":
            if not tie:
                tensors[k] = v.to(dtype).contiguous()
            continue  # 共用嵌入：发布的检查点里没有它
        assert k.startswith("model.")
        keep32 = k.endswith("A_log") or k.endswith("linear_attn.norm.weight")  # 发布检查点里这两种存 float32
        tensors["model.language_model." + k[len("model."):]] = v.to(torch.float32 if keep32 else dtype).contiguous()
    if mtp:
        tensors.update({k: v.to(dtype) for k, v in mtp_tensors(cfg, gen).items()})
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 4, 4, generator=gen).to(dtype)
    tensors["model.visual.merger.linear_fc1.weight"] = torch.randn(16, 16, generator=gen).to(dtype)
    save_shards(path, tensors)

    text = cfg.to_dict()
    text["model_type"] = "qwen3_5_text"
    text["mtp_num_hidden_layers"] = 1
    text["dtype"] = "float32" if dtype == torch.float32 else "bfloat16"
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": tie,
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 16},
        "image_token_id": 248056,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        make_tokenizer(path, min(400, cfg.vocab_size))
    return path, hf


# 专家混合（35B-A3B 的结构）：256 个专家、每个 token 用 8 个，只是各处都窄
MOE_TINY = dict(TINY, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=32, shared_expert_intermediate_size=64)
del MOE_TINY["intermediate_size"]
# 35B-A3B 的全部宽度（hidden 2048、256 个专家 × 512、DeltaNet 16/32 个头），只是层数少、词表小
WIDTHS_35B = dict(vocab_size=1024, hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2,
                  head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
                  moe_intermediate_size=512, shared_expert_intermediate_size=512)


def per_expert(tensors: dict, prefix: str) -> dict:
    """名字以 prefix 开头的堆叠专家（experts.gate_up_proj [E, 2I, H]、experts.down_proj [E, H, I]）拆成按专家分开存的
    experts.{e}.gate_proj.weight 等（35B-A3B 的 MTP 层、FP8 版的布局）。"""
    out = {}
    for k, v in tensors.items():
        if k.startswith(prefix) and k.endswith("experts.gate_up_proj"):
            base = k[: -len(".gate_up_proj")]
            for e, w in enumerate(v):
                gate, up = w.chunk(2)
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = gate.clone(), up.clone()
        elif k.startswith(prefix) and k.endswith("experts.down_proj"):
            out.update({f"{k[: -len('.down_proj')]}.{e}.down_proj.weight": w.clone() for e, w in enumerate(v)})
        else:
            out[k] = v
    return out


def moe_config(**overrides):
    """transformers 的 Qwen3_5MoeTextConfig：MOE_TINY 的形状，输出头不与嵌入共用。"""
    from transformers import Qwen3_5MoeTextConfig

    kw = {**MOE_TINY, **overrides}
    kw.setdefault("max_position_embeddings", 4096)
    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    return Qwen3_5MoeTextConfig(**kw, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=rope,
                                eos_token_id=kw["vocab_size"] - 1)


def make_moe_checkpoint(path, seed: int = 0, mtp: bool = True, dtype=torch.float32, out_scale: float = OUT_SCALE,
                        main_layout: str = "stacked", mtp_layout: str = "per_expert", **overrides):
    """专家混合的随机检查点（Qwen3.5-35B-A3B 的布局）：model_type "qwen3_5_moe"，输出头不共用，主干的专家堆叠存放
    （main_layout="per_expert"：按专家分开，像 FP8 版），MTP 层也是专家混合层、按专家分开存（mtp_layout="stacked"：
    像 Qwen3.6）。返回 (path, transformers 的 Qwen3_5MoeForCausalLM)。"""
    from transformers import Qwen3_5MoeForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    cfg = moe_config(**overrides)
    torch.manual_seed(seed)
    hf = Qwen3_5MoeForCausalLM(cfg).float().eval()
    randomize(hf, gen, out_scale)
    tensors = {}
    for k, v in hf.state_dict().items():
        keep32 = k.endswith("A_log") or k.endswith("linear_attn.norm.weight")
        name = k if k == "lm_head.weight" else "model.language_model." + k[len("model."):]
        tensors[name] = v.to(torch.float32 if keep32 else dtype).contiguous()
    if main_layout == "per_expert":
        tensors = per_expert(tensors, "model.")
    if mtp:
        more = {k: v.to(dtype) for k, v in mtp_tensors(cfg, gen).items()}
        tensors.update(per_expert(more, "mtp.") if mtp_layout == "per_expert" else more)
    save_shards(path, tensors)
    text = cfg.to_dict()
    text.update(model_type="qwen3_5_moe_text", mtp_num_hidden_layers=1,
                dtype="float32" if dtype == torch.float32 else "bfloat16")
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "tie_word_embeddings": False, "text_config": text,
              "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 16}}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    make_tokenizer(path, min(400, cfg.vocab_size))
    return path, hf


def save_shards(path, tensors):
    """两个分片加索引，与发布的检查点一样。"""
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


VISION_08B = dict(hidden_size=768, num_heads=12, intermediate_size=3072, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, num_position_embeddings=2304)  # 0.8B 的视觉塔宽度
VISION_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PREPROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
                "image_std": [0.5] * 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216},
                "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor"}


@torch.no_grad()
def randomize_vision(module: torch.nn.Module, gen: torch.Generator) -> None:
    """视觉塔：LayerNorm 的权重围绕 1（它是普通的缩放），偏置小而不为零，矩阵按 1/sqrt(输入宽度)。"""
    for name, p in module.named_parameters():
        if "norm" in name:
            p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "pos_embed" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(math.prod(p.shape[1:])))


def make_vision_checkpoint(path, seed: int = 0, depth: int = 2, out_scale: float = OUT_SCALE, mtp: bool = True,
                           dtype=torch.float32, moe: bool = False, **overrides):
    """发布布局的多模态检查点：文本模型、mtp.*、视觉塔 model.visual.*（0.8B 的宽度，depth 个块）、preprocessor_config.json，
    分词器带视觉的特殊记号，图像 token 的 id 从它读（不是发布检查点的 248056：我们必须从 config.json 读）。
    moe=True：专家混合的文本模型（MOE_TINY），视觉塔照 35B-A3B 的加宽到 1152。
    返回 (path, transformers 的 Qwen3_5ForConditionalGeneration 或 Qwen3_5MoeForConditionalGeneration)。"""
    from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tk = make_tokenizer(path, 400, SPECIAL + VISION_SPECIAL)
    ids = {k: tk.token_to_id(t) for k, t in zip(("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                                  "video_token_id"), VISION_SPECIAL)}
    gen = torch.Generator().manual_seed(seed)
    text = moe_config(**overrides) if moe else hf_config(True, **overrides)
    torch.manual_seed(seed)
    kind = (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe else (Qwen3_5Config, Qwen3_5ForConditionalGeneration)
    wide = dict(VISION_08B, hidden_size=1152, num_heads=16, intermediate_size=4304) if moe else VISION_08B
    cfg = kind[0](text_config=text.to_dict(), tie_word_embeddings=not moe, **ids,
                  vision_config=dict(depth=depth, out_hidden_size=text.hidden_size, **wide))
    hf = kind[1](cfg).float().eval()
    randomize(hf.model.language_model, gen, out_scale)
    randomize_vision(hf.model.visual, gen)
    tensors = {}
    for k, v in hf.state_dict().items():
        keep32 = k.endswith("A_log") or k.endswith("linear_attn.norm.weight")
        if k != "lm_head.weight" or moe:  # 专家混合的输出头不与嵌入共用
            tensors[k] = v.to(torch.float32 if keep32 else dtype).contiguous()
    if mtp:
        tensors.update({k: v.to(dtype) for k, v in mtp_tensors(text, gen).items()})
    save_shards(path, tensors)
    config = cfg.to_dict()
    config["text_config"].update(model_type="qwen3_5_moe_text" if moe else "qwen3_5_text", mtp_num_hidden_layers=1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return path, hf


def prompt(vocab, T, seed=0):
    """随机的 [1, T] 提示词（种子固定）。"""
    return torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(seed))


def small_model(vocab_size: int, embed_std: float, seed: int = 0, **overrides):
    """直接用我们的 Config 搭一个极小的随机模型（不经过检查点），给采样与错误处理的测试用。"""
    from qwen import Config, Model

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
              linear_key_head_dim=8, linear_value_head_dim=8)
    kw.update(overrides)
    m = Model(Config(**kw)).eval()
    with torch.no_grad():
        m.embed_tokens.weight.normal_(0, embed_std)  # 也是输出头：它的尺度决定分布有多尖
    return m


SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "你好，世界！今天天气很好。我们来学习 Transformer 与长江。",
    "用一句话介绍一下 Transformer。写一段 200 字的短文，介绍长江。",
    "Hello world! The quick brown fox jumps over the lazy dog. 🚀🎉👍",
    "def add(a, b):\n    return a + b\n",
    "<think>\n\n</think>\n\n system user assistant 😀 中文 emoji 🐉",
]


BEFORE, AFTER = TOOLS_PROMPT.split("{tools}")
# 测试检查点的对话模板：我们照 build_prompt 写的 Qwen3.5 写法（发布的原文只在 ../shared/reference 里、CI 上没有）。它与
# 发布的文字不同，所以 Prompt 用 jinja2 渲染它（检查点自己的模板那条路）；test_chat 比它与 build_prompt 逐字相同。
QWEN_LIKE = r'''{#- 测试检查点的对话模板：照第 13 章的 build_prompt 写的 Qwen3.5 写法（不是发布的原文）。 -#}
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is not none -%}
{%- for c in content -%}
{%- if c.type in ("image", "image_url") or "image" in c or "image_url" in c -%}<|vision_start|><|image_pad|><|vision_end|>
{%- else -%}{{ c.text }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last=-1) -%}
{%- for m in messages -%}
{%- set t = text(m.content) | trim -%}
{%- if m.role == "user" and not (t.startswith("<tool_response>") and t.endswith("</tool_response>")) -%}
{%- set ns.last = loop.index0 -%}
{%- endif -%}
{%- endfor -%}
{%- if ns.last < 0 -%}{{ raise_exception("messages 里没有用户的问题") }}{%- endif -%}
{%- set system = (text(messages[0].content) | trim) if messages[0].role == "system" else none -%}
{%- if tools -%}
{%- set listed -%}{%- for tool in tools -%}{{ "\n" ~ (tool | tojson) }}{%- endfor -%}{%- endset -%}
{%- set system = BEFORE ~ listed ~ AFTER ~ (("\n\n" ~ system) if system else "") -%}
{%- endif -%}
{%- if system is not none -%}{{ "<|im_start|>system\n" ~ system ~ "<|im_end|>\n" }}{%- endif -%}
{%- for m in messages -%}
{%- set content = text(m.content) | trim -%}
{%- if m.role == "user" -%}
{{ "<|im_start|>user\n" ~ content ~ "<|im_end|>\n" }}
{%- elif m.role == "assistant" -%}
{%- set reasoning = "" -%}
{%- if m.reasoning_content is string -%}
{%- set reasoning = m.reasoning_content -%}
{%- elif "</think>" in content -%}
{%- set reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n") -%}
{%- set content = content.split("</think>")[-1].lstrip("\n") -%}
{%- endif -%}
{%- set think = ("<think>\n" ~ (reasoning | trim) ~ "\n</think>\n\n") if loop.index0 > ns.last else "" -%}
{%- set calls -%}
{%- for call in m.tool_calls or [] -%}
{%- set f = call.function if call.function is defined else call -%}
{{ ("\n" if not loop.first else "") ~ "<tool_call>\n<function=" ~ f.name ~ ">\n" }}
{%- for k, v in (f.arguments or {}).items() -%}
{{ "<parameter=" ~ k ~ ">\n" ~ ((v | tojson) if (v is mapping or (v is iterable and v is not string)) else v) ~ "\n</parameter>\n" }}
{%- endfor -%}
{{ "</function>\n</tool_call>" }}
{%- endfor -%}
{%- endset -%}
{{ "<|im_start|>assistant\n" ~ think ~ content ~ ("\n\n" if calls and content | trim else "") ~ calls ~ "<|im_end|>\n" }}
{%- elif m.role == "tool" -%}
{%- set opening = "<|im_start|>user" if loop.index0 and messages[loop.index0 - 1].role != "tool" else "" -%}
{%- set closing = "<|im_end|>\n" if loop.last or messages[loop.index0 + 1].role != "tool" else "" -%}
{{ opening ~ "\n<tool_response>\n" ~ content ~ "\n</tool_response>" ~ closing }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ "<|im_start|>assistant\n" ~ ("<think>\n" if enable_thinking else "<think>\n\n</think>\n\n") }}
{%- endif -%}
'''.replace("BEFORE", json.dumps(BEFORE)).replace("AFTER", json.dumps(AFTER))


def make_tokenizer(path, vocab_size: int = 400, special=SPECIAL):
    """字节级 BPE 分词器，带 Qwen 的特殊记号；存为 path/tokenizer.json，旁边放 QWEN_LIKE 对话模板
    （发布的检查点有 chat_template.jinja，Chat 据此按对话格式组织提示词）。"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(CORPUS * 20, trainer)
    tk.save(str(Path(path) / "tokenizer.json"))
    (Path(path) / "chat_template.jinja").write_text(QWEN_LIKE)
    return tk


if __name__ == "__main__":
    out = sys.argv[1]
    preset = WIDTHS_08B if "--08b-widths" in sys.argv else {}
    make_checkpoint(out, **preset)
    make_tokenizer(out)
    print(out)
