"""The engine in a process of its own, as vLLM's EngineCore: the HTTP server's process sends it
requests and aborts, and it answers every step with that step's outputs and its load.

Why a process and not a thread: a step is Python and small tensor ops that hold the GIL, and
so is the HTTP server (uvicorn, one server-sent event per token per client). In one process
they take turns on one core; in two, the HTTP work of one step runs beside the model work of
the next. On the 2-core bench machine that is most of continuous batching's lead over one
request at a time (trainer/bench/serve_results.md).

Messages are pickled, one per step each way at most; tensors in them (the model at start, a
VLM's image) travel as torch.multiprocessing sends them: CPU tensors in shared memory, CUDA
tensors as IPC handles. The engine process maps the weights the server loaded instead of
getting a copy: one copy in memory, on a GPU too, however large the model.

The child ignores SIGINT and SIGTERM: the parent drains it (a Ctrl-C or a launcher's SIGTERM
reaching the whole process group must not cut requests off), and it exits when told to drain
and done, or when the parent is gone (its pipe closes).
"""

import enum
import importlib
import io
import pickle
import signal
import types
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  # registers its tensor reducers with ForkingPickler

from protos import trainer_config_pb2
from trainer.inference.engine import Engine, FinishReason, Output
from trainer.inference.grammar import Vocabulary
from trainer.model import Transformer


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds its Engine from (trainer/inference/engine.py's arguments)."""

    model: Transformer
    cfg: trainer_config_pb2.ServeConfig  # with defaults applied
    decode: Callable[[list[int]], str]  # picklable: a module's function or a bound method
    eos_id: int
    max_len: int
    embed_images: Callable[[torch.Tensor], torch.Tensor] | None
    threads: int  # torch's intra-op threads, the parent's
    vocab: int | None = None  # the tokenizer's ids, the only ones sampled (engine.py)
    grammar: Vocabulary | None = None  # structured output's token masks (grammar.py)
    draft: Transformer | None = None  # speculative decoding's draft model (serve.draft_path)


@dataclass(frozen=True)
class EngineStats:
    """The engine's load after a step (the heartbeat's, /health's and the gauges' numbers)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    preemptions: int  # since the start
    finished: int  # requests ended since the start
    received: int  # requests received since the start: the parent counts those still in flight
    kv_blocks_shared: int = 0  # held by more than one request (the prefix cache's sharing)
    prompt_tokens: int = 0  # admitted since the start
    cached_tokens: int = 0  # of those, read from the prefix cache
    draft_tokens: int = 0  # speculative tokens proposed since the start
    accepted_tokens: int = 0  # of those, kept
    grammar_seconds: float = 0.0  # spent on structured output's grammars since the start
    grammar_tokens: int = 0  # positions they masked


@dataclass(frozen=True)
class StepReport:
    outputs: list[Output]
    stats: EngineStats


class Command(enum.Enum):
    ADD = "add"  # payload: a Request
    ABORT = "abort"  # payload: a request id
    DRAIN = "drain"  # finish what you hold, say STOPPED, exit


STOPPED = "stopped"  # the engine's last message after a drain


class _Pickler(ForkingPickler):
    """multiprocessing's pickler (tensors by shared memory, with torch's reducers), which also
    pickles a module by its name: the model holds its ops module (kernels or
    kernels.reference, trainer/model.py), which the engine process imports again."""

    def reducer_override(self, obj):
        if isinstance(obj, types.ModuleType):
            return importlib.import_module, (obj.__name__,)
        return NotImplemented


def dumps(message: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(dumps(message))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def run_engine(conn: Connection, spec_bytes: bytes) -> None:
    """The engine process's main: `spec_bytes` is a pickled EngineSpec."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spec: EngineSpec = pickle.loads(spec_bytes)
    torch.set_num_threads(spec.threads)
    engine = Engine(
        spec.model,
        spec.cfg,
        decode=spec.decode,
        eos_id=spec.eos_id,
        max_len=spec.max_len,
        embed_images=spec.embed_images,
        vocab=spec.vocab,
        grammar=spec.grammar,
        draft=spec.draft,
    )
    received, draining = 0, False
    refused: list[Output] = []

    def stats() -> EngineStats:
        allocator, grammars = engine.cache.allocator, engine.grammars
        return EngineStats(
            len(engine.scheduler.running),
            len(engine.scheduler.waiting),
            allocator.used,
            allocator.free,
            engine.scheduler.preemptions,
            engine.finished,
            received,
            allocator.shared,
            engine.scheduler.prompt_tokens,
            engine.scheduler.cached_tokens,
            engine.drafted,
            engine.accepted,
            grammars.seconds if grammars else 0.0,
            grammars.tokens if grammars else 0,
        )

    try:
        send(conn, StepReport([], stats()))  # ready
        while True:
            idle = not engine.has_work()
            if idle and draining:
                send(conn, STOPPED)
                return
            if idle:
                conn.poll(None)  # nothing to do until a command comes (or the pipe closes)
            while conn.poll():
                command, payload = receive(conn)
                if command is Command.ADD:
                    received += 1
                    try:
                        engine.add(payload)
                    except ValueError:  # the API checks these first; never lose the request
                        refused.append(Output(payload.id, "", [], FinishReason.ABORT))
                elif command is Command.ABORT:
                    engine.abort(payload)
                elif command is Command.DRAIN:
                    draining = True
            outputs, refused = refused, []
            if engine.has_work():
                outputs += engine.step()
            if outputs or not idle:
                send(conn, StepReport(outputs, stats()))
    except (EOFError, BrokenPipeError):
        return  # the parent is gone: so are the requests' clients
