"""构建课程的笔记本：把 cells/ 里每章的单元格源码拼成 .ipynb，在真的内核里执行一遍，连同输出写回 notebooks/。

单元格源码是 percent 格式的 .py（jupytext 的写法，读起来就是普通的脚本）：
    # %% [markdown]        一个说明单元格，下面每行去掉开头的 "# "
    # %%                   一个代码单元格

改笔记本时改 cells/ 里的源码，再运行

    python notebooks/make.py            # 全部重建并执行
    python notebooks/make.py 07 14      # 只重建名字以 07、14 开头的

执行用 nbclient：内核 python3，工作目录是 notebooks/，每个单元格至多 120 秒。提交的 .ipynb 带着这一次运行的输出；
不记每个单元格的执行时刻（record_timing=False），重建时无关的元数据不会变。
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "cells"
KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}


def parse(text: str) -> list[tuple[str, str]]:
    """percent 格式的源码 → [(种类, 内容)]，种类是 "markdown" 或 "code"；单元格前后的空行去掉。"""
    cells, kind, lines = [], None, []
    for line in text.splitlines() + ["# %%"]:  # 末尾补一个分隔，收下最后一个单元格
        if line.startswith("# %%"):
            if kind is not None:
                cells.append((kind, "\n".join(lines).strip("\n")))
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind == "markdown":
            lines.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
        elif kind is not None:
            lines.append(line)
    return [(k, s) for k, s in cells if s]


def build(source: Path):
    """一个源码文件 → 还没执行的笔记本。"""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNEL)
    for kind, text in parse(source.read_text(encoding="utf-8")):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(make(text))
    for i, cell in enumerate(nb.cells):  # 单元格的 id 按顺序编号：重建时不变，diff 干净
        cell["id"] = f"{source.stem.split('_')[0]}-{i:02d}"
    return nb


def execute(nb) -> float:
    """在内核 python3 里执行（工作目录 notebooks/），输出写进 nb；返回用了几秒。出错时抛出 nbclient 的 CellExecutionError。"""
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=120, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(HERE)}}).execute()
    return time.perf_counter() - t0


def main(argv) -> None:
    sources = sorted(SOURCES.glob("*.py"))
    if argv:
        sources = [s for s in sources if any(s.stem.startswith(a) for a in argv)]
    if not sources:
        sys.exit(f"cells/ 里没有名字以 {' 或 '.join(argv)} 开头的源码")
    for source in sources:
        nb = build(source)
        seconds = execute(nb)
        out = HERE / f"{source.stem}.ipynb"
        nbformat.write(nb, out)
        print(f"{out.name}: {seconds:.1f} s, {out.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main(sys.argv[1:])
