"""附录 · 一个手写的 C++ 内核：分块布局的矩阵乘几行输入（matvec.cpp），编译一次，之后直接加载。

解码的矩阵乘法只有 1～5 行输入，时间都花在读权重上；matvec.cpp 是一个几十行的循环，逐块顺序读权重、乘加进每行的
累加器，每一行的求和顺序固定（验证的行与解码的行逐位相同，第 14 章）。它注册成 torch 算子 torch.ops.qwen_fast.matvec：
不编译时直接调用，整步编译的图（step.py）把它当成一个外部调用，每次只花几微秒。

第一次用时拿这台机器的 C++ 编译器（linear.py 的 find_compiler）编译它（十几秒），.so 存在 $XDG_CACHE_HOME/qwen/kernels/ 下，
文件名里是源码、torch 版本、编译器与 CPU 的指纹：换了其中任何一个就是另一个文件名，别的机器或别的 torch 写下的文件
从不加载（-march=native 编出的代码换一种 CPU 可能跑不了）。先写到临时文件再改名，几个进程同时编译也不会读到半个文件。
像 llama.cpp 的 CPU 后端一样：模型的图是一回事，读权重的内核是另一回事。
"""

import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("matvec.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w"]


def cpu_fingerprint() -> str:
    """CPU 的型号与指令集（Linux 读 /proc/cpuinfo；别处用 platform 给的）。"""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def kernel_file(cxx: str) -> Path:
    """这台机器、这个 torch、这个编译器编译 matvec.cpp 得到的 .so 该在哪儿。"""
    from .linear import record_file

    key = "\n".join([SOURCE.read_text(), torch.__version__, cxx, str(os.stat(cxx).st_mtime_ns), cpu_fingerprint(),
                     " ".join(FLAGS)])
    return record_file("kernels") / f"matvec-{hashlib.sha256(key.encode()).hexdigest()[:20]}.so"


def build(cxx: str, out: Path) -> None:
    """用 cxx 把 matvec.cpp 编译成 out（先写临时文件，编好了再改名）。失败时 RuntimeError 带上编译器的报错。"""
    from torch.utils.cpp_extension import include_paths, library_paths

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    cmd = [cxx, str(SOURCE), "-o", tmp, *FLAGS, abi, *[f"-I{p}" for p in include_paths()],
           *[f"-L{p}" for p in library_paths()], "-ltorch_cpu", "-lc10"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"编译 {SOURCE.name} 失败：{done.stderr.strip()[-600:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_kernel(cxx: str) -> None:
    """让 torch.ops.qwen_fast.matvec 可用：已经加载过就什么也不做；否则加载这台机器编好的 .so（没有就先编译）。"""
    if hasattr(torch.ops.qwen_fast, "matvec"):
        return
    load_or_build(kernel_file(cxx), cxx)
    torch.library.register_fake("qwen_fast::matvec")(fake_matvec)


def load_or_build(out: Path, cxx: str) -> None:
    """加载 out；没有这个文件、或它坏了（加载时 OSError）就用 cxx 重新编译一次再加载。编译或加载失败时报错。"""
    try:
        torch.ops.load_library(str(out))
    except OSError:
        build(cxx, out)
        torch.ops.load_library(str(out))


def fake_matvec(x, blocks, scales):
    """torch.compile 追踪整步的图时只需要输出的形状与 dtype。"""
    return x.new_empty(x.shape[0], blocks.shape[0] * blocks.shape[2])
