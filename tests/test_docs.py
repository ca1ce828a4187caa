"""文档：表与数字只有一个来源，读者能顺着每一处引用找到东西。

- docs/performance.md 里生成的表（夹在 `<!-- bench: 名字 -->` 与 `<!-- /bench -->` 之间）与 qwen.bench.tables 按
  docs/bench.json 生成的一字不差：换了一次完整运行却忘了重写表，这里就不通过（重写：python -m qwen.bench.tables docs/performance.md）。
- docs/、qwen/、tests/ 与 README.md 里没有议题编号：编号在仓库外面，读者打不开；要说的是它指的那件事。
- performance.md 说的是今天的代码：它提到的测试都还在（改了名的旧测试只在 perf-history.md 里）。
- README.md 与 docs/*.md 里每个相对链接都指向存在的文件，代码与文档里提到的 docs/ 下的文件都在；“某某.md 的‘某节’”
  这样的引用，那一节在那个文件里。
"""

import json
import re
from pathlib import Path

from qwen.bench.tables import MARK, TABLES, render, stale, update

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCANNED = ("docs", "qwen", "tests")  # 加上 README.md
TEXT = {".md", ".py", ".cpp", ".txt", ".json", ".toml", ".svg", ".jinja"}
DATA = ROOT / "qwen" / "demo"  # demo 检查点的分词器与配置：数据，不是写给人读的文字

# 议题编号：英文的 issue / pull request / PR 后跟编号，中文的“问题”后跟编号，以及单独的 #编号。后者不算的：#include 之类
# （# 后面是字母）、引号或 = : 后面的颜色（"#333"、fill:#333）、HTML 实体（&#39;）、恰好 6 位数字的颜色（#000000）
ISSUE = re.compile(r"(?i)\b(?:issues?|pull\s+requests?|PRs?)\s*#?\s*\d+"
                   r"|问题\s*#?\s*\d+"
                   r"|(?<![\w&#\"':=/])#(?!\d{6}\b)\d+\b(?![0-9a-f])")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CROSS = re.compile(r"([\w-]+\.md)\)?\s*(?:的|里的|中的)\s*“([^”]+)”")  # performance.md 的“服务：连续批处理”
LOCAL = re.compile(r"(?:见|上面|下面|上文|下文)的?\s*“([^”]+)”|^\|.*\|\s*“([^”]+)”\s*\|$", re.M)  # 同一个文件里：见“逐位相同”、表的最后一格


def texts(*folders: str):
    """这几个文件夹（相对仓库根）下每个文本文件 → (路径, 内容)；再加上 README.md。"""
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in TEXT and "__pycache__" not in path.parts and DATA not in path.parents:
                yield path, path.read_text(errors="replace")
    yield ROOT / "README.md", (ROOT / "README.md").read_text()


def markdown():
    """README.md 与 docs/*.md → (路径, 内容)。"""
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        yield path, path.read_text()


def where(path: Path, text: str, at: int) -> str:
    """text 里第 at 个字符在哪：“文件 第几行”，报错时用。"""
    return f"{path.relative_to(ROOT)} 第 {text.count(chr(10), 0, at) + 1} 行"


def anchors(text: str) -> list:
    """一个 markdown 文件里能被“某节”引用的地方：标题，与段首加粗的小标题（**内存。**）。"""
    heads = re.findall(r"^#+\s+(.+)$", text, re.M)
    return heads + re.findall(r"^\*\*([^*]+)\*\*", text, re.M)


def test_performance_tables_are_generated_from_bench_json():
    """performance.md 的每张生成的表都与 bench.json 相符，TABLES 里的每种表都用上了，重写一遍不改任何字。"""
    text, res = (DOCS / "performance.md").read_text(), json.loads((DOCS / "bench.json").read_text())
    names = [m.group(2) for m in MARK.finditer(text)]
    assert set(names) == set(TABLES), names
    assert stale(text, res) == [], "表与 docs/bench.json 不符：运行 python -m qwen.bench.tables docs/performance.md"
    assert update(text, res) == text


def test_moe_tables_are_generated_from_their_run():
    """moe.md（专家混合）的表由它自己的一次完整运行 docs/bench-moe.json 生成：与 llama.cpp 的对照、投机解码，每个 token 读的
    字节只算 k 个专家；投机解码那张表写着一次验证读到的不同专家数。"""
    text, res = (DOCS / "moe.md").read_text(), json.loads((DOCS / "bench-moe.json").read_text())
    assert {m.group(2) for m in MARK.finditer(text)} == {"run", "decode", "compare", "spec"}
    assert stale(text, res) == [], "表与 docs/bench-moe.json 不符：运行 python -m qwen.bench.tables docs/moe.md --json docs/bench-moe.json"
    assert "35B-A3B" in res["model"] and all(r.get("llama_cpp") for r in res["runs"].values())
    assert "一次验证 k + 1 行每层读到的不同专家" in render("spec", res)


def test_a_changed_number_is_caught_and_rewritten():
    """改掉表里的一个数，stale 就说出是哪张表，update 把它改回来；标记之外的文字不动。"""
    res = json.loads((DOCS / "bench.json").read_text())
    good = "前言\n<!-- bench: decode -->\n" + render("decode", res) + "<!-- /bench -->\n后记\n"
    first_row = render("decode", res).splitlines()[2]
    bad = good.replace(first_row, first_row.replace("|", "| 9", 2))
    assert bad != good and stale(bad, res) == ["decode"] and stale(good, res) == []
    assert update(bad, res) == good


def test_the_issue_pattern():
    """ISSUE 认得出各种写法的议题编号，不把 #include、颜色、HTML 实体、Markdown 的标题当成编号。
    例子用 format 拼出来：这个文件自己也在下面的扫描里。"""
    hits = ["issue {}", "Issue #{}", "issues {}、27", "（#{}）", "见 #{}", "问题 {}", "PR #{}", "pull request {}"]
    misses = ["#include <cmath>", 'fill="#333"', "color:#123", "&#{};", "## 性能", "#000000", "# {} 个", "第 {} 章", "a#{}b"]
    for example in hits:
        assert ISSUE.search(example.format(39)), example
    for example in misses:
        assert not ISSUE.search(example.format(39)), example


def test_no_issue_numbers_anywhere():
    """docs/、qwen/、tests/ 与 README.md 里没有议题编号（读者打不开它；写它指的那件事）。"""
    found = [f"{where(path, text, m.start())}：{m.group(0)!r}" for path, text in texts(*SCANNED) for m in ISSUE.finditer(text)]
    assert not found, "议题编号：\n" + "\n".join(found)


def test_relative_links_point_to_files():
    """README.md 与 docs/*.md 的相对链接（含图片）都指向仓库里存在的文件。"""
    broken = []
    for path, text in markdown():
        for m in LINK.finditer(text):
            target = m.group(1).split("#")[0]
            if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # 同一页的锚点、http: 之类
                continue
            if not (path.parent / target).exists():
                broken.append(f"{where(path, text, m.start())}：{m.group(1)}")
    assert not broken, "指向不存在的文件：\n" + "\n".join(broken)


def test_tests_named_in_performance_exist():
    """performance.md 说的是今天的代码：它提到的测试（`test_…`，不是 test_….py 这样的文件名）在 tests/ 里都有。改了名的
    旧测试只在 perf-history.md 里出现，那里写着它今天叫什么。"""
    defined = {m.group(1) for _, text in texts("tests") for m in re.finditer(r"def (test_\w+)", text)}
    named = set(re.findall(r"\b(test_\w+)\b(?!\.py)", (DOCS / "performance.md").read_text()))
    assert named and named <= defined, sorted(named - defined)


def test_mentioned_docs_files_exist():
    """代码、测试与文档里提到的 docs/ 下的文件（docs/performance.md、docs/bench.json……）都在；`git show 提交:docs/…`
    指的是旧提交里的文件，不算。"""
    mentioned = re.compile(r"(?<![\w:/])docs/([\w.-]+\.[a-z]+)")
    missing = [f"{where(path, text, m.start())}：{m.group(0)}" for path, text in texts(*SCANNED)
               for m in mentioned.finditer(text) if not (DOCS / m.group(1)).exists()]
    assert not missing, "提到的文件不在：\n" + "\n".join(missing)


def test_section_references_name_existing_sections():
    """“performance.md 的‘逐位相同’”这样的引用（文档、代码、测试里），同一篇文档里的“见‘某节’”与表的最后一格里的
    “某节”：那一节（标题或段首加粗的小标题里有这几个字）在那个文件里。"""
    docs = {path.name: anchors(text) for path, text in markdown()}
    missing = []
    for path, text in texts(*SCANNED):
        for m in CROSS.finditer(text):
            if m.group(1) in docs and not any(m.group(2) in a for a in docs[m.group(1)]):
                missing.append(f"{where(path, text, m.start())}：{m.group(1)} 里没有“{m.group(2)}”")
    for path, text in markdown():
        for m in LOCAL.finditer(text):
            name = m.group(1) or m.group(2)
            if ".md" not in text[max(0, m.start() - 20) : m.start()] and not any(name in a for a in docs[path.name]):
                missing.append(f"{where(path, text, m.start())}：没有“{name}”这一节")
    assert not missing, "\n".join(missing)
