# %% [markdown]
# # 第 4 章附 · 专家混合：每个 token 选 8 个专家
#
# `qwen/moe.py` 的 `SparseMoE`：路由器给 E 个专家各打一个分数，softmax 之后取最高的 k 个、重新归一，这 k 个 SwiGLU 专家的
# 输出按权重相加，再加上带门的共享专家。这本笔记本在一个随机权重的小模型上（35B-A3B 的结构：256 个专家、每个 token 8 个，
# 只是各处都窄）看三件事：每层给每个 token 选了哪些专家；k 个权重有多大；投机解码一次验证 k + 1 行时，这些行一共
# 碰到多少个不同的专家——CPU 上读权重最花时间，碰到的专家越多，验证就越贵（第 14 章）。
#
# 权重是随机的，路由也就近乎随机：训练过的模型里相邻的 token 更常选同样的专家，碰到的专家会少一些。

# %%
# 图直接画在笔记本里（Jupyter 的 matplotlib-inline 后端）
import matplotlib.pyplot as plt
import torch

import qwen
from qwen.moe import route

torch.manual_seed(0)
torch.set_num_threads(1)
plt.rcParams.update({"figure.figsize": (7, 3), "figure.dpi": 80, "font.size": 9, "lines.antialiased": False})
cfg = qwen.Config(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                  linear_value_head_dim=32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=32,
                  shared_expert_intermediate_size=64)
model = qwen.Model(cfg).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if "experts" in name:  # 堆叠的专家 [E, out, in]：按输入宽度缩放的随机数
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
print(f"每层 {cfg.num_experts} 个专家、每个 token 用 {cfg.num_experts_per_tok} 个；"
      f"一层的专家参数 {model.layers[0].mlp.experts.gate_up_proj.numel() * 3 // 2:,}，一个 token 读到其中的 "
      f"{cfg.num_experts_per_tok / cfg.num_experts:.1%}")

# %% [markdown]
# ## 每层选了哪些专家
#
# 在每层的路由器（`mlp.gate`）上挂一个钩子，记下它的分数，再用第 4 章附的 `route` 算出每个 token 选的专家与权重。

# %%
scores = {}
hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o, n=n: scores.__setitem__(n, o.reshape(-1, o.shape[-1])))
         for n, layer in enumerate(model.layers)]
ids = torch.randint(0, cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    model(ids)
for h in hooks:
    h.remove()
routes = {n: route(s, cfg.num_experts_per_tok) for n, s in scores.items()}  # 层 → (权重 [T, k], 专家 [T, k])

fig, axes = plt.subplots(1, len(routes), figsize=(10, 3), sharey=True)
for (n, (w, idx)), ax in zip(routes.items(), axes):
    grid = torch.zeros(ids.shape[1], cfg.num_experts)
    grid.scatter_(1, idx, w)  # 第 t 行：token t 选中的专家处是它的权重
    ax.imshow(grid, aspect="auto", cmap="Blues", interpolation="nearest")
    ax.set_title(f"layer {n}", fontsize=9)
    ax.set_xlabel("expert")
axes[0].set_ylabel("token position")
plt.tight_layout()

# %% [markdown]
# ## k 个权重
#
# 重新归一之后每个 token 的 k 个权重和为 1；从大到小排好，看第 1、2、……、k 个选择平均占多少。都是 1/k 时等于 k 个专家
# 平分；第一个越大，路由越“确定”。

# %%
for n, (w, _) in routes.items():
    plt.plot(range(1, cfg.num_experts_per_tok + 1), w.float().mean(0), marker="o", label=f"layer {n}")
plt.axhline(1 / cfg.num_experts_per_tok, color="gray", linestyle=":", label="1/k")
plt.xlabel("choice j (largest first)")
plt.ylabel("mean weight")
plt.legend()
print({n: round(float(w.float().sum(-1).mean()), 4) for n, (w, _) in routes.items()})  # 每行的和都是 1

# %% [markdown]
# ## 验证 k + 1 行碰到几个专家
#
# 解码一个 token 读 8 个专家；投机解码一次验证 `[last, d₁, …, d_k]` 这 k + 1 行，每个专家只读一遍、乘它的那几行，
# 读的专家数是这些行选中的并集：在 8 与 8(k + 1) 之间（也不超过 256）。按相继的 k + 1 个 token 数一数：

# %%
rows = range(1, 9)
for n, (_, idx) in routes.items():
    distinct = [sum(len(set(idx[t : t + r].flatten().tolist())) for t in range(ids.shape[1] - r)) / (ids.shape[1] - r)
                for r in rows]
    plt.plot(rows, distinct, marker="o", label=f"layer {n}")
plt.plot(rows, [min(8 * r, cfg.num_experts) for r in rows], color="gray", linestyle=":", label="bound 8(k+1)")
plt.xlabel("rows verified at once, k + 1")
plt.ylabel("distinct experts read")
plt.legend()
print("验证的行数多，读的专家就多：起草几个才划算，要看真实量出的一轮验证的代价（第 14 章 best_draft_count 的 round_cost）")
