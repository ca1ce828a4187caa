# %% [markdown]
# # 第 7–8 章 · Gated DeltaNet 的记忆，画出来
#
# 第 7 章（`qwen/deltanet.py`）：每个头一个固定大小的记忆矩阵 S，每来一个 token
#
#     S ← exp(g)·S                  先整体衰减（g ≤ 0）
#     S ← S + k ⊗ β(v − Sᵀk)        delta 规则：只写入还没预测对的部分
#     o = Sᵀq
#
# 第 8 章（`qwen/chunk.py`）把同一个递推改写成分块的矩阵乘法。这本笔记本在随包的 demo 检查点上、一段真实的提示词里，
# 看第一个 DeltaNet 层的门 exp(g)、记忆的大小、分块与递推是否相同、一条记忆怎样被遗忘，以及回滚用的 `state_after`。

# %%
# 图直接画在笔记本里（Jupyter 的 matplotlib-inline 后端，不必写 %matplotlib inline）
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import qwen
from qwen.chunk import chunk_gated_delta_rule
from qwen.deltanet import recurrent_gated_delta_rule, state_after

torch.manual_seed(0)
torch.set_num_threads(1)  # demo 模型很小：一个线程最快，计时也稳
plt.rcParams.update({"figure.figsize": (7, 3), "figure.dpi": 80, "font.size": 9,
                     "lines.antialiased": False})  # 线不抗锯齿：PNG 小得多，笔记本不臃肿

# %% [markdown]
# 加载 demo 检查点（第 10 章的普通模型，float32）和它的分词器（第 13 章的 `Chat`）。demo 只学过 Python 标准库的源码，
# 提示词就用一段代码。第 0 层是 DeltaNet 层（`layer_types` 的前三个是 `linear_attention`）。

# %%
model = qwen.Model.from_pretrained("demo")
chat = qwen.Chat(model)
text = '''import os


def walk_files(root):
    """Yield the path of every file below root."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            yield os.path.join(dirpath, name)


class Stack:
    """A simple last-in, first-out stack."""

    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()
'''
ids = chat.encode(text)
net = model.layers[0].linear_attn  # 第一个 DeltaNet 层（GatedDeltaNet）
print(model.cfg.layer_types, "tokens:", ids.shape[1], "heads:", net.num_v_heads, "Dk = Dv =", net.head_k_dim)

# %% [markdown]
# `GatedDeltaNet.forward` 收一个参数 `rule`：核心递推的实现（第 7 章的逐 token 递推或第 8 章的分块形式，签名相同）。
# 先用 PyTorch 的 forward pre-hook 记下整个模型前向时每个 DeltaNet 层的输入，再给这一层传一个“旁听”的 rule，
# 就拿到它真正喂给递推的 q、k、v、g、β，而不必重写投影、卷积与归一化。

# %%
inputs = {}  # 层号 → 这一层 linear_attn 的输入 [1, T, hidden]
hooks = [layer.linear_attn.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
         for i, layer in enumerate(model.layers) if layer.layer_type == "linear_attention"]
with torch.inference_mode():
    model(ids)
for hook in hooks:
    hook.remove()


def rule_inputs(i):
    """第 i 层递推的输入 {q、k [1, H, T, Dk]，v [1, H, T, Dv]，g、beta [1, H, T]} 与这一层的输出。"""
    seen = {}

    def spy(q, k, v, g, beta, S, keep_all=False):  # 记下输入，照常用第 7 章的递推算
        seen.update(q=q, k=k, v=v, g=g, beta=beta)
        return recurrent_gated_delta_rule(q, k, v, g, beta, S, keep_all)

    with torch.inference_mode():
        out = model.layers[i].linear_attn(inputs[i], rule=spy)
    return seen, out


runs = {i: rule_inputs(i) for i in inputs}
(seen, out), h = runs[0], inputs[0]  # 第一个 DeltaNet 层
q, k, v, g, beta = (seen[n] for n in ("q", "k", "v", "g", "beta"))
H, T = g.shape[1:]
print({n: tuple(t.shape) for n, t in seen.items()})

# %% [markdown]
# ## 门：每个头、每个 token 的衰减 exp(g)
#
# exp(g) = exp(−exp(A_log)·softplus(a + dt_bias)) ∈ (0, 1]（`GatedDeltaNet.gates`）：接近 1 的头几乎不忘，
# 小的头每个 token 都把旧记忆打个折。a 由 `in_proj_a` 按 token 给出，同一个头在不同的 token 上忘得不一样多。
# 下图是三个 DeltaNet 层全部 12 个头（L 层号、h 头号）：demo 的第 0 层忘得最快，后面的层有记得久的头。

# %%
gates = torch.cat([runs[i][0]["g"][0].exp() for i in runs])  # [层数·H, T]
names = [f"L{i} h{j}" for i in runs for j in range(H)]
fig, ax = plt.subplots()
im = ax.imshow(gates, aspect="auto", interpolation="nearest", vmin=0, vmax=1)
ax.set(yticks=range(len(names)), yticklabels=names, xlabel="token t", title="exp(g_t) per head (rows) and token")
fig.colorbar(im, ax=ax, pad=0.02)
plt.show()

# %% [markdown]
# ## 记忆有多大：‖S_t‖
#
# 用第 7 章 `recurrent_gated_delta_rule(..., keep_all=True)` 取回第一个 DeltaNet 层每个位置之后的 S，画它的
# Frobenius 范数（彩色），灰线是同一个头的 exp(g_t)：门一关（exp(g) 小），记忆的范数就塌下去，写入又让它涨回来。

# %%
with torch.inference_mode():
    S0 = torch.zeros(1, H, k.shape[-1], v.shape[-1])
    o_rec, S_rec, states = recurrent_gated_delta_rule(q, k, v, g, beta, S0, keep_all=True)
norms = torch.stack([S.flatten(2).norm(dim=-1)[0] for S in states])  # [T, H]
fig, axes = plt.subplots(H, 1, figsize=(7, 4), sharex=True)
for i, ax in enumerate(axes):
    ax.plot(g[0, i].exp(), color="0.6", lw=0.8, label="exp(g_t)")
    ax.plot(norms[:, i], color=f"C{i}", lw=1, label=r"$\|S_t\|_F$")
    ax.set_ylabel(f"head {i}")
axes[0].legend(ncol=2, loc="upper right", fontsize=7)
axes[0].set_title("layer 0: memory norm after each token, and the gate")
axes[-1].set_xlabel("token t")
plt.show()

# %% [markdown]
# ## 第 8 章：分块并行与逐 token 递推算出同样的东西
#
# `chunk_gated_delta_rule` 把序列切成 64 个 token 一块（这里另试 16 个一块），块内几次矩阵乘法，块与块之间才串行。
# 输出与最终状态都应在 float32 的舍入之内与递推相同。下图是每个 token 的输出最大误差，竖线是 16 个一块时的块边界：
# 误差不随块数累积。

# %%
with torch.inference_mode():
    for chunk in (64, 16):
        o_c, S_c, _ = chunk_gated_delta_rule(q, k, v, g, beta, S0, chunk=chunk)
        print(f"chunk={chunk}: max|o_chunk - o_rec| = {(o_c - o_rec).abs().max():.2e}, "
              f"max|S_chunk - S_rec| = {(S_c - S_rec).abs().max():.2e}")
    err = (o_c - o_rec).abs().amax(dim=(0, 1, 3))  # [T]：16 个一块时每个 token 的最大误差
fig, ax = plt.subplots()
ax.semilogy(err.clamp(min=1e-12), ".", ms=3)
for b in range(16, T, 16):
    ax.axvline(b, color="0.85", lw=0.8, zorder=0)
ax.set(xlabel="token t", ylabel="max |o_chunk - o_rec|", title="chunked (16) vs recurrent output, layer 0")
plt.show()

# %% [markdown]
# 这个旁听的递推与层的真实前向是同一个计算：用分块形式再跑一遍整层，输出与上面 `net(h)` 的输出也相同（舍入之内）。

# %%
with torch.inference_mode():
    out_chunk = net(h, rule=chunk_gated_delta_rule)
print(f"layer output, chunk rule vs recurrent rule: max diff = {(out_chunk - out).abs().max():.2e}")

# %% [markdown]
# ## 一条记忆怎样被遗忘
#
# 往记忆里写一对联想 key → val（S₀ = key ⊗ val，即 β = 1 写一次，S₀ᵀkey = val），再接着喂提示词的真实 token。
# 递推对 S 是仿射的：S_t = M_t S₀ + (不写 key 时的 S_t)，M_t = e^{g_t}(I − β_t k_t k_tᵀ) ⋯ e^{g_1}(I − β_1 k_1 k_1ᵀ)。
# 把 v 置零再递推，得到的就只是 M_t S₀，它对 key 的回答是 (keyᵀ M_t key)·val：实线画这个系数，也就是 S 还记得 val 的多少。
# 只有门的话它是 exp(g₁ + … + g_t)（同色的淡粗线）；实线比它低的部分是 delta 规则的“改写”：新写入的 k 与 key 相近时，
# 会擦掉 key 上的旧值。挑四个门不同的头（三个 DeltaNet 层里平均 exp(g) 从大到小）：
# - 左图：随机的 key，与真实的 k 几乎正交，遗忘几乎全来自门；
# - 右图：key 取提示词里第一个 `self` 的 k（每个头自己的），之后同一个 token 再出现（竖线）时它被改写，掉得比门更快。

# %%
def forgetting(seen, key, start):
    """第 start 个 token 时每个头写进 key[h] → val，读它之后的 token：(联想还剩的系数 [T', H], 只有门时的 [T', H])。"""
    q, k, v, g, beta = (seen[n][:, :, start + 1 :] for n in ("q", "k", "v", "g", "beta"))
    val = torch.randn(v.shape[-1])
    S_key = key[None, :, :, None] * val  # [1, H, Dk, Dv]：每个头 key[h] ⊗ val
    with torch.inference_mode():
        _, _, states = recurrent_gated_delta_rule(q, k, torch.zeros_like(v), g, beta, S_key, keep_all=True)  # v = 0：只剩 M_t S₀
    left = torch.stack([(S[0].transpose(-1, -2) @ key[..., None])[..., 0] @ val for S in states]) / val.dot(val)
    return left, g[0].cumsum(-1).exp().T


torch.manual_seed(0)
order = gates.mean(1).argsort(descending=True)
chosen = [int(order[j]) for j in (0, 3, 7, len(order) - 1)]  # 最慢、较慢、较快、最快
token = ids[0].tolist()
p0 = next(t for t in range(T) if chat.decode([token[t]]) == "self")
again = [t - p0 for t in range(p0 + 1, T) if token[t] == token[p0]]  # 同一个 token 再出现在 p0 之后第几步
random_key = F.normalize(torch.randn(H, k.shape[-1]), dim=-1)
fig, axes = plt.subplots(1, 2, figsize=(8, 3), sharey=True)
for ax, which in zip(axes, ("random", "self")):
    curves = [forgetting(runs[i][0], random_key if which == "random" else runs[i][0]["k"][0, :, p0], p0) for i in runs]
    left, gate_only = (torch.cat(x, dim=1) for x in zip(*curves))  # [T', 12]
    for c, j in enumerate(chosen):
        ax.semilogy(range(1, len(left) + 1), gate_only[:, j], lw=3, alpha=0.3, color=f"C{c}")
        ax.semilogy(range(1, len(left) + 1), left[:, j].abs().clamp(min=1e-12), lw=1, color=f"C{c}",
                    label=f"{names[j]}, mean exp(g)={gates[j].mean():.2f}")
    ax.set(xlabel=f"tokens after the write (t - {p0})", xlim=(0, 32), ylim=(1e-6, 2),
           title=f"key = {'random unit vector' if which == 'random' else 'k of token self'}")
for t in again:
    axes[1].axvline(t, color="0.5", lw=0.8, ls=":")
axes[0].set_ylabel(r"$key^T M_t\, key$ (faint: gate only)")
axes[0].legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 回滚：`state_after(parts, t)` 就是只喂前 t+1 个 token 的记忆
#
# 投机解码（第 14 章）验证几个草稿时，分块形式用 `keep_all=True` 记下 (S₀, G, K, U)，被拒绝时用第 7 章的
# `state_after(parts, t)` 重建第 t 个位置之后的记忆，不必重算。这里先读 40 个 token 得到 S₀，再把接下来的 40 个 token
# 作为一块喂进去；对每个 t，与从 S₀ 只递推前 t+1 个 token 的最终记忆比较。

# %%
T0, W = 40, 40
with torch.inference_mode():
    _, S_start, _ = recurrent_gated_delta_rule(q[:, :, :T0], k[:, :, :T0], v[:, :, :T0], g[:, :, :T0], beta[:, :, :T0], S0)
    window = [t[:, :, T0 : T0 + W] for t in (q, k, v, g, beta)]
    _, _, parts = chunk_gated_delta_rule(*window, S_start, keep_all=True)
    diffs = []
    for t in range(W):
        _, S_ref, _ = recurrent_gated_delta_rule(*(x[:, :, : t + 1] for x in window), S_start)
        diffs.append((state_after(parts, t) - S_ref).abs().max().item())
print(f"max over t of max|state_after(parts, t) - S(first t+1 tokens)| = {max(diffs):.2e}")
fig, ax = plt.subplots()
ax.semilogy(range(W), [max(d, 1e-12) for d in diffs], "o", ms=3)
ax.set(xlabel="t (position inside the verified block)", ylabel="max abs diff", ylim=(1e-12, 1e-3),
       title="state_after(parts, t) vs feeding only the first t+1 tokens")
plt.show()
