"""Each test's measured time against the timeout its size gives it, from a Bazel run's build
event log: the table to commit, and the tests whose timeout leaves too little margin.

    ./bazel test //some:tests --build_event_json_file=/tmp/bep.json
    python3 tools/test_times.py /tmp/bep.json [--margin 3]

Why a margin: CI machines are shared. Measured on 2 cores beside another suite (load average
~10), a `small` test (60 s) whose 20 s are mostly importing torch has no room left for a busier
minute. A test's size must give it at least `margin` (3) times its time measured so, and
exit status 1 lists those that do not, with the size that would. The timeouts are Bazel's
defaults per size (no test here sets `timeout`). tools/test_times.md holds the last table.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

TIMEOUT_S = {"SMALL": 60, "MEDIUM": 300, "LARGE": 900, "ENORMOUS": 3600}


@dataclasses.dataclass(frozen=True)
class TestTime:
    label: str
    size: str  # SMALL, MEDIUM, LARGE, ENORMOUS
    seconds: float  # the longest attempt of the run
    status: str

    @property
    def timeout(self) -> int:
        return TIMEOUT_S[self.size]

    def fits(self, margin: float) -> bool:
        return self.timeout >= margin * self.seconds

    def size_needed(self, margin: float) -> str:
        """The smallest size whose timeout holds `margin` times the measured time."""
        need = margin * self.seconds
        return next((s for s, t in TIMEOUT_S.items() if t >= need), "ENORMOUS")


def read_events(path: Path) -> list[TestTime]:
    """The tests of a build event log (one JSON object a line), cached results included
    (their time is the run that produced them)."""
    sizes: dict[str, str] = {}
    results: dict[str, tuple[float, str]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            event = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not a build event ({e})") from e
        ident = event.get("id", {})
        if "targetConfigured" in ident and "testSize" in event.get("configured", {}):
            sizes[ident["targetConfigured"]["label"]] = event["configured"]["testSize"]
        if "testResult" in ident and "testResult" in event:
            label, result = ident["testResult"]["label"], event["testResult"]
            seconds = int(result.get("testAttemptDurationMillis", 0)) / 1000
            previous = results.get(label, (0.0, ""))
            results[label] = (max(seconds, previous[0]), result.get("status", "?"))
    return [
        TestTime(label, sizes.get(label, "MEDIUM"), seconds, status)
        for label, (seconds, status) in sorted(results.items(), key=lambda kv: -kv[1][0])
    ]


def table(times: list[TestTime], margin: float) -> str:
    """Markdown: one row a test, slowest first."""
    rows = ["| test | size (timeout) | measured s | timeout / measured | status |"]
    rows.append("|---|---|---|---|---|")
    for t in times:
        ratio = t.timeout / t.seconds if t.seconds else float("inf")
        flag = "" if t.fits(margin) else f" **< {margin:g}: {t.size_needed(margin).lower()}**"
        rows.append(
            f"| `{t.label}` | {t.size.lower()} ({t.timeout} s) | {t.seconds:.1f} | "
            f"{ratio:.1f}{flag} | {t.status} |"
        )
    total = sum(t.seconds for t in times)
    rows.append(f"\n{len(times)} tests, {total:,.0f} s of test time in all.")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("events", type=Path, help="a --build_event_json_file")
    p.add_argument("--margin", type=float, default=3.0, help="timeout / measured, at least (3)")
    a = p.parse_args(argv)
    if a.margin <= 0:
        p.error(f"--margin: {a.margin:g} must be positive")
    times = read_events(a.events)
    if not times:
        p.error(f"{a.events}: no test results in it")
    print(table(times, a.margin))
    short = [t for t in times if not t.fits(a.margin)]
    for t in short:
        print(
            f"{t.label}: {t.seconds:.1f} s measured, {t.size.lower()} gives {t.timeout} s: "
            f'size = "{t.size_needed(a.margin).lower()}"',
            file=sys.stderr,
        )
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
