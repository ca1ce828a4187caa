"""命令行对话：python -m qwen "你好"；不给提示词时进入多轮对话。

python -m qwen compile [--model …]：提前把用得着的都编译好（C++ 的 matvec；--compile 用的解码一步的图），缓存在磁盘上。
python -m qwen serve [--model …]：OpenAI 兼容的 HTTP 服务（附录 qwen/serve）。"""

import argparse
import math
import os
import sys
import time

import torch

from .chat import Chat
from .conversation import Conversation
from .fast import is_compiled, warm_up
from .model import Model
from .weights import find_model

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


SEED = (-2**63, 2**63 - 1)  # torch.Generator.manual_seed 收 64 位的整数；与服务的 seed 一样取有符号的范围


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


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m qwen", description="与 Qwen3.5 对话（流式输出）")
    p.add_argument("prompt", nargs="?", help="一句话；省略时进入交互式多轮对话")
    p.add_argument("--model", default=None, help="检查点文件夹（默认：QWEN_MODEL、本地缓存或下载 Qwen/Qwen3.5-0.8B）")
    p.add_argument("--system", default=None, help="系统提示词")
    p.add_argument("--max-new-tokens", type=number(int, 1), default=512)
    p.add_argument("--temperature", type=number(float, 0), default=None, help="0 为贪心（默认取检查点 generation_config.json 的设置）")
    p.add_argument("--top-k", type=number(int, 1), default=None)
    p.add_argument("--top-p", type=number(float, 0, 1, low_open=True), default=None)
    p.add_argument("--repetition-penalty", type=number(float, 0, low_open=True), default=None, help="出现过的 token 的 logit 除以它（1 为不罚）")
    p.add_argument("--presence-penalty", type=number(float), default=None, help="生成过的 token 的 logit 减去它（0 为不罚）")
    p.add_argument("--seed", type=number(int, *SEED), default=None)
    p.add_argument("--think", action="store_true", help="开启思考模式（默认不思考）")
    p.add_argument("--no-mtp", action="store_true", help="不用 MTP 草稿头做投机解码（默认检查点有草稿头就用）")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="默认：CPU 支持时 bfloat16，否则 float32")
    p.add_argument("--threads", type=number(int, 1), default=None, help="PyTorch 线程数（默认不改）")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="--compile：解码一步再用 torch.compile 编译成图（第一次要几分钟，之后解码快一些）；"
                        "--no-compile：oneDNN 打包的布局；默认：能编译 C++ 就用分块布局与 C++ 的 matvec")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="矩阵存成 int8（分块布局上）：读的字节少一半、内存少一半，输出只差量化误差")
    return p.parse_args(argv)


def answer(conversation, messages, args) -> str:
    """流式打印一轮回答，结尾打印 token 数、秒数、速度与草稿的接受率；返回完整文字。"""
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty)
    pieces = []
    for piece in conversation.reply(messages, args.think, args.max_new_tokens, seed=args.seed, **sampling):
        pieces.append(piece)
        print(piece, end="", flush=True)
    st = conversation.stats
    accepted = "" if st["drafted"] is None else (f"，草稿接受率 {st['hits'] / st['drafted']:.0%}（{st['hits']}/{st['drafted']}）"
                                                 if st["drafted"] else "，草稿接受率 —（这一轮没有起草）")
    print(f"\n[{st['tokens']} 个 token，{st['seconds']:.1f} 秒，{st['tokens'] / max(st['seconds'], 1e-9):.1f} token/s{accepted}]",
          file=sys.stderr)
    return "".join(pieces)


def prepare(argv) -> None:
    """python -m qwen compile：编译 C++ 的 matvec 与 --compile 的图（主模型与草稿头），之后的运行从磁盘缓存读。"""
    p = argparse.ArgumentParser(prog="python -m qwen compile",
                                description="提前编译：C++ 的 matvec（默认路径要它），以及 --compile 用的解码一步的图")
    p.add_argument("--model", default=None, help="检查点文件夹或 demo（默认同 python -m qwen）")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--quantize", choices=["int8"], default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        model = Model.from_pretrained(args.model, dtype=DTYPES.get(args.dtype), compile=True, quantize=args.quantize)
        mtp = Conversation(Chat(model)).mtp
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        sys.exit(f"错误：{e}")
    print(f"C++ 的 matvec 与加载：{time.perf_counter() - t0:.1f} 秒", file=sys.stderr)
    print(f"解码一步的图（主模型{'与草稿头' if mtp is not None else ''}）：{warm_up(model, mtp, calibrate=False):.1f} 秒",
          file=sys.stderr)
    if mtp is not None:  # 默认路径上起草一个 token 的代价（自动挑草稿数用）：量一次，记下来
        default = Model.from_pretrained(model.path, dtype=model.dtype, quantize=args.quantize)
        head = Conversation(Chat(default)).mtp
        seconds = warm_up(default, head)
        print(f"默认路径上多起草一个 token 的代价：一步的 {head.draft_cost:.0%}（{seconds:.1f} 秒）", file=sys.stderr)


def serve_arguments(argv):
    p = argparse.ArgumentParser(prog="python -m qwen serve", description="OpenAI 兼容的 HTTP 服务：连续批处理、MTP、留下的对话")
    p.add_argument("--model", default=None, help="检查点文件夹或 demo（默认同 python -m qwen）")
    p.add_argument("--host", default="127.0.0.1", help="监听的地址（默认只有本机能连）")
    p.add_argument("--port", type=number(int, 1, 65535), default=8000)
    p.add_argument("--api-key", default=os.environ.get("QWEN_API_KEY") or None,
                   help="要求请求带 Authorization: Bearer <KEY>（默认取环境变量 QWEN_API_KEY：不必写在命令行里）")
    p.add_argument("--allow-origin", action="append", default=[], metavar="URL",
                   help="放行这个网页来源（如 http://localhost:3000）的请求并回 CORS 头；可以重复或用逗号隔开，* 是全部")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="另外接受的 Host 名（反向代理、局域网里的主机名）；可以重复或用逗号隔开，* 是全部")
    p.add_argument("--served-model-name", default=None, help="/v1/models 里的名字（默认取检查点文件夹的名字）")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--quantize", choices=["int8"], default=None, help="矩阵存成 int8（同 python -m qwen --quantize）")
    p.add_argument("--slots", type=number(int, 1), default=8, help="同时生成的请求数，多出来的排队")
    p.add_argument("--cache-mb", type=number(int, 0), default=512, help="留下的对话状态至多占多少 MB")
    p.add_argument("--max-tokens", type=number(int, 1), default=4096, help="一个请求的 max_tokens 上限")
    p.add_argument("--no-mtp", action="store_true", help="不用草稿头")
    args = p.parse_args(argv)
    args.allow_origin = [o.strip() for item in args.allow_origin for o in item.split(",") if o.strip()]
    args.allow_host = [h.strip() for item in args.allow_host for h in item.split(",") if h.strip()]
    return args


def serve_main(argv) -> None:
    """python -m qwen serve：OpenAI 兼容的服务（附录 qwen/serve）。"""
    args = serve_arguments(argv)
    try:
        import fastapi  # noqa: F401  服务要的两个包：先查，别等到监听时才报 ModuleNotFoundError
        import uvicorn  # noqa: F401
    except ImportError as e:
        sys.exit(f"错误：服务要 FastAPI 与 uvicorn（{e.name} 没装）：pip install \"qwen[serve]\"，"
                 f"在仓库里是 pip install -e \".[serve]\"")
    from .serve.api import serve

    try:
        path = find_model(args.model)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"错误：{e}")
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        print(f"（监听 {args.host}：别的机器也能连上来，建议用 --api-key 或 QWEN_API_KEY 要求 key）", file=sys.stderr)

    def load():
        from .serve.engine import Engine

        model = Model.from_pretrained(path, dtype=DTYPES.get(args.dtype), quantize=args.quantize)
        mtp = None if args.no_mtp else Conversation(Chat(model)).mtp
        if mtp is not None:
            warm_up(model, mtp, calibrate="recorded")
        print(f"（{path} 加载好了：http://{args.host}:{args.port}/v1）", file=sys.stderr)
        return Engine(model, mtp, slots=args.slots, cache_mb=args.cache_mb)

    serve(load, args.served_model_name or model_name(path), args.host, args.port, args.api_key,
          max_tokens=args.max_tokens, allow_hosts=args.allow_host, allow_origins=args.allow_origin)


def model_name(path) -> str:
    """HF 缓存里的检查点（.../models--Qwen--Qwen3.5-0.8B/snapshots/<提交>）叫 Qwen/Qwen3.5-0.8B，别的取文件夹名。"""
    repo = path.parent.parent.name
    return repo[len("models--"):].replace("--", "/") if repo.startswith("models--") else path.name


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compile"]:
        return prepare(argv[1:])
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model = Model.from_pretrained(args.model, dtype=DTYPES.get(args.dtype), compile=args.compile,
                                      quantize=args.quantize)
        conversation = Conversation(Chat(model), mtp=not args.no_mtp)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        sys.exit(f"错误：{e}")
    if not args.no_mtp and conversation.mtp is None:
        print("（检查点没有 MTP 草稿头：用普通解码）", file=sys.stderr)
    if is_compiled(model):  # 编译各张图：第一次在这台机器上要一会儿，之后从磁盘缓存读
        print("（编译解码用的图……）", end="", file=sys.stderr, flush=True)
        seconds = warm_up(model, conversation.mtp)
        print(f"\r（编译解码用的图：{seconds:.1f} 秒）" if seconds > 3 else "\r" + " " * 20 + "\r", file=sys.stderr)
    elif conversation.mtp is not None:
        warm_up(model, conversation.mtp, calibrate="recorded")  # 起草的代价：用量过的（python -m qwen compile 量）
    messages = [{"role": "system", "content": args.system}] if args.system else []
    try:
        if args.prompt is not None:
            answer(conversation, messages + [{"role": "user", "content": args.prompt}], args)
            return
        print("多轮对话：输入内容后回车；空行或 Ctrl-D 退出，/reset 清空历史。", file=sys.stderr)
        while True:
            try:
                text = input("你：").strip()
            except EOFError:
                break
            if not text:
                break
            if text == "/reset":
                messages = messages[:1] if args.system else []
                conversation.reset()
                continue
            messages.append({"role": "user", "content": text})
            print("Qwen：", end="", flush=True)
            messages.append({"role": "assistant", "content": answer(conversation, messages, args)})
    except ValueError as e:
        sys.exit(f"错误：{e}")


if __name__ == "__main__":
    main()
