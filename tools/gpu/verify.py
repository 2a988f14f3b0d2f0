"""Proves or disproves every GPU claim of Kitchen in one run, and leaves the numbers.

    tools/gpu/verify.sh [--out DIR] [--tiny]       # the wrapper sets up Python, then runs this

Steps, each a subprocess with its own time limit (8 minutes in all on a GPU for steps 1-4,
and 2.5 more for fp8, which only GPUs of capability 8.9+ run):
  1. kernel tests   every op's test file, compiled Triton on CUDA (fp32, fp16 and bf16 cases);
  2. kernel bench   each op vs eager and torch.compile at Llama-3-8B shapes in bf16, with the
                    goal lines (fwd+bwd at or below both; fused linear cross entropy peak
                    memory <= 1/4 of eager at 8K tokens x 128K vocabulary);
  3. trainer bench  MFU of a ~1B model on packed rows at 4K and 8K, kernels on and off,
                    torch.compile on, bf16, fused AdamW (goal: >= 50% on one H200);
  4. precision      a bf16 run's loss tracks the fp32 run's; the variable-length attention
                    path equals the masked one;
  5. fp8            train.dtype fp8 against bf16 (a dim-4096 model, compiled): the loss tracks
                    and a step is no slower (skipped where there are no fp8 matmuls).
Every goal becomes one row of DIR/verify.md and DIR/verify.csv (with the device, versions, date
and commit) and one printed verdict line: "met", "MISS", "FAILED" (the step itself broke) or
"skipped: why". Nothing is hidden: a step that breaks or times out is a FAILED row with the
tail of its log, and the exit status is 1 if any row is MISS or FAILED.

`--tiny` is the same plumbing on a CPU in about a minute (//tools/gpu:verify_test): the kernel
tests of one op in Triton's interpreter, a small benchmark, a tiny model. Its numbers say the
script works, not how fast anything is.
"""

import argparse
import csv
import dataclasses
import datetime
import io
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from protos import files

ROOT = Path(__file__).absolute().parents[2]  # not resolved: under Bazel, the runfiles
MFU_GOAL = 0.50
BAD = ("MISS", "FAILED")


@dataclasses.dataclass
class Row:
    step: str
    goal: str
    measured: str
    verdict: str  # "met", "MISS", "FAILED" or "skipped: why"
    seconds: float = 0.0


@dataclasses.dataclass
class Step:
    name: str
    argv: list[str]
    limit_s: int
    judge: Callable[["Result"], list[Row]]
    env: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Result:
    code: int | None  # None: timed out
    output: str
    seconds: float
    out: Path


def run_step(step: Step, out: Path, log) -> list[Row]:
    env = os.environ | {"PYTHONUNBUFFERED": "1"} | step.env
    began = time.monotonic()
    log.write(f"\n===== {step.name}: {' '.join(step.argv)}\n")
    log.flush()
    try:
        done = subprocess.run(
            step.argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=step.limit_s
        )
        result = Result(done.returncode, done.stdout + done.stderr, time.monotonic() - began, out)
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
            errors="replace"
        )
        result = Result(None, text, time.monotonic() - began, out)
    log.write(result.output)
    log.flush()
    try:
        rows = step.judge(result)
    except Exception as e:  # a judge that cannot read the step's output: the step broke
        rows = []
        result.output += f"\n(verify: could not read the results: {e!r})"
    if result.code is None or not rows:
        why = f"timed out after {step.limit_s} s" if result.code is None else f"exit {result.code}"
        tail = " / ".join(result.output.strip().splitlines()[-3:])[-300:]
        rows.append(Row(step.name, "the step runs to the end", f"{why}: {tail}", "FAILED"))
    for r in rows:
        r.seconds = result.seconds
    return rows


# ---------------------------------------------------------------- judges: output -> rows


def judge_kernel_tests(r: Result) -> list[Row]:
    root = ET.parse(r.out / "kernel_tests.xml").getroot()
    suite = root if root.tag == "testsuite" else root[0]
    n = int(suite.get("tests", 0))
    bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    failed = [
        c.get("name", "?")
        for c in suite.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    measured = f"{n - bad - skipped} passed, {bad} failed, {skipped} skipped"
    if failed:
        measured += ": " + ", ".join(failed[:5]) + (" ..." if len(failed) > 5 else "")
    return [
        Row(
            "kernel tests", "every kernel test passes", measured, "met" if n and not bad else "MISS"
        )
    ]


def judge_kernel_bench(r: Result) -> list[Row]:
    md = (r.out / "kernels_bench.md").read_text()
    rows = []
    for line in md.splitlines():
        m = re.match(r"- (met |MISS) (.+?): (.+)$", line)
        if m:
            rows.append(Row("kernel bench", m.group(2), m.group(3), m.group(1).strip()))
    if not rows and "| kernels |" in md:
        rows.append(
            Row(
                "kernel bench",
                "each op vs eager and compile",
                "measured (see kernels_bench.md)",
                "skipped: goals are judged on CUDA only",
            )
        )
    return rows


def judge_trainer_bench(r: Result) -> list[Row]:
    md = (r.out / "trainer_bench.md").read_text()
    rows = []
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 8 and cells[0].isdigit():
            seq, kern, comp, params, _, mfu, tflops, tps = cells
            value = float(mfu.split("%")[0]) / 100
            judged = kern == "on" and comp == "on" and "table:" in mfu
            verdict = (
                ("met" if value >= MFU_GOAL else "MISS")
                if judged
                else "skipped: reference row (kernels off or no datasheet peak)"
            )
            rows.append(
                Row(
                    "trainer bench",
                    f"MFU >= {MFU_GOAL:.0%} at seq {seq} "
                    f"(kernels {kern}, compile {comp}, {params})",
                    f"{mfu}, {tflops} TFLOP/s, {tps} tokens/s",
                    verdict,
                )
            )
    return rows


def _checks(step: str, path: Path) -> list[Row]:
    """Rows from a checks JSON (trainer/bench/precision_checks.py's Check records)."""
    checks = json.loads(path.read_text())
    return [Row(step, c["name"] + ": " + c["goal"], c["measured"], c["verdict"]) for c in checks]


def judge_precision(r: Result) -> list[Row]:
    return _checks("precision", r.out / "precision.json")


def judge_fp8(r: Result) -> list[Row]:
    return _checks("fp8", r.out / "fp8.json")


# ---------------------------------------------------------------- the plan


def steps(out: Path, tiny: bool, cache_dir: str) -> list[Step]:
    """The plan. On a GPU the limits add up to 8 minutes (10.5 with fp8); a tiny CPU run gets
    5 times each (Triton's interpreter, and a CI machine shared with other tests)."""
    py = sys.executable

    def limit(gpu_seconds: int) -> int:
        return gpu_seconds * (5 if tiny else 1)

    if tiny:  # CPU: Triton's interpreter for the tests, the reference ops for the timings
        test_files = ["kernels/ops/rms_norm_test.py"]
        test_env = {"TRITON_INTERPRET": "1"}
        kbench = [
            "--device",
            "cpu",
            "--ops",
            "rms_norm",
            "--impls",
            "kernels,eager",
            "--tokens",
            "256",
        ]
        tbench = [
            "--gpu-model",
            "tiny",
            "--seq",
            "128",
            "--kernels",
            "on",
            "--compile",
            "off",
            "--tokens-per-step",
            "512",
        ]
    else:
        test_files = sorted(
            str(p.relative_to(ROOT)) for p in (ROOT / "kernels/ops").glob("*_test.py")
        )
        test_env = {"KITCHEN_KERNEL_TEST_DEVICE": "cuda"}
        kbench = ["--device", "cuda", "--tokens", "4096,8192"]
        tbench = ["--seq", "4096,8192", "--kernels", "on,off", "--compile", "on"]
    return [
        Step(
            "kernel tests",
            [
                py,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--junitxml={out}/kernel_tests.xml",
                *test_files,
            ],
            limit(90),
            judge_kernel_tests,
            test_env,
        ),
        Step(
            "kernel bench",
            [py, "kernels/bench/bench_kernels.py", *kbench, "--out", str(out / "kernels_bench")],
            limit(120),
            judge_kernel_bench,
        ),
        Step(
            "trainer bench",
            [
                py,
                "trainer/bench/trainer_bench.py",
                "--skip-cpu",
                "--cache-dir",
                cache_dir,
                "--out",
                str(out / "trainer_bench.md"),
                *tbench,
            ],
            limit(210),
            judge_trainer_bench,
        ),
        Step(
            "precision",
            [
                py,
                "trainer/bench/precision_checks.py",
                "--json",
                str(out / "precision.json"),
                "--cache-dir",
                cache_dir,
                *(["--tiny"] if tiny else []),
            ],
            limit(60),
            judge_precision,
        ),
        Step(  # skipped at once where there are no fp8 matmuls (the tiny CPU mode)
            "fp8",
            [
                py,
                "trainer/bench/fp8_checks.py",
                "--json",
                str(out / "fp8.json"),
                "--cache-dir",
                cache_dir,
            ],
            limit(150),
            judge_fp8,
        ),
    ]


def environment() -> dict[str, str]:
    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
    }
    probe = (
        "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda, "
        "torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu', sep='|')"
    )
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    torch_v, triton_v, cuda_v, device = (got.stdout.strip().split("|") + ["?"] * 4)[:4]
    info |= {"device": device, "torch": torch_v, "triton": triton_v, "cuda": cuda_v}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    info["commit"] = commit.stdout.strip() or os.environ.get("KITCHEN_COMMIT", "unknown")
    return info


def report(rows: list[Row], info: dict[str, str], tiny: bool) -> tuple[str, str]:
    md = io.StringIO()
    md.write(f"# GPU verification{' (tiny CPU mode: plumbing only)' if tiny else ''}\n\n")
    md.writelines(f"- {k}: {v}\n" for k, v in info.items())
    md.write("\n| step | goal | measured | verdict | step time |\n|---|---|---|---|---|\n")
    for r in rows:
        cells = (r.step, r.goal, r.measured, r.verdict, f"{r.seconds:.0f} s")
        md.write("| " + " | ".join(c.replace("|", "/") for c in cells) + " |\n")
    table = io.StringIO()
    fields = [f.name for f in dataclasses.fields(Row)] + list(info)
    writer = csv.DictWriter(table, fieldnames=fields)
    writer.writeheader()
    for r in rows:
        writer.writerow(dataclasses.asdict(r) | info)
    return md.getvalue(), table.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "gpu-results", help="results folder")
    p.add_argument("--tiny", action="store_true", help="CPU plumbing mode (a minute, no GPU)")
    p.add_argument("--cache-dir", default=str(ROOT / ".state/precook"), help="precooked datasets")
    p.add_argument("--only", help="comma-separated step names (default: all)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    info = environment()
    print(
        f"verify: {info['device']}, torch {info['torch']}, triton {info['triton']} -> {args.out}",
        file=sys.stderr,
    )
    rows: list[Row] = []
    with open(args.out / "verify.log", "w") as log:
        for step in steps(args.out, args.tiny, args.cache_dir):
            if args.only and step.name not in args.only.split(","):
                continue
            print(f"verify: {step.name} (limit {step.limit_s} s) ...", file=sys.stderr, flush=True)
            for r in run_step(step, args.out, log):
                rows.append(r)
                print(f"{r.verdict.split(':')[0]:>7}  {r.step}: {r.goal}: {r.measured}", flush=True)
    md, table = report(rows, info, args.tiny)
    for name, text in (("verify.md", md), ("verify.csv", table)):
        files.write_atomic(str(args.out / name), text)
    bad = [r for r in rows if r.verdict in BAD]
    print(
        f"verify: {len(rows) - len(bad)} of {len(rows)} rows met or skipped, "
        f"{len(bad)} MISS or FAILED: {args.out}/verify.md"
    )
    return exit_code(rows)


def exit_code(rows: list[Row]) -> int:
    """1 if any goal was missed or any step broke: a skipped goal is not a failure."""
    return 1 if any(r.verdict in BAD for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
