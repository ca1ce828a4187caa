# %% [markdown]
# # 第 14 章 · MTP 草稿头与投机解码，量一量
#
# `qwen/mtp.py`：草稿头便宜地猜出 d₁…d_k，主模型把 [last, d₁, …, d_k] 一次前向验证，收下一致的前缀再加一个自己的 token。
# 这本笔记本在随包的 demo 检查点与它的草稿头上看：每个草稿位置被接受的比例、实测的加速比随 k 的变化、
# 理论上的加速比曲线，以及几轮投机解码里起草、验证、提交各花了多少时间。先确认贪心时输出与普通解码逐 token 相同。

# %%
# 图直接画在笔记本里（Jupyter 的 matplotlib-inline 后端，不必写 %matplotlib inline）
import time

import matplotlib.pyplot as plt
import torch

import qwen
from qwen.cache import State, commit, keep_history
from qwen.mtp import MTP, Run, generate_mtp, speculate, verify

torch.manual_seed(0)
torch.set_num_threads(1)  # demo 模型很小：一个线程最快，计时也稳
plt.rcParams.update({"figure.figsize": (7, 3), "figure.dpi": 80, "font.size": 9,
                     "lines.antialiased": False})  # 线不抗锯齿：PNG 小得多，笔记本不臃肿
model = qwen.Model.from_pretrained("demo")  # 第 10 章的普通模型
mtp = MTP.from_pretrained(model.cfg, model.path)  # 本章的草稿头（检查点里的 mtp.*）
chat = qwen.Chat(model)
PROMPTS = [  # demo 只学过 Python 标准库：给它几段代码开头（同 ch14_mtp.py）
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    "class Stack:\n    \"\"\"A simple last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "import os\n\n\ndef walk_files(root):\n    \"\"\"Yield the path of every file below root.\"\"\"\n",
]
prompts = [chat.encode(p) for p in PROMPTS]
N = 80  # 每次生成的 token 数（不设停止符：两种解码的长度一样）

# %% [markdown]
# ## 贪心时输出不变
#
# `generate_mtp(..., draft_tokens=k)` 每轮固定起草 k 个；贪心时它的输出必须与第 12 章的 `qwen.generate` 逐 token 相同。

# %%
with torch.inference_mode():
    plain = [qwen.generate(model, ids, N) for ids in prompts]
    for k in (1, 2, 3, 4):
        for ids, want in zip(prompts, plain):
            tokens, rounds, hits = generate_mtp(model, mtp, ids, N, draft_tokens=k)
            assert tokens == want, (k, ids.shape)
print("greedy speculative output == plain greedy output for k = 1..4 on", len(prompts), "prompts")
print(repr(chat.decode(plain[2])[:120]))

# %% [markdown]
# ## 每个草稿位置的接受率
#
# `speculate` 返回这次的 `Run`，它记下 `tried_at[i]`（第 i+1 个草稿被验证的次数：前面的都通过了它才会被看）和
# `accepted_at[i]`（它通过的次数）。条形是三个提示词合起来的 accepted_at / tried_at：第一个位置最容易猜对，
# 后面的位置只在前面都通过时才被验证，是条件概率，不一定更低：前面都猜对时，往往正处在好猜的一段。

# %%
rates, lines = {}, []
with torch.inference_mode():
    for k in (1, 2, 3, 4):
        results = [speculate(model, mtp, ids, N, draft_tokens=k) for ids in prompts]
        acc = torch.tensor([r.accepted_at for r in results]).sum(0)
        tried = torch.tensor([r.tried_at for r in results]).sum(0)
        rates[k] = acc / tried.clamp(min=1)
        lines.append(f"k={k}: accepted/tried per position " + ", ".join(f"{a}/{t}" for a, t in zip(acc.tolist(), tried.tolist())))
print("\n".join(lines))
fig, ax = plt.subplots()
for k, r in rates.items():
    ax.bar([i + 1 + (k - 2.5) * 0.2 for i in range(k)], r, width=0.2, label=f"k = {k}")
ax.set(xlabel="draft position i", ylabel="accepted_at / tried_at", xticks=[1, 2, 3, 4], ylim=(0, 1.2),
       yticks=[0, 0.2, 0.4, 0.6, 0.8, 1.0], title="acceptance per draft position (demo, greedy)")
ax.legend(ncol=4, fontsize=8, loc="upper center")
plt.show()

# %% [markdown]
# ## 一轮里的时间：起草、验证、提交
#
# 照 `spec_round` 写一轮带计时的（贪心、记下历史再提交），用的全是本章与第 11 章的零件：`mtp.draft` 起草 k 个，
# `model.hidden` 与 `lm_head` 一次前向验证 [last, d₁…d_k]，`verify` 收下一致的前缀再加一个主模型的 token，`commit` 只留下
# 它们的效果，草稿头收下这一轮的隐藏状态。开头的预填充就是 `Run.start`（预填充、选出第一个 token、草稿头记下提示词）。

# %%
def begin(ids):
    """预填充（Run.start，贪心）→ (这次生成每轮都用的 Run：主模型状态、草稿头这边、怎么选 token, 第一个新 token)。"""
    run = Run.start(model, ids)
    run.penalty.add(run.tokens)
    return run, run.tokens[0]


def timed_round(run, last, k):
    """一轮 → (本轮的 token, 通过的草稿数, 四个时刻：开始、起草完、验证完、提交完)。"""
    t0 = time.perf_counter()
    drafts, qs = mtp.draft(model, run, k)
    t1 = time.perf_counter()
    start = run.state.pos
    keep_history(run.state)
    h = model.hidden(torch.tensor([[last] + drafts]), run.state)
    logits = model.lm_head(h).float()
    n, new = verify(drafts, qs, logits[0], run)
    t2 = time.perf_counter()
    commit(run.state, start, len(new))
    run.drafter.add(h[:, : len(new)], new)
    run.penalty.add(new)
    return new, n, (t0, t1, t2, time.perf_counter())


def run_rounds(ids, k, rounds):
    """预填充后跑几轮 → (全部新 token, 每轮的 (通过数, 时刻))。"""
    run, last = begin(ids)
    tokens, log = [last], []
    for _ in range(rounds):
        new, n, times = timed_round(run, last, k)
        tokens, last = tokens + new, new[-1]
        log.append((n, times))
    return tokens, log

# %% [markdown]
# 同样的 token 逐个普通解码一遍，记下每一步的时间，作为比较的单位（“一步”）。
# 对每个 k 跑 24 轮，取各段的中位数：起草随 k 线性增长，验证 k+1 个 token 却比解码 1 个贵不了多少——这就是加速的来源。
# demo 很小（主模型只有 4 层），起草一步相对主模型一步并不便宜，每轮的 Python 开销也占得多；0.8B 上起草相对便宜得多
# （docs/performance.md 的“投机解码”一节）。

# %%
def plain_steps(ids, tokens):
    """预填充后把 tokens 逐个喂进去（同第 12 章的 stream）→ 每一步的 (开始, 结束) 时刻。"""
    state = State(model)
    model(ids, state, last=True)
    steps = []
    for t in tokens[:-1]:
        t0 = time.perf_counter()
        int(model(torch.tensor([[t]]), state, last=True)[0, -1].argmax())
        steps.append((t0, time.perf_counter()))
    return steps


ids = prompts[2]
with torch.inference_mode():
    step = torch.tensor([b - a for a, b in plain_steps(ids, plain[2])]).median().item()
    cost, lines = {}, []
    for k in (1, 2, 3, 4):
        tokens, log = run_rounds(ids, k, 24)
        assert tokens == plain[2][: len(tokens)]  # 计时的这一轮也与普通贪心逐 token 相同
        parts = torch.tensor([[t[1] - t[0], t[2] - t[1], t[3] - t[2]] for _, t in log]).median(0).values
        cost[k] = parts.sum().item() / step  # 一轮的代价，以普通解码一步为单位
        lines.append(f"k={k}: draft {parts[0] / step:.2f}, verify {parts[1] / step:.2f}, commit {parts[2] / step:.2f} steps "
                     f"-> round cost r_k = {cost[k]:.2f} plain steps")
print("\n".join(lines))

# %% [markdown]
# 时间线：k = 3 的前 8 轮（上）与逐个普通解码同样多的 token（下），横轴是从第一轮开始的毫秒数。
# 验证条上的数字是这一轮产出的 token 数（通过的草稿 + 主模型补的一个）。

# %%
with torch.inference_mode():
    tokens, log = run_rounds(ids, 3, 8)
    steps = plain_steps(ids, tokens)
zero, ms = log[0][1][0], lambda a, b: ((a - zero) * 1e3, (b - a) * 1e3)
fig, ax = plt.subplots(figsize=(7, 2.4))
for n, (t0, t1, t2, t3) in log:
    ax.broken_barh([ms(t0, t1)], (2.6, 0.8), color="tab:orange")
    ax.broken_barh([ms(t1, t2)], (1.6, 0.8), color="tab:blue")
    ax.broken_barh([ms(t2, t3)], (0.6, 0.8), color="tab:green")
    ax.text(ms(t1, t2)[0] + ms(t1, t2)[1] / 2, 2.0, str(n + 1), ha="center", va="center", color="white", fontsize=7)
zero = steps[0][0]
ax.broken_barh([ms(a, b) for a, b in steps], (-0.4, 0.8), facecolors=["0.45", "0.75"] * len(steps))
ax.set(yticks=[3, 2, 1, 0], yticklabels=["draft", "verify", "commit", "plain decode"], xlabel="ms",
       title=f"8 rounds of k=3 ({len(tokens) - 1} tokens) vs plain decoding of the same tokens")
plt.show()

# %% [markdown]
# ## 实测的加速比
#
# 普通的 `qwen.generate` 与 `generate_mtp(..., draft_tokens=k)` 各生成 80 个 token，交替着跑三遍，各取最快的一次
# （别的进程的干扰只会让某一次变慢）。时间包括预填充；这台机器上的数每次运行都会略有不同。

# %%
def best_times(ids, repeats=3):
    """交替计时，每种取最快的一次 → {0: 普通解码, k: 投机解码（每轮 k 个）} 的秒数，与各 k 的 Run。"""
    best, results = {}, {}
    with torch.inference_mode():
        for _ in range(repeats):
            for k in (0, 1, 2, 3, 4):
                t0 = time.perf_counter()
                if k == 0:
                    qwen.generate(model, ids, N)
                else:
                    results[k] = speculate(model, mtp, ids, N, draft_tokens=k)
                best[k] = min(best.get(k, float("inf")), time.perf_counter() - t0)
    return best, results


best, results = best_times(ids)
speedup = {k: best[0] / best[k] for k in (1, 2, 3, 4)}
for k in (1, 2, 3, 4):
    r = results[k]
    print(f"k={k}: {best[k] * 1e3:.0f} ms vs plain {best[0] * 1e3:.0f} ms -> speed-up {speedup[k]:.2f}x, "
          f"{r.rounds} rounds, {(len(r.tokens) - 1) / r.rounds:.2f} tokens/round, first-position acceptance "
          f"{r.accepted_at[0]}/{r.tried_at[0]}")

# %% [markdown]
# 加速比对 k：点是实测的，叉是按上面量的一轮代价预测的（实测的每轮 token 数 ÷ r_k）。k 大了每轮产出更多，
# 但起草的代价也随 k 线性增长；接受率不够高时，多起草反而不划算。

# %%
per_round = {k: (len(results[k].tokens) - 1) / results[k].rounds for k in (1, 2, 3, 4)}
fig, ax = plt.subplots(figsize=(5, 2.6))
ax.plot(list(speedup), list(speedup.values()), "o-", lw=1, label="measured")
ax.plot(list(per_round), [per_round[k] / cost[k] for k in per_round], "x", ms=7, label="tokens per round / r_k")
ax.axhline(1, color="0.6", lw=0.8, ls=":")
ax.set(xlabel="draft tokens per round k", ylabel="speed-up", xticks=[1, 2, 3, 4], title="speculative vs plain greedy (demo)")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 理论：加速比与接受率
#
# 设每个草稿独立地以概率 a 被接受，一轮在第一个被拒绝的草稿处停下，主模型总会补一个 token。一轮期望产出
#
#     E(a, k) = 1 + a + a² + … + a^k = (1 − a^{k+1}) / (1 − a)
#
# 个 token。一轮的代价以普通解码一步为单位是 r_k（上面量的：k 次起草 + 验证 k+1 个 + 提交），于是
#
#     加速比 S(a, k) = E(a, k) / r_k
#
# `best_draft_count(a, round_cost)` 就是用这个式子（r_k 取 warm_up 量出的 round_cost[k]）按观察到的接受率挑 k 的。曲线是各 k 的 S(a, k)；
# 点是实测的加速比，横坐标取让 E(a, k) 等于实测的每轮 token 数的 a（“等效接受率”）。点离曲线不远；差别来自
# 实测时间里的预填充、各轮之间的 Python 开销，以及 r_k 取的是中位数。曲线与 y = 1 的交点是这个 k 值得起草的最低接受率。

# %%
def effective_a(per_round, k):
    """解 (1 − a^{k+1}) / (1 − a) = per_round（二分法），a ∈ [0, 1)。"""
    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (1 - mid ** (k + 1)) / (1 - mid) < per_round else (lo, mid)
    return lo


a = torch.linspace(0, 0.99, 100)
fig, ax = plt.subplots()
for k in (1, 2, 3, 4):
    ax.plot(a, (1 - a ** (k + 1)) / (1 - a) / cost[k], lw=1, color=f"C{k - 1}", label=f"k = {k}, r_k = {cost[k]:.2f}")
    ax.plot(effective_a(per_round[k], k), speedup[k], "o", color=f"C{k - 1}", ms=6)
ax.axhline(1, color="0.6", lw=0.8, ls=":")
ax.set(xlabel="acceptance rate a", ylabel="speed-up", title="S(a, k) = (1 - a^(k+1)) / (1 - a) / r_k; dots: measured")
ax.legend(fontsize=8)
plt.show()
