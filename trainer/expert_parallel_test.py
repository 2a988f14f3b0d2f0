"""Expert parallelism under torchrun (gloo on 127.0.0.1) trains like one process.

N ranks x 1 micro-batch must match 1 process x N micro-batches of accumulation (the loader
hands global batch g to rank g % N; the MoE balancing terms are per micro-batch): the same loss
at every step and the same final weights, up to float summation order. Here 2 ranks hold 2 of
the 4 experts each, and a run resumed from an expert-parallel checkpoint ends bitwise where the
uninterrupted run ended. expert_parallel_groups_test.py: 4 ranks in two expert groups.
"""

import shutil

import pytest
import torch

from protos.progress_log import read_progress_log
from trainer.testing import assert_same_run, final_weights, moe_job, run_trainer, torchrun

MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_shared_experts": 1}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ep")


@pytest.fixture(scope="module")
def two_ranks(root):
    single = run_trainer(
        "--config",
        moe_job(root, "single2", "AUX_LOSS", MOE, grad_accum=2),
        "--run-dir",
        root / "single2",
        timeout=600,  # a loaded 2-core machine: minutes, not seconds
    )
    assert single.returncode == 0, single.stdout + single.stderr
    result = torchrun(moe_job(root, "ep2", "AUX_LOSS", MOE, parallelism="EXPERT"), root / "ep2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "EXPERT on 2 x cpu" in result.stdout
    return root


def test_two_ranks_match_one_process(two_ranks):
    assert_same_run(two_ranks / "single2", two_ranks / "ep2")
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
