"""附录 · 基准测试：解码有多快，离硬件的上限还有多远，投机解码值不值。

    python -m qwen.bench                     # 不用下载：按 0.8B 的形状造随机权重
    python -m qwen.bench --model demo        # 或任何检查点文件夹

同一次运行里、同样的权重、dtype 与线程数，依次测：
1. 普通贪心解码的 token/s：qwen（默认的 layout="auto"：能编译 C++ 就是分块布局；以及 oneDNN 打包的 layout="packed"）、transformers 的
   Qwen3_5ForCausalLM（装了的话）与 llama.cpp（--llama-cpp，给了 llama-bench 与 GGUF 文件时）；
2. 512 个 token 的预填充速度，两者；
3. 内存带宽的下限：解码一个 token 要读的权重字节数 ÷ 与那次解码同时实测的内存读带宽；
4. 受控接受率的投机解码：草稿器知道贪心续写，每个草稿以概率 a 猜对（真的 MTP 照样运行，
   它的代价照算），k = 1、2、3 与自动挑选，对照理想值 (1 − a^(k+1)) / (1 − a)，
   以及课程里的做法（快照、拒绝时重算、全词表起草）；
5. 峰值常驻内存。
每一项在单独的子进程里测，互不干扰；峰值内存因此只算那一项自己的。共享的机器忽快忽慢（内存带宽几分钟之内就能差很多，
见 docs/perf-history.md），所以 qwen 与 transformers 轮流测几轮、各取最快的一轮，带宽紧挨着解码测，
投机解码的加速比只与它前后紧挨着测的两次普通贪心（的平均）比；每组设置用草稿器的几个随机种子各测一次（--seeds，
自动挑 k 测两倍），加速比按解码阶段（第一个 token 之后）算，与解码 tok/s 同一口径。
结果打印成表，写成 JSON，并画出加速比对接受率的图（需要 matplotlib）。

一个文件一件事：checkpoint.py 造随机权重的检查点；probe.py 机器与模型的事实（带宽、每个 token 读的字节、峰值内存）；
oracle.py 受控接受率的草稿器；scale.py 第 14 章旁边打印的 0.8B 形状一轮的代价；runs.py 子进程里测 qwen 与 transformers；
llama.py 测 llama.cpp；report.py 表格与图；__main__.py 命令行与轮流测的安排。
"""


from ..tools.checkpoint import random_checkpoint
from .oracle import OracleDrafter
from .probe import bytes_per_token, peak_rss_gb, read_bandwidth, timed
from .report import ideal, merge_rounds, report

__all__ = ["OracleDrafter", "bytes_per_token", "ideal", "merge_rounds", "peak_rss_gb", "random_checkpoint", "read_bandwidth",
           "report", "timed"]
