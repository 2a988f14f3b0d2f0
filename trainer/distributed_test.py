"""Two processes under torchrun (gloo on 127.0.0.1) train like one process.

The loader hands global batch g to rank g % world_size, and the loss is the mean over every
labelled token of the global batch: so 2 ranks x 1 micro-batch (DDP or FSDP2) must match
1 process x 2 micro-batches of gradient accumulation, up to float summation order.
"""

import pytest
import torch

from protos.progress_log import read_progress_log
from trainer.testing import (
    final_weights,
    run_trainer,
    tiny_job,
    torchrun,
    train_losses,
    write_job,
)

STEPS = 6


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    job = write_job(
        root / "single.yaml", tiny_job(root / "cache", steps=STEPS, train={"grad_accum": 2})
    )
    result = run_trainer("--config", job, "--run-dir", root / "single")
    assert result.returncode == 0, result.stdout + result.stderr
    return root


@pytest.mark.parametrize("parallelism", ["DDP", "FSDP"])
def test_two_processes_match_one(single, parallelism):
    root = single
    job = write_job(
        root / f"{parallelism}.yaml",
        tiny_job(root / "cache", steps=STEPS, train={"parallelism": parallelism}),
    )
    result = torchrun(job, root / parallelism)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"{parallelism} on 2 x cpu" in result.stdout

    expected, got = dict(train_losses(root / "single")), dict(train_losses(root / parallelism))
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    a, b = final_weights(root / "single"), final_weights(root / parallelism)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)
    # Tokens/s and tokens counted across both ranks.
    records = [r for r in read_progress_log(root / parallelism).records if r.phase == "train"]
    single = [r for r in read_progress_log(root / "single").records if r.phase == "train"]
    assert records[-1].tokens_total == single[-1].tokens_total


def test_gradient_noise_scale_is_measured_with_accumulation(single):
    records = [r for r in read_progress_log(single / "single").records if r.phase == "train"]
    assert all(r.gradient_noise_scale != 0 for r in records[1:])
