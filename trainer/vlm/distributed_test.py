"""A VLM stage on two processes under torchrun (gloo on 127.0.0.1) trains like one process.

As for the text trainer (trainer/distributed_test.py): the loader hands global batch g to rank
g % world_size and the loss is the mean over every labelled token of the global batch, so 2
ranks x 1 micro-batch under DDP must match 1 process x 2 micro-batches of gradient
accumulation: the same loss at every step and the same final weights, up to float summation
order (rel 1e-5 on the loss, as the text trainer's test).
"""

import pytest
import torch

from protos.progress_log import read_progress_log
from trainer.testing import final_weights, run_trainer, torchrun, train_losses, write_job
from trainer.vlm.testing import vlm_job, write_scenes

STEPS = 4


def job(root, stage: str, **train) -> dict:
    return vlm_job(
        root,
        steps=STEPS,
        train={"micro_batch": 8, "log_every": 1, **train},
        vision={"stage": stage},
        checkpoint={"every_steps": 2},
    )


# ALIGN trains the encoder and projector with the language model frozen: DDP reduces the
# vision parameters and leaves the frozen ones out (a text model's DDP run is
# trainer/distributed_test.py's; FINETUNE, everything trained, matched too, and took as long).
@pytest.mark.parametrize("stage", ["ALIGN"])
def test_two_processes_match_one(tmp_path, stage):
    write_scenes(tmp_path, count=60)
    single = write_job(tmp_path / "single.yaml", job(tmp_path, stage, grad_accum=2))
    result = run_trainer("--config", single, "--run-dir", tmp_path / "single")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ddp = job(tmp_path, stage, parallelism="DDP")
    result = torchrun(write_job(tmp_path / "ddp.yaml", ddp), tmp_path / "ddp")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    expected, got = dict(train_losses(tmp_path / "single")), dict(train_losses(tmp_path / "ddp"))
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    a, b = final_weights(tmp_path / "single"), final_weights(tmp_path / "ddp")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)
    records = [r for r in read_progress_log(tmp_path / "ddp").records if r.phase == "train"]
    alone = [r for r in read_progress_log(tmp_path / "single").records if r.phase == "train"]
    assert records[-1].tokens_total == alone[-1].tokens_total
    assert records[-1].image_token_share == pytest.approx(alone[-1].image_token_share)
