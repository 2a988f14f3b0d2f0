"""What a job's MLflow run holds, computed from Kitchen's own messages; no MLflow here.

- params: the job spec as run, defaults applied (protos/defaults.py), flattened to dotted names
  (`trainer.optim.lr`); a repeated field is one param holding its JSON;
- metrics: each kitchen.v1.Progress field that protos/metric_catalog.py lists for the job's kind
  (the one metric table: the same fields the Prometheus exporter exports), keyed by field name,
  plus an eval job's scores as `eval/<task>/<metric>`. A report carries only what it measured
  (proto3: 0 is "not in this report"), so zero values are not logged;
- tags: who and what (`kitchen.job_id`, kind, team, owner, image) and what decides a run:
  the image digest when the reference pins one; from the run directory (`run_dir_tags`), each
  checkpoint's file digests and what the trainer recorded in provenance.json (protos/
  provenance.py): the git commit of the code it ran (also as MLflow's own
  `mlflow.source.git.commit`, which the run page shows) and the precooked dataset's digest;
- artifacts: the plots, each checkpoint's manifest, and a profile's traces and table.
"""

import json
import os
from dataclasses import asdict, dataclass

from google.protobuf import json_format

from protos import defaults, job_pb2, metric_catalog, progress_pb2, provenance
from protos.enums import enum_name
from protos.metric_catalog import Source
from protos.paths import PROFILE_DIR, checkpoint_dirs

JOB_ID_TAG = "kitchen.job_id"
AXIS_FIELDS = ("step", "total_steps")  # MLflow's x axis (every value's step), not metrics
# MLflow's own limits (mlflow/utils/validation.py): longer values are refused by the server.
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000


@dataclass(frozen=True)
class Point:
    """One metric value: MLflow's (key, value, timestamp, step)."""

    key: str
    value: float
    step: int
    timestamp_ms: int

    def to_json(self) -> dict:
        return asdict(self)


def experiment_name(team: str) -> str:
    """One experiment per team (an unteamed job's: `kitchen/default`)."""
    return f"kitchen/{team or 'default'}"


def _flatten(prefix: str, value, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else key, item, out)
        return
    text = json.dumps(value) if isinstance(value, list) else str(value)
    if len(text) > MAX_PARAM_VALUE:  # a long list of sources: the head, said so
        text = text[: MAX_PARAM_VALUE - 20] + "...(truncated)"
    out[prefix] = text


def world_size(spec: job_pb2.JobSpec) -> int:
    r = spec.resources
    return (r.nodes or 1) * (r.processes_per_node or 1)


def spec_params(spec: job_pb2.JobSpec) -> dict[str, str]:
    """The spec as run, every default applied, as {dotted field: value}."""
    run = job_pb2.JobSpec()
    run.CopyFrom(spec)
    run.trainer.CopyFrom(defaults.with_defaults(spec.trainer, world_size(spec)))
    tree = json_format.MessageToDict(
        run, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    out: dict[str, str] = {}
    _flatten("", tree, out)
    return dict(sorted(out.items()))


def job_tags(job: job_pb2.Job) -> dict[str, str]:
    s = job.spec
    tags = {
        JOB_ID_TAG: job.id,
        "kitchen.kind": enum_name(s, "kind").lower(),
        "kitchen.team": s.team,
        "kitchen.owner": s.owner,
        "kitchen.run_dir": job.run_dir,
        "mlflow.user": s.owner,
        "mlflow.runName": s.name or job.id,
    }
    if s.image:
        tags["kitchen.image"] = s.image
        if "@sha256:" in s.image:  # a reference by tag names no digest: none is claimed
            tags["kitchen.image_digest"] = s.image.rsplit("@", 1)[1]
    return {k: v[:MAX_TAG_VALUE] for k, v in tags.items() if v}


def checkpoint_tags(run_dir: str) -> dict[str, str]:
    """`kitchen.checkpoint.<step dir>`: the sha256 of each file of each checkpoint's meta.json
    (trainer/checkpoint.py writes it; read here as JSON: the launcher has no torch)."""
    tags = {}
    for path in checkpoint_dirs(run_dir):
        name = os.path.basename(path)
        try:
            with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
                files = json.load(f).get("files", {})
        except (OSError, ValueError, AttributeError):
            continue  # being written, or damaged: trainer/checkpoint.py skips it too
        digests = {k: v.get("sha256", "") for k, v in sorted(files.items()) if isinstance(v, dict)}
        tags[f"kitchen.checkpoint.{name}"] = json.dumps(digests)[:MAX_TAG_VALUE]
    return tags


def provenance_tags(run_dir: str) -> dict[str, str]:
    """The code's commit and the dataset's digest, as the trainer recorded them."""
    facts = provenance.read(run_dir)
    tags = {}
    code = [c for c in facts.get("code", []) if isinstance(c, dict)]
    if code:
        newest = code[-1]
        tags["kitchen.git_commit"] = str(newest.get("commit") or "unknown")
        tags["kitchen.code"] = str(newest.get("how", ""))
        if newest.get("commit"):
            tags["mlflow.source.git.commit"] = str(newest["commit"])
        if len(code) > 1:  # attempts that ran different code
            tags["kitchen.git_commits"] = json.dumps(
                [{"attempt": c.get("attempt"), "commit": c.get("commit")} for c in code]
            )
    dataset = facts.get("dataset")
    if isinstance(dataset, dict):
        tags["kitchen.dataset"] = str(dataset.get("path", ""))
        tags["kitchen.dataset_digest"] = str(dataset.get("digest", ""))
    return {k: v[:MAX_TAG_VALUE] for k, v in tags.items() if v}


def run_dir_tags(run_dir: str) -> dict[str, str]:
    """Every tag read from the run directory: checkpoint digests and provenance."""
    return {**checkpoint_tags(run_dir), **provenance_tags(run_dir)} if run_dir else {}


def run_artifacts(run_dir: str) -> list[tuple[str, str]]:
    """(file, artifact directory) a finished run uploads: its plots, each checkpoint's
    meta.json (the manifest: files, digests, step; never the weights) and a profile's files
    (trainer.profile: every rank's Chrome trace, the table)."""
    if not run_dir or not os.path.isdir(run_dir):
        return []
    out = [(os.path.join(run_dir, n), "plots") for n in sorted(os.listdir(run_dir))]
    out = [(path, d) for path, d in out if path.endswith(".png")]
    for path in checkpoint_dirs(run_dir):
        out.append((os.path.join(path, "meta.json"), f"checkpoints/{os.path.basename(path)}"))
    profile = os.path.join(run_dir, PROFILE_DIR)
    if os.path.isdir(profile):  # not a save's .tmp file (dot-named)
        names = sorted(n for n in os.listdir(profile) if not n.startswith("."))
        out += [(os.path.join(profile, n), PROFILE_DIR) for n in names]
    return out


def progress_points(p: progress_pb2.Progress, kind: int, timestamp_ms: int) -> list[Point]:
    """The metric values one report carries, for a job of `kind` (a job_pb2.JobKind)."""
    points = []
    for m in metric_catalog.metrics(Source.PROGRESS):
        if (m.kinds and kind not in m.kinds) or m.field in AXIS_FIELDS:
            continue
        value = getattr(p, m.field)
        if value:
            points.append(Point(m.field, float(value), p.step, timestamp_ms))
    for score in p.eval_scores:
        points.append(Point(f"eval/{score.task}/{score.metric}", score.value, p.step, timestamp_ms))
    return points
