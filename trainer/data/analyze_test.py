import json
import os
import subprocess
import sys

import numpy as np
import pytest

from trainer.data import analyze, packing, testdata

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_measure_by_hand_concat():
    # rows of 4 from documents of 3, 4, 2 tokens: [a a a b] [b b b c] [c . . .]
    r = analyze.measure(packing.pack("concat", np.array([3, 4, 2]), 4), 3)
    assert (r["rows"], r["slots"], r["tokens"], r["padding_tokens"]) == (3, 12, 9, 3)
    assert r["target_tokens"] == 9 - 5  # five pieces, each ends without a target
    assert r["padding_waste_pct"] == pytest.approx(25.0)
    assert r["packing_efficiency_pct"] == pytest.approx(100 * 4 / 12)
    assert r["split_documents_pct"] == pytest.approx(100 * 2 / 3)
    assert r["attention_flops_per_useful_token"] == pytest.approx(12 * 3 * 16 / 4)
    assert r["attention_flops_per_useful_token_doc_masked"] == pytest.approx(12 * 21 / 4)


def test_measure_by_hand_pad():
    r = analyze.measure(packing.pack("pad", np.array([3, 4, 2]), 3), 3)
    assert (r["rows"], r["slots"], r["tokens"], r["truncated_tokens"]) == (3, 9, 8, 1)
    assert r["truncated_pct"] == pytest.approx(100 / 9)
    assert r["padding_waste_pct"] == pytest.approx(100 / 9)
    assert r["split_documents_pct"] == 0


def test_table_explains_itself_and_takeaway_uses_the_numbers():
    lengths = testdata.doc_lengths(300, seed=4) * 3
    results = analyze.analyze_lengths(lengths, [128, 512])
    assert len(results) == 8
    report = {
        "corpus": {"description": "test", **analyze.corpus_summary(lengths)},
        "tokenizer": "test tokenizer",
        "results": results,
    }
    table = analyze.format_table(report)
    assert analyze.MEANING in table
    best = next(r for r in results if r["seq_len"] == 512 and r["strategy"] == "best_fit")
    assert f"best_fit learns from {best['packing_efficiency_pct']:.1f}%" in table
    assert best["packing_efficiency_pct"] > 95 and best["truncated_pct"] == 0


def test_plot_is_a_png(tmp_path):
    path = str(tmp_path / "lengths.png")
    analyze.plot_lengths(testdata.doc_lengths(100, 0), [64, 256], path, "test")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def run_cli(*args):
    env = dict(os.environ)  # under Bazel PYTHONPATH already holds the runfiles
    env.setdefault("PYTHONPATH", os.pathsep.join([REPO, os.path.join(REPO, ".gen")]))
    command = [sys.executable, "-m", "trainer.data.cli", *args]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def test_cli_build_then_cache_hit_and_analyze(tmp_path):
    testdata.write_text_corpus(str(tmp_path / "c"), n=30)
    common = ["--input", str(tmp_path / "c"), "--cache-dir", str(tmp_path / "cache")]
    common += ["--vocab-size", "300", "--workers", "1"]
    first = run_cli("build", *common, "--seq-len", "64", "--packing", "concat")
    assert first.stdout.startswith("precooked: ") and "rows of 64 (concat)" in first.stdout
    assert "tokenize" in first.stderr and "tokens/s" in first.stderr
    again = run_cli("build", *common, "--seq-len", "64", "--packing", "concat", "--json")
    manifest = json.loads(again.stdout)
    assert manifest["cache_hit"] and manifest["manifest"]["packing"] == "concat"

    plot = str(tmp_path / "h.png")
    table = run_cli("analyze", *common, "--seq-len", "32,128", "--plot", plot)
    assert "found in the cache" in table.stderr  # the corpus was tokenized by build already
    assert analyze.MEANING in table.stdout and os.path.exists(plot)
    report = json.loads(run_cli("analyze", *common, "--seq-len", "32,128", "--json").stdout)
    assert {(r["seq_len"], r["strategy"]) for r in report["results"]} == {
        (t, s) for t in (32, 128) for s in packing.STRATEGIES
    }
    assert report["corpus"]["documents"] == 30
