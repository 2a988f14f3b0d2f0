"""loss.png: the train and eval loss curves of a run, from its metrics.jsonl."""

import io
from pathlib import Path

from protos import progress_pb2
from protos.files import write_atomic
from protos.progress_log import is_eval, last_per_step, read_progress_log


def loss_curves(records: list[progress_pb2.Progress]) -> tuple[dict, dict]:
    """{step: loss} for train and for eval, in step order. A step logged twice (redone after a
    restart or a rollback) keeps its last value: the curve the final weights followed."""
    train = {step: p.loss for step, p in last_per_step(records).items()}
    heldout = {step: p.eval_loss for step, p in last_per_step(records, is_eval).items()}
    return train, heldout


def plot_loss(run_dir) -> Path | None:
    """Write `<run_dir>/loss.png` (atomically); None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, heldout = loss_curves(read_progress_log(run_dir).records)
    if not train and not heldout:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if train:
        ax.plot(list(train), list(train.values()), label="train", color="tab:blue")
    if heldout:
        ax.plot(list(heldout), list(heldout.values()), "o-", label="eval", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(f"loss: {Path(run_dir).resolve().name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    path = Path(run_dir) / "loss.png"
    write_atomic(str(path), png.getvalue())
    return path
