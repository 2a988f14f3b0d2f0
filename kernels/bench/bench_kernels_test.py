"""The benchmark's machinery, not its numbers: the memory meter against known allocations, and
a tiny end-to-end run that must write complete CSV and Markdown (no timing is asserted)."""

import csv

import pytest
import torch

import kernels
from kernels.bench import bench_kernels, measure


def test_cpu_peak_memory_counts_what_is_live_at_once():
    def allocate():
        a = torch.empty(1024, 1024)  # 4 MiB
        b = torch.empty(512, 1024)  # 2 MiB: 6 MiB live
        del a
        c = torch.empty(256, 1024)  # 1 MiB: 3 MiB live
        return b, c

    assert measure.peak_bytes(allocate, torch.device("cpu")) == 6 * 2**20


def test_time_ms_reports_every_implementation():
    calls = {"a": 0, "b": 0}

    def count(name):
        calls[name] += 1

    got = measure.time_ms(
        {"a": lambda: count("a"), "b": lambda: count("b")}, torch.device("cpu"), reps=3, warmup=1
    )
    assert set(got) == {"a", "b"} and all(ms >= 0 for ms in got.values())
    assert calls["a"] == calls["b"] >= 1 + 1 + 3  # warmup, probe, reps: interleaved evenly


def test_small_cpu_run_writes_csv_and_markdown(tmp_path, monkeypatch):
    # Run with the interpreter off (and so the reference on CPU) even in a pytest process that
    # other kernel tests started with TRITON_INTERPRET=1.
    monkeypatch.setattr(kernels.dispatch, "INTERPRET", False)
    prefix = tmp_path / "results"
    args = ["--device", "cpu", "--tokens", "8", "--ops", "rms_norm,cross_entropy"]
    assert bench_kernels.main([*args, "--impls", "kernels,eager", "--out", str(prefix)]) == 0
    rows = list(csv.DictReader(open(prefix.with_suffix(".csv"))))
    assert [(r["op"], r["impl"]) for r in rows] == [
        ("rms_norm", "kernels"),
        ("rms_norm", "eager"),
        ("cross_entropy", "kernels"),
        ("cross_entropy", "eager"),
    ]
    for r in rows:
        assert float(r["fwd_bwd_ms"]) > 0 and float(r["peak_mib"]) > 0
        assert r["device"] and r["date"] and "torch" in r["versions"]
    assert float(rows[0]["speedup_vs_eager"]) > 0
    report = prefix.with_suffix(".md").read_text()
    assert "kernels.* dispatches to kernels.reference" in report  # says plainly what CPU measures
    assert "| cross_entropy | tokens=8 vocab=8192 | eager |" in report


def test_refuses_to_time_the_interpreter(monkeypatch):
    monkeypatch.setattr(kernels.dispatch, "INTERPRET", True)
    with pytest.raises(SystemExit):
        bench_kernels.main(["--device", "cpu"])
