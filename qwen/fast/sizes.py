"""附录 · 快路径的尺寸与门槛，集中在一处：哪个数管什么，它们之间怎样相关。

分块布局与量化（linear.py、kernel.py；C++ 的内核由 kernel.py 在编译时用 -DQWEN_BLOCK、-DQWEN_QGROUP 收到同样的数）：

| 名字 | 值 | 管什么 |
|---|---|---|
| BLOCK | 32 | 分块布局每块的输出个数：matvec.cpp 每读一块权重乘加进每行的 32 个累加器 |
| QGROUP | 32 | int4 每个输出每这么多个输入一个比例；int8、int4 的内核把输入也按这么多个一组量化 |
| PAD_ROWS | 4 | oneDNN 打包的 bfloat16 内核（packed 布局）不足这么多行时补零行 |
| KERNEL_ROWS | 32 | 不超过这么多行时矩阵乘法用 C++ 的 matvec（每行各算各的）；更多行（长的预填充）走 AMX，或拼回普通布局（int8、int4 与一对一对存放的 bfloat16 不拼回，仍用 matvec） |

一次前向有几个 token（layers.py、step.py、serve/）：

| 名字 | 值 | 管什么 |
|---|---|---|
| DECODE_LENGTHS | 1…5 | graphs 布局上编译成图的长度：解码 1 个 token，验证 1～4 个草稿 |
| VERIFY_ROWS | max(DECODE_LENGTHS) | 不多于这么多个 token 时逐个位置地算（DeltaNet 递推、注意力逐个查询）：验证的行与解码逐位相同 |
| STEP_ROWS | 32 | 不多于这么多个 token 时 DeltaNet 层由 deltanet.cpp 逐个位置地走、一层一次 C 调用；也是一次前向能与别的请求拼在一起的上限 |
| GROUPED_FROM | 256 | 解码时缓存至少这么长才用分组矩阵乘法算注意力（更短时 SDPA 的固定开销更小） |
| COMPILED_PIECE | 512 | 分块布局（blocked、graphs）上长提示词一段的长度：要拼回普通布局的矩阵每段拼回一次，段长些划算 |
| PROMPT_PIECE | 64 | 服务按这么多个 token 一段读提示词：段与段之间可以停下（取消、关闭） |
| DELTA_CHUNK | 32 | 快路径上 DeltaNet 分块形式的块长（第 8 章是 64）：块内的几项与块长成正比、块与块之间的与块长无关，CPU 上 32 更快，离 float64 的结果也更近（数字见 docs/performance.md） |

各章自己的门槛在各章里（附录不改它们）：第 8 章的 CHUNK = 64（分块形式的块长；快路径用自己的 DELTA_CHUNK）、
第 9 章的 RECURRENT_MAX_T = 3（普通模型不多于这么多 token 时递推）、第 10 章的 PREFILL_PIECE = 256（带状态的长输入一段多长）。

它们之间必须成立的（下面的 assert 在导入时查）：
- VERIFY_ROWS ≤ STEP_ROWS ≤ KERNEL_ROWS：拼在一起的一步（至多 STEP_ROWS 行）与验证的行都走每行各算各的 C++ 内核，
  所以一行的结果与同一步里有几行无关——投机解码与服务的共用行逐位相同靠的就是这一条；
- QGROUP 是 4 的倍数（int8、int4 的点积一次 4 个输入），BLOCK 是 16 的倍数（AVX-512 一个向量 16 个 float32）。
"""

BLOCK = 32
QGROUP = 32
PAD_ROWS = 4
KERNEL_ROWS = 32

DECODE_LENGTHS = (1, 2, 3, 4, 5)
VERIFY_ROWS = max(DECODE_LENGTHS)
STEP_ROWS = 32
GROUPED_FROM = 256
COMPILED_PIECE = 512
PROMPT_PIECE = 64
DELTA_CHUNK = 32

assert VERIFY_ROWS <= STEP_ROWS <= KERNEL_ROWS, "拼在一起的行与验证的行都要走每行各算各的 C++ 内核"
assert QGROUP % 4 == 0 and BLOCK % 16 == 0
