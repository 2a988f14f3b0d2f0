"""The `train` entry point end to end on a tiny model and a small real corpus: pretrain, then
evaluate and generate from its checkpoint; bad configs exit 2 before any work."""

import json
import math

import pytest
import torch

from protos.exit_codes import ExitCode
from protos.progress_log import read_progress_log
from trainer import main
from trainer.testing import tiny_job, write_job

torch.set_num_threads(1)
STEPS = 8


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    job = write_job(
        root / "job.yaml", tiny_job(root / "cache", steps=STEPS, train={"eval_every": 4})
    )
    code = main.main(["--config", str(job), "--run-dir", str(root / "run")])
    return code, root, job


def test_pretrain_succeeds_and_writes_every_output(trained):
    code, root, _ = trained
    run = root / "run"
    assert code == ExitCode.OK
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == [
        "step_00000004",
        "step_00000008",
    ]
    log = (run / "train.log").read_text()
    assert "step      8/8 | loss" in log and "tok/s" in log and "MFU" in log
    assert "goodput" in log and "badput: startup" in log


def test_metrics_jsonl_has_every_step_eval_and_an_honest_mfu(trained):
    _, root, _ = trained
    log = read_progress_log(root / "run")
    assert log.warnings == []
    records = log.records
    train = [r for r in records if r.phase == "train"]
    assert [r.step for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert r.mfu_basis == "measured"  # a CPU is in no table: calibrated at start-up
        assert 0 < r.mfu < 1 and r.tflops > 0 and r.tokens_per_second > 0
        assert 0 < r.data_time_seconds < r.step_time_seconds
        assert 0 < r.goodput < 1 and r.peak_memory_bytes > 0
        assert 0 <= r.padding_fraction < 0.5 and r.grad_norm > 0 and r.lr > 0
        assert r.total_steps == STEPS
    # 4 rows of 64 positions per step, minus padding.
    assert STEPS * 4 * 64 * 0.5 < train[-1].tokens_total <= STEPS * 4 * 64
    assert train[-1].loss < train[0].loss - 0.2  # it learns, even in 8 steps
    evals = [r for r in records if r.phase == "eval"]
    assert [r.step for r in evals] == [4, 8]
    assert evals[1].eval_loss < evals[0].eval_loss
    assert records[-1].phase == "done" and "goodput" in records[-1].message


def test_eval_job_reports_loss_perplexity_and_choice_accuracy(trained):
    _, root, job = trained
    spec = json.loads(json.dumps(tiny_job(root / "cache", kind="EVAL")))
    eval_job = write_job(root / "eval.yaml", spec)
    assert main.main(["--config", str(eval_job), "--run-dir", str(root / "run")]) == 0
    report = json.loads((root / "run" / "eval.json").read_text())
    assert report["step"] == STEPS and report["checkpoint"].endswith("step_00000008")
    assert report["perplexity"] == pytest.approx(math.exp(report["loss"]))
    assert report["tokens"] > 0
    assert report["choice_questions"] > 0 and 0 <= report["choice_accuracy"] <= 1


def test_generate_job_prints_text_and_tokens_per_second(trained, capsys):
    _, root, _ = trained
    spec = tiny_job(root / "cache", kind="GENERATE")
    spec["trainer"]["generate"] = {"prompt": "def main(", "max_new_tokens": 12, "seed": 1}
    job = write_job(root / "generate.yaml", spec)
    assert main.main(["--config", str(job), "--run-dir", str(root / "run")]) == 0
    out = capsys.readouterr().out
    assert "\ndef main(" in out  # the prompt, then its continuation
    assert "tokens/s" in out


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model": {"n_heads": 5}}, "trainer.model.n_heads: 5 does not divide dim 64"),
        ({"model": {"n_kv_heads": 3}}, "trainer.model.n_kv_heads: 3 does not divide n_heads 4"),
        ({"model": {"max_seq_len": 32}}, "trainer.data.seq_len: 64 is longer than"),
        ({"model": {"n_head": 4}}, "trainer.model.n_head"),  # a typo: unknown field
    ],
)
def test_bad_config_exits_2_naming_the_field_before_any_work(tmp_path, capsys, change, message):
    spec = tiny_job(tmp_path / "cache")
    for section, fields in change.items():
        spec["trainer"][section].update(fields)
    job = write_job(tmp_path / "job.yaml", spec)
    code = main.main(["--config", str(job), "--run-dir", str(tmp_path / "run")])
    assert code == ExitCode.BAD_CONFIG
    assert message in capsys.readouterr().err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_precook_job_only_precooks(trained, capsys):
    _, root, _ = trained
    job = write_job(root / "precook.yaml", tiny_job(root / "cache", kind="PRECOOK"))
    assert main.main(["--config", str(job), "--run-dir", str(root / "precook-run")]) == 0
    assert "cache hit" in capsys.readouterr().out  # the pretrain job's data, found again
    assert not (root / "precook-run" / "checkpoints").exists()
