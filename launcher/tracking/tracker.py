"""The launcher's MLflow writer: every job's run, fed by the progress the launcher already gets.

Why here: the launcher receives every job's progress over gRPC (ReportProgress) and knows the
job as run (spec, team, owner, image, run directory), for every executor (local, Slurm,
Kubernetes, images); a trainer has no team experiment to write to, may run where MLflow is not
reachable, and would need a tracking dependency in its image. A run started by hand has only its
run directory: `kitchen track import RUN_DIR` sends its metrics.jsonl with the same records.

Tracking never holds training back. The controller's calls only append to memory (or write one
small spool file, for a job's start and end); a thread of its own spools the buffered values
every `flush_seconds` (launcher/tracking/spool.py: durable, bounded) and sends what is spooled,
oldest first. While MLflow is down, slow or refusing connections, batches wait in the spool,
a warning is logged once per outage, kitchen_tracking_send_failures_total counts the failed
sends, and sending resumes (backing off up to 30 s) when it answers again. A batch the server
refuses outright (a 4xx answer) is moved to spool/rejected/ with a warning rather than retried
for ever. Values buffered in memory since the last flush are lost if the launcher dies; the run
directory's metrics.jsonl still has them.
"""

import logging
import os
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from launcher.tracking import records
from launcher.tracking.sink import MlflowSink, Refused
from launcher.tracking.spool import Batch, Spool, SpoolError
from protos import job_pb2, launcher_pb2, progress_pb2
from protos.paths import tracking_dir

log = logging.getLogger("kitchen.tracking")
MAX_BACKOFF_SECONDS = 30.0
STATUS = {  # a final JobState -> MLflow's RunStatus
    job_pb2.SUCCEEDED: "FINISHED",
    job_pb2.FAILED: "FAILED",
    job_pb2.CANCELLED: "KILLED",
}


class Tracker:
    def __init__(
        self,
        cfg: launcher_pb2.LauncherConfig,
        registry: CollectorRegistry,
    ):
        """`cfg`: the resolved launcher config (its tracking.uri is not "none")."""
        self.cfg = cfg
        self.flush_seconds = cfg.tracking.flush_seconds
        self.spool = Spool(
            os.path.join(tracking_dir(cfg.state_dir), "spool"), cfg.tracking.spool_max_bytes
        )
        self._sink: MlflowSink | None = None  # made in the thread: importing mlflow takes seconds
        self._lock = threading.Lock()
        self._buffer: dict[str, Batch] = {}  # job id -> values not yet spooled
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing_since: float | None = None
        self._backoff = 0.0
        self.failures = Counter(
            "kitchen_tracking_send_failures", "Sends to MLflow that failed (server down, slow "
            "or refusing); the records wait in the spool.", registry=registry,
        )  # fmt: skip
        self.dropped = Counter(
            "kitchen_tracking_dropped_batches", "Spooled batches dropped to keep the spool "
            "under tracking.spool_max_bytes, or refused by the server.", registry=registry,
        )  # fmt: skip
        self.waiting = Gauge(
            "kitchen_tracking_spooled_batches", "Batches waiting in the spool for MLflow.",
            registry=registry,
        )  # fmt: skip
        self.waiting.set_function(lambda: len(self.spool.pending()))

    # ---------------------------------------------------------------- the controller's calls

    def job_started(self, job: job_pb2.Job) -> None:
        """An attempt started: the run's identity, params and resolved config (again on a
        retry: same values, and a launcher restarted mid-job re-finds the run)."""
        spec = records.spec_params(job.spec)
        batch = Batch(
            job.id, records.experiment_name(job.spec.team), records.job_tags(job), spec,
            documents={"config/job_spec.json": spec},
        )  # fmt: skip
        self._put(batch)

    def progress(self, job: job_pb2.Job, p: progress_pb2.Progress) -> None:
        """One report as the trainer sent it (not merged: an eval report carries eval values
        only). Memory only: the thread spools it within flush_seconds."""
        points = records.progress_points(p, job.spec.kind, int(time.time() * 1000))
        if not points:
            return
        with self._lock:
            batch = self._buffer.get(job.id)
            if batch is None:
                batch = self._buffer[job.id] = Batch(job.id, records.experiment_name(job.spec.team))
            batch.points.extend(points)

    def job_ended(self, job: job_pb2.Job) -> None:
        """A final state: the values still buffered, then the plots, checkpoint manifests,
        profile, the digests and commit from the run directory, and the run's status."""
        status = STATUS.get(job.state)
        if status is None:  # preempted or retried: the run goes on
            return
        self._flush_buffer()
        artifacts = records.run_artifacts(job.run_dir)
        tags = records.run_dir_tags(job.run_dir)
        experiment = records.experiment_name(job.spec.team)
        self._put(Batch(job.id, experiment, tags, artifacts=artifacts, status=status))

    # ---------------------------------------------------------------- the thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kitchen-tracking", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Spool what is buffered and try one last send, for at most `timeout` seconds (a
        failing send gives up after one request, 10 s at most); what is left stays in the
        spool for the next start."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._flush_buffer()

    def _put(self, batch: Batch) -> None:
        dropped = self.spool.put(batch)
        if dropped:
            self.dropped.inc(dropped)
            log.warning(
                "tracking: spool over %d bytes: dropped the %d oldest batches (metrics.jsonl "
                "in each run directory still has every step)", self.spool.max_bytes, dropped,
            )  # fmt: skip
        self._wake.set()

    def _flush_buffer(self) -> None:
        with self._lock:
            batches, self._buffer = list(self._buffer.values()), {}
        for batch in batches:
            self._put(batch)

    def _connect(self) -> None:
        """Import mlflow and reach the store (an embedded one creates its tables: ~10-25 s on a
        loaded 2-core machine), once, at start: not while a job's last records wait."""
        if self._sink is None:
            sink = MlflowSink(self.cfg.tracking.uri, self.cfg.state_dir)
            sink.client.search_experiments(max_results=1)
            self._sink = sink

    def _run(self) -> None:
        try:
            self._connect()
        except Exception as err:  # noqa: BLE001 (down now: drain() tries again)
            self._failed(err)
        while not self._stopping.is_set():
            self._wake.wait(max(self.flush_seconds, self._backoff))
            self._wake.clear()
            self._flush_buffer()
            self.drain()

    def drain(self) -> int:
        """Send the spooled batches, oldest first, until one fails; returns how many went."""
        sent = 0
        for path in self.spool.pending():
            try:
                self._connect()
                assert self._sink is not None
                batch = self.spool.load(path)
                self._sink.send(batch)
            except SpoolError as err:
                self._reject(path, str(err))
                continue
            except Refused as err:
                self._reject(path, str(err))
                continue
            except Exception as err:  # noqa: BLE001 (whatever MLflow raises, training goes on)
                self._failed(err)
                return sent
            self.spool.remove(path)
            sent += 1
        if self._failing_since is not None and sent:
            log.warning(
                "tracking: MLflow at %s answers again after %.0f s; spooled batches sent",
                self.cfg.tracking.uri, time.time() - self._failing_since,
            )  # fmt: skip
            self._failing_since = None
        self._backoff = 0.0
        return sent

    def _failed(self, err: Exception) -> None:
        self.failures.inc()
        self._backoff = min(MAX_BACKOFF_SECONDS, max(self.flush_seconds, 2 * self._backoff))
        if self._failing_since is None:
            self._failing_since = time.time()
            if isinstance(err, ImportError):  # a Python without mlflow(-skinny) installed
                log.warning(
                    "tracking: %s in this launcher's Python: set tracking.uri: none in its "
                    "config, or install mlflow; records wait in %s", err, self.spool.dir,
                )  # fmt: skip
                return
            log.warning(
                "tracking: cannot send to MLflow at %s (%s: %s); jobs run on, records wait in "
                "%s and are sent when it answers", self.cfg.tracking.uri, type(err).__name__,
                str(err).splitlines()[0][:200] if str(err) else "", self.spool.dir,
            )  # fmt: skip

    def _reject(self, path: str, reason: str) -> None:
        rejected = os.path.join(self.spool.dir, "rejected")
        os.makedirs(rejected, exist_ok=True)
        os.replace(path, os.path.join(rejected, os.path.basename(path)))
        self.dropped.inc()
        log.warning("tracking: MLflow refused %s, kept in %s: %s", path, rejected, reason[:300])
