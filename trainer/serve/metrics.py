"""The serve job's own /metrics: latency histograms and load, named after vLLM's (`vllm:` ->
`kitchen_serve_`), in a registry per server so that tests can run several in one process."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds: from a few ms (a tiny model on a GPU) to minutes (a long answer on a loaded CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServeMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels, values = ["model_name"], [model_name]

        def hist(name: str, doc: str) -> Histogram:
            h = Histogram(name, doc, labels, registry=self.registry, buckets=LATENCY_BUCKETS)
            return h.labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(*values)

        self.time_to_first_token = hist(
            "kitchen_serve_time_to_first_token_seconds", "From arrival to the first token."
        )
        self.inter_token_latency = hist(
            "kitchen_serve_inter_token_latency_seconds", "Between two tokens of a request."
        )
        self.e2e_latency = hist(
            "kitchen_serve_e2e_request_latency_seconds", "From arrival to the last token."
        )
        self.generation_tokens = Counter(
            "kitchen_serve_generation_tokens", "Tokens generated.", labels, registry=self.registry
        ).labels(*values)
        self.prompt_tokens = Counter(
            "kitchen_serve_prompt_tokens", "Prompt tokens admitted.", labels, registry=self.registry
        ).labels(*values)
        self.requests = Counter(
            "kitchen_serve_requests",
            "Requests ended, by finish reason (stop, length, abort) or rejected (overloaded).",
            [*labels, "finish_reason"],
            registry=self.registry,
        )
        self.preemptions = Counter(
            "kitchen_serve_preemptions",
            "Requests preempted for KV-cache blocks (recomputed later).",
            labels,
            registry=self.registry,
        ).labels(*values)
        self.running = gauge("kitchen_serve_num_requests_running", "Requests in the batch.")
        self.waiting = gauge("kitchen_serve_num_requests_waiting", "Requests queued.")
        self.blocks_used = gauge("kitchen_serve_kv_cache_blocks_used", "KV-cache blocks held.")
        self.blocks_free = gauge("kitchen_serve_kv_cache_blocks_free", "KV-cache blocks free.")
        self._values = values

    def ended(self, reason: str) -> None:
        self.requests.labels(*self._values, reason).inc()
