"""A simulated fleet feeding the launcher's real exporter, served on a real /metrics endpoint.

Dashboard and rule checks need series that move like a busy launcher's (steps land in the
step-time histogram, tokens accumulate, jobs leave the queue) within seconds and without
running trainers. The series come from launcher.metrics.LauncherMetrics itself, fed with real
Job and Progress messages, so their names, types and labels are the launcher's, not a copy.
tests/ runs the same checks against the whole launcher running a real tiny job.
"""

import math
import random
import statistics
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from launcher.metrics import LauncherMetrics
from protos import job_pb2, progress_pb2

# (nodes, GPUs per node) of the simulated pools.
POOLS = {"cpu": (1, 0), "h100": (8, 8)}


@dataclass
class SimulatedJob:
    """A running training job and the shape of its curves."""

    job: job_pb2.Job
    step_seconds: float
    tokens_per_step: int
    mfu: float
    peak_memory_bytes: int
    padding_fraction: float
    step: int = 0
    diverged: bool = False  # set to make the loss NaN from the next step on
    moe_experts: int = 0  # > 0: a mixture-of-experts job, reporting routing per layer
    image_token_share: float = 0.0  # #16: a VLM job's share of image tokens per batch


def simulated_ranks(step_time: float, rng: random.Random) -> list[progress_pb2.RankHealth]:
    """Four data-parallel ranks of one step: equally busy, each waiting a little on the others."""
    waits = [rng.uniform(0.02, 0.08) * step_time for _ in range(4)]
    busy = [step_time - w for w in waits]
    median = statistics.median(busy)
    return [
        progress_pb2.RankHealth(
            rank=r,
            host=f"node-{r // 2}",
            step_time_seconds=step_time,
            data_time_seconds=0.02 * step_time,
            collective_wait_seconds=waits[r],
            straggler_score=busy[r] / median,
        )
        for r in range(4)
    ]


def _job(
    job_id: str, name: str, kind: job_pb2.JobKind, pool: str, team: str, attempts: int
) -> job_pb2.Job:
    job = job_pb2.Job(id=job_id, state=job_pb2.RUNNING, attempts=attempts, pool=pool)
    job.spec.name, job.spec.kind, job.spec.team = name, kind, team
    return job


def default_fleet() -> list[SimulatedJob]:
    """A tiny CPU pretraining job and an H100 SFT job on its second attempt."""
    return [
        SimulatedJob(
            _job("j-0001", "tiny", job_pb2.PRETRAIN, "cpu", "ml", attempts=1),
            step_seconds=0.35,
            tokens_per_step=8192,
            mfu=0.06,
            peak_memory_bytes=2_100_000_000,
            padding_fraction=0.0,
            moe_experts=8,
        ),
        SimulatedJob(
            _job("j-0002", "chat-sft", job_pb2.SFT, "h100", "research", attempts=2),
            step_seconds=1.2,
            tokens_per_step=524288,
            mfu=0.41,
            peak_memory_bytes=61_000_000_000,
            padding_fraction=0.18,
        ),
        # #14: RL jobs report the RL series (kitchen_rl_*) the run dashboard's RL row shows.
        SimulatedJob(
            _job("j-0003", "grpo", job_pb2.PPO, "cpu", "ml", attempts=1),
            step_seconds=2.0,
            tokens_per_step=2048,
            mfu=0.01,
            peak_memory_bytes=900_000_000,
            padding_fraction=0.3,
        ),
        SimulatedJob(
            _job("j-0004", "dpo", job_pb2.DPO, "cpu", "ml", attempts=1),
            step_seconds=0.5,
            tokens_per_step=4096,
            mfu=0.02,
            peak_memory_bytes=800_000_000,
            padding_fraction=0.2,
        ),
        # #16: a VLM stage (docs/vlm.md's finetune: 57% image tokens, 29% padding).
        SimulatedJob(
            _job("j-0005", "scenes-vlm", job_pb2.VLM, "cpu", "ml", attempts=1),
            step_seconds=0.6,
            tokens_per_step=640,
            mfu=0.1,
            peak_memory_bytes=560_000_000,
            padding_fraction=0.29,
            image_token_share=0.57,
        ),
        # A serve job: its heartbeat feeds the serve dashboard (it has no training series).
        SimulatedJob(
            _job("j-0006", "chat-serve", job_pb2.SERVE, "cpu", "ml", attempts=1),
            step_seconds=0.0,
            tokens_per_step=0,
            mfu=0.0,
            peak_memory_bytes=0,
            padding_fraction=0.0,
        ),
    ]


def _rl_fields(kind: job_pb2.JobKind, step: int, rng: random.Random) -> dict:
    """What a PPO or DPO job reports besides the training fields (trainer/rl/)."""
    if kind == job_pb2.PPO:
        return {
            "reward_mean": min(0.9, 0.2 + step / 500),
            "reward_std": 0.4,
            "kl": 0.5 + step / 200,
            "entropy": rng.uniform(2.0, 2.2),
            "clip_fraction": rng.uniform(0.05, 0.1),
            "response_length": rng.uniform(14, 18),
            "rollout_seconds": rng.uniform(1.1, 1.3),
            "rollout_logprob_diff": rng.uniform(1e-6, 4e-6),  # float rounding (#30)
            "pass_rate": min(0.9, 0.2 + step / 500),
        }
    if kind == job_pb2.DPO:
        return {
            "preference_accuracy": min(0.9, 0.5 + step / 400),
            "margin": step / 300,
            "chosen_reward": step / 600,
            "rejected_reward": -step / 600,
            "kl": 0.3 + step / 300,
            "pass_rate": min(0.8, 0.1 + step / 500),
        }
    return {}


class SimulatedFleet:
    """Serves the launcher's metrics on 127.0.0.1 and advances the fleet every `tick_s`."""

    def __init__(self, jobs: list[SimulatedJob] | None = None, tick_s: float = 0.1, seed: int = 0):
        self.metrics = LauncherMetrics(retention_seconds=900, fleet=self.fleet)
        self.jobs = jobs if jobs is not None else default_fleet()
        self.tick_s = tick_s
        self.rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: WSGIServer | None = None
        self.port = 0

    def fleet(self) -> dict:
        """The launcher-wide numbers, in the shape launcher.controller.Controller.fleet gives."""
        with self._lock:
            queued = {pool: self.rng.randint(1, 4) for pool in POOLS}
        running = {pool: [j for j in self.jobs if j.job.pool == pool] for pool in POOLS}
        counts = {(job_pb2.RUNNING, pool): len(jobs) for pool, jobs in running.items()}
        counts.update({(job_pb2.QUEUED, pool): n for pool, n in queued.items()})
        counts.update({(job_pb2.SUCCEEDED, "cpu"): 41, (job_pb2.FAILED, "h100"): 2})
        pools = {
            pool: {
                "nodes_capacity": nodes,
                "gpus_capacity": nodes * gpus,
                "nodes_in_use": len(running[pool]),
                "gpus_in_use": len(running[pool]) * gpus,
            }
            for pool, (nodes, gpus) in POOLS.items()
        }
        return {"counts": counts, "queued": queued, "pools": pools}

    def start(self) -> str:
        """Starts serving; returns the scrape target "127.0.0.1:PORT"."""
        for sim in self.jobs:
            for attempt in range(1, sim.job.attempts + 1):
                self.metrics.attempt_started(sim.job, waited_seconds=12.0 * attempt)
                if attempt < sim.job.attempts:
                    self.metrics.attempt_ended(sim.job, preempted=False)
        self.tick()
        self._server, _ = start_http_server(0, addr="127.0.0.1", registry=self.metrics.registry)
        self.port = self._server.server_port
        self._thread.start()
        return f"127.0.0.1:{self.port}"

    def progress(self, sim: SimulatedJob) -> progress_pb2.Progress:
        """The next step's report, as a trainer would send it."""
        rng = self.rng
        sim.step += 1
        if sim.job.spec.kind == job_pb2.SERVE:
            return self._heartbeat(sim)
        checkpoint = sim.step % 50 == 0  # a checkpoint write makes every 50th step slow
        step_time = sim.step_seconds * rng.uniform(0.95, 1.08) * (4.0 if checkpoint else 1.0)
        loss = 2.4 + 8.4 * math.exp(-sim.step / 300) + rng.gauss(0, 0.03)
        p = progress_pb2.Progress(
            job_id=sim.job.id,
            attempt=sim.job.attempts,
            phase="train",
            step=sim.step,
            total_steps=100_000,
            loss=math.nan if sim.diverged else loss,
            eval_loss=loss + 0.1,
            grad_norm=rng.uniform(0.5, 1.5),
            lr=3e-4,
            tokens_per_second=sim.tokens_per_step / step_time,
            step_time_seconds=step_time,
            data_time_seconds=0.02 * step_time,
            mfu=sim.mfu * sim.step_seconds / step_time,
            peak_memory_bytes=sim.peak_memory_bytes,
            padding_fraction=sim.padding_fraction,
            image_token_share=sim.image_token_share,
            goodput=min(0.97, 0.5 + sim.step / 400),
            tokens_total=sim.tokens_per_step * sim.step,
            ranks=simulated_ranks(step_time, rng),
            **_rl_fields(sim.job.spec.kind, sim.step, rng),
            # a held-out eval at the first step and every 50th after (kitchen_eval_score)
            eval_scores=[{"task": "heldout", "metric": "loss", "value": loss + 0.1}]
            if sim.step % 50 == 1
            else [],
        )
        if sim.moe_experts:
            self._routing(sim, p)
        return p

    def _heartbeat(self, sim: SimulatedJob) -> progress_pb2.Progress:
        """A serve job's heartbeat (trainer/serve/server.py): load, KV blocks, window latency."""
        rng = self.rng
        running = rng.randint(4, 12)
        used = running * rng.randint(6, 10)
        ttft, itl = rng.uniform(0.05, 0.2), rng.uniform(0.01, 0.03)
        return progress_pb2.Progress(
            job_id=sim.job.id,
            attempt=sim.job.attempts,
            phase="serve",
            endpoint="http://127.0.0.1:8000",
            running_requests=running,
            waiting_requests=rng.randint(0, 3),
            kv_blocks_used=used,
            kv_blocks_free=256 - used,
            serve_preemptions=sim.step // 40,
            requests_finished=3 * sim.step,
            ttft_p50_seconds=ttft,
            ttft_p99_seconds=3 * ttft,
            itl_p50_seconds=itl,
            itl_p99_seconds=2 * itl,
            generated_tokens_per_second=running / itl,
            # A shared 512-token system prompt of ~600-token prompts: ~85% read from the cache.
            kv_blocks_shared=32,
            prompt_tokens=600 * 3 * sim.step,
            prefix_cached_tokens=512 * 3 * sim.step,
            spec_draft_tokens=40 * sim.step,  # prompt lookup: ~30% of drafts kept
            spec_accepted_tokens=12 * sim.step,
            grammar_seconds=0.02 * sim.step,  # 100 constrained tokens a step at 0.2 ms each
            grammar_tokens=100 * sim.step,
        )

    def _routing(self, sim: SimulatedJob, p: progress_pb2.Progress) -> None:
        """Two balanced MoE layers, top-2: loads within a few tens of percent of even."""
        for layer in (0, 1):
            loads = [self.rng.uniform(0.7, 1.4) for _ in range(sim.moe_experts)]
            mean = sum(loads) / len(loads)
            p.moe_layers.add(
                layer=layer,
                tokens_per_expert=[
                    int(x * sim.tokens_per_step * 2 / sim.moe_experts) for x in loads
                ],
                imbalance=max(loads) / mean,
                aux_loss=self.rng.uniform(1.0, 1.1),
                z_loss=self.rng.uniform(1.0, 4.0),
                router_entropy=self.rng.uniform(0.8, 0.95),
                micro_batch_imbalance=self.rng.uniform(1.5, 2.5),
            )
        p.moe_max_imbalance = max(s.imbalance for s in p.moe_layers)
        p.moe_min_router_entropy = min(s.router_entropy for s in p.moe_layers)
        p.moe_dropped_fraction = 0.0

    def tick(self) -> None:
        """One step of every job, one job leaving each pool's queue, one scheduler pass."""
        with self._lock:
            for sim in self.jobs:
                self.metrics.progress(sim.job, self.progress(sim))
            for pool in POOLS:
                wait = self.rng.expovariate(1 / 20)
                self.metrics.queue_wait.labels(pool, "ml").observe(wait)
            self.metrics.scheduler_pass.observe(self.rng.uniform(0.0004, 0.002))

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.tick()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
