"""README 里的那张图（docs/whole.svg）：整体的样子，由这个脚本从代码里的事实画出来，所以它跟着代码走。

画四件事：24 层的 3:1 排法（Config 的默认值就是 Qwen3.5-0.8B：layer_types 按 full_attention_interval 排）；每种层带着
什么状态、多大（第 7 章的记忆 S、卷积窗口，第 6 章的 KV 缓存，数字从 Config 算）；投机解码的一轮：起草、验证、提交
（第 14 章）；服务里的线程（附录 serve/：线程的名字从 qwen/serve 的源码里找，改了名字而图没改，脚本就报错）。
SVG 是手写的文字（浏览器用自己的字体显示中文），同样的代码每次写出同样的字节。

    python docs/whole.py           # 重写 docs/whole.svg
    python docs/whole.py --check   # 图与代码不符时退出码 1（测试也这样查）
"""

import re
import sys
from html import escape
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from qwen.weights import Config  # noqa: E402  只读配置：不加载模型

OUT = HERE / "whole.svg"
DELTA, ATTN, DRAFT, SERVE = "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1"
THREADS = {  # 服务的线程（名字在 qwen/serve 的源码里）：谁做什么
    "qwen-load": "加载模型（加载完之前 /health 是 503）",
    "qwen-request": "每个请求一个：跑单个请求的代码（stream / Run.stream）",
    "qwen-rows": "RowBatcher：一步把几个请求的同一件事一次算完（共用一次读权重）",
    "qwen-prefill": "长提示词的预填充，放在对齐之外",
}


def box(x, y, w, h, fill, text="", color="#fff", size=12, stroke="none"):
    label = f'<text x="{x + w / 2:g}" y="{y + h / 2 + size * 0.35:g}" font-size="{size}" fill="{color}" ' \
            f'text-anchor="middle">{escape(text)}</text>' if text else ""
    return f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" rx="4" fill="{fill}" stroke="{stroke}"/>{label}'


def text(x, y, s, size=13, weight="normal", anchor="start", color="#222"):
    return f'<text x="{x:g}" y="{y:g}" font-size="{size}" font-weight="{weight}" text-anchor="{anchor}" fill="{color}">' \
           f'{escape(s)}</text>'


def arrow(x1, y1, x2, y2):
    return f'<line x1="{x1:g}" y1="{y1:g}" x2="{x2:g}" y2="{y2:g}" stroke="#555" marker-end="url(#a)"/>'


def layers(cfg: Config, y: int) -> list:
    """上：嵌入 → 24 层（蓝：DeltaNet，橙：注意力）→ 范数与输出头；MTP 草稿头接在最后的隐藏状态上。"""
    n, full = cfg.num_hidden_layers, cfg.layer_types.count("full_attention")
    out = [text(20, y, f"模型：{n} 层，{n - full} 层 Gated DeltaNet 与 {full} 层门控注意力，"
                       f"每 {cfg.full_attention_interval} 层一组（3:1）", 15, "bold"),
           box(20, y + 20, 70, 34, "#777", "嵌入")]
    for i, kind in enumerate(cfg.layer_types):
        out.append(box(100 + i * 29, y + 20, 25, 34, ATTN if kind == "full_attention" else DELTA, str(i), size=10))
    end = 100 + n * 29
    out += [box(end + 6, y + 20, 110, 34, "#777", "范数 · 输出头"), arrow(end + 60, y + 54, end + 60, y + 78),
            box(end - 40, y + 78, 150, 30, DRAFT, "MTP 草稿头：猜 t+2", size=11)]
    return out


def states(cfg: Config, y: int) -> list:
    """每种层带着的状态（float32 的记忆，KV 缓存按 bfloat16 算）：DeltaNet 的不随长度变，注意力的每个 token 长一截。"""
    conv = cfg.linear_num_key_heads * cfg.linear_key_head_dim * 2 + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    memory = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    return [box(20, y, 14, 14, DELTA), text(42, y + 12, f"DeltaNet 层（第 7、8 章）：记忆 S [{cfg.linear_num_value_heads}, "
                                                         f"{cfg.linear_key_head_dim}, {cfg.linear_value_head_dim}] 与卷积窗口 "
                                                         f"[{cfg.linear_conv_kernel_dim - 1}, {conv}]：每层 "
                                                         f"{memory / 2**20:g} MiB，与上下文多长无关"),
            box(20, y + 24, 14, 14, ATTN), text(42, y + 36, f"注意力层（第 6 章）：KV 缓存 [2, {cfg.num_key_value_heads}, T, "
                                                              f"{cfg.head_dim}]：每层每个 token {per_token // 1024} KiB，"
                                                              "随 T 增长"),
            text(42, y + 60, "回滚（第 11 章）：验证时记下每个位置之后的记忆，提交时 DeltaNet 取回被接受的那一份，"
                             "KV 缓存截短", 12, color="#555")]


def spec_round(y: int) -> list:
    """中：投机解码的一轮（第 14 章）。"""
    steps = [("起草", "草稿头一个接一个猜 d₁…d_k", DRAFT), ("验证", "主模型一次前向读 [last, d₁…d_k]", DELTA),
             ("提交", "收下一致的前缀，再加主模型自己的一个", ATTN)]
    out = [text(20, y, "投机解码的一轮（第 14 章）：贪心时输出与普通解码逐 token 相同", 15, "bold")]
    for i, (name, what, color) in enumerate(steps):
        x = 20 + i * 290
        out += [box(x, y + 14, 260, 44, color), text(x + 130, y + 32, name, 13, "bold", "middle", "#fff"),
                text(x + 130, y + 50, what, 11, anchor="middle", color="#fff")]
        if i:
            out.append(arrow(x - 28, y + 36, x - 2, y + 36))
    return out


def threads(y: int) -> list:
    """下：服务（附录 serve/）里的线程。"""
    found = set(re.findall(r'name="(qwen-[a-z]+)"', "".join(p.read_text(encoding="utf-8")
                                                           for p in sorted((HERE.parent / "qwen/serve").glob("*.py")))))
    if found != set(THREADS):
        raise SystemExit(f"qwen/serve 里的线程是 {sorted(found)}，图里画的是 {sorted(THREADS)}：请更新 docs/whole.py")
    out = [text(20, y, "服务（python -m qwen serve）：uvicorn 的事件循环收请求，引擎的线程算", 15, "bold")]
    for i, (name, what) in enumerate(THREADS.items()):
        out += [box(20, y + 14 + i * 30, 120, 24, SERVE, name, size=11), text(150, y + 31 + i * 30, what, 12)]
    return out


def svg() -> str:
    cfg = Config()
    parts = [*layers(cfg, 28), *states(cfg, 170), *spec_round(270), *threads(370)]
    head = ('<svg xmlns="http://www.w3.org/2000/svg" width="940" height="510" viewBox="0 0 940 510" '
            'font-family="sans-serif">\n<defs><marker id="a" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
            'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>\n'
            '<rect width="940" height="510" fill="#fff"/>\n')
    return head + "\n".join(parts) + "\n</svg>\n"


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(0 if OUT.read_text(encoding="utf-8") == svg() else "docs/whole.svg 与代码不符：python docs/whole.py 重画")
    OUT.write_text(svg(), encoding="utf-8")
