"""Where a profiled step's time goes, read from the Chrome trace trainer/step_profiler.py saved.

Torch-free: it reads the trace file (JSON), so the table can be recomputed from the artifact
alone. The trace's training thread holds the annotations `kitchen/step N` (one whole step) and
`kitchen/data_wait` (reading its micro-batches); what the table says, per profiled step:

- step time: the mean wall time of the `kitchen/step` spans;
- data-loader wait: the `kitchen/data_wait` spans, as a share of the step;
- communication: the time a collective was in flight (gloo's and NCCL's own spans on whatever
  thread runs them, c10d's calls, NCCL's kernels), their union within the steps outside the
  data wait: on DDP it overlaps the backward pass, so it is not time lost by itself;
- the top operators by self time on the training thread (an operator's own time, without the
  operators it calls: these shares add up, with the rest, to the step), then every other
  operator together, then the step's time in no operator (Python between operators, waits);
- on CUDA, the compute kernels by GPU time and the share of the step the GPU was busy.
"""

import json
from collections import defaultdict
from dataclasses import asdict, dataclass

STEP = "kitchen/step"  # + " N": one whole step, on the training thread
DATA_WAIT = "kitchen/data_wait"
HOST_CATEGORIES = frozenset({"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"})
COLLECTIVE_PREFIXES = ("gloo:", "nccl:", "c10d::")  # host spans; gloo's cover the whole work
COLLECTIVE_KERNEL_PREFIX = "nccl"  # NCCL's kernels (ncclDevKernel_AllReduce_...)
MAX_NAME = 90  # characters of an operator or kernel name in the table (templates are long)


class TraceError(ValueError):
    """Not a trace with profiled Kitchen steps; the message names the file."""


@dataclass(frozen=True)
class Row:
    name: str
    calls: float  # per step
    ms: float  # per step
    share: float  # of the step's wall time


@dataclass(frozen=True)
class ProfileTable:
    steps: list[int]
    rank: int
    world_size: int
    device: str
    step_ms: float
    data_wait: Row
    communication: Row
    ops: list[Row]  # the top operators by self time, training thread
    other_ops: Row  # every other operator together
    outside_reading: Row  # in no operator while reading batches (the loader's Python, waits)
    outside_ops: Row  # in no operator elsewhere: Python between operators, waits
    kernels: list[Row]  # CUDA: the top compute kernels by GPU time ([] on CPU)
    gpu_busy: Row | None  # CUDA: the union of compute kernels

    def to_json(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        """Markdown: what the log prints and profile.md holds."""
        steps = f"{self.steps[0]}-{self.steps[-1]}" if len(self.steps) > 1 else f"{self.steps[0]}"
        out = [
            f"Profile of steps {steps} on rank {self.rank} of {self.world_size} ({self.device}): "
            f"{self.step_ms:.1f} ms a step.",
            "",
            "| where the step's time goes | share | ms a step |",
            "| --- | ---: | ---: |",
        ]
        waits = [self.data_wait, self.communication, *([self.gpu_busy] if self.gpu_busy else [])]
        out += [f"| {r.name} | {r.share:.1%} | {r.ms:.1f} |" for r in waits]
        out += [
            "",
            f"Top {len(self.ops)} operators by self time (the training thread; an operator's own "
            "time, without the operators it calls):",
            "",
            "| operator | calls a step | ms a step | share of the step |",
            "| --- | ---: | ---: | ---: |",
        ]
        for r in [*self.ops, self.other_ops, self.outside_reading, self.outside_ops]:
            calls = f"{r.calls:,.1f}".removesuffix(".0") if r.calls else ""
            out.append(f"| {r.name[:MAX_NAME]} | {calls} | {r.ms:.2f} | {r.share:.1%} |")
        if self.kernels:
            out += [
                "",
                f"Top {len(self.kernels)} CUDA kernels by GPU time (collectives excluded):",
                "",
                "| kernel | calls a step | ms a step | share of the step |",
                "| --- | ---: | ---: | ---: |",
            ]
            out += [
                f"| {r.name[:MAX_NAME]} | {r.calls:,.1f} | {r.ms:.2f} | {r.share:.1%} |"
                for r in self.kernels
            ]
        return "\n".join(out) + "\n"


def render_ranks(tables: list[ProfileTable]) -> str:
    """Every rank's step, data-loader wait and communication side by side (Markdown): a rank
    that waits for its data makes the others wait in their collectives."""
    out = [
        "Every rank (each from its own trace):",
        "",
        "| rank | ms a step | data-loader wait | communication |",
        "| ---: | ---: | ---: | ---: |",
    ]
    out += [
        f"| {t.rank} | {t.step_ms:.1f} | {t.data_wait.share:.1%} | {t.communication.share:.1%} |"
        for t in tables
    ]
    return "\n".join(out) + "\n"


def read_trace(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
    except (OSError, ValueError) as err:
        raise TraceError(f"{path}: not a readable Chrome trace ({err})") from err
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(f"{path}: no traceEvents list (not a Chrome trace)")
    return trace


def _spans(trace: dict) -> list[dict]:
    """Complete events ("ph": "X") with a start and a duration."""
    return [
        e for e in trace["traceEvents"]
        if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e
    ]  # fmt: skip


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > start:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _clip(intervals, windows) -> list[tuple[float, float]]:
    """The parts of `intervals` inside `windows` (both unions: sorted, disjoint)."""
    out = []
    for start, end in intervals:
        for w_start, w_end in windows:
            low, high = max(start, w_start), min(end, w_end)
            if high > low:
                out.append((low, high))
    return _union(out)


def _minus(intervals, holes) -> list[tuple[float, float]]:
    out = []
    for start, end in intervals:
        cursor = start
        for h_start, h_end in holes:
            if h_end <= cursor or h_start >= end:
                continue
            if h_start > cursor:
                out.append((cursor, h_start))
            cursor = max(cursor, h_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def _self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """(event, its duration less its children's) for the nested spans of one thread."""
    ordered = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    own = [float(e["dur"]) for e in ordered]
    stack: list[int] = []
    for i, e in enumerate(ordered):
        while stack and ordered[stack[-1]]["ts"] + ordered[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        if stack:  # clipped: a child's rounding may take it past its parent's end
            parent = ordered[stack[-1]]
            inside = min(e["ts"] + e["dur"], parent["ts"] + parent["dur"]) - e["ts"]
            own[stack[-1]] -= max(inside, 0.0)
        stack.append(i)
    return [(e, max(t, 0.0)) for e, t in zip(ordered, own, strict=True)]


def _collective(e: dict) -> bool:
    name = str(e.get("name", ""))
    kernel = e.get("cat") == "kernel" and name.startswith(COLLECTIVE_KERNEL_PREFIX)
    return kernel or name.startswith(COLLECTIVE_PREFIXES)


def _rows(totals: dict[str, list[float]], n_steps: int, wall: float, top: int) -> list[Row]:
    """{name: [calls, microseconds]} -> the `top` rows by time, per step."""
    ranked = sorted(totals.items(), key=lambda item: (-item[1][1], item[0]))[:top]
    return [_row(name, calls, us, n_steps, wall) for name, (calls, us) in ranked]


def _row(name: str, calls: float, us: float, n_steps: int, wall: float) -> Row:
    return Row(name, calls / n_steps, us / 1000 / n_steps, us / wall if wall else 0.0)


def analyse(trace: dict, top: int = 15, source: str = "the trace") -> ProfileTable:
    """The table of a trace of `kitchen/step` spans (see the module docstring)."""
    spans = _spans(trace)
    steps = [e for e in spans if str(e.get("name", "")).startswith(STEP + " ")]
    if not steps:
        raise TraceError(f"{source}: no {STEP!r} spans (not a profile of Kitchen steps)")
    thread = steps[0]["tid"]
    steps = sorted((e for e in steps if e["tid"] == thread), key=lambda e: e["ts"])
    windows = _union([(e["ts"], e["ts"] + e["dur"]) for e in steps])
    wall = _length(windows)
    n = len(steps)

    def inside(e) -> bool:
        return any(s <= e["ts"] and e["ts"] + e["dur"] <= t + 1e-3 for s, t in windows)

    host = [
        e for e in spans
        if e["tid"] == thread and e.get("cat") in HOST_CATEGORIES and inside(e)
        and not str(e.get("name", "")).startswith("ProfilerStep#")
    ]  # fmt: skip
    data = _union([(e["ts"], e["ts"] + e["dur"]) for e in host if e["name"] == DATA_WAIT])
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    outside = {STEP: 0.0, DATA_WAIT: 0.0}
    for e, own in _self_times(host):
        if e["name"] == DATA_WAIT:
            outside[DATA_WAIT] += own
        elif e["name"].startswith(STEP + " "):
            outside[STEP] += own
        else:
            totals[e["name"]][0] += 1
            totals[e["name"]][1] += own
    ops = _rows(totals, n, wall, top)
    shown = {r.name for r in ops}
    rest = [v for k, v in totals.items() if k not in shown]
    other = _row(
        f"({len(rest)} other operators)", sum(c for c, _ in rest), sum(t for _, t in rest), n, wall
    )
    collectives = [(e["ts"], e["ts"] + e["dur"]) for e in spans if _collective(e)]
    comm = _minus(_clip(_union(collectives), windows), data)
    kernels = [
        e for e in spans
        if e.get("cat") == "kernel" and inside(e)
        and not str(e.get("name", "")).startswith(COLLECTIVE_KERNEL_PREFIX)
    ]  # fmt: skip
    kernel_totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        kernel_totals[e["name"]][0] += 1
        kernel_totals[e["name"]][1] += e["dur"]
    busy = _length(_union([(e["ts"], e["ts"] + e["dur"]) for e in kernels]))
    info = trace.get("distributedInfo") or {}
    return ProfileTable(
        steps=[int(e["name"].rsplit(" ", 1)[1]) for e in steps],
        rank=int(info.get("rank", 0)),
        world_size=int(info.get("world_size", 1)),
        device="cuda" if trace.get("deviceProperties") else "cpu",
        step_ms=wall / 1000 / n,
        data_wait=_row("data-loader wait", n, _length(data), n, wall),
        communication=_row("communication (a collective in flight)", 0, _length(comm), n, wall),
        ops=ops,
        other_ops=other,
        outside_reading=_row(
            "(in no operator, reading batches: the loader's Python, waits)",
            0,
            outside[DATA_WAIT],
            n,
            wall,
        ),  # fmt: skip
        outside_ops=_row("(in no operator, elsewhere: Python, waits)", 0, outside[STEP], n, wall),
        kernels=_rows(kernel_totals, n, wall, top),
        gpu_busy=_row("GPU busy (compute kernels)", 0, busy, n, wall) if kernels else None,
    )
