"""附录 · 采样的规则与读数：第 12 章的 Sampling 之外，服务与工具要的两件事。

- grammar.py：文法（JSON Schema、工具调用）——第 12 章 Rule 协议的一条规则，只许合乎它的 token；
- logprobs.py：提示词各位置的对数概率（completions 的 echo）与每个 token 的字节（OpenAI 的 bytes）。
生成的 token 自己的对数概率不在这里：Sampling(logprobs=n) 要，第 12 章随 token 一起交回。
"""
