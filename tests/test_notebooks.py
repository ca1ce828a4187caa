"""notebooks/ 里的课程笔记本：每一本都能在真的内核里从头跑通，提交的那份带着一次运行的输出。

笔记本由 notebooks/make.py 从 notebooks/cells/ 的源码构建并执行。这里把每本 .ipynb 读进内存、清掉输出，
用 nbclient 在内核 python3 里执行（工作目录 notebooks/，同 make.py），任何一个单元格出错就失败；执行过的笔记本只在内存里，
从不写回仓库。另外检查提交的那份：每个代码单元格都执行过（execution_count 不空），至少有一张 image/png 的图。
"""

import copy
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(PATHS) >= 4, f"notebooks/ 里只有 {[p.name for p in PATHS]}"


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_committed_notebook_has_outputs(path):
    """提交的笔记本带着一次运行的输出：代码单元格都有 execution_count，没有错误输出，至少一张图。"""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} 没有代码单元格"
    missing = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not missing, f"{path.name} 的第 {missing} 个单元格没有执行过：请运行 python notebooks/make.py"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], f"{path.name} 提交的输出里有错误"
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} 没有一张 image/png 的图"


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path):
    """清掉输出，在内核 python3 里从头执行一份拷贝；出错时 nbclient 抛出 CellExecutionError（带着出错的单元格）。"""
    nb = nbformat.read(path, as_version=4)
    fresh = copy.deepcopy(nb)
    for cell in fresh.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbclient.NotebookClient(fresh, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    assert all(c.execution_count for c in fresh.cells if c.cell_type == "code")
    assert nbformat.read(path, as_version=4) == nb  # 仓库里的那份没有被改写


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_is_built_from_its_cells(path):
    """提交的 .ipynb 的单元格就是 cells/ 里那份源码（make.py 的 build）：改了源码却没重建，这里就失败。"""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make", NOTEBOOKS / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    built = make.build(NOTEBOOKS / "cells" / f"{path.stem}.py")
    committed = nbformat.read(path, as_version=4)
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in built.cells], \
        "请运行 python notebooks/make.py 重建"
