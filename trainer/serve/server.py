"""A running server: the engine in its own process (engine_process.py), uvicorn on a thread of
this one, and the `serve` job around them.

The job listens on serve.host:serve.port (port 0: any free port), reports its endpoint and
load to the launcher every serve.heartbeat_seconds (the heartbeat also keeps the hang detector
quiet while it is healthy), and on SIGTERM or the launcher's stop drains: uvicorn stops
accepting connections and waits for the open ones, the engine finishes every request it holds,
then the job exits 75 (ExitCode.PREEMPTED, as a stopped training job does): the launcher makes
that CANCELLED after a cancel and re-queues it after a preemption. Ctrl-C (SIGINT) on a job run
by hand drains the same way and exits 0. If the engine process dies, the job exits 1
(ExitCode.FAILED), and the launcher's retry policy restarts it.
"""

import asyncio
import signal
import socket
import threading
import time

import torch
import uvicorn

from protos import attempt_pb2, progress_pb2, trainer_config_pb2
from protos.exit_codes import ExitCode
from protos.exposure import read_secret_env, read_secret_file
from protos.validation_kinds import check_serve_pool
from trainer.data.tokenizer import Tokenizer
from trainer.inference.grammar import Vocabulary
from trainer.jobs.context import install_sigterm_handler
from trainer.model import Transformer
from trainer.serve.api import ServedModel, create_app
from trainer.serve.engine_process import EngineSpec
from trainer.serve.guard import timed_protocol
from trainer.serve.images import PromptImages
from trainer.serve.metrics import ServeMetrics
from trainer.serve.runner import EngineRunner

DRAIN_SECONDS = 120  # longest wait for open requests at shutdown


class Server:
    def __init__(
        self,
        model: Transformer,
        cfg: trainer_config_pb2.ServeConfig,
        served: ServedModel,
        *,
        decode,
        eos_id: int,
        vocab: int | None = None,
        draft: Transformer | None = None,
    ):
        """`cfg` has its defaults applied (protos.defaults.with_defaults); `draft` speculative
        decoding's draft model (serve.draft_path)."""
        key = api_key(cfg)  # first: a key that cannot be read stops the job before anything
        spec = EngineSpec(
            model,
            cfg,
            decode=decode,
            eos_id=eos_id,
            max_len=served.max_len,
            embed_images=served.images.embed if served.images else None,
            threads=torch.get_num_threads(),
            vocab=vocab,
            grammar=served.grammar,
            draft=draft,
        )
        self.runner = EngineRunner(spec, ServeMetrics(served.name))
        # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
        # on sockets that say they are TCP, and accepted ones take their protocol from this one.
        # With Nagle on, a streamed token waits for the client's delayed ACK of the one before:
        # on a kept-alive connection (the openai client's) tokens came in 40 ms bursts.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((cfg.host or "127.0.0.1", cfg.port))
        self.tls = bool(cfg.tls_cert)
        config = uvicorn.Config(
            create_app(served, self.runner, key),
            log_level="warning",
            timeout_graceful_shutdown=DRAIN_SECONDS,
            http=timed_protocol(cfg.request_timeout_seconds),
            timeout_keep_alive=cfg.idle_timeout_seconds,  # type: ignore[arg-type]  # a float works
            ssl_certfile=cfg.tls_cert or None,
            ssl_keyfile=cfg.tls_key or None,
        )
        self.http = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._serve, name="serve-http", daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.sock.getsockname()
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    def _serve(self) -> None:
        asyncio.run(self.http.serve(sockets=[self.sock]))

    def start(self, timeout: float = 30.0) -> "Server":
        """Starts the engine process, then the HTTP server (`timeout`: for the latter)."""
        self.runner.start()
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.http.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.endpoint} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> bool:
        """Drains (open requests finish) and stops; True when nothing was cut off."""
        self.http.should_exit = True
        self.thread.join(DRAIN_SECONDS + 5)
        return self.runner.drain(DRAIN_SECONDS) and not self.thread.is_alive()

    def heartbeat(self, job_id: str, attempt: int) -> progress_pb2.Progress:
        stats = self.runner.stats
        beat = progress_pb2.Progress(
            job_id=job_id,
            attempt=attempt,
            phase="serve",
            endpoint=self.endpoint,
            serve_preemptions=stats.preemptions,
            requests_finished=stats.finished,
        )
        load, latency = self.runner.load(), self.runner.window_latency()
        beat.running_requests, beat.waiting_requests = load.running_requests, load.waiting_requests
        beat.kv_blocks_used, beat.kv_blocks_free = load.kv_blocks_used, load.kv_blocks_free
        beat.kv_blocks_shared = stats.kv_blocks_shared
        beat.prompt_tokens, beat.prefix_cached_tokens = stats.prompt_tokens, stats.cached_tokens
        beat.spec_draft_tokens = stats.draft_tokens
        beat.spec_accepted_tokens = stats.accepted_tokens
        beat.grammar_seconds, beat.grammar_tokens = stats.grammar_seconds, stats.grammar_tokens
        beat.ttft_p50_seconds, beat.ttft_p99_seconds = (
            latency.ttft_p50_seconds,
            latency.ttft_p99_seconds,
        )
        beat.itl_p50_seconds, beat.itl_p99_seconds = (
            latency.itl_p50_seconds,
            latency.itl_p99_seconds,
        )
        return beat


def grammar_vocabulary(tokenizer: Tokenizer) -> Vocabulary:
    """What the engine builds structured output's token masks from: a `bpe` tokenizer's
    tokenizer.json (llguidance reads its byte-level alphabet itself), cl100k's bytes per id."""
    if tokenizer.kind == "bpe":
        return Vocabulary(tokenizer.vocab_size, tokenizer.eos_id, hf_json=tokenizer.hf_json())
    tokens = tuple(tokenizer.token_bytes())
    specials = tuple(i for i, t in enumerate(tokens) if not t)
    return Vocabulary(
        tokenizer.vocab_size, tokenizer.eos_id, tokens=tokens, special_ids=specials,
        encode=tokenizer.encode,
    )  # fmt: skip


def api_key(cfg: trainer_config_pb2.ServeConfig) -> str:
    """The key clients must send ("": none), from serve.api_key_file or serve.api_key_env."""
    if cfg.api_key_file:
        return read_secret_file(cfg.api_key_file, "trainer.serve.api_key_file")
    if cfg.api_key_env:
        return read_secret_env(cfg.api_key_env, "trainer.serve.api_key_env")
    return ""


def serve(
    model: Transformer,
    tokenizer: Tokenizer,
    max_len: int,
    cfg: trainer_config_pb2.ServeConfig,
    attempt: attempt_pb2.Attempt,
    log,
    client,
    images: PromptImages | None = None,
    draft: Transformer | None = None,
) -> ExitCode:
    """The `serve` job: serves `model` until SIGTERM or the launcher's stop, reporting a
    heartbeat to `client` (a ProgressClient, or None run by hand). `cfg` has its defaults.
    `images`: a VLM's image input (`model` is then its language model)."""
    # The checkpoint's context, not the config's (#36): a pool smaller than it is refused
    # before anything starts, naming serve.num_blocks.
    check_serve_pool(cfg, max_len, "the checkpoint's context")
    served = ServedModel(
        name=cfg.model_name or attempt.spec.name,
        encode=tokenizer.encode,
        bos_id=tokenizer.bos_id,
        max_len=max_len,
        created=int(time.time()),
        images=images,
        grammar=grammar_vocabulary(tokenizer),
    )
    sigterm = install_sigterm_handler()
    interrupted: list[int] = []  # Ctrl-C on a job run by hand: drain, then exit 0
    signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    server = Server(
        model,
        cfg,
        served,
        decode=tokenizer.decode,
        eos_id=tokenizer.eos_id,
        vocab=tokenizer.vocab_size,
        draft=draft,
    )
    server.start()
    reads = f", with {images.tokens} tokens per image" if images else ""
    log(f"serving on {server.endpoint}/v1: model {served.name!r} (OpenAI API{reads})")
    launcher_stop = client.stop_requested.is_set if client else (lambda: False)

    def stop_requested() -> bool:
        return sigterm() or bool(interrupted) or launcher_stop() or bool(server.runner.failed)

    tokens, last = 0, time.monotonic()
    while not stop_requested():
        beat = server.heartbeat(attempt.job_id, attempt.number)
        generated, now = server.runner.generated, time.monotonic()
        beat.generated_tokens_per_second = (generated - tokens) / max(now - last, 1e-9)
        tokens, last = generated, now
        if client is not None:
            client.send(beat)
        deadline = now + cfg.heartbeat_seconds
        while time.monotonic() < deadline and not stop_requested():
            time.sleep(0.1)
    if server.runner.failed:  # the launcher's retry policy restarts the job
        log(f"error: {server.runner.failed}; open requests ended with finish reason 'abort'")
        server.stop()
        return ExitCode.FAILED
    log("stopping: draining open requests")
    clean = server.stop()
    served_count = server.runner.stats.finished
    log(f"stopped ({'drained' if clean else 'drain timed out'}); {served_count} requests served")
    return ExitCode.OK if interrupted and not sigterm() else ExitCode.PREEMPTED
