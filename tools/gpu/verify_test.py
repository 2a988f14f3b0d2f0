"""tools/gpu/verify.py: the tiny CPU mode runs every step end to end, and the verdicts are
read from real step output: a goal missed is MISS, a step that breaks is FAILED, and either
makes the exit status 1. (The GPU numbers themselves need a GPU: see tools/gpu/README.md.)"""

import csv
import subprocess
import sys

import pytest

from tools.gpu import verify


def test_tiny_mode_runs_every_step(tmp_path):
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(verify.ROOT / "tools/gpu/verify.py"), "--tiny", "--out", str(out),
         "--cache-dir", str(tmp_path / "precook")],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    with open(out / "verify.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["step"] for r in rows} == {
        "kernel tests",
        "kernel bench",
        "trainer bench",
        "precision",
        "fp8",
    }
    assert all(r["verdict"] == "met" or r["verdict"].startswith("skipped:") for r in rows), rows
    assert all(r["device"] == "cpu" and r["torch"] and r["date"] for r in rows)
    tests = next(r for r in rows if r["step"] == "kernel tests")
    assert tests["verdict"] == "met" and " 0 failed" in tests["measured"]
    md = (out / "verify.md").read_text()
    assert md.count("\n| ") == len(rows) + 1  # the header row and one row per goal
    assert "bf16 loss tracks fp32" in md and "varlen" in md
    fp8_rows = [r for r in rows if r["step"] == "fp8"]  # no fp8 matmuls here: said, not faked
    assert len(fp8_rows) == 2, rows
    assert all(r["verdict"] == "skipped: no fp8 matmul on cpu" for r in fp8_rows), fp8_rows
    assert (out / "verify.log").stat().st_size > 0


def _result(tmp_path, code=0, output="") -> verify.Result:
    return verify.Result(code, output, 1.0, tmp_path)


def test_a_missed_goal_is_miss(tmp_path):
    (tmp_path / "kernels_bench.md").write_text(
        "| op | size | impl |\n- met  rms_norm tokens=4096: fwd+bwd at or below eager (1.50x)\n"
        "- MISS fused_linear_cross_entropy peak memory <= 1/4 of eager at 8K tokens, vocab 128K:"
        " 0.400\n"
    )
    rows = verify.judge_kernel_bench(_result(tmp_path))
    assert [r.verdict for r in rows] == ["met", "MISS"]
    (tmp_path / "trainer_bench.md").write_text(
        "| 4096 | on | on | 1.07 B | 32,768 | 47.1% (table:H200-SXM) | 466 | 61,000 |\n"
        "| 4096 | off | on | 1.07 B | 32,768 | 41.0% (table:H200-SXM) | 405 | 53,000 |\n"
        "| 8192 | on | on | 1.07 B | 32,768 | 55.0% (table:H200-SXM) | 544 | 64,000 |\n"
    )
    verdicts = [r.verdict for r in verify.judge_trainer_bench(_result(tmp_path))]
    assert verdicts[0] == "MISS" and verdicts[2] == "met" and verdicts[1].startswith("skipped")


def test_a_broken_or_hung_step_is_failed_with_its_output(tmp_path):
    with open(tmp_path / "log", "w") as log:
        broken = verify.Step(
            "precision", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], 60,
            verify.judge_precision,
        )  # fmt: skip
        (row,) = verify.run_step(broken, tmp_path, log)
        assert row.verdict == "FAILED" and "exit 3" in row.measured and "boom" in row.measured
        hung = verify.Step("kernel bench", [sys.executable, "-c", "import time; time.sleep(30)"], 1,
                           verify.judge_kernel_bench)  # fmt: skip
        (row,) = verify.run_step(hung, tmp_path, log)
        assert row.verdict == "FAILED" and "timed out after 1 s" in row.measured


@pytest.mark.parametrize("verdicts, code", [(["met", "skipped: x"], 0), (["met", "MISS"], 1)])
def test_report_has_one_row_per_goal(verdicts, code):
    rows = [verify.Row("s", f"goal {i}", "m|n", v) for i, v in enumerate(verdicts)]
    md, table = verify.report(rows, {"device": "cpu", "date": "today"}, tiny=True)
    assert md.count("\n| s | goal ") == len(rows)
    assert "m/n" in md  # a | inside a cell cannot split the table
    assert len(list(csv.DictReader(table.splitlines()))) == len(rows)
    assert verify.exit_code(rows) == code
