"""附录 · 快路径（机房）：把各章搭出的普通模型变换成 CPU 上快的样子。

章节里的模型是普通的 torch 模块，不知道这里的存在；像 gpt-fast 的 _load_model 先搭模型、再用 quantize.py 变换它那样，
这里从外面换掉模块或属性：

    model, mtp = qwen.fast.load(path)                 # 这台机器上最快的布局；有草稿头就一起读

- load.py：加载与变换。layout 选矩阵的布局（plain 各章的模块、packed oneDNN 打包、blocked 分块布局与 C++ 的 matvec、
  graphs 再把解码一步编译成图），quantize="int8" 或 "int4" 选权重的格式；auto 是这台机器上最快的（编得出 C++ 就是 blocked）。
- linear.py：矩阵的两种布局（PackedLinear、BlockedLinear），读同一输入的几个投影拼成一个矩阵；kernel.py 编译
  matvec.cpp 等 C++ 内核一次，records.py 把编译失败与量出的代价记在磁盘上。
- rows.py：输出头换了布局之后，与它共用的嵌入表留在检查点文件里，查表时按行读（FileEmbedding）。
- layers.py：各层换成改写了几个小方法的子类：拼接的投影、就地更新的 DeltaNet 递推、按键值头分组的解码注意力。
  padded.py：左填充的批处理每行照单独运行那样算。step.py：解码与验证的一步（全部层）编译成一张图（FastModel）。
- experts.py：专家混合层（第 4 章附）：每个专家两个分块的矩阵，一个 token 只乘它的 k 个（FastMoE；分块布局上整层是
  layer.cpp 的一次调用）。
- draft.py：草稿头的同样变换，只给起草词表打分（FastMTP）。warm.py：用之前把各张图编译好，量出多起草一个 token 的代价。

变换只影响速度与内存，输出与普通路径只差浮点舍入。每条快路径上一行的结果与同时算几行无关：投机解码验证的每一行与单独
解码那个 token 时逐位相同（第 14 章的承诺，tests/test_exact.py）。为什么快、快多少、逐位相同怎么做到，见 docs/performance.md。
"""

from .draft import FastMTP
from .load import DTYPES, LAYOUTS, describe, load, load_draft, load_model, num_params, preferred_dtype, resolve
from .warm import measure_round_cost, warm_up

__all__ = ["DTYPES", "LAYOUTS", "FastMTP", "describe", "load", "load_draft", "load_model", "measure_round_cost", "num_params",
           "preferred_dtype", "resolve", "warm_up"]
