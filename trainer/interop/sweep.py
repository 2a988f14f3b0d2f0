"""A sweep: every checkpoint of a run (or of several runs) evaluated, score against step.

`trainer.eval.sweep` names a run directory (its checkpoints/), a checkpoints directory, or a
directory of runs (each subdirectory with checkpoints/). The EVAL job evaluates each valid
checkpoint in step order, reports each as it goes (metrics.jsonl, the launcher, Prometheus),
and writes sweep.json (one row per checkpoint) and sweep.png (one panel per task and metric,
a line per run) in its run directory.
"""

import io
import math
from pathlib import Path

from protos.config_yaml import ConfigError
from protos.files import write_atomic, write_json_atomic
from trainer import checkpoint
from trainer.interop.harness import TaskScore

FIELD = "trainer.eval.sweep"


def sweep_targets(root: Path) -> list[tuple[str, Path]]:
    """(run name, checkpoint dir) of every checkpoint under `root`, runs by name, then step."""
    if (root / "checkpoints").is_dir():
        runs = [(root.name, root / "checkpoints")]
    elif checkpoint.checkpoints(root):
        runs = [(root.parent.name, root)]
    elif root.is_dir():
        runs = [
            (d.name, d / "checkpoints")
            for d in sorted(root.iterdir())
            if (d / "checkpoints").is_dir()
        ]
    else:
        raise ConfigError(FIELD, f"{root} is not a directory")
    found = [(name, path) for name, ckpts in runs for path in checkpoint.checkpoints(ckpts)]
    if not found:
        raise ConfigError(FIELD, f"no checkpoints (step_*) in {root}, its checkpoints/ or its runs")
    return found


def write_sweep(run_dir: Path, rows: list[dict]) -> Path:
    """sweep.json and sweep.png in `run_dir`; the png's path."""
    if not rows:
        raise ConfigError(FIELD, "every checkpoint found was damaged: nothing evaluated")
    write_json_atomic(str(run_dir / "sweep.json"), rows)
    return plot_sweep(rows, run_dir / "sweep.png")


def plot_sweep(rows: list[dict], path: Path) -> Path:
    """One panel per (task, metric), score against step, a line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for row in rows:
        for key, value in row["scores"].items():
            if not math.isnan(value):
                series.setdefault(key, {}).setdefault(row["run"], []).append((row["step"], value))
    cols = min(3, len(series))
    lines = -(-len(series) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(4.5 * cols, 3.2 * lines), dpi=100, squeeze=False)
    for ax in axes.flat[len(series) :]:
        ax.axis("off")
    for ax, (key, runs) in zip(axes.flat, sorted(series.items()), strict=False):
        for run, points in sorted(runs.items()):
            steps, values = zip(*sorted(points), strict=True)
            ax.plot(steps, values, "o-", label=run)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_atomic(str(path), png.getvalue())
    return path


def row(run: str, path: Path, step: int, scores: list[TaskScore]) -> dict:
    return {
        "run": run,
        "checkpoint": str(path),
        "step": step,
        "scores": {f"{s.task}/{s.metric}": s.value for s in scores},
    }
