"""The engine on a thread of its own, fed by the HTTP server's event loop.

The engine (engine.py) is single-threaded and pure; the runner owns it. Requests and aborts
arrive through an inbox and are applied between steps; each step's outputs go to the
request's sink (a callable the server supplies, e.g. one that hands them to an asyncio queue).
Latency and load are recorded here, where the clock of every token is known.
"""

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainer.serve.engine import Engine, Output, Request
from trainer.serve.metrics import ServeMetrics

Sink = Callable[[Output], None]


class Overloaded(Exception):
    """The queue is full (ServeConfig.max_waiting): the server answers 429."""


class Draining(Exception):
    """The server is stopping: it finishes what it has and takes nothing new (503)."""


@dataclass(frozen=True)
class Load:
    """What the engine holds now (the heartbeat's and /health's numbers)."""

    running_requests: int
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_free: int


@dataclass(frozen=True)
class Latency:
    """p50 and p99 of one window of requests (0: no token came in it)."""

    ttft_p50_seconds: float
    ttft_p99_seconds: float
    itl_p50_seconds: float
    itl_p99_seconds: float


def _p50_p99(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    if not values:
        return 0.0, 0.0
    return values[len(values) // 2], values[min(len(values) - 1, len(values) * 99 // 100)]


@dataclass
class _Timing:
    sink: Sink
    arrived: float
    last_token: float = 0.0


class EngineRunner:
    def __init__(self, engine: Engine, metrics: ServeMetrics):
        self.engine, self.metrics = engine, metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet running: inbox + engine.waiting
        self._live: dict[str, _Timing] = {}
        self._draining = False
        self.generated = 0  # tokens generated so far (the heartbeat's throughput)
        self._ttft: list[float] = []  # since the last `window_latency`
        self._itl: list[float] = []
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, request: Request, sink: Sink) -> None:
        """Queues `request`; raises Overloaded or Draining instead of queueing past the limit."""
        with self._lock:
            if self._draining:
                raise Draining("the server is shutting down")
            if self._queued >= self.engine.cfg.max_waiting:
                self.metrics.ended("overloaded")
                raise Overloaded(
                    f"{self._queued} requests are already waiting (serve.max_waiting "
                    f"{self.engine.cfg.max_waiting}): retry later"
                )
            self._queued += 1
        self._inbox.put(("add", request, sink))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def drain(self, timeout: float | None = None) -> bool:
        """Takes no new request, finishes the ones it has, stops; True when all finished."""
        with self._lock:
            self._draining = True
        self._inbox.put(("wake", None, None))
        return self._stopped.wait(timeout)

    def load(self) -> Load:
        """Read without locking: a heartbeat may see a step half-way, which a gauge can live
        with."""
        e = self.engine
        return Load(
            running_requests=len(e.running),
            waiting_requests=len(e.waiting) + self._inbox.qsize(),
            kv_blocks_used=e.cache.allocator.used,
            kv_blocks_free=e.cache.allocator.free,
        )

    def window_latency(self) -> Latency:
        """Time to first token and inter-token latency since the last call (the heartbeat's
        window)."""
        ttft, self._ttft = self._ttft, []
        itl, self._itl = self._itl, []
        return Latency(*_p50_p99(ttft), *_p50_p99(itl))

    def _run(self) -> None:
        while True:
            idle = not self.engine.has_work()
            if idle and self._draining and self._inbox.empty():
                break
            try:
                self._apply(self._inbox.get(timeout=0.5) if idle else self._inbox.get_nowait())
                while True:
                    self._apply(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if self.engine.has_work():
                self._step()
        self._stopped.set()

    def _apply(self, item) -> None:
        what, payload, sink = item
        if what == "add":
            self._live[payload.id] = _Timing(sink, payload.arrived)
            self.engine.add(payload)
            self.metrics.prompt_tokens.inc(len(payload.prompt))
        elif what == "abort" and payload in self._live:
            self.engine.abort(payload)

    def _step(self) -> None:
        preempted = self.engine.preemptions
        outputs = self.engine.step()
        now = time.monotonic()
        m = self.metrics
        generated = 0
        for out in outputs:
            timing = self._live.get(out.request_id)
            if timing is None:
                continue
            if out.token_ids:
                generated += len(out.token_ids)
                if timing.last_token:
                    m.inter_token_latency.observe(now - timing.last_token)
                    self._itl.append(now - timing.last_token)
                else:
                    m.time_to_first_token.observe(now - timing.arrived)
                    self._ttft.append(now - timing.arrived)
                timing.last_token = now
            if out.finish is not None:
                m.e2e_latency.observe(now - timing.arrived)
                m.ended(out.finish.value)
                del self._live[out.request_id]
            timing.sink(out)
        m.generation_tokens.inc(generated)  # once a step: a counter's lock per token adds up
        self.generated += generated
        m.preemptions.inc(self.engine.preemptions - preempted)
        with self._lock:
            self._queued = len(self.engine.waiting) + self._inbox.qsize()
        load = self.load()
        m.running.set(load.running_requests)
        m.waiting.set(load.waiting_requests)
        m.blocks_used.set(load.kv_blocks_used)
        m.blocks_free.set(load.kv_blocks_free)
