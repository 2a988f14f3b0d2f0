"""`kitchen diff A B`: everything that decides two runs, side by side, and where their losses part.

What decides a run: its spec as run (every config field, defaults applied: records.spec_params,
the same params its MLflow run holds, so the data sources, the seed and the checkpoint it starts
from are among them), the code's commit, the image it ran in, the precooked dataset it read and
the checkpoints it wrote (their digests): the MLflow run's tags, from the run directory.

Where the losses part: over the steps both logged, the first step from which |loss_A - loss_B|
stays above PART_SIGMAS times the noise for PART_STEPS logged steps in a row. The noise of one
curve is the spread of its jitter around its own trend (`_noise`: robust, from second
differences); the two curves' noises add in quadrature. Equal runs on one machine are
bitwise equal (docs: determinism is per machine), and then no step parts.
"""

import json
import math
import statistics
from dataclasses import dataclass

from launcher.tracking import records
from launcher.tracking.run_dir import Run

PART_SIGMAS = 3.0
PART_STEPS = 3  # a single spike is not a parting
MIN_SHARED_STEPS = 5


@dataclass(frozen=True)
class Difference:
    field: str
    a: str
    b: str


@dataclass(frozen=True)
class Parting:
    shared_steps: int
    noise: float  # the difference's standard deviation, loss units
    step: int | None  # the first step they part at; None: they never do
    gap: float  # |A - B| at that step (0 when they never part)
    identical: bool  # every shared value bitwise equal


@dataclass(frozen=True)
class RunDiff:
    a: Run
    b: Run
    identity: list[Difference]  # job, run dir, image (all shown)
    config: list[Difference]  # fields that differ
    fields_compared: int
    loss: Parting | None  # None: fewer than MIN_SHARED_STEPS shared steps


def _identity(run: Run) -> dict[str, str]:
    tags = {**records.job_tags(run.job), **records.run_dir_tags(run.job.run_dir)}
    digest = tags.get("kitchen.dataset_digest", "-")
    return {
        "job": tags.get(records.JOB_ID_TAG, "-"),
        "run dir": run.job.run_dir,
        "code commit": tags.get("kitchen.git_commit", "-"),
        "image": tags.get("kitchen.image", "(host)"),
        "image digest": tags.get("kitchen.image_digest", "-"),
        "dataset digest": digest[:12] if digest != "-" else digest,  # as git shortens commits
        "last checkpoint": _last_checkpoint(tags),
    }


def _last_checkpoint(tags: dict[str, str]) -> str:
    """`step_00000020 model.pt 08a901bdbb97 train.pt 5ad75670d908` (sha256 prefixes, as git
    shortens commits), or "-"."""
    names = sorted(k for k in tags if k.startswith("kitchen.checkpoint."))
    if not names:
        return "-"
    digests = json.loads(tags[names[-1]])
    files = " ".join(f"{name} {digest[:12]}" for name, digest in digests.items())
    return f"{names[-1].rsplit('.', 1)[1]} {files}"


def _noise(values: list[float]) -> float:
    """The standard deviation of a curve's jitter: second differences cancel a locally straight
    trend (for white noise their variance is 6 sigma^2), and their median absolute deviation
    (x 1.4826 for a normal spread) ignores the few steps where the curve bends hard (the first
    steps of training)."""
    second = [a - 2 * b + c for a, b, c in zip(values, values[1:], values[2:], strict=False)]
    if len(second) < 2:
        return 0.0
    middle = statistics.median(second)
    mad = statistics.median(abs(x - middle) for x in second)
    return 1.4826 * mad / math.sqrt(6)


def loss_parting(a: dict[int, float], b: dict[int, float]) -> Parting | None:
    shared = sorted(set(a) & set(b))
    if len(shared) < MIN_SHARED_STEPS:
        return None
    va, vb = [a[s] for s in shared], [b[s] for s in shared]
    noise = math.hypot(_noise(va), _noise(vb))
    identical = va == vb
    run = 0
    for i in range(len(shared)):
        gap = abs(va[i] - vb[i])
        run = run + 1 if gap > PART_SIGMAS * noise and not identical else 0
        if run == PART_STEPS:
            first = shared[i - PART_STEPS + 1]
            return Parting(len(shared), noise, first, abs(a[first] - b[first]), identical)
    return Parting(len(shared), noise, None, 0.0, identical)


def _curve(run: Run, key: str = "loss") -> dict[int, float]:
    return {p.step: p.value for p in run.points if p.key == key}


def compare(a: Run, b: Run) -> RunDiff:
    ia, ib = _identity(a), _identity(b)
    identity = [Difference(k, ia[k], ib[k]) for k in ia]
    pa, pb = records.spec_params(a.job.spec), records.spec_params(b.job.spec)
    fields = sorted(set(pa) | set(pb))
    config = [
        Difference(f, pa.get(f, "-"), pb.get(f, "-")) for f in fields if pa.get(f) != pb.get(f)
    ]
    return RunDiff(a, b, identity, config, len(fields), loss_parting(_curve(a), _curve(b)))


def _table(rows: list[Difference]) -> list[str]:
    width = max([len(r.field) for r in rows] + [5])
    col = max([len(r.a) for r in rows] + [1])
    return [f"  {r.field:<{width}}  {r.a:<{col}}  {r.b}" for r in rows]


def render(d: RunDiff) -> str:
    lines = ["run", *_table([Difference("", "A", "B"), *d.identity])]
    lines.append(f"config: {len(d.config)} of {d.fields_compared} fields differ (defaults applied)")
    lines += _table(d.config) if d.config else ["  (none)"]
    p = d.loss
    if p is None:
        lines.append(f"loss: fewer than {MIN_SHARED_STEPS} steps logged by both: not compared")
    elif p.identical:
        lines.append(f"loss: identical at all {p.shared_steps} shared steps (bitwise)")
    elif p.step is None:
        lines.append(
            f"loss: within {PART_SIGMAS:g} x noise ({p.noise:.4f}) at all {p.shared_steps} "
            "shared steps: the curves do not part"
        )
    else:
        lines.append(
            f"loss: the curves part at step {p.step}: |A - B| = {p.gap:.4f} > {PART_SIGMAS:g} x "
            f"noise ({p.noise:.4f}) for {PART_STEPS}+ logged steps ({p.shared_steps} shared)"
        )
    return "\n".join(lines) + "\n"
