"""The launcher's Prometheus exporter (`/metrics`).

Per job (labels job_id, name, kind, pool, team; not `job`, which is Prometheus's scrape job),
from the trainer's progress reports:
  kitchen_train_step_duration_seconds (histogram, one observation per step), kitchen_train_step,
  kitchen_train_total_steps, kitchen_train_loss, kitchen_train_eval_loss, kitchen_train_mfu_ratio,
  kitchen_train_tokens_total, kitchen_train_tokens_per_second, kitchen_train_goodput_ratio,
  kitchen_train_peak_memory_bytes, kitchen_train_padding_ratio, kitchen_train_grad_norm,
  kitchen_train_learning_rate, kitchen_job_attempts_total, kitchen_job_preemptions_total,
  kitchen_eval_score{task,metric,step} (an eval job's scores, one series per checkpoint step);
  for mixture-of-experts jobs the kitchen_train_moe_* series of launcher/moe_metrics.py.
Launcher-wide: kitchen_jobs{state,pool}, kitchen_queue_depth{pool},
  kitchen_job_queue_wait_seconds{pool,team} (histogram), kitchen_scheduler_pass_duration_seconds
  (histogram), kitchen_pool_capacity{pool,resource}, kitchen_pool_in_use{pool,resource}.
Cardinality stays bounded: a finished job's series are dropped `retention` seconds after it ends.

Per rank (the job's labels plus rank and host; trainer/health/, docs/reliability.md), from the
latest report's kitchen.v1.RankHealth: kitchen_train_rank_step_seconds,
kitchen_train_rank_data_seconds, kitchen_train_rank_collective_wait_seconds,
kitchen_train_rank_straggler_score, kitchen_train_rank_sdc_mismatches; and per job
kitchen_train_sdc_rollbacks_total. The `rank` label is bounded: only the RANK_SERIES_LIMIT ranks
most worth a look (any that lost a replica check, then the highest straggler scores) are
exported, so a 4,096-rank job adds 8 series per metric, not 4,096.
"""

import bisect
import math
import threading
import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from launcher import moe_metrics
from protos import job_pb2
from protos.enums import enum_name

JOB_LABELS = ["job_id", "name", "kind", "pool", "team"]
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
WAIT_BUCKETS = (0.1, 0.5, 1, 5, 15, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 24 * 3600)
PASS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
RANK_LABELS = [*JOB_LABELS, "rank", "host"]
RANK_SERIES_LIMIT = 8
# (metric, help, RankHealth field) of the per-rank gauges.
_RANK_GAUGES = [
    ("kitchen_train_rank_step_seconds", "Mean step time of one rank.", "step_time_seconds"),
    ("kitchen_train_rank_data_seconds", "Mean data time of one rank.", "data_time_seconds"),
    (
        "kitchen_train_rank_collective_wait_seconds",
        "Mean time per step one rank waits in collectives for its peers.",
        "collective_wait_seconds",
    ),
    (
        "kitchen_train_rank_straggler_score",
        "A rank's busy time (step minus collective wait) over the median rank's.",
        "straggler_score",
    ),
    (
        "kitchen_train_rank_sdc_mismatches",
        "Cross-replica checks a rank lost (its parameters or optimizer state differed).",
        "sdc_mismatches",
    ),
]
# (metric, help, Progress field) of the per-job gauges.
_GAUGES = [
    ("kitchen_train_step", "Latest reported optimizer step.", "step"),
    ("kitchen_train_total_steps", "Steps the job will run.", "total_steps"),
    ("kitchen_train_loss", "Training loss at the latest report.", "loss"),
    ("kitchen_train_eval_loss", "Latest evaluation loss (NaN before the first eval).", "eval_loss"),
    ("kitchen_train_mfu_ratio", "Model FLOPs utilization, 0-1.", "mfu"),
    ("kitchen_train_tokens_per_second", "Training throughput in tokens/s.", "tokens_per_second"),
    ("kitchen_train_goodput_ratio", "Share of wall time spent on useful steps, 0-1.", "goodput"),
    ("kitchen_train_peak_memory_bytes", "Peak accelerator memory.", "peak_memory_bytes"),
    ("kitchen_train_padding_ratio", "Share of batch tokens that are padding.", "padding_fraction"),
    ("kitchen_train_grad_norm", "Gradient norm before clipping.", "grad_norm"),
    ("kitchen_train_learning_rate", "Learning rate.", "lr"),
    (
        "kitchen_train_image_token_share_ratio",
        "VLM: image tokens / all tokens, 0-1.",
        "image_token_share",
    ),
    ("kitchen_train_comm_ratio", "Share of a step spent in collectives, 0-1.", "comm_fraction"),
    # A serve job's heartbeat (trainer/serve/); its latency histograms are on its own /metrics.
    ("kitchen_serve_running_requests", "Requests in a serve job's batch.", "running_requests"),
    ("kitchen_serve_waiting_requests", "Requests queued in a serve job.", "waiting_requests"),
    ("kitchen_serve_kv_blocks_used", "Paged KV-cache blocks in use.", "kv_blocks_used"),
    ("kitchen_serve_kv_blocks_free", "Paged KV-cache blocks free.", "kv_blocks_free"),
    ("kitchen_serve_job_preemptions", "Requests preempted for KV blocks.", "serve_preemptions"),
    ("kitchen_serve_ttft_p50_seconds", "Time to first token, median.", "ttft_p50_seconds"),
    ("kitchen_serve_ttft_p99_seconds", "Time to first token, p99.", "ttft_p99_seconds"),
    ("kitchen_serve_itl_p50_seconds", "Inter-token latency, median.", "itl_p50_seconds"),
    ("kitchen_serve_itl_p99_seconds", "Inter-token latency, p99.", "itl_p99_seconds"),
    (
        "kitchen_serve_generated_tokens_per_second",
        "Tokens a serve job generated per second.",
        "generated_tokens_per_second",
    ),
]
# #14 RLHF (REWARD, DPO, PPO jobs): exported once a job reports them, each holding its newest
# non-zero value (train and eval records carry different ones; other kinds have none).
_RL_GAUGES = [
    ("kitchen_rl_reward_mean", "PPO: mean reward of the latest rollout batch.", "reward_mean"),
    ("kitchen_rl_reward_std", "PPO: reward standard deviation in that batch.", "reward_std"),
    ("kitchen_rl_kl", "Mean per-response KL(policy || reference), nats.", "kl"),
    ("kitchen_rl_entropy", "PPO: mean per-token entropy of the policy's samples.", "entropy"),
    ("kitchen_rl_clip_ratio", "PPO: share of tokens whose ratio was clipped.", "clip_fraction"),
    ("kitchen_rl_value_loss", "PPO: value head loss.", "value_loss"),
    ("kitchen_rl_response_length_tokens", "Mean response length.", "response_length"),
    ("kitchen_rl_rollout_seconds", "PPO: generating a step's rollouts.", "rollout_seconds"),
    ("kitchen_rl_update_seconds", "PPO: a step's optimizer epochs.", "update_seconds"),
    (
        "kitchen_rl_preference_accuracy_ratio",
        "Chosen scored above rejected.",
        "preference_accuracy",
    ),
    ("kitchen_rl_margin", "Mean chosen minus rejected score.", "margin"),
    ("kitchen_rl_chosen_reward", "DPO: implicit reward of chosen responses.", "chosen_reward"),
    (
        "kitchen_rl_rejected_reward",
        "DPO: implicit reward of rejected responses.",
        "rejected_reward",
    ),
    ("kitchen_rl_pass_rate_ratio", "Verifier pass rate on held-out prompts.", "pass_rate"),
]


class _JobSeries:
    def __init__(self, labels):
        self.labels = labels
        self.progress = None
        self.ranks = []  # the latest non-empty Progress.ranks
        self.has_eval = False
        self.last_step = None
        self.buckets = [0] * (len(STEP_BUCKETS) + 1)
        self.step_seconds_sum = 0.0
        self.attempt = None
        self.attempts = 0
        self.preemptions = 0
        self.finished_at = None
        self.rl: dict[str, float] = {}  # _RL_GAUGES: newest non-zero value of each field
        self.moe = None  # the latest Progress with MoE statistics (launcher/moe_metrics.py)
        self.eval_scores: dict[tuple[str, str, int], float] = {}  # (task, metric, step) -> value


def job_labels(job: job_pb2.Job, names: bool = True) -> list:
    """Label values of a job's series; without `names` the name label repeats the job id (a
    shared launcher's /metrics does not tell every team what the others work on)."""
    kind = enum_name(job.spec, "kind").lower()
    return [job.id, job.spec.name if names else job.id, kind, job.pool, job.spec.team]


class LauncherMetrics:
    """Holds the series; `fleet` is a callable giving the launcher-wide numbers at scrape."""

    def __init__(
        self, retention_seconds: float, fleet=None, clock=time.time, job_names: bool = True
    ):
        self.registry = CollectorRegistry()
        self.job_names = job_names
        self.retention = retention_seconds
        self.clock = clock
        self.fleet = fleet
        self._lock = threading.Lock()
        self._jobs: dict[str, _JobSeries] = {}
        self.queue_wait = Histogram(
            "kitchen_job_queue_wait_seconds",
            "Time from entering the queue to starting, per attempt.",
            ["pool", "team"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.scheduler_pass = Histogram(
            "kitchen_scheduler_pass_duration_seconds",
            "Wall time of one scheduling pass.",
            buckets=PASS_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(self)

    def _series(self, job) -> _JobSeries:
        series = self._jobs.get(job.id)
        if series is None:
            series = self._jobs[job.id] = _JobSeries(job_labels(job, self.job_names))
        return series

    def attempt_started(self, job: job_pb2.Job, waited_seconds: float):
        self.queue_wait.labels(job.pool, job.spec.team).observe(max(waited_seconds, 0.0))
        with self._lock:
            series = self._series(job)
            series.attempts += 1
            series.finished_at = None

    def progress(self, job: job_pb2.Job, p):
        with self._lock:
            series = self._series(job)
            if p.attempt != series.attempt:  # a resumed attempt re-runs steps: count them again
                series.attempt, series.last_step = p.attempt, None
            if p.step_time_seconds > 0 and (series.last_step is None or p.step > series.last_step):
                # One observation per step since the last report, so counts are steps.
                steps = 1 if series.last_step is None else p.step - series.last_step
                i = bisect.bisect_left(STEP_BUCKETS, p.step_time_seconds)
                series.buckets[i] += steps
                series.step_seconds_sum += steps * p.step_time_seconds
            series.last_step = p.step if series.last_step is None else max(p.step, series.last_step)
            series.has_eval = series.has_eval or p.eval_loss != 0
            for score in p.eval_scores:  # an eval job's scores of the checkpoint at p.step
                series.eval_scores[(score.task, score.metric, p.step)] = score.value
            series.progress = p
            if p.ranks:
                series.ranks = list(p.ranks)
            series.rl.update((f, v) for _, _, f in _RL_GAUGES if (v := getattr(p, f)))
            if p.moe_layers:
                series.moe = p

    def attempt_ended(self, job: job_pb2.Job, preempted: bool):
        with self._lock:
            series = self._series(job)
            series.preemptions += int(preempted)
            if job.state in (job_pb2.SUCCEEDED, job_pb2.FAILED, job_pb2.CANCELLED):
                series.finished_at = self.clock()

    def collect(self):
        now = self.clock()
        with self._lock:
            for job_id in [
                j
                for j, s in self._jobs.items()
                if s.finished_at is not None and now - s.finished_at > self.retention
            ]:
                del self._jobs[job_id]
            jobs = list(self._jobs.values())
            yield from self._job_families(jobs)
        if self.fleet is not None:
            yield from self._fleet_families(self.fleet())

    def _job_families(self, jobs):
        gauges = {
            name: GaugeMetricFamily(name, doc, labels=JOB_LABELS)
            for name, doc, _ in _GAUGES + _RL_GAUGES
        }
        hist = HistogramMetricFamily(
            "kitchen_train_step_duration_seconds",
            "Wall time per optimizer step.",
            labels=JOB_LABELS,
        )
        tokens = CounterMetricFamily(
            "kitchen_train_tokens", "Tokens trained on so far.", labels=JOB_LABELS
        )
        attempts = CounterMetricFamily(
            "kitchen_job_attempts", "Attempts started (restarts = attempts - 1).", labels=JOB_LABELS
        )
        preemptions = CounterMetricFamily(
            "kitchen_job_preemptions", "Times the job was preempted.", labels=JOB_LABELS
        )
        scores = GaugeMetricFamily(
            "kitchen_eval_score",
            "An eval job's score of the checkpoint at `step`, per harness task and metric.",
            labels=[*JOB_LABELS, "task", "metric", "step"],
        )
        for s in jobs:
            for (task, metric, step), value in sorted(s.eval_scores.items()):
                scores.add_metric([*s.labels, task, metric, str(step)], value)
            attempts.add_metric(s.labels, s.attempts)
            preemptions.add_metric(s.labels, s.preemptions)
            p = s.progress
            if p is None:
                continue
            for name, _, field in _GAUGES:
                value = getattr(p, field)
                if field == "eval_loss" and not s.has_eval:
                    value = math.nan
                gauges[name].add_metric(s.labels, value)
            for name, _, field in _RL_GAUGES:
                if field in s.rl:
                    gauges[name].add_metric(s.labels, s.rl[field])
            tokens.add_metric(s.labels, p.tokens_total)
            cumulative, total = [], 0
            for le, n in zip([*map(str, STEP_BUCKETS), "+Inf"], s.buckets, strict=True):
                total += n
                cumulative.append((le, total))
            hist.add_metric(s.labels, cumulative, s.step_seconds_sum)
        yield from gauges.values()
        yield from (hist, tokens, attempts, preemptions, scores)
        yield from _rank_families(jobs)
        yield from moe_metrics.families([(s.labels, s.moe) for s in jobs], JOB_LABELS)

    def _fleet_families(self, fleet):
        jobs = GaugeMetricFamily(
            "kitchen_jobs", "Jobs in the store by state.", labels=["state", "pool"]
        )
        # Every state of every pool, 0 included: "nothing running" must read 0, not no data.
        pools = sorted(set(fleet["pools"]) | {pool for _, pool in fleet["counts"]})
        states = [s for s in job_pb2.JobState.values() if s != job_pb2.JOB_STATE_UNSPECIFIED]
        for pool in pools:
            for state in states:
                n = fleet["counts"].get((state, pool), 0)
                jobs.add_metric([job_pb2.JobState.Name(state), pool], n)
        depth = GaugeMetricFamily("kitchen_queue_depth", "Jobs waiting to start.", labels=["pool"])
        capacity = GaugeMetricFamily(
            "kitchen_pool_capacity", "Pool size.", labels=["pool", "resource"]
        )
        in_use = GaugeMetricFamily(
            "kitchen_pool_in_use", "Held by running jobs.", labels=["pool", "resource"]
        )
        for pool, usage in sorted(fleet["pools"].items()):
            depth.add_metric([pool], fleet["queued"].get(pool, 0))
            for resource in ("nodes", "gpus"):
                capacity.add_metric([pool, resource], usage[f"{resource}_capacity"])
                in_use.add_metric([pool, resource], usage[f"{resource}_in_use"])
        yield from (jobs, depth, capacity, in_use)

    def describe(self):
        return []  # collected on demand only: series come and go with jobs


def ranks_to_export(ranks: list) -> list:
    """At most RANK_SERIES_LIMIT RankHealth: those that lost a replica check, then the highest
    straggler scores (ties: the lower rank)."""
    ordered = sorted(ranks, key=lambda r: (-(r.sdc_mismatches > 0), -r.straggler_score, r.rank))
    return ordered[:RANK_SERIES_LIMIT]


def _rank_families(jobs):
    gauges = {n: GaugeMetricFamily(n, doc, labels=RANK_LABELS) for n, doc, _ in _RANK_GAUGES}
    rollbacks = CounterMetricFamily(
        "kitchen_train_sdc_rollbacks",
        "Rollbacks after data-parallel replicas disagreed (silent data corruption).",
        labels=JOB_LABELS,
    )
    for s in jobs:
        if s.progress is None:
            continue
        rollbacks.add_metric(s.labels, s.progress.sdc_rollbacks)
        for r in ranks_to_export(s.ranks):
            for name, _, field in _RANK_GAUGES:
                gauges[name].add_metric([*s.labels, str(r.rank), r.host], getattr(r, field))
    yield from gauges.values()
    yield rollbacks
