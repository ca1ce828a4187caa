"""附录 · 服务：给运维看的指标。GET /metrics 是 Prometheus 的文本格式（prometheus-client，vLLM 与 llama-server 也这样导出）。

名字照 vLLM（前缀 qwen: 换掉 vllm:），抓取 vLLM 的仪表盘改个前缀就能用：
- qwen:prompt_tokens_total、qwen:generation_tokens_total：读过的提示词 token（不含从留下的状态接着读、没重读的）与生成的
  token；qwen:request_success_total{finished_reason}：结束的请求（stop、length、cancelled）；
- qwen:time_to_first_token_seconds：从提交到第一个 token 的直方图；
- qwen:num_requests_running、qwen:num_requests_waiting：正在生成、排队的请求数（抓取时从引擎读）；
- qwen:spec_decode_num_draft_tokens_total、qwen:spec_decode_num_accepted_tokens_total：草稿头起草的、被接受的 token。
每个服务一个自己的 CollectorRegistry（不用进程全局的那个）：测试里几个服务并存，各数各的。
"""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)  # 秒：同 vLLM 的一部分


class Metrics:
    """一个引擎的计数。engine：读 running、queue 的长度（抓取时）。"""

    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        self.prompt = Counter("qwen:prompt_tokens", "读过的提示词 token（从留下的状态接着读的不算）", registry=r)
        self.generated = Counter("qwen:generation_tokens", "生成的 token", registry=r)
        self.finished = Counter("qwen:request_success", "结束的请求", ["finished_reason"], registry=r)
        self.ttft = Histogram("qwen:time_to_first_token_seconds", "提交到第一个 token 的秒数", buckets=TTFT_BUCKETS, registry=r)
        self.drafted = Counter("qwen:spec_decode_num_draft_tokens", "草稿头起草的 token", registry=r)
        self.accepted = Counter("qwen:spec_decode_num_accepted_tokens", "被接受的草稿 token", registry=r)
        Gauge("qwen:num_requests_running", "正在生成的请求", registry=r).set_function(lambda: len(engine.running))
        Gauge("qwen:num_requests_waiting", "排队的请求", registry=r).set_function(lambda: len(engine.queue))

    def first_token(self, submitted: float) -> None:
        self.ttft.observe(time.monotonic() - submitted)

    def done(self, request, run=None) -> None:
        """一个请求结束：它读过的提示词、生成的 token 与（投机解码时）这次的 Run 起草、接受的数。"""
        self.prompt.inc(max(len(request.ids) - request.cached_tokens, 0))
        self.generated.inc(len(request.tokens))
        self.finished.labels(request.finish_reason or "error").inc()
        if run is not None:
            self.drafted.inc(run.drafted)
            self.accepted.inc(run.hits)

    def text(self) -> bytes:
        return generate_latest(self.registry)
