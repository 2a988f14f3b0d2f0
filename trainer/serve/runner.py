"""The HTTP server's handle on the engine, which runs in a process of its own
(engine_process.py).

Requests and aborts go to the engine process as they come; each step's report comes back to a
receiving thread here, which hands every output to its request's sink (a callable the server
supplies, e.g. one that hands it to the event loop) and records latency and load. Latency is
measured here, on the clock of the process that writes to the clients.

If the engine process dies (a crash, the OOM killer), or the receiving thread fails, every open
request ends with finish reason `abort`, new ones are refused (503), and `failed` says why: the
serve job then exits FAILED and the launcher's retry policy restarts it.
"""

import multiprocessing
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from trainer.inference.engine import FinishReason, Output, Request
from trainer.serve.engine_process import (
    STOPPED,
    Command,
    EngineSpec,
    EngineStats,
    StepReport,
    dumps,
    receive,
    run_engine,
    send,
)
from trainer.serve.metrics import ServeMetrics

Sink = Callable[[Output], None]

START_SECONDS = 300  # longest wait for the engine process to build its model (a loaded machine)


class Overloaded(Exception):
    """The queue is full (ServeConfig.max_waiting): the server answers 429."""


class Draining(Exception):
    """The server is stopping, or its engine is gone: it takes nothing new (503)."""


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
    def __init__(self, spec: EngineSpec, metrics: ServeMetrics):
        self.cfg, self.metrics = spec.cfg, metrics
        self.decode = spec.decode  # a token's text, for the API's logprobs
        context = multiprocessing.get_context("spawn")  # fork would copy the server's threads
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=run_engine,
            args=(child, dumps(spec)),
            name="serve-engine",
            daemon=True,  # ends with this process, whatever happens to it
        )
        self._child_conn = child
        self._send_lock = threading.Lock()  # the event loop and the main thread both send
        self._lock = threading.Lock()
        self._sent = 0  # requests sent to the engine since the start
        self._live: dict[str, _Timing] = {}
        self._draining = False
        self.failed = ""  # why the server can no longer answer ("": it can)
        self.stats = EngineStats(0, 0, 0, self.cfg.num_blocks, 0, 0, 0)
        self._preemptions_seen = 0
        self._cached_seen = 0
        self._drafts_seen = (0, 0)  # draft tokens, accepted tokens
        self._grammar_seen = (0.0, 0)  # grammar seconds, grammar tokens
        self.generated = 0  # tokens generated so far (the heartbeat's throughput)
        self._ttft: list[float] = []  # since the last `window_latency`
        self._itl: list[float] = []
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._receive, name="serve-outputs", daemon=True)

    def start(self, timeout: float = START_SECONDS) -> None:
        """Starts the engine process and waits until its model is built."""
        self.process.start()
        self._child_conn.close()  # the child's end: only the child holds it now
        if not self._conn.poll(timeout):
            self.process.kill()
            raise RuntimeError(f"the serve engine process did not start within {timeout:.0f} s")
        try:
            self.stats = receive(self._conn).stats
        except EOFError:
            self.process.join(5)
            raise RuntimeError(
                f"the serve engine process exited with code {self.process.exitcode} before "
                "it was ready (its error is above)"
            ) from None
        self.thread.start()

    def submit(self, request: Request, sink: Sink) -> None:
        """Queues `request`; raises Overloaded or Draining instead of queueing past the limit."""
        with self._lock:
            if self._draining or self.failed:
                raise Draining(self.failed or "the server is shutting down")
            waiting = self.load().waiting_requests  # in flight + the engine's queue
            if waiting >= self.cfg.max_waiting:
                self.metrics.ended("overloaded")
                raise Overloaded(
                    f"{waiting} requests are already waiting (serve.max_waiting "
                    f"{self.cfg.max_waiting}): retry later"
                )
            self._sent += 1
            self._live[request.id] = _Timing(sink, request.arrived)
        self.metrics.prompt_tokens.inc(len(request.prompt))
        self._send(Command.ADD, request)

    def abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._send(Command.ABORT, request_id)

    def drain(self, timeout: float | None = None) -> bool:
        """Takes no new request, finishes the ones it has, stops; True when all finished."""
        with self._lock:
            self._draining = True
        self._send(Command.DRAIN, None)
        stopped = self._stopped.wait(timeout)
        self.process.join(5 if stopped else 0)
        return stopped and not self.failed

    def load(self) -> Load:
        s = self.stats
        in_flight = self._sent - s.received  # sent, not yet in the engine's queue
        return Load(s.running, s.waiting + in_flight, s.kv_blocks_used, s.kv_blocks_free)

    def window_latency(self) -> Latency:
        """Time to first token and inter-token latency since the last call (the heartbeat's
        window)."""
        ttft, self._ttft = self._ttft, []
        itl, self._itl = self._itl, []
        return Latency(*_p50_p99(ttft), *_p50_p99(itl))

    def _send(self, command: Command, payload) -> None:
        try:
            with self._send_lock:
                send(self._conn, (command, payload))
        except OSError:  # the engine is gone: the receiving thread ends the requests
            pass

    def _receive(self) -> None:
        try:
            while True:
                try:
                    message = receive(self._conn)
                except (EOFError, OSError):
                    self.process.join(5)
                    code = self.process.exitcode
                    self._fail(f"the serve engine process exited with code {code}")
                    return
                if message == STOPPED:
                    self._stopped.set()
                    return
                self._report(message)
        except Exception as e:  # a bug here must not leave a server that answers nothing
            traceback.print_exc()
            self._fail(f"the serve job's output thread failed: {e!r}")

    def _fail(self, reason: str) -> None:
        """Ends every open request (finish reason `abort`) and refuses new ones: `failed`."""
        with self._lock:
            self.failed = reason
            live, self._live = self._live, {}
        if self.process.is_alive():
            self.process.kill()
        for request_id, timing in live.items():
            self.metrics.ended(FinishReason.ABORT.value)
            timing.sink(Output(request_id, "", [], FinishReason.ABORT))
        self._stopped.set()

    def _report(self, report: StepReport) -> None:
        now = time.monotonic()
        m = self.metrics
        generated = 0
        ttft: list[float] = []
        itl: list[float] = []
        e2e: list[float] = []
        for out in report.outputs:
            timing = self._live.get(out.request_id)
            if timing is None:
                continue
            if out.token_ids:
                generated += len(out.token_ids)
                if timing.last_token:
                    itl.append(now - timing.last_token)
                else:
                    ttft.append(now - timing.arrived)
                timing.last_token = now
            if out.finish is not None:
                e2e.append(now - timing.arrived)
                m.ended(out.finish.value)
                del self._live[out.request_id]
            timing.sink(out)
        # Once a step, not once a token: a metric's lock per token adds up.
        m.inter_token_latency.observe_many(itl)
        m.time_to_first_token.observe_many(ttft)
        m.e2e_latency.observe_many(e2e)
        self._itl.extend(itl)  # extend, not +=: window_latency swaps these lists
        self._ttft.extend(ttft)
        m.generation_tokens.inc(generated)
        self.generated += generated
        s = self.stats = report.stats
        m.preemptions.inc(s.preemptions - self._preemptions_seen)
        self._preemptions_seen = s.preemptions
        m.cached_tokens.inc(s.cached_tokens - self._cached_seen)
        self._cached_seen = s.cached_tokens
        m.blocks_shared.set(s.kv_blocks_shared)
        m.draft_tokens.inc(s.draft_tokens - self._drafts_seen[0])
        m.accepted_tokens.inc(s.accepted_tokens - self._drafts_seen[1])
        self._drafts_seen = (s.draft_tokens, s.accepted_tokens)
        m.grammar_seconds.inc(s.grammar_seconds - self._grammar_seen[0])
        m.grammar_tokens.inc(s.grammar_tokens - self._grammar_seen[1])
        self._grammar_seen = (s.grammar_seconds, s.grammar_tokens)
        load = self.load()
        m.running.set(load.running_requests)
        m.waiting.set(load.waiting_requests)
        m.blocks_used.set(load.kv_blocks_used)
        m.blocks_free.set(load.kv_blocks_free)
