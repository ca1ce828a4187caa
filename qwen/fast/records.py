"""附录 · 记在磁盘上的测量结果：这台机器能不能编译 C++ 内核（linear.py 的 can_compile）、起草的代价（fast 的
round_cost）、编好的内核放在哪儿（kernel.py 的 kernel_file）。都在 $XDG_CACHE_HOME/qwen/ 下（默认 ~/.cache/qwen/）。

它只用标准库，不引用 qwen 的别的模块：kernel.py 与 linear.py 都引用它，它不引用它们，依赖只朝一个方向。
"""

import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path


def record_file(name: str) -> Path:
    """记在磁盘上的测量结果（能不能编译、起草的代价）：$XDG_CACHE_HOME/qwen/<name>（默认 ~/.cache/qwen/）。"""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen" / name


def read_record(name: str, key: str):
    """record_file(name) 里 key 对应的值；没有记录、记录坏了或 key 对不上时 None。"""
    return read_json(record_file(name)).get(key)


def write_record(name: str, key: str, value) -> None:
    """把 key → value 加进 record_file(name)；写不了（只读的家目录）就算了，下次再测一遍。
    几个进程或线程同时写时：读、改、写这三步在一把文件锁里做，新内容先写进临时文件再整个换上去（os.replace），
    所以谁也不会读到写了一半的文件，谁加的 key 也不会被别人的旧内容盖掉。"""
    file = record_file(name)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with locked(file.with_name(file.name + ".lock")):
            record = read_json(file)
            tmp = file.with_name(f".{file.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(record | {key: value}, ensure_ascii=False, indent=1))
            os.replace(tmp, file)
    except OSError:
        pass


def read_json(file: Path) -> dict:
    try:
        record = json.loads(file.read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


@contextmanager
def locked(lock_file: Path):
    """独占一把文件锁（fcntl.flock；没有它的系统上退成进程内的锁）。"""
    try:
        import fcntl
    except ImportError:
        with RECORD_LOCK:
            yield
        return
    with open(lock_file, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


RECORD_LOCK = threading.Lock()  # 只在没有 fcntl 的系统上用
