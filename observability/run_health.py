"""What a person should notice about a finished (or running) run, from its per-step series.

The same shapes the Prometheus alerts watch for (docs/observability.md), with thresholds to
match: loss NaN or spiking, MFU sagging below its own level, slow steps (a checkpoint sawtooth
or a straggler), input stalls, low goodput, restarts. run_health_test.py holds each threshold
marked "as <alert>" equal to the number in that alert's expression.
"""

from typing import NamedTuple

import numpy as np

from observability.run_series import RunSeries

SPIKE_RATIO, SPIKE_MARGIN = 1.5, 0.5  # as KitchenLossSpike
SPIKE_WINDOW = 50  # logged steps before the one judged (the alert looks back 30 minutes)
SAG_RATIO = 0.7  # as KitchenMFUDrop
STEP_SLOWDOWN_RATIO = 1.5  # as KitchenStepTimeRegression
SLOW_STEP_RATIO = 2.0
DATA_STALL_SHARE = 0.1
GOODPUT_FLOOR = 0.8  # as KitchenGoodputLow


class Finding(NamedTuple):
    severity: str  # "problem" or "note"
    title: str
    detail: str


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _steps_text(steps) -> str:
    shown = ", ".join(str(int(s)) for s in steps[:5])
    return shown + (f" and {len(steps) - 5} more" if len(steps) > 5 else "")


def _loss_findings(steps, loss) -> list[Finding]:
    bad = ~np.isfinite(loss)
    if bad.any():
        return [
            Finding(
                "problem",
                "Loss is NaN or infinite",
                f"From step {int(steps[bad][0])} ({int(bad.sum())} logged steps). Everything "
                "after that is wasted: resume from an earlier checkpoint with a lower learning "
                "rate or stronger gradient clipping.",
            )
        ]
    spikes = []
    for i in range(10, len(loss)):
        median = float(np.median(loss[max(0, i - SPIKE_WINDOW) : i]))
        if loss[i] > SPIKE_RATIO * median and loss[i] - median > SPIKE_MARGIN:
            spikes.append(i)
    if not spikes:
        return []
    lasting = len(spikes) >= 3 and spikes[-1] == len(loss) - 1
    return [
        Finding(
            "problem" if lasting else "note",
            "Loss spikes",
            f"{len(spikes)} logged steps above {SPIKE_RATIO}x the median of the previous "
            f"{SPIKE_WINDOW} (steps {_steps_text(steps[spikes])}). "
            + (
                "The loss has not come back down: the run is diverging."
                if lasting
                else "Short spikes that recover are usually a few bad batches."
            ),
        )
    ]


def _mfu_findings(steps, mfu) -> list[Finding]:
    settled = mfu[len(mfu) // 10 :]  # the first tenth is warm-up and compilation
    if len(settled) < 20 or not np.any(settled > 0):
        return []
    level = float(np.median(settled))
    window = max(5, len(settled) // 20)
    blocks = settled[: len(settled) // window * window].reshape(-1, window)
    low = np.nonzero(np.median(blocks, axis=1) < SAG_RATIO * level)[0]
    if not len(low):
        return []
    first = int(steps[len(mfu) // 10 + low[0] * window])
    return [
        Finding(
            "problem",
            "MFU sagged",
            f"From around step {first} MFU stayed below {SAG_RATIO:.0%} of the run's own median "
            f"({level:.1%}) in {len(low)} of {len(blocks)} stretches of {window} logged steps: "
            "a slow node, throttling, input stalls or another job on the same machine.",
        )
    ]


def _step_time_findings(steps, step_time, data_time) -> list[Finding]:
    out = []
    median = float(np.median(step_time))
    slow = np.nonzero(step_time > SLOW_STEP_RATIO * median)[0]
    if len(slow) >= 3:
        gaps = np.diff(steps[slow])
        periodic = len(gaps) >= 2 and np.std(gaps) <= 0.1 * np.mean(gaps)
        detail = f"{len(slow)} steps took over {SLOW_STEP_RATIO:.0f}x the median {median:.3g} s"
        if periodic:
            detail += (
                f", every {np.mean(gaps):.0f} steps: a sawtooth, usually checkpoint saves. "
                "Save less often or asynchronously if it costs too much."
            )
        else:
            detail += f" (steps {_steps_text(steps[slow])}): stragglers or input stalls."
        out.append(Finding("note", "Slow steps", detail))
    tail = step_time[-max(5, len(step_time) // 5) :]
    if len(step_time) >= 50 and np.median(tail) > STEP_SLOWDOWN_RATIO * median:
        out.append(
            Finding(
                "problem",
                "Steps got slower",
                f"The last {len(tail)} steps took a median {np.median(tail):.3g} s against "
                f"{median:.3g} s for the run: a straggler, a degrading node or growing inputs.",
            )
        )
    share = float(np.median(data_time / np.maximum(step_time, 1e-12)))
    if share > DATA_STALL_SHARE:
        out.append(
            Finding(
                "problem",
                "Waiting for data",
                f"Loading input takes {share:.0%} of a median step: the accelerator idles. "
                "Precook the data, add loader workers or prefetch more batches.",
            )
        )
    return out


def findings(series: RunSeries) -> list[Finding]:
    """Problems first, then notes; empty for a healthy run."""
    v, steps = series.values, series.steps
    if not len(steps):
        return [Finding("problem", "No training steps", "The log has no training step yet.")]
    out = _loss_findings(steps, v["loss"]) + _mfu_findings(steps, v["mfu"])
    out += _step_time_findings(steps, v["step_time_seconds"], v["data_time_seconds"])
    goodput = v["goodput"][-1]
    if 0 < goodput < GOODPUT_FLOOR:
        # The trainer ends with a line breaking badput down; it says where the time went.
        breakdown = [m for _, _, m in series.events if m.startswith("goodput")]
        out.append(
            Finding(
                "problem",
                "Low goodput",
                f"Only {goodput:.0%} of wall time went into steps that count "
                f"(Kitchen's alert threshold is {GOODPUT_FLOOR:.0%})."
                + (f" The trainer's account: {breakdown[-1]}." if breakdown else ""),
            )
        )
    if series.restart_steps:
        out.append(
            Finding(
                "note",
                "Restarts",
                f"{_plural(len(series.restart_steps), 'restart')}, resumed at "
                f"{'step' if len(series.restart_steps) == 1 else 'steps'} "
                f"{_steps_text(series.restart_steps)}; {series.recomputed_steps} logged steps "
                "were computed again after resuming from a checkpoint.",
            )
        )
    return sorted(out, key=lambda f: f.severity != "problem")
