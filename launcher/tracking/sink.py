"""Sends tracking batches to MLflow (a tracking server or a local sqlite store), in bulk.

One experiment per team (records.experiment_name); one run per job, found again by its
`kitchen.job_id` tag, so a launcher restarted mid-job (or a batch sent twice) keeps writing
the same run. Values go in `log_batch` calls of at most MLflow's per-request limits, never one
call per value (400 values one by one took 112 s on a loaded 2-core machine).

mlflow is imported here only: the rest of the launcher runs without it.
"""

import os

from launcher.tracking.records import JOB_ID_TAG
from launcher.tracking.spool import Batch
from protos.paths import tracking_dir

# MLflow's per-request limits (mlflow/utils/validation.py).
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100
# A down server must fail a send fast (the sender retries on its own schedule), not after
# MLflow's default of 7 retries with backoff (minutes) or its 120 s timeout.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


class Refused(Exception):
    """The server answered and refused the batch (4xx): sending it again cannot help."""


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


class MlflowSink:
    def __init__(self, uri: str, state_dir: str = ""):
        from mlflow.tracking import MlflowClient  # noqa: PLC0415 (optional at import)

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        # A local store keeps artifacts beside itself (else MLflow writes ./mlruns in the cwd).
        self.artifact_root = (
            os.path.join(tracking_dir(state_dir), "artifacts")
            if uri.startswith("sqlite:") and state_dir
            else None
        )
        self._experiments: dict[str, str] = {}
        self._runs: dict[str, str] = {}  # job id -> MLflow run id

    def experiment_id(self, name: str) -> str:
        if name not in self._experiments:
            found = self.client.get_experiment_by_name(name)
            if found is None:
                location = (
                    os.path.join(self.artifact_root, name.replace("/", "_"))
                    if self.artifact_root
                    else None
                )
                self._experiments[name] = self.client.create_experiment(name, location)
            else:
                self._experiments[name] = found.experiment_id
        return self._experiments[name]

    def run_id(self, batch: Batch, create: bool = True) -> str | None:
        """The run of `batch`'s job; made if there is none and `create`, else None."""
        if batch.job_id not in self._runs:
            if not create and self.client.get_experiment_by_name(batch.experiment) is None:
                return None
            experiment = self.experiment_id(batch.experiment)
            found = self.client.search_runs(
                [experiment], f"tags.`{JOB_ID_TAG}` = '{batch.job_id}'", max_results=1
            )
            if found:
                self._runs[batch.job_id] = found[0].info.run_id
            elif not create:
                return None
            else:
                run = self.client.create_run(experiment, tags={JOB_ID_TAG: batch.job_id})
                self._runs[batch.job_id] = run.info.run_id
        return self._runs[batch.job_id]

    def send(self, batch: Batch) -> str:
        """Write all of `batch`; returns the run id. Raises Refused on a 4xx answer, anything
        else (connection refused, timeout, 5xx) as it came."""
        from mlflow.entities import Metric, Param, RunTag  # noqa: PLC0415
        from mlflow.exceptions import RestException  # noqa: PLC0415

        try:
            run = self.run_id(batch)
            assert run is not None  # made if missing
            tags = [RunTag(k, v) for k, v in batch.tags.items()]
            params = [Param(k, v) for k, v in batch.params.items()]
            metrics = [Metric(p.key, p.value, p.timestamp_ms, p.step) for p in batch.points]
            for chunk in _chunks(tags, MAX_TAGS):
                self.client.log_batch(run, tags=chunk)
            for chunk in _chunks(params, MAX_PARAMS):
                self.client.log_batch(run, params=chunk)
            for chunk in _chunks(metrics, MAX_METRICS):
                self.client.log_batch(run, metrics=chunk)
            for path, directory in batch.artifacts:
                if os.path.isfile(path):  # a plot not drawn (the job failed early) is no error
                    self.client.log_artifact(run, path, directory or None)
            for artifact_file, document in batch.documents.items():
                self.client.log_dict(run, document, artifact_file)
            if batch.status:
                self.client.set_terminated(run, batch.status)
            return run
        except RestException as err:
            status = err.get_http_status_code()
            if 400 <= status < 500 and status != 429:
                raise Refused(str(err)) from err
            raise
