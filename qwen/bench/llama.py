"""附录 · 基准测试：llama.cpp 的 llama-bench（同样的权重转成 GGUF、同样的线程数），与 qwen 轮流测。"""

import json
import subprocess
import sys
from pathlib import Path

from .probe import PROMPT_LEN


def find_gguf(args) -> list[Path] | None:
    """--gguf 给的文件，与 --quantize 的格式一样多；没给、且只有一种格式时在模型文件夹里找唯一的一个 .gguf。
    对不上时 None。"""
    if args.gguf:
        return [Path(g) for g in args.gguf] if len(args.gguf) == len(args.quantize) else None
    found = sorted(Path(args.model).glob("*.gguf"))
    return found if len(found) == 1 and len(args.quantize) == 1 else None


def run_llama(args, gguf: Path) -> dict | None:
    """llama.cpp 的 llama-bench，与 qwen 同样的线程数：解码 tokens 个 token（前面已有 PROMPT_LEN 个 token 的上下文，
    与 qwen 的提示词一样长）与 prefill 个 token 的预填充。返回 tok/s；找不到程序或失败时打印原因、返回 None。"""
    exe = Path(args.llama_cpp) / "llama-bench"
    out = {}
    for key, flags in (("decode_tok_s", ["-p", "0", "-n", str(args.tokens), "-d", str(PROMPT_LEN)]),
                       ("prefill_tok_s", ["-p", str(args.prefill), "-n", "0"])):
        cmd = [str(exe), "-m", str(gguf), "-t", str(args.threads), "-r", "2", "-o", "json"] + flags
        print(f"  测 llama.cpp {key.split('_')[0]}（{gguf.name}）…", file=sys.stderr, flush=True)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode < 0:  # 被信号杀死：虚拟机上 llama.cpp 重排过的权重读提示词（AMX 的块指令）会 SIGILL/SIGSEGV
                # 解码：不带上下文再测（一个 token 一个 token 地走，不碰块指令，仍是它最快的重排路径）；预填充：只能关掉重排
                retry = ["-d", "0"] if key == "decode_tok_s" else ["--repack", "0"]
                again = cmd[:-2] + retry if key == "decode_tok_s" else cmd + retry  # 解码：换掉最后的 -d PROMPT_LEN
                p = subprocess.run(again, capture_output=True, text=True)
                out.setdefault("fallback", []).append(" ".join(retry))
            out[key] = json.loads(p.stdout)[0]["avg_ts"]
            out["type"] = json.loads(p.stdout)[0]["model_type"]
        except (OSError, ValueError, IndexError, KeyError) as e:
            print(f"  llama.cpp 失败（{' '.join(cmd)}）：{type(e).__name__} {e}\n{getattr(p, 'stderr', '')[-1000:]}",
                  file=sys.stderr)
            return None
    return out
