"""附录 · 工具：课程之外、用模型的人会用到的几个命令。

- compare.py：python -m qwen.tools.compare，逐块对照 transformers，指出第一个不对的块；
- train.py：python -m qwen.tools.train，从零训练主模型与 MTP 草稿头（随包的 demo 检查点就是它训的）；
- vocab.py：python -m qwen.tools.vocab，数出起草词表（草稿头给哪些 token 打分），存在检查点旁边；
- checkpoint.py：按一个形状造随机权重、存成发布检查点的布局（基准测试与 compare --random 用，不必下载模型）。
"""
