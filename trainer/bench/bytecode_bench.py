"""What the venv's compiled bytecode saves each Python process (tools/python/make_venv.py).

Bazel's sandbox mounts the venv read-only, so a process can only read the bytecode the venv
build compiled; before make_venv compiled it, every test process compiled torch's sources
again. This runs the same commands both ways, alternating, in one run:

- with bytecode: the venv's __pycache__ (as every test and trainer process now runs);
- from source: PYTHONPYCACHEPREFIX at an empty directory and PYTHONDONTWRITEBYTECODE=1, so
  Python finds no bytecode, compiles every module it imports and writes none (as before).

The commands: importing what a trainer imports (torch, torch._dynamo, FSDP, matplotlib), and
a whole trainer run (tiny_job: 6 steps of a 2-layer model, its data precooked by a first,
untimed run). Prints wall and CPU seconds (the process and its children) and their ratios:

    tools/py trainer/bench/bytecode_bench.py [--rounds 3] [--out trainer/bench/bytecode_results.md]
"""

import argparse
import itertools
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from protos import files
from trainer.bench.machine import machine
from trainer.testing import subprocess_env, tiny_job, train_command, write_job

IMPORTS = "import torch, torch._dynamo, torch.distributed.fsdp, matplotlib.pyplot"


def timed(command: list[str], env: dict) -> tuple[float, float]:
    """(wall s, CPU s) of `command`, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{command} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="pairs per command (median)")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bytecode-bench-") as tmp:
        root = Path(tmp)
        with_bytecode = dict(subprocess_env(), PYTHONDONTWRITEBYTECODE="1")
        from_source = dict(with_bytecode, PYTHONPYCACHEPREFIX=str(root / "no-bytecode"))
        config = write_job(root / "tiny.yaml", tiny_job(root / "cache", steps=6))
        runs = itertools.count()  # a new run directory for each trainer run

        def trainer() -> list[str]:
            return train_command("--config", config, "--run-dir", root / f"run{next(runs)}")

        timed(trainer(), with_bytecode)  # precooks the data into the cache the others hit
        commands: dict[str, Callable[[], list[str]]] = {
            "import torch, _dynamo, FSDP, pyplot": lambda: [sys.executable, "-c", IMPORTS],
            "trainer run (6 tiny steps)": trainer,
        }
        rows = []
        for label, command in commands.items():
            times: dict[str, list[tuple[float, float]]] = {"with": [], "source": []}
            for _ in range(args.rounds):
                times["source"].append(timed(command(), from_source))
                times["with"].append(timed(command(), with_bytecode))
            med = {
                k: [statistics.median(t[i] for t in v) for i in (0, 1)] for k, v in times.items()
            }
            rows.append(
                f"| {label} | {med['source'][0]:.2f} s / {med['source'][1]:.2f} s "
                f"| {med['with'][0]:.2f} s / {med['with'][1]:.2f} s "
                f"| {med['source'][0] / med['with'][0]:.2f}x / "
                f"{med['source'][1] / med['with'][1]:.2f}x |"
            )
            print(rows[-1], flush=True)

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    table = "\n".join(
        [
            f"# Python start-up with and without the venv's bytecode ({args.rounds} pairs, "
            "medians)",
            "",
            f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {machine()}, load average {load} at the end",
            "",
            "| command | from source: wall / CPU | with bytecode: wall / CPU | saved: wall / CPU |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )
    print(table)
    if args.out:
        files.write_atomic(str(args.out), table.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
