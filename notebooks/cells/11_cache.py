# %% [markdown]
# # 第 11 章 · 缓存：生成时每层带着走的状态
#
# `qwen/cache.py` 的 `State` 里每层一份状态：全注意力层是 KV 缓存（`AttentionState`，随长度增长），
# DeltaNet 层是卷积窗口与记忆矩阵 S（`DeltaNetState`，大小固定）。这本笔记本先按 config 算出两者的字节数随长度怎样变化，
# 再看撤销最近喂进去的 token 的两种做法：存档与回退（`snapshot` / `rollback`）、记下历史再提交（`keep_history` / `commit`）。

# %%
# 图直接画在笔记本里（Jupyter 的 matplotlib-inline 后端，不必写 %matplotlib inline）
import matplotlib.pyplot as plt
import torch

import qwen
from qwen.cache import AttentionState, State, commit, copy_state, keep_history, rollback, snapshot

torch.manual_seed(0)
torch.set_num_threads(1)  # demo 模型很小：一个线程最快
plt.rcParams.update({"figure.figsize": (7, 3), "figure.dpi": 80, "font.size": 9,
                     "lines.antialiased": False})  # 线不抗锯齿：PNG 小得多，笔记本不臃肿
model = qwen.Model.from_pretrained("demo")
chat = qwen.Chat(model)

# %% [markdown]
# ## 状态有多大
#
# 按 config 算（状态都存成 float32，4 字节）：
# - 每个注意力层的 KV 缓存：2（k 和 v）× `num_key_value_heads` × T × `head_dim`，随长度 T 线性增长；
# - 每个 DeltaNet 层：记忆 S 是 `linear_num_value_heads` × `linear_key_head_dim` × `linear_value_head_dim`，
#   卷积窗口是最近 3 个 q、k、v 通道的输入，都与 T 无关。
#
# demo 的 config 来自 `qwen/demo/config.json`；Qwen3.5-0.8B 的数就是 `qwen.Config()` 的默认值（第 1 章），不用下载。

# %%
def state_bytes(cfg, T, B=1):
    """按 config 算出的状态字节数：(全部注意力层的 KV 缓存, 全部 DeltaNet 层的 S 与卷积窗口)。"""
    attn = cfg.layer_types.count("full_attention")
    delta = len(cfg.layer_types) - attn
    kv = attn * 2 * B * cfg.num_key_value_heads * T * cfg.head_dim * 4
    channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    S = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return kv, delta * B * (S + (cfg.linear_conv_kernel_dim - 1) * channels) * 4


configs = {"demo (qwen/demo/config.json)": model.cfg, "Qwen3.5-0.8B (qwen.Config() defaults)": qwen.Config()}
for name, cfg in configs.items():
    per_token, fixed = state_bytes(cfg, 1)
    print(f"{name}: KV {per_token / 1024:.1f} KiB per token, DeltaNet state {fixed / 2**20:.2f} MiB, "
          f"equal at T = {fixed / per_token:.0f}; at T = {cfg.max_position_embeddings}: "
          f"KV {state_bytes(cfg, cfg.max_position_embeddings)[0] / 2**20:.0f} MiB")

# %% [markdown]
# 在 demo 上实测：喂进越来越长的输入，数 `State` 里张量的字节。KV 缓存底层是按倍数扩容的缓冲区（第 6 章的
# `AttentionState.reserve`）：真正分配的（`k_buf`、`v_buf`）至少容得下 256 个位置，不够时扩到所需的两倍，追加一个 token
# 不必把整段历史复制一遍。

# %%
def measured(state):
    """State 里实际的字节：(KV 缓存用到的, KV 缓冲区分配的, DeltaNet 的 S 与卷积窗口)。"""
    attn = [s for s in state.layers if isinstance(s, AttentionState)]
    delta = [s for s in state.layers if not isinstance(s, AttentionState)]
    return (sum(s.k.nbytes + s.v.nbytes for s in attn), sum(s.k_buf.nbytes + s.v_buf.nbytes for s in attn),
            sum(s.S.nbytes + s.conv.nbytes for s in delta))


lengths, points = [16, 64, 256, 1024, 2048], []
with torch.inference_mode():
    state = State(model)
    for T in lengths:
        model(torch.randint(model.cfg.vocab_size, (1, T - state.pos)), state, last=True)
        points.append(measured(state))
for T, (used, allocated, fixed) in zip(lengths, points):
    assert (used, fixed) == state_bytes(model.cfg, T)  # 与按 config 算的相同
    print(f"T = {T:5d}: KV used {used / 1024:8.0f} KiB, allocated {allocated / 1024:8.0f} KiB, DeltaNet {fixed / 1024:.0f} KiB")

# %% [markdown]
# 下图（对数坐标）：实线是 KV 缓存，水平线是 DeltaNet 的状态，虚线是“假如每层都是注意力”时的 KV 缓存。
# 混合架构里只有四分之一的层有 KV 缓存；DeltaNet 的状态在两线相交的长度 T* 之后就比 KV 缓存小了，而且从此不再增长。
# 左图的点是上面在 demo 上实测的字节（圆点：用到的；叉：分配的缓冲区）。

# %%
fig, axes = plt.subplots(1, 2, figsize=(8, 3))
for ax, (name, cfg) in zip(axes, configs.items()):
    T = torch.logspace(0, torch.log10(torch.tensor(float(cfg.max_position_embeddings))), 60)
    kv, fixed = state_bytes(cfg, T)
    every = kv * len(cfg.layer_types) / cfg.layer_types.count("full_attention")
    ax.loglog(T, kv, label="KV cache (attention layers)")
    ax.loglog(T, torch.full_like(T, fixed), label="DeltaNet S + conv")
    ax.loglog(T, every, "--", color="0.5", lw=0.8, label="KV if every layer were attention")
    ax.axvline(fixed / state_bytes(cfg, 1)[0], color="0.7", lw=0.8, ls=":")
    ax.set(title=name.split(" (")[0], xlabel="tokens T", ylabel="bytes")
axes[0].loglog(lengths, [p[0] for p in points], "o", color="C0", ms=4, label="measured (demo)")
axes[0].loglog(lengths, [p[1] for p in points], "x", color="C0", ms=5, label="allocated buffer")
axes[0].loglog(lengths, [p[2] for p in points], "o", color="C1", ms=4)
axes[0].legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 撤销最近的 token：存档与回退、记下历史再提交
#
# 投机解码（第 14 章）一次喂进 [last, d₁, …, d_k]，验证之后只留下前 j 个，其余的要从状态里撤掉。
# - `snapshot` / `rollback`：先拷下 DeltaNet 层的 S 与卷积窗口（注意力层只记长度），回退后把要留下的 j 个 token **重新喂一遍**；
# - `keep_history` / `commit`：前向时顺手记下重建每个位置之后的 S 所需的量，`commit(state, start, keep=j)` 直接取出
#   第 j 个 token 之后的 S（第 7 章的 `state_after`）、从完整的卷积输入里切出窗口、把 KV 缓存截到 start + j，不必重算。
#
# 两种做法都应与“只喂前 j 个 token”得到同样的状态。下面喂 5 个 token（提示词之后贪心续写的 5 个，当作 last 与 4 个草稿），
# 对每个 j 比较各层的 KV 缓存、卷积窗口与 S。

# %%
def state_diff(a, b):
    """两个 State 的最大差：各层 KV 缓存（长度要相同）、卷积窗口与 S；pos 也要相同。"""
    assert a.pos == b.pos
    worst = 0.0
    for x, y in zip(a.layers, b.layers):
        if isinstance(x, AttentionState):
            assert x.length == y.length
            pairs = [(x.k, y.k), (x.v, y.v)]
        else:
            pairs = [(x.conv, y.conv), (x.S, y.S)]
        worst = max([worst] + [(p - q).abs().max().item() for p, q in pairs])
    return worst


ids = chat.encode('import os\n\n\ndef walk_files(root):\n    """Yield the path of every file below root."""\n')
K = 5
with torch.inference_mode():
    base = State(model)
    model(ids, base, last=True)
    feed = torch.tensor([qwen.generate(model, ids, K)])  # [1, 5]：last、d1…d4
print("prompt:", ids.shape[1], "tokens, fed:", chat.decode(feed[0]).replace("\n", "\\n"))

# %%
def compare(model, base, feed, j, reference):
    """只留下前 j 个：(rollback 再重喂 与参照的差, commit 与参照的差)。reference(state, tokens) 是“只喂前 j 个”的做法。"""
    with torch.inference_mode():
        ref = copy_state(base)
        reference(ref, feed[:, :j])
        a = copy_state(base)
        snap = snapshot(a)
        model(feed, a)
        rollback(a, snap)
        model(feed[:, :j], a)  # 回退之后要重喂：多一次前向
        b = copy_state(base)
        keep_history(b)
        model(feed, b)
        commit(b, base.pos, j)  # 不重算
    return state_diff(a, ref), state_diff(b, ref)


together = lambda state, tokens: model(tokens, state)  # 参照：前 j 个一次喂进去
print("\n".join("keep j = %d: max diff  snapshot/rollback+refeed %.1e   keep_history/commit %.1e"
                % (j, *compare(model, base, feed, j, together)) for j in range(1, K + 1)))

# %% [markdown]
# 存档与回退再重喂，做的正是与参照相同的运算，差是 0。提交的差可以不是 0，但都在 float32 的舍入之内（1e-6 上下）：
# 各章的普通模型一次喂 5 个 token 与一次喂 j 个，矩阵乘法的行数不同、DeltaNet 用的形式不同（不超过 3 个 token 用逐 token 递推，
# 更多时用第 8 章的分块形式），求和的顺序就不同。状态本身取得对：附录的快路径（`qwen.fast`）保证一次验证的每一行与逐个解码时
# 逐位相同，在它上面提交的状态与逐个解码前 j 个 token 的状态**逐位相同**（这里用不需编译的 oneDNN 打包布局、float32）：

# %%
fast, _ = qwen.fast.load("demo", layout="packed", dtype=torch.float32, draft=False)
one_by_one = lambda state, tokens: [fast(tokens[:, i : i + 1], state) for i in range(tokens.shape[1])]  # 参照：逐个解码
with torch.inference_mode():
    fast_base = State(fast)
    fast(ids, fast_base, last=True)
print("\n".join("fast path, keep j = %d: max diff  snapshot/rollback+refeed %.1e   keep_history/commit %.1e"
                % (j, *compare(fast, fast_base, feed, j, one_by_one)) for j in range(1, K + 1)))

# %% [markdown]
# ## 提交时留下什么、丢掉什么
#
# 以 j = 3 为例（喂了 [last, d1, d2, d3, d4]，接受到 d2）：KV 缓存截到 start + 3（`AttentionState.truncate`）；
# DeltaNet 的卷积窗口取完整输入里紧接第 3 个 token 之前的 3 列，也就是最后三个留下的 token 的输入；
# S 换成第 3 个 token（d2）之后的那份 `state_after(parts, 2)`。灰色是提示词里已在状态中的位置。

# %%
j, names = 3, ["last", "d1", "d2", "d3", "d4"]
prompt_shown = 4  # 画出提示词的最后几个位置
fig, ax = plt.subplots(figsize=(7, 2.6))
x0 = -prompt_shown
rows = {"fed tokens": 3, "KV cache": 2, "DeltaNet conv window": 1, "DeltaNet S": 0}
ax.broken_barh([(x0, prompt_shown)], (rows["KV cache"] - 0.3, 0.6), color="0.8")
for name in ("fed tokens", "KV cache"):
    y = rows[name] - 0.3
    ax.broken_barh([(0, j)], (y, 0.6), color="tab:green")
    ax.broken_barh([(j, K - j)], (y, 0.6), facecolor="white", edgecolor="tab:red", hatch="///")
ax.broken_barh([(j - 3, 3)], (rows["DeltaNet conv window"] - 0.3, 0.6), color="tab:blue")
ax.plot([j - 0.5], [rows["DeltaNet S"]], "D", color="tab:purple", ms=8)
ax.annotate(f"S = state_after(parts, {j - 1})", (j - 0.5, 0), (j + 0.3, -0.05), fontsize=8, va="center")
ax.annotate(f"truncate(start + {j})", (K, rows["KV cache"]), (K + 0.2, rows["KV cache"]), fontsize=8, va="center")
ax.annotate(f"full[:, {j}:{j + 3}]", (j, rows["DeltaNet conv window"]), (j + 0.2, rows["DeltaNet conv window"]), fontsize=8, va="center")
ax.set(yticks=list(rows.values()), yticklabels=list(rows), xlim=(x0, K + 2.5), ylim=(-0.6, 3.6),
       xticks=[i + 0.5 for i in range(x0, K)], xticklabels=["..."] * prompt_shown + names)
ax.set_title(f"commit(state, start, keep={j}): green kept, red hatched dropped, grey prompt")
ax.axvline(0, color="k", lw=0.8)
plt.show()
