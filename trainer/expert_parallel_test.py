"""Expert parallelism under torchrun (gloo on 127.0.0.1) trains like one process.

N ranks x 1 micro-batch must match 1 process x N micro-batches of accumulation (the loader
hands global batch g to rank g % N; the MoE balancing terms are per micro-batch): the same loss
at every step and the same final weights, up to float summation order. 2 ranks hold 2 experts
each; 4 ranks form two expert groups of 2 (experts sharded, and replicated across the groups).
A run resumed from an expert-parallel checkpoint ends where the uninterrupted run ended.
"""

import shutil

import pytest
import torch

from protos.progress_log import read_progress_log
from trainer.distributed_test import torchrun
from trainer.testing import final_weights, run_trainer, tiny_job, train_losses, write_job

STEPS = 6
MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_shared_experts": 1}


def _job(root, name, balance, **train):
    job = tiny_job(
        root / "cache",
        steps=STEPS,
        model={**MOE, "moe_balance": balance},
        optim={"schedule": "CONSTANT"},
        train=train,
        checkpoint={"every_steps": 3},
    )
    return write_job(root / f"{name}.yaml", job)


def _same_run(root, expected_dir, got_dir):
    expected, got = dict(train_losses(root / expected_dir)), dict(train_losses(root / got_dir))
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    a, b = final_weights(root / expected_dir), final_weights(root / got_dir)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ep")


@pytest.fixture(scope="module")
def two_ranks(root):
    single = run_trainer(
        "--config", _job(root, "single2", "AUX_LOSS", grad_accum=2), "--run-dir", root / "single2"
    )
    assert single.returncode == 0, single.stdout + single.stderr
    result = torchrun(_job(root, "ep2", "AUX_LOSS", parallelism="EXPERT"), root / "ep2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "EXPERT on 2 x cpu" in result.stdout
    return root


def test_two_ranks_match_one_process(two_ranks):
    _same_run(two_ranks, "single2", "ep2")
    # Each rank holds half the experts; the checkpoint holds them all, as one process has them.
    weights = final_weights(two_ranks / "ep2")
    assert weights["layers.0.feed_forward.experts.w13"].shape[0] == MOE["moe_experts"]
    record = [r for r in read_progress_log(two_ranks / "ep2").records if r.phase == "train"][-1]
    assert [s.layer for s in record.moe_layers] == [0, 1]
    # 4 rows x 64 positions x 2 ranks x top-2, every assignment counted once.
    assert sum(record.moe_layers[0].tokens_per_expert) == 4 * 64 * 2 * 2


def test_resume_from_an_expert_parallel_checkpoint(two_ranks):
    root = two_ranks
    shutil.copytree(root / "ep2", root / "resumed")
    shutil.rmtree(sorted((root / "resumed" / "checkpoints").glob("step_*"))[-1])  # keep step 3
    result = torchrun(root / "ep2.yaml", root / "resumed")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed from" in result.stdout
    a, b = final_weights(root / "ep2"), final_weights(root / "resumed")
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_four_ranks_in_two_expert_groups_match_one_process(root):
    single = run_trainer(
        "--config",
        _job(root, "single4", "AUX_FREE_BIAS", grad_accum=4),
        "--run-dir",
        root / "single4",
    )
    assert single.returncode == 0, single.stdout + single.stderr
    job = _job(root, "ep4", "AUX_FREE_BIAS", parallelism="EXPERT", expert_parallel=2)
    result = torchrun(job, root / "ep4", nproc=4)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _same_run(root, "single4", "ep4")
    # The selection bias moved (balancing happened) and every replica agreed on it.
    bias = final_weights(root / "ep4")["layers.0.feed_forward.router.expert_bias"]
    assert bias.abs().sum() > 0
