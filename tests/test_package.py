"""装上的就是测过的：wheel（以及 pip install .）里有包在运行时要的每一个文件。

`pip install -e .` 直接用源码树，测试看不出 wheel 少了什么；少了一个内核源码时，默认路径会退回慢的 oneDNN 布局。
这里真的打一个 wheel，与源码树里 qwen/ 下的文件逐个核对。（.ci/run 另把这个 wheel 装进一个新的 venv，在那里跑 demo。）"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_files() -> set[str]:
    """qwen/ 下包要带的文件（不算 __pycache__ 与编译出的 .pyc）。"""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "qwen").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def test_wheel_has_every_file_of_the_package(tmp_path):
    src = tmp_path / "src"  # 在一份副本里打包：源码树里留下的 build/ 不会混进来，也不往源码树里写东西
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "qwen", src / "qwen", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("qwen-*.whl")
    names = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("qwen/")}
    want = source_files()
    assert {"qwen/fast/matvec.cpp", "qwen/fast/deltanet.cpp", "qwen/fast/norm.cpp", "qwen/demo/tokenizer.json"} <= want
    assert want - names == set(), "wheel 里少了这些文件"
    assert names - want == set(), "wheel 里多了源码树里没有的文件"
