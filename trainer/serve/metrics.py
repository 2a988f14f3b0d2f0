"""The serve job's own /metrics: latency histograms and load, named after vLLM's (`vllm:` ->
`kitchen_serve_`), in a registry per server so that tests can run several in one process."""

import bisect
import threading
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Seconds: from a few ms (a tiny model on a GPU) to minutes (a long answer on a loaded CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class StepHistogram(Collector):
    """A Prometheus histogram fed a whole engine step's observations at once.

    The inter-token latency has one observation per generated token: with 32 requests in a
    step, prometheus_client's Histogram.observe takes its locks 32 times. This one counts the
    step's values first and takes one lock. It exposes the same series (`_bucket{le}`, `_sum`,
    `_count`) as prometheus_client's Histogram."""

    def __init__(
        self,
        name: str,
        doc: str,
        labels: dict[str, str],
        registry: CollectorRegistry,
        buckets: tuple[float, ...] = (),
    ):
        self._name, self._doc, self._labels = name, doc, labels
        self._bounds = [*buckets, float("inf")]
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: Iterable[float]) -> None:
        counts, total = [0] * len(self._bounds), 0.0
        for v in values:
            counts[bisect.bisect_left(self._bounds, v)] += 1  # le: v <= bound
            total += v
        with self._lock:
            self._counts = [a + b for a, b in zip(self._counts, counts, strict=True)]
            self._sum += total

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._doc, labels=list(self._labels))
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric(list(self._labels.values()), buckets, total)
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self._name, self._doc, labels=list(self._labels))


class ServeMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels, values = ["model_name"], [model_name]

        def hist(name: str, doc: str) -> StepHistogram:
            by_label = dict(zip(labels, values, strict=True))
            return StepHistogram(name, doc, by_label, self.registry, LATENCY_BUCKETS)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(*values)

        self.time_to_first_token = hist(
            "kitchen_serve_time_to_first_token_seconds", "From arrival to the first token."
        )
        self.inter_token_latency = hist(
            "kitchen_serve_inter_token_latency_seconds", "Between two tokens of a request."
        )
        self.e2e_latency = hist(
            "kitchen_serve_e2e_request_latency_seconds", "From arrival to the last token."
        )
        self.generation_tokens = counter("kitchen_serve_generation_tokens", "Tokens generated.")
        self.prompt_tokens = counter("kitchen_serve_prompt_tokens", "Prompt tokens admitted.")
        self.requests = Counter(
            "kitchen_serve_requests",
            "Requests ended, by finish reason (stop, length, abort) or rejected (overloaded).",
            [*labels, "finish_reason"],
            registry=self.registry,
        )
        self.preemptions = counter(
            "kitchen_serve_preemptions",
            "Requests preempted for KV-cache blocks (recomputed later).",
        )
        self.running = gauge("kitchen_serve_num_requests_running", "Requests in the batch.")
        self.waiting = gauge("kitchen_serve_num_requests_waiting", "Requests queued.")
        self.blocks_used = gauge("kitchen_serve_kv_cache_blocks_used", "KV-cache blocks held.")
        self.blocks_free = gauge("kitchen_serve_kv_cache_blocks_free", "KV-cache blocks free.")
        self.blocks_shared = gauge(
            "kitchen_serve_kv_cache_blocks_shared",
            "KV-cache blocks held by more than one request (shared prefixes).",
        )
        # The prefix cache's hit rate is cached / prompt tokens (vLLM's prefix_cache_hits /
        # prefix_cache_queries, in tokens).
        self.cached_tokens = counter(
            "kitchen_serve_prefix_cached_tokens",
            "Prompt tokens read from the prefix cache instead of computed.",
        )
        # Speculative decoding's acceptance rate is accepted / draft tokens (vLLM's
        # spec_decode_num_accepted_tokens / spec_decode_num_draft_tokens).
        self.draft_tokens = counter(
            "kitchen_serve_spec_decode_draft_tokens",
            "Tokens proposed by speculative decoding's draft (prompt lookup or a draft model).",
        )
        self.accepted_tokens = counter(
            "kitchen_serve_spec_decode_accepted_tokens",
            "Draft tokens the model verified and kept (greedy: its own choice; sampled: the "
            "rejection rule).",
        )
        # Structured output's grammar time per token is grammar seconds / grammar tokens: the
        # time masks, draft checks and the matchers' construction took, per masked position.
        self.grammar_seconds = counter(
            "kitchen_serve_grammar_seconds",
            "Time structured output's grammars took (token masks, draft checks, compiling).",
        )
        self.grammar_tokens = counter(
            "kitchen_serve_grammar_tokens",
            "Positions structured output's grammars masked.",
        )
        self._values = values

    def ended(self, reason: str) -> None:
        self.requests.labels(*self._values, reason).inc()
