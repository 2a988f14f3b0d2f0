"""The launcher's Prometheus exporter (`/metrics`).

Per job (labels job_id, name, kind, pool, team; not `job`, which is Prometheus's scrape job),
from the trainer's progress reports: every metric of protos/metric_catalog.py, for the job kinds
its entry names and as it says (the latest value, the newest non-zero one, a counter, the
step-time histogram; RankHealth entries add labels rank and host, MoeLayerStats entries the label
layer). From the launcher's own events: kitchen_job_attempts_total,
kitchen_job_preemptions_total, and kitchen_eval_score{task,metric,step} (an eval job's scores,
one series per checkpoint step).
Launcher-wide: kitchen_jobs{state,pool}, kitchen_queue_depth{pool},
  kitchen_job_queue_wait_seconds{pool,team} (histogram), kitchen_scheduler_pass_duration_seconds
  (histogram), kitchen_pool_capacity{pool,resource}, kitchen_pool_in_use{pool,resource}.
Cardinality stays bounded: a finished job's series are dropped `retention` seconds after it ends,
and the `rank` label is bounded: only the RANK_SERIES_LIMIT ranks most worth a look (any that
lost a replica check, then the highest straggler scores; trainer/health/, docs/reliability.md)
are exported, so a 4,096-rank job adds 8 series per metric, not 4,096.
"""

import bisect
import math
import threading
import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from protos import job_pb2, metric_catalog, progress_pb2
from protos.enums import enum_name
from protos.metric_catalog import Series, Source

JOB_LABELS = ["job_id", "name", "kind", "pool", "team"]
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
WAIT_BUCKETS = (0.1, 0.5, 1, 5, 15, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 24 * 3600)
PASS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
RANK_LABELS = [*JOB_LABELS, "rank", "host"]
RANK_SERIES_LIMIT = 8
_LABELS = {
    Source.PROGRESS: JOB_LABELS,
    Source.RANK: RANK_LABELS,
    Source.MOE_LAYER: [*JOB_LABELS, "layer"],
}
_FAMILIES = {
    Series.COUNTER: CounterMetricFamily,
    Series.STEP_HISTOGRAM: HistogramMetricFamily,
}


class _StepHistogram:
    """A cumulative histogram fed one observation per step (the buckets count steps)."""

    def __init__(self):
        self.buckets = [0] * (len(STEP_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float, steps: int):
        self.buckets[bisect.bisect_left(STEP_BUCKETS, seconds)] += steps
        self.sum += steps * seconds

    def add_to(self, family: HistogramMetricFamily, labels: list):
        cumulative, total = [], 0
        for le, n in zip([*map(str, STEP_BUCKETS), "+Inf"], self.buckets, strict=True):
            total += n
            cumulative.append((le, total))
        family.add_metric(labels, cumulative, self.sum)


class _JobSeries:
    def __init__(self, labels, kind: int):
        self.labels = labels
        self.kind = kind  # job_pb2.JobKind: a catalog metric is exported for its kinds only
        self.progress: progress_pb2.Progress | None = None
        self.ranks: list[progress_pb2.RankHealth] = []  # the latest non-empty Progress.ranks
        self.reported: set[str] = set()  # Series.NAN_UNTIL_REPORTED fields seen non-zero
        self.newest: dict[str, float] = {}  # Series.NEWEST_NONZERO: newest non-zero per field
        self.moe: progress_pb2.Progress | None = None  # the latest with MoE statistics
        self.last_step = None
        self.histograms = {
            m.field: _StepHistogram()
            for m in metric_catalog.metrics(Source.PROGRESS, Series.STEP_HISTOGRAM)
        }
        self.attempt = None
        self.attempts = 0
        self.preemptions = 0
        self.finished_at = None
        self.eval_scores: dict[tuple[str, str, int], float] = {}  # (task, metric, step) -> value

    def value(self, m) -> float | None:
        """A Progress metric's value now, or None while it has none to export."""
        if m.series == Series.NEWEST_NONZERO:
            return self.newest.get(m.field)
        p = self.moe if m.series == Series.MOE else self.progress
        if p is None:
            return None
        if m.series == Series.NAN_UNTIL_REPORTED and m.field not in self.reported:
            return math.nan
        return getattr(p, m.field)

    def sources(self, source: Source) -> list:
        """(extra label values, message) of each RankHealth or MoeLayerStats series."""
        if source == Source.RANK:
            return [([str(r.rank), r.host], r) for r in ranks_to_export(self.ranks)]
        return [([str(layer.layer)], layer) for layer in self.moe.moe_layers] if self.moe else []


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
            labels = job_labels(job, self.job_names)
            series = self._jobs[job.id] = _JobSeries(labels, job.spec.kind)
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
            if series.last_step is None or p.step > series.last_step:
                # One observation per step since the last report, so counts are steps.
                steps = 1 if series.last_step is None else p.step - series.last_step
                for field, histogram in series.histograms.items():
                    if (seconds := getattr(p, field)) > 0:
                        histogram.observe(seconds, steps)
            series.last_step = p.step if series.last_step is None else max(p.step, series.last_step)
            for m in metric_catalog.metrics(Source.PROGRESS):
                if (value := getattr(p, m.field)) == 0:
                    continue
                if m.series == Series.NEWEST_NONZERO:
                    series.newest[m.field] = value
                elif m.series == Series.NAN_UNTIL_REPORTED:
                    series.reported.add(m.field)
            for score in p.eval_scores:  # an eval job's scores of the checkpoint at p.step
                series.eval_scores[(score.task, score.metric, p.step)] = score.value
            series.progress = p
            if p.ranks:
                series.ranks = list(p.ranks)
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
        yield from _catalog_families(jobs)
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
        yield from (attempts, preemptions, scores)

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


def _catalog_families(jobs):
    """One family per catalog metric, a sample per job (per rank or layer) that has a value."""
    for m in metric_catalog.CATALOG:
        family_type = _FAMILIES.get(m.series, GaugeMetricFamily)
        family = family_type(m.name, m.help, labels=_LABELS[m.source])
        for s in jobs:
            if s.progress is None or (m.kinds and s.kind not in m.kinds):
                continue
            if m.series == Series.STEP_HISTOGRAM:
                s.histograms[m.field].add_to(family, s.labels)
            elif m.source != Source.PROGRESS:
                for extra, message in s.sources(m.source):
                    family.add_metric([*s.labels, *extra], getattr(message, m.field))
            elif (value := s.value(m)) is not None:
                family.add_metric(s.labels, value)
        yield family
