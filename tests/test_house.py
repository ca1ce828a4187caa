"""房子的结构：课程的各章只引用前面的章节，包里的模块之间没有循环引用。

README 说“各章是普通的 torch 模块，只引用前面的章节。附录与章节分开放”。这里不导入 qwen，只用 ast 读 qwen/ 下每个
.py 文件的每一条 import（模块顶层的，以及函数、方法、类里的），把它解析成包里的模块，检查两件事：
- 第 k 章只引用第 1…k−1 章（以及标准库、第三方库）：不引用后面的章，也不引用任何附录（qwen/__init__.py、__main__、
  fast/、serve/、bench、compare、conversation、vocab、train……，章节表之外的都是附录）；
- 包里的模块（含 fast/、serve/）之间没有循环：a 引用 b、b 又（直接或绕几步）引用 a。函数里的延迟导入也算：
  它只是把循环藏到运行时。

解析的规则：
- `import qwen.x.y`、`from qwen.x.y import n`（或相对的 `from .y import n`）是到 qwen.x.y 这一个模块的边，不另算到包
  qwen.x 的边（包的 __init__.py 是模块 qwen.x）；
- `from B import n` 里 B.n 本身是一个模块文件时（`from . import fast`、`from .fast import linear`），边到 B.n，不到 B：
  所以子模块里的 `from . import fast` 不是到 qwen/__init__.py 的边，而 `from . import 某个在 __init__ 里定义的名字` 是。
"""

import ast
import re
from collections.abc import Sequence
from pathlib import Path

from qwen import chapters

ROOT = Path(__file__).resolve().parents[1]

CHAPTERS = tuple(chapters())  # 课程的各章，按顺序（从各章文档的开头排出）：qwen.<名字>；包里别的模块都是附录


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """root（包的文件夹）下每个 .py 文件 → 模块名：root/x.py → package.x，root/fast/__init__.py → package.fast。"""
    modules = {}
    for file in sorted(root.rglob("*.py")):
        parts = list(file.relative_to(root).with_suffix("").parts)
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = file
    return modules


def imports_of(name: str, file: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """file（模块 name）里每一条 import 引用的包内模块：[(模块名, 行号)]，不论写在顶层还是函数、类里。"""
    is_package = file.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]  # 相对导入从这个包算起
    package = name.split(".")[0]

    def known(target: str) -> str | None:
        """target 或它最长的、是包里模块的前缀（写错的子模块名退回到它所在的包）。"""
        parts = target.split(".")
        while parts:
            if ".".join(parts) in modules:
                return ".".join(parts)
            parts.pop()
        return None

    found = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 > len(here) - 1:
                    continue  # 越出了包（不会是包里的模块）
                base = ".".join([*here[: len(here) - (node.level - 1)], *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target == package or target.startswith(package + "."):
                module = known(target)
                if module is not None and module != name:
                    found.append((module, node.lineno))
    return found


def import_graph(root: Path, package: str = "qwen") -> dict[str, dict[str, list[int]]]:
    """包里的模块图：模块 → {它引用的包内模块 → 引用所在的行号}。"""
    modules = package_modules(root, package)
    graph = {}
    for name, file in modules.items():
        edges: dict[str, list[int]] = {}
        for module, line in imports_of(name, file, modules):
            edges.setdefault(module, []).append(line)
        graph[name] = {m: sorted(set(lines)) for m, lines in edges.items()}
    return graph


def cycles(graph: dict[str, dict[str, list[int]]], limit: int = 100) -> list[list[str]]:
    """图里的每个简单环（至多 limit 个），每个从环上名字最小的模块开始：[a, b, …, a]。"""
    order = sorted(graph)
    rank = {m: i for i, m in enumerate(order)}
    found: list[list[str]] = []

    def walk(start: str, path: list[str], on_path: set[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if len(found) >= limit:
                return
            if nxt == start:
                found.append([*path, start])
            elif rank[nxt] > rank[start] and nxt not in on_path:  # 只找从最小的模块开始的环：每个环只报一次
                on_path.add(nxt)
                walk(start, [*path, nxt], on_path)
                on_path.discard(nxt)

    for start in order:
        walk(start, [start], {start})
    return found


def check_house(root: Path | str, package: str = "qwen", chapters: Sequence[str] = CHAPTERS) -> list[str]:
    """root（包的文件夹）里违反房子结构的地方，一条一句：章节引用了后面的章或附录；模块之间的循环引用。没有时是空表。"""
    root = Path(root)
    graph = import_graph(root, package)
    where = {name: file.relative_to(root.parent).as_posix() for name, file in package_modules(root, package).items()}
    chapter_of = {f"{package}.{c}": i for i, c in enumerate(chapters)}
    problems = []
    for name, edges in graph.items():
        if name not in chapter_of:
            continue
        for module, lines in sorted(edges.items()):
            if chapter_of.get(module, len(chapters)) >= chapter_of[name]:
                kind = "后面的章" if module in chapter_of else "附录"
                problems.append(f"章节引用了{kind}：{name} → {module}（{where[name]} 第 {'、'.join(map(str, lines))} 行）")
    for cycle in cycles(graph):
        steps = " → ".join(cycle)
        at = "；".join(f"{where[a]} 第 {'、'.join(map(str, graph[a][b]))} 行" for a, b in zip(cycle, cycle[1:]))
        problems.append(f"循环引用：{steps}（{at}）")
    return problems


def test_chapters_import_only_earlier_chapters_and_nothing_is_circular():
    problems = check_house(ROOT / "qwen")
    assert not problems, "qwen 包的结构有问题：\n" + "\n".join(problems)


def test_the_checker_catches_a_planted_violation(tmp_path):
    """在 tmp_path 下造一个小包：第 1 章在函数里 `from . import fast`，第 3 章引用了第 4 章与 __init__ 里定义的名字，
    附录 fast/ 里两个模块互相引用（一个相对、一个绝对、一个在函数里），第 3、4 章互相引用。这些都要报出来；
    允许的引用（前面的章、附录引用章节与附录）一个也不报。"""
    pkg = tmp_path / "qwen"
    (pkg / "fast").mkdir(parents=True)
    files = {
        "__init__.py": "VERSION = 1\n",
        "weights.py": "import json\n\ndef load():\n    from . import fast\n    return fast\n",
        "embedding.py": "from .weights import load\nimport qwen.weights\n",
        "norm.py": ("from .embedding import x\nfrom . import VERSION\n\n"
                    "class RMSNorm:\n    def f(self):\n        from .mlp import MLP\n"),
        "mlp.py": "import torch\nfrom qwen.norm import RMSNorm\n",
        "fast/__init__.py": "from .a import f\n",
        "fast/a.py": "import torch\nfrom . import b\n",
        "serve.py": "from .mlp import MLP\nfrom .fast import f\nfrom . import VERSION\n",  # 附录引用章节与附录：允许
        "fast/b.py": "def g():\n    import qwen.fast.a\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert check_house(pkg, chapters=("weights", "embedding", "norm", "mlp")) == [
        "章节引用了附录：qwen.norm → qwen（qwen/norm.py 第 2 行）",
        "章节引用了后面的章：qwen.norm → qwen.mlp（qwen/norm.py 第 6 行）",
        "章节引用了附录：qwen.weights → qwen.fast（qwen/weights.py 第 4 行）",
        "循环引用：qwen.fast.a → qwen.fast.b → qwen.fast.a（qwen/fast/a.py 第 2 行；qwen/fast/b.py 第 2 行）",
        "循环引用：qwen.mlp → qwen.norm → qwen.mlp（qwen/mlp.py 第 2 行；qwen/norm.py 第 6 行）",
    ]
    (pkg / "fast/b.py").write_text("def g():\n    pass\n")
    (pkg / "norm.py").write_text("from .embedding import x\nfrom .weights import load\n")
    (pkg / "weights.py").write_text("import json\n")
    assert check_house(pkg, chapters=("weights", "embedding", "norm", "mlp")) == []


def test_the_readme_picture_is_drawn_from_the_code():
    """README 的图（docs/whole.svg）由 docs/whole.py 从代码里的事实画出（层的排法与状态的大小来自 Config，线程的名字来自
    qwen/serve 的源码）：重画的与仓库里的逐字相同。"""
    import importlib.util

    spec = importlib.util.spec_from_file_location("whole", ROOT / "docs/whole.py")
    whole = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(whole)
    drawn = whole.svg()
    assert drawn == (ROOT / "docs/whole.svg").read_text(encoding="utf-8"), "python docs/whole.py 重画"
    assert drawn.count('fill="#f28e2b"') == 6 + 2 and "18 层 Gated DeltaNet 与 6 层门控注意力" in drawn  # 6 层，另有图例与“提交”


def test_the_folder_says_what_is_a_chapter():
    """qwen/ 顶层的每个 .py（__init__、__main__ 之外）都是一章或一章的附，文件开头写着“第 N 章”：附录都在子包里。
    README 的章节表按同样的顺序列出同样的文件；第 1–11 章不提图（图是第 15 章的事，第 10 章只收向量与位置）。"""
    top = sorted(f.stem for f in (ROOT / "qwen").glob("*.py") if f.stem not in ("__init__", "__main__"))
    assert sorted(CHAPTERS) == top, set(top) - set(CHAPTERS)
    table = (ROOT / "README.md").read_text(encoding="utf-8").split("| 章 | 文件 | 内容 |")[1].split("\n\n")[0]
    listed = [n for n in re.findall(r"`(\w+)\.py`", table) if (ROOT / "qwen" / f"{n}.py").is_file()]  # ch14_mtp.py 不在包里
    assert listed == list(CHAPTERS), "README 的章节表应照 qwen.chapters() 的顺序"
    number = {c: int(re.match(r'"""第 (\d+) 章', (ROOT / "qwen" / f"{c}.py").read_text())[1]) for c in CHAPTERS}
    for name in [c for c in CHAPTERS if number[c] <= 11]:
        text = (ROOT / "qwen" / f"{name}.py").read_text(encoding="utf-8")
        assert not re.search(r"image|picture|图像|图片|看图", text, re.I), f"第 {number[name]} 章 {name}.py 提到了图"
    with_images = (ROOT / "qwen" / "model.py").read_text()
    assert "hidden_with_images" not in with_images and "place(" not in with_images


def test_reading_the_chapters_loads_no_appendix():
    """import qwen 与各章（新的解释器里按顺序导入全部各章）不读进任何附录：qwen/__init__.py 只在第一次用到
    Conversation、qwen.fast 时才导入它们。"""
    import subprocess
    import sys

    code = ("import sys, qwen\n" + "".join(f"import qwen.{c}\n" for c in CHAPTERS) +
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('qwen'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert loaded == {"qwen", *(f"qwen.{c}" for c in CHAPTERS)}, loaded - {f"qwen.{c}" for c in CHAPTERS}


def test_every_chapter_has_its_tests_under_its_name():
    """学习者按章名找测试：第 N 章 qwen/X.py 的测试在 tests/test_X.py，那个文件开头写着“第 N 章 X.py”（N 与那一章自己
    开头写的相同）。"""
    here = Path(__file__).parent
    for name in CHAPTERS:
        path = here / f"test_{name}.py"
        assert path.is_file(), f"qwen/{name}.py 没有 tests/test_{name}.py"
        number = re.match(r"第 (\d+) 章", ast.get_docstring(ast.parse((ROOT / "qwen" / f"{name}.py").read_text()))).group(1)
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert doc.startswith(f"第 {number} 章 {name}.py："), f"{path.name} 的开头应是“第 {number} 章 {name}.py：”：{doc[:40]!r}"
