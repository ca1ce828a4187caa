"""第 14 章 · 实验：普通贪心解码 vs. MTP 草稿头驱动的投机解码。

对每个提示词分别跑两种解码（同样的 max_new_tokens），打印速度、验证轮数、接受率、
两者输出是否逐 token 相同，以及加速比。在终端里，被接受的草稿 token 会高亮显示。

    python ch14_mtp.py --model demo         # 随包附带的小模型，离线即可运行（提示词是几段代码）
    python ch14_mtp.py                      # 默认：find_model() 找到的 Qwen3.5-0.8B
    python ch14_mtp.py --model /path/to/ckpt --draft-tokens 2 --dtype bfloat16 --threads 2

不给 --draft-tokens 时，每轮起草几个由 generate_mtp 按观察到的接受率与这台机器上量出的一轮的代价自动挑选（见
qwen.mtp.best_draft_count）；起草在这里永远不划算时一个也不起草，另按固定每轮 1 个跑一遍，看看接受率。
最后打印为什么是这个加速比：这台机器上 demo 与 0.8B 的形状各自一轮的代价（0.8B 的形状第一次量要几秒，之后读记下的），
以及同样的接受率在两者上各该有多少加速。
"""

import argparse
import gc
import sys
import time

import torch

from qwen.cache import State, copy_state, keep_history
from qwen.chat import Chat
from qwen.__main__ import layout_of, model_options
from qwen.bench.scale import FULL, full_size_costs
from qwen.fast import DTYPES, describe, load, num_params, warm_up
from qwen.mtp import best_draft_count, speculate
from qwen.sample import generate

PROMPTS = ["用一句话介绍一下 Transformer。", "写一段 200 字的短文，介绍长江。"]
# 没有对话模板的检查点（demo 模型只学过 Python 标准库）：给它几段代码开头，让它续写
CODE_PROMPTS = [
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    "class Stack:\n    \"\"\"A simple last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "import os\n\n\ndef walk_files(root):\n    \"\"\"Yield the path of every file below root.\"\"\"\n",
]


def highlight(chat, result, color: bool) -> str:
    """把回答拼出来；终端里被接受的草稿 token 用绿色背景标出。"""
    if not color:
        return chat.decode(result.tokens)
    pieces = [chat.decode(result.tokens[:1])]
    for drafted, accepted, emitted in result.trace:
        if accepted:
            pieces.append("\x1b[42m" + chat.decode(emitted[:accepted]) + "\x1b[0m")
        pieces.append(chat.decode(emitted[accepted:]))
    return "".join(pieces)


@torch.inference_mode()
def verify_gap(model, ids, tokens, k: int = 4) -> float:
    """读完提示词之后，把 tokens 的前 k+1 个一次验证，与逐个解码它们比：logits 的最大差（第 14 章 verify 的说明）。"""
    state = State(model)
    model(ids, state, last=True)
    feed = torch.tensor([tokens[: k + 1]])
    together = copy_state(state)
    keep_history(together)  # 与投机解码的验证一样记下历史（只比 logits，不提交）
    verified = model(feed, together)
    alone = copy_state(state)
    decoded = torch.cat([model(feed[:, i : i + 1], alone) for i in range(feed.shape[1])], 1)
    return (verified - decoded).abs().max().item()


def draft_vocab(text: str):
    """--draft-vocab 的值：auto、all 或正整数。"""
    if text in ("auto", "all"):
        return None if text == "all" else text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"要 auto、all 或正整数，收到 {text!r}")
    return int(text)


def at_least(low: int):
    """argparse 的 type：不小于 low 的整数，否则一行清楚的错误（不是深处的 traceback）。"""
    def parse(text):
        if not text.lstrip("-").isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"要不小于 {low} 的整数，收到 {text!r}")
        return int(text)
    return parse


def arguments(argv):
    """命令行：加载的选项（--model、--dtype、--layout、--quantize）与 python -m qwen 的是同一份定义（qwen/__main__.py）。"""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                parents=[model_options("主模型与草稿头的矩阵存成 int8 或 int4（分块布局上）")])
    p.add_argument("--prompt", action="append", default=[], help="再加一个提示词（可重复）")
    p.add_argument("--max-new-tokens", type=at_least(1), default=120)
    p.add_argument("--draft-tokens", type=at_least(1), default=None, help="每轮起草几个 token（默认按接受率自动挑）")
    p.add_argument("--draft-vocab", type=draft_vocab, default="auto",
                   help="起草时给哪些 token 打分：auto（默认，见 qwen/tools/vocab.py）、all（全词表）或 n（前 n 个 id）")
    p.add_argument("--threads", type=at_least(1), default=None)
    args = p.parse_args(argv)
    args.layout = layout_of(args)  # --compile 与 --layout 矛盾时报错，不悄悄挑一个
    return args


def load_head(args):
    """加载主模型与草稿头（附录的 qwen.fast.load），预热并量出起草的代价，打印草稿头的大小与设置。"""
    try:
        model, mtp = load(args.model, args.layout, args.quantize, DTYPES.get(args.dtype), draft_vocab=args.draft_vocab)
        if mtp is None:
            raise ValueError(f"检查点 {model.path} 里没有 mtp.* 张量：它没有 MTP 草稿头，不能做投机解码")
        chat = Chat(model)
        if model.layout == "graphs":
            print("编译解码与投机解码用的图（第一次在这台机器上要几十秒，之后从磁盘缓存读）……", flush=True)
        print(f"预热与校准用了 {warm_up(model, mtp, calibrate=not args.draft_tokens):.1f} 秒\n")
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        sys.exit(f"错误：{e}")
    print(f"MTP 草稿头：{num_params(mtp) / 1e6:.2f}M 参数（与主模型共用嵌入；起草只乘输出头里起草词表的那几行）")
    for name, module in mtp.named_children():
        print(f"  {name}: {num_params(module) / 1e6:.2f}M")
    print(f"起草词表：{getattr(mtp, 'draft_note', '全词表')}")
    how = f"固定 {args.draft_tokens} 个" if args.draft_tokens else f"自动（按接受率挑 0～4 个，{costs(mtp.round_cost)}）"
    print(f"线程 {torch.get_num_threads()}，dtype {str(model.dtype).removeprefix('torch.')}，{describe(model)}，"
          f"每轮起草：{how}\n")

    return model, mtp, chat


def costs(round_cost) -> str:
    """一轮的代价，一句话。"""
    text = f"量得起草 1～{len(round_cost) - 1} 个的一轮各花普通解码的 {' / '.join(f'{r:.2f}' for r in round_cost[1:])} 步"
    return text + ("" if best_draft_count(1, round_cost) else "：草稿全对也不划算，一个也不起草")


def expected(a: float, round_cost) -> tuple[float, int]:
    """第一个草稿位置的接受率 a、一轮的代价 round_cost → (期望的加速比, 每轮起草几个)：第 14 章 best_draft_count 的式子。"""
    k = best_draft_count(a, round_cost)
    return (1 - min(a, 0.99) ** (k + 1)) / (1 - min(a, 0.99)) / round_cost[k], k


def main(argv=None):
    args = arguments(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, mtp, chat = load_head(args)
    color = sys.stdout.isatty()
    seen = [compare(model, mtp, chat, text, args, color) for text in (PROMPTS if chat.templated else CODE_PROMPTS) + args.prompt]
    if not args.draft_tokens:
        why(model, mtp, seen)


def why(model, mtp, seen) -> None:
    """为什么是这个加速比：这台机器上 demo 与 0.8B 的形状各自一轮的代价，同样的接受率在两者上的期望加速比。"""
    tried, accepted = sum(t for _, t, _, _ in seen), sum(a for _, _, a, _ in seen)
    a = accepted / max(tried, 1)
    step, measured = sum(s for s, _, _, _ in seen) / len(seen), sum(x for _, _, _, x in seen) / len(seen)
    print("为什么是这个加速比：投机解码省的是读权重的时间（验证 k+1 个 token 时每个权重读一次、乘 k+1 行）。")
    print(f"  这个模型：解码一步 {step * 1e3:.2f} 毫秒，{costs(mtp.round_cost)}。")
    if model.cfg.num_hidden_layers * model.cfg.hidden_size >= FULL.num_hidden_layers * FULL.hidden_size:
        return  # 不比 0.8B 小：它自己的代价就说明了问题
    print("  它的一步几乎全是固定开销（权重只有几 MB，装得进缓存）：多验证一行、起草一个 token 都和一步差不多贵。")
    print("  同一台机器上量一量 0.8B 的形状（24 层、宽 1024、随机权重；第一次要几秒，之后读记下的）……", flush=True)
    try:
        full = full_size_costs(model.dtype)
    except (OSError, RuntimeError) as e:  # 临时文件夹放不下约 700 MB、内存不够……：说清楚，不算实验失败
        print(f"  量不了 0.8B 的形状（{type(e).__name__}: {e}）：要约 700 MB 的临时文件与 2 GB 内存。")
        return
    rows = " / ".join(f"{t * 1e3:.1f}" for t in full["verify"])
    print(f"  0.8B 的形状：一次前向验证 1～{len(full['verify'])} 行各 {rows} 毫秒，起草一个 {full['draft'] * 1e3:.1f} 毫秒，"
          f"{costs(full['round_cost'])}。")
    (s, k), (s_full, k_full) = expected(a, mtp.round_cost), expected(a, full["round_cost"])
    print(f"  同样的接受率（上面第一个草稿位置的 {a:.0%}）：这个模型期望 {s:.2f}×（每轮起草 {k} 个；上面自动挑的实测平均 {measured:.2f}×），"
          f"0.8B 的形状期望 {s_full:.2f}×（每轮起草 {k_full} 个）。")


def compare(model, mtp, chat, text: str, args, color: bool) -> tuple[float, int, int]:
    """一个提示词：普通贪心与投机解码各跑一遍，打印速度、接受率、是否逐 token 相同与加速比。
    返回 (普通解码每个 token 的秒数, 第一个草稿位置验证了几次, 通过了几次, 自动挑草稿数的实测加速比)。"""
    ids = chat.encode(chat.prompt([{"role": "user", "content": text}]))
    generate(model, ids, 2)  # 预热：第一次调用有一次性的开销
    t0 = time.perf_counter()
    plain = generate(model, ids, args.max_new_tokens, chat.stop)
    t1 = time.perf_counter()
    r = speculate(model, mtp, ids, args.max_new_tokens, chat.stop, draft_tokens=args.draft_tokens)
    t2 = time.perf_counter()
    a, b = t1 - t0, t2 - t1
    print(f"提示词：{text!r}" if not chat.templated else f"提示词：{text}")
    print(f"  普通贪心：{len(plain)} 个 token，{a:.2f} 秒，{len(plain) / a:.1f} token/s")
    print(f"  投机解码：{len(r.tokens)} 个 token，{b:.2f} 秒，{len(r.tokens) / b:.1f} token/s")
    ks = [d for d, _, _ in r.trace if d]
    idle = f"，{r.rounds - len(ks)} 轮没有起草" if r.rounds > len(ks) else ""
    print(f"  验证轮数 {r.rounds}，起草 {r.drafted}，接受 {r.hits}，接受率 {r.acceptance:.0%}，"
          f"起草的轮平均每轮 {sum(ks) / max(len(ks), 1):.1f} 个{idle}")
    if len(ks) and max(ks) > 1:
        rates = ", ".join(f"{acc}/{tried}" for acc, tried in zip(r.accepted_at, r.tried_at))
        print(f"  各草稿位置（接受/验证）：{rates}")
    print(f"  输出逐 token 相同：{'是' if plain == r.tokens else '否'}")
    if len(plain) > 1:
        print(f"  一次验证 {min(len(plain), 5)} 个 token 与逐个解码的 logits 最大差：{verify_gap(model, ids, plain):.3g}")
    answer = chat.decode([t for t in plain if t not in chat.stop])
    print(f"  回答前 60 字：{answer[:60]!r}")
    print(f"  加速比：{a / b:.2f}×")
    if not r.drafted and not args.draft_tokens:  # 自动挑选一个也没起草：另按固定每轮 1 个跑一遍，看看草稿头猜得准不准
        t3 = time.perf_counter()
        r = speculate(model, mtp, ids, args.max_new_tokens, chat.stop, draft_tokens=1)
        c = time.perf_counter() - t3
        print(f"  固定每轮起草 1 个：接受 {r.hits}/{r.drafted}，接受率 {r.acceptance:.0%}，加速比 {a / c:.2f}×，"
              f"输出逐 token 相同：{'是' if plain == r.tokens else '否'}")
    if color:
        print("  （绿色是草稿头猜对、白送的 token）")
        print("  " + highlight(chat, r, color).replace("\n", "\n  "))
    print()
    return a / len(plain), r.tried_at[0] if r.tried_at else 0, r.accepted_at[0] if r.accepted_at else 0, a / b


if __name__ == "__main__":
    main()
    gc.freeze()  # 马上就退出：解释器收尾时不必再把 torch 的几十万个对象扫一遍（省下的时间见 docs/performance.md）
