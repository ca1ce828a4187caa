"""命令行：python -m qwen [chat] "你好"（不给提示词时进入多轮对话）；三个子命令（argparse 的 subparsers）：

python -m qwen chat [提示词]：对话（默认的子命令，可以省略不写）。
python -m qwen compile [--model …]：提前把用得着的都编译好（C++ 的 matvec；--layout graphs 的解码一步的图），缓存在磁盘上。
python -m qwen serve [--model …]：OpenAI 兼容的 HTTP 服务（附录 qwen/serve）。
加载都经过附录的 qwen.fast.load：--layout 选矩阵的布局，--quantize 选权重的格式。"""

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from .chat import Chat
from .conversation import Conversation
from .fast import DTYPES, LAYOUTS, load, load_model, warm_up
from .fast.records import record_file
from .sample import RULES
from .weights import find_model


def number(kind, low=None, high=None, low_open=False):
    """argparse 的 type：把参数转成 kind，不在 [low, high]（low_open 时 (low, high]）里、或不是有限的数（inf、nan）
    就是一行清楚的错误。"""
    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"要{'整数' if kind is int else '数'}，收到 {text!r}") from None
        if kind is float and not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"要有限的数，收到 {text}")
        if (low is not None and (x < low or (low_open and x == low))) or (high is not None and x > high):
            left = "(-∞" if low is None else f"{'(' if low_open else '['}{low}"
            raise argparse.ArgumentTypeError(f"要在 {left}, {'∞)' if high is None else f'{high}]'} 里，收到 {text}")
        return x
    return parse


def bias(text: str) -> tuple:
    """--logit-bias 的 type：ID=数 → (token id, 加到它 logit 上的数，[-100, 100])。"""
    token, _, value = text.partition("=")
    try:
        return number(int, 0)(token), number(float, -100, 100)(value)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"要 ID=数（比如 151645=-100：不许这个 token），{text!r} 不对：{e}") from None


def json_object(text: str) -> dict:
    """--chat-template-kwargs 的 type：一个 JSON 对象（比如 '{"preserve_thinking": true}'）。"""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"要 JSON 对象，{text!r} 解析不了：{e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"要 JSON 对象（{{\"名字\": 值}}），收到 {text!r}")
    return value


def setting(name: str):
    """一项采样设置的 argparse type：范围取第 12 章的 RULES（与 Sampling.check、服务是同一张表）。"""
    integer, low, high, low_open, _ = RULES[name]
    return number(int if integer else float, low, high, low_open)


def model_options(quantize_help: str) -> argparse.ArgumentParser:
    """几个子命令共用的加载选项：--model、--dtype、--layout、--quantize，以及旧的 --compile / --no-compile。"""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", default=None, help="检查点文件夹或 demo（默认：QWEN_MODEL、本地缓存或下载 Qwen/Qwen3.5-0.8B）")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="默认：CPU 支持时 bfloat16，否则 float32")
    p.add_argument("--layout", choices=["auto", *LAYOUTS], default="auto",
                   help="矩阵的布局：auto（默认：能编译 C++ 就是 blocked）、plain、packed（oneDNN）、blocked（C++ 的 matvec）、"
                        "graphs（blocked，解码一步再用 torch.compile 编译成图，第一次要几分钟）")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="旧的写法：--compile 即 --layout graphs，--no-compile 即 --layout packed")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None, help=quantize_help)
    return p


def layout_of(args) -> str:
    """--layout 与旧的 --compile / --no-compile：两个都给了且不一致时报错，而不是悄悄挑一个。"""
    if args.compile is None:
        return args.layout
    old = "graphs" if args.compile else "packed"
    if args.layout not in ("auto", old):
        sys.exit(f"错误：--{'' if args.compile else 'no-'}compile 即 --layout {old}，与 --layout {args.layout} 矛盾")
    return old


def chat_arguments(sub) -> None:
    p = sub.add_parser("chat", parents=[model_options("矩阵存成 int8 或 int4（分块布局上）：读的字节是 bfloat16 的一半或 28%，输出只差量化误差")],
                       help="与模型对话（默认的子命令：python -m qwen \"你好\"）")
    p.add_argument("prompt", nargs="?", help="一句话；省略时进入交互式多轮对话")
    p.add_argument("--system", default=None, help="系统提示词")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="随提示词一起看的图（PNG、JPEG、WebP；可以重复）；交互式对话里用 /image PATH")
    p.add_argument("--max-new-tokens", type=number(int, 1), default=512)
    p.add_argument("--temperature", type=setting("temperature"), default=None,
                   help="0 为贪心（默认取检查点 generation_config.json 的设置）")
    p.add_argument("--top-k", type=setting("top_k"), default=None)
    p.add_argument("--top-p", type=setting("top_p"), default=None)
    p.add_argument("--repetition-penalty", type=setting("repetition_penalty"), default=None,
                   help="出现过的 token 的 logit 除以它（1 为不罚）")
    p.add_argument("--presence-penalty", type=setting("presence_penalty"), default=None, help="生成过的 token 的 logit 减去它（0 为不罚）")
    p.add_argument("--frequency-penalty", type=setting("frequency_penalty"), default=None,
                   help="生成过 n 次的 token 的 logit 减去 n 倍的它（0 为不罚；小模型重复个没完时用）")
    p.add_argument("--logit-bias", type=bias, action="append", default=[], metavar="ID=BIAS",
                   help="给 token ID 的 logit 加上 BIAS（[-100, 100]；-100 即不许它；可以重复）")
    p.add_argument("--seed", type=setting("seed"), default=None)
    p.add_argument("--think", action="store_true", help="开启思考模式（默认不思考）")
    p.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help="交给对话模板的参数（比如 '{\"preserve_thinking\": true}'；发布的模板只有 enable_thinking 与 add_vision_id）")
    p.add_argument("--no-mtp", action="store_true", help="不用 MTP 草稿头做投机解码（默认检查点有草稿头就用）")
    p.add_argument("--threads", type=number(int, 1), default=None, help="PyTorch 线程数（默认不改）")
    p.set_defaults(run=chat_main)


def answer(conversation, messages, args) -> str:
    """流式打印一轮回答，结尾打印 token 数、秒数、速度与草稿的接受率；返回完整文字。"""
    settings = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                    frequency_penalty=args.frequency_penalty, logit_bias=dict(args.logit_bias) or None)
    pieces = []
    for piece in conversation.reply(messages, args.think, args.max_new_tokens, chat_template_kwargs=args.chat_template_kwargs,
                                    **settings):
        pieces.append(piece)
        print(piece, end="", flush=True)
    st = conversation.stats
    accepted = "" if st["drafted"] is None else (f"，草稿接受率 {st['hits'] / st['drafted']:.0%}（{st['hits']}/{st['drafted']}）"
                                                 if st["drafted"] else "，草稿接受率 —（这一轮没有起草）")
    print(f"\n[{st['tokens']} 个 token，{st['seconds']:.1f} 秒，{st['tokens'] / max(st['seconds'], 1e-9):.1f} token/s{accepted}]",
          file=sys.stderr)
    return "".join(pieces)


def compile_arguments(sub) -> None:
    p = sub.add_parser("compile", parents=[model_options("也编译 int8 或 int4 的路径")],
                       help="提前编译：C++ 的 matvec（默认路径要它），以及 --layout graphs 用的解码一步的图")
    p.set_defaults(run=prepare)


def prepare(args) -> None:
    """python -m qwen compile：编译 C++ 的 matvec 与 --layout graphs 的图（主模型与草稿头），之后的运行从磁盘缓存读；
    再量一次默认布局上多起草一个 token 的代价，记下来。存这些的文件夹写不了时先说出来：编了也存不下。"""
    for folder in cache_folders():
        if not writable(folder):
            sys.exit(f"错误：{folder} 写不了：compile 编出的内核、图与量出的代价都存在那里，存不下就白编了（下次照样要编）。"
                     "把 XDG_CACHE_HOME（内核与记录）或 TORCHINDUCTOR_CACHE_DIR（图）指到一个写得了的文件夹再试")
    t0 = time.perf_counter()
    try:
        model, mtp = load(args.model, "graphs", args.quantize, DTYPES.get(args.dtype))
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        sys.exit(f"错误：{e}")
    print(f"C++ 的 matvec 与加载：{time.perf_counter() - t0:.1f} 秒", file=sys.stderr)
    print(f"解码一步的图（主模型{'与草稿头' if mtp is not None else ''}）：{warm_up(model, mtp, calibrate=False):.1f} 秒",
          file=sys.stderr)
    if mtp is not None:  # 默认路径上起草一个 token 的代价（自动挑草稿数用）：量一次，记下来
        default, head = load(model.path, quantize=args.quantize, dtype=model.dtype)
        seconds = warm_up(default, head)
        rounds = " / ".join(f"{r:.2f}" for r in head.round_cost[1:])
        print(f"默认路径上起草 1～{len(head.round_cost) - 1} 个的一轮各花普通解码的 {rounds} 步（{seconds:.1f} 秒）", file=sys.stderr)


def cache_folders() -> list:
    """compile 的结果存在哪儿：内核与记录（record_file），torch.compile 的图（inductor 的缓存）。"""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return [record_file("kernels").parent, Path(cache_dir())]


def writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
        return True
    except OSError:
        return False


def serve_options(sub) -> None:
    p = sub.add_parser("serve", parents=[model_options("矩阵存成 int8 或 int4（同 python -m qwen --quantize）")],
                       help="OpenAI 兼容的 HTTP 服务：连续批处理、MTP、留下的对话")
    p.add_argument("--host", default="127.0.0.1", help="监听的地址（默认只有本机能连）")
    p.add_argument("--port", type=number(int, 1, 65535), default=8000)
    p.add_argument("--api-key", default=os.environ.get("QWEN_API_KEY") or None,
                   help="要求请求带 Authorization: Bearer <KEY>（默认取环境变量 QWEN_API_KEY：不必写在命令行里）")
    p.add_argument("--allow-origin", action="append", default=[], metavar="URL",
                   help="放行这个网页来源（如 http://localhost:3000）的请求并回 CORS 头；可以重复或用逗号隔开，* 是全部")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="另外接受的 Host 名（反向代理、局域网里的主机名）；可以重复或用逗号隔开，* 是全部")
    p.add_argument("--served-model-name", default=None, help="/v1/models 里的名字（默认取检查点文件夹的名字）")
    p.add_argument("--slots", type=number(int, 1), default=8, help="同时生成的请求数，多出来的排队")
    p.add_argument("--cache-mb", type=number(int, 0), default=512, help="留下的对话状态至多占多少 MB")
    p.add_argument("--max-tokens", type=number(int, 1), default=4096, help="一个请求的 max_tokens 上限")
    p.add_argument("--max-body-mb", type=number(float, 0, low_open=True), default=20,  # 同 serve/api.py 的 MAX_BODY
                   help="请求体至多多少 MB（带图的请求是 base64 的 data: URL，一张手机照片几 MB；超过回 413）")
    p.add_argument("--default-chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help="请求没给 chat_template_kwargs 时交给对话模板的参数（比如 '{\"enable_thinking\": false}'；默认是模板自己的）")
    p.add_argument("--no-mtp", action="store_true", help="不用草稿头")
    p.set_defaults(run=serve_main)


def serve_arguments(argv):
    """python -m qwen serve 的参数，--allow-origin、--allow-host 按逗号拆开。"""
    return allowed(parser().parse_args(["serve", *argv]))


def allowed(args):
    args.allow_origin = [o.strip() for item in args.allow_origin for o in item.split(",") if o.strip()]
    args.allow_host = [h.strip() for item in args.allow_host for h in item.split(",") if h.strip()]
    return args


def serve_main(args) -> None:
    """python -m qwen serve：OpenAI 兼容的服务（附录 qwen/serve）。"""
    args = allowed(args)
    try:
        import fastapi  # noqa: F401  服务要的包：先查，别等到监听时才报 ModuleNotFoundError
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        sys.exit(f"错误：服务要 FastAPI、uvicorn 与 prometheus-client（{e.name} 没装）：pip install \"qwen[serve]\"，"
                 f"在仓库里是 pip install -e \".[serve]\"")
    from .serve.api import serve

    try:
        path = find_model(args.model)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"错误：{e}")
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        print(f"（监听 {args.host}：别的机器也能连上来，建议用 --api-key 或 QWEN_API_KEY 要求 key）", file=sys.stderr)

    def start():
        from .serve.engine import Engine

        model, mtp = load(path, layout_of(args), args.quantize, DTYPES.get(args.dtype), draft=not args.no_mtp)
        if mtp is not None:
            warm_up(model, mtp, calibrate="recorded")
        print(f"（{path} 加载好了：http://{args.host}:{args.port}/v1）", file=sys.stderr)
        return Engine(model, mtp, slots=args.slots, cache_mb=args.cache_mb)

    serve(start, args.served_model_name or model_name(path), args.host, args.port, args.api_key,
          max_tokens=args.max_tokens, allow_hosts=args.allow_host, allow_origins=args.allow_origin,
          max_body=int(args.max_body_mb * 2**20), default_chat_template_kwargs=args.default_chat_template_kwargs)


def model_name(path) -> str:
    """HF 缓存里的检查点（.../models--Qwen--Qwen3.5-0.8B/snapshots/<提交>）叫 Qwen/Qwen3.5-0.8B，别的取文件夹名。"""
    repo = path.parent.parent.name
    return repo[len("models--"):].replace("--", "/") if repo.startswith("models--") else path.name


COMMANDS = ("chat", "compile", "serve")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qwen", description="与 Qwen3.5 对话（流式输出）；compile、serve 见各自的 --help")
    sub = p.add_subparsers(title="子命令（省略时是 chat）", metavar="{chat,compile,serve}")
    chat_arguments(sub)
    compile_arguments(sub)
    serve_options(sub)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):  # python -m qwen "你好"：默认的子命令
        argv = ["chat", *argv]
    args = parser().parse_args(argv)
    return args.run(args)


def one_line(message, category, filename, lineno, line=None) -> str:
    """命令行里的警告印一行：类别与它说的那句话（qwen 的警告自己说清楚了是什么、为什么、这次怎么办），不印出处的文件与
    源码行。"""
    return f"{category.__name__}: {message}\n"


def chat_main(args) -> None:
    """python -m qwen [chat]：一句话，或交互式的多轮对话。"""
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model = load_model(args.model, layout_of(args), args.quantize, DTYPES.get(args.dtype))
        conversation = Conversation(Chat(model), mtp=not args.no_mtp)
        conversation.prompt.check(args.chat_template_kwargs, args.think)  # 模板收不收这些参数（与 --think）：先查
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        sys.exit(f"错误：{e}")
    print(f"（{conversation.prompt.describe()}）", file=sys.stderr)
    if not args.no_mtp and conversation.mtp is None:
        print("（检查点没有 MTP 草稿头：用普通解码）", file=sys.stderr)
    if model.layout == "graphs":  # 编译各张图：第一次在这台机器上要一会儿，之后从磁盘缓存读
        print("（编译解码用的图……）", end="", file=sys.stderr, flush=True)
        seconds = warm_up(model, conversation.mtp)
        print(f"\r（编译解码用的图：{seconds:.1f} 秒）" if seconds > 3 else "\r" + " " * 20 + "\r", file=sys.stderr)
    elif conversation.mtp is not None:
        warm_up(model, conversation.mtp, calibrate="recorded")  # 起草的代价：用量过的（python -m qwen compile 量）
    messages = [{"role": "system", "content": args.system}] if args.system else []
    try:
        if args.prompt is not None:
            answer(conversation, messages + [user_message(args.prompt, args.image)], args)
            return
        if args.image:
            sys.exit("错误：--image 要与提示词一起给（python -m qwen \"图里有什么？\" --image a.png）；交互式对话里用 /image PATH")
        talk(conversation, messages, args)
    except ValueError as e:
        sys.exit(f"错误：{e}")


def user_message(text: str, images) -> dict:
    """一条用户消息：有图时是分段的列表，图在文字之前（第 13 章的 build_prompt 照发布的模板写出它们）。"""
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [*({"type": "image", "image": path} for path in images), {"type": "text", "text": text}]}


def talk(conversation, messages, args) -> None:
    """交互式的多轮对话：空行或 Ctrl-D 退出，/reset 清空历史，/image PATH 让下一句话带上这张图。"""
    print("多轮对话：输入内容后回车；空行或 Ctrl-D 退出，/reset 清空历史，/image PATH 给下一句话附一张图。", file=sys.stderr)
    system, images = messages[:1], []
    while True:
        try:
            text = input("你：").strip()
        except EOFError:
            break
        if not text:
            break
        if text == "/reset":
            messages, images = list(system), []
            conversation.reset()
            continue
        if text.startswith("/image"):
            path = text[len("/image"):].strip()
            if not path or not os.path.isfile(os.path.expanduser(path)):
                print(f"（没有这个文件：{path!r}；用法：/image PATH）", file=sys.stderr)
            else:
                images.append(os.path.expanduser(path))
                print(f"（下一句话带上 {len(images)} 张图）", file=sys.stderr)
            continue
        messages.append(user_message(text, images))
        print("Qwen：", end="", flush=True)
        try:
            messages.append({"role": "assistant", "content": answer(conversation, messages, args)})
        except ValueError as e:  # 图读不了、检查点不能看图：说清楚，这一句作废，对话继续
            print(f"\n（{e}）", file=sys.stderr)
            messages.pop()
        images = []


if __name__ == "__main__":
    warnings.formatwarning = one_line  # 只在命令行的进程里：在别的程序里调用 main() 不改它的警告格式
    main()
    gc.freeze()  # 马上就退出：解释器收尾时不必再把 torch 的几十万个对象扫一遍（省下的时间见 docs/performance.md）
