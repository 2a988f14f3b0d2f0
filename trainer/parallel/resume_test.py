"""The trainer's own checkpoints under model-parallel layouts, resumed under other layouts.

Through the real entry point (`trainer.main` under torchrun, gloo on 127.0.0.1), a chain of
runs of one tiny job, every run on the same global batch (16 rows a step) and data order:
  A  pipeline parallel with FSDP (PP=2 x FSDP=2, 4 ranks) trains steps 1-4, a checkpoint
     every step (dcp/ + model.pt);
  B  A's step-1 checkpoint resumed under tensor parallel (TP=2, 2 ranks): steps 2-4;
  C  B's step-3 checkpoint (written by TP) resumed under plain data parallel (DDP, 2 ranks).
Each resumed step logs the loss A logged at that step (relative 1e-5, as the layouts' proofs),
and the final weights agree; in this process, A's shards load into one whole model.
"""

import shutil
from pathlib import Path

import pytest
import torch

from protos import trainer_config_pb2
from trainer import checkpoint
from trainer.model import Transformer, select_ops
from trainer.optim import build_optimizer
from trainer.testing import final_weights, tiny_job, torchrun, train_losses, write_job

STEPS = 4
MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "tie_embeddings": False}


def job(root: Path, name: str, **train) -> Path:
    train = {"parallelism": "DDP", **train}
    spec = tiny_job(
        root / "cache", steps=STEPS, model=MODEL, train=train, checkpoint={"every_steps": 1}
    )
    spec["trainer"]["checkpoint"]["keep_last"] = STEPS
    return write_job(root / f"{name}.yaml", spec)


def resume_from(source: Path, step: int, run_dir: Path) -> None:
    """`run_dir` starts with one checkpoint of `source`: the trainer resumes from it."""
    name = f"{checkpoint.PREFIX}{step:08d}"
    shutil.copytree(source / "checkpoints" / name, run_dir / "checkpoints" / name)


def launch(root: Path, name: str, nproc: int, **train) -> Path:
    """`train`: the layout and grad_accum, so that micro_batch (4) x data-parallel ranks x
    grad_accum is 16 rows in every run."""
    result = torchrun(job(root, name, **train), root / name, nproc=nproc)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root / name


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    launch(root, "pp2", 4, pipeline_parallel=2, parallelism="FSDP", grad_accum=2)
    resume_from(root / "pp2", 1, root / "tp2")
    launch(root, "tp2", 2, tensor_parallel=2, grad_accum=4)
    resume_from(root / "tp2", 3, root / "dp2")
    launch(root, "dp2", 2, grad_accum=2)
    return root


def test_pipeline_checkpoint_holds_every_rank_shards_checksummed(chain):
    path = chain / "pp2" / "checkpoints" / f"{checkpoint.PREFIX}{STEPS:08d}"
    meta = checkpoint.verify(path)
    shards = sorted(n for n in meta.files if n.startswith("dcp/"))
    assert shards == ["dcp/.metadata"] + [f"dcp/__{r}_0.distcp" for r in range(4)]
    assert "optimizer" not in torch.load(path / "train.pt")  # it is in the shards
    # Retention and numbering as for every run: one directory per step, nothing left over.
    names = sorted(p.name for p in (chain / "pp2" / "checkpoints").iterdir())
    assert names == [f"{checkpoint.PREFIX}{s:08d}" for s in range(1, STEPS + 1)]
    # A damaged shard makes the checkpoint invalid for a resume.
    damaged = chain / "damaged"
    shutil.copytree(path, damaged)
    with open(damaged / "dcp" / "__3_0.distcp", "r+b") as f:
        f.write(b"\0" * 16)
    with pytest.raises(checkpoint.CheckpointError, match="__3_0.distcp"):
        checkpoint.verify(damaged)


@pytest.mark.parametrize(("run", "first"), [("tp2", 2), ("dp2", 4)])
def test_resumed_under_another_layout_logs_the_same_losses(chain, run, first):
    expected = dict(train_losses(chain / "pp2"))
    got = dict(train_losses(chain / run))
    assert sorted(got) == list(range(first, STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), (run, step)
    a, b = final_weights(chain / "pp2"), final_weights(chain / run)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=2e-4, msg=name)
    log = (chain / run / "train.log").read_text()
    if run == "tp2":  # A ran on 4 processes
        assert "written by 4 processes, resumed by 2" in log
    assert f"resumed from {chain / run / 'checkpoints'}" in log


def test_shards_load_into_one_process(chain):
    """dcp/ read with no process group into a whole model: model.pt's weights exactly."""
    path = chain / "pp2" / "checkpoints" / f"{checkpoint.PREFIX}{STEPS:08d}"
    meta = checkpoint.verify(path)
    model = Transformer(meta.model, meta.vocab_size, ops=select_ops(False, "cpu"))
    # The learning rate and betas come from the checkpoint's param groups.
    optimizer = build_optimizer(model, trainer_config_pb2.OptimConfig(lr=0.0), "cpu")
    checkpoint.load(path, model, optimizer, rank=0)
    whole = torch.load(path / "model.pt")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, whole[name], rtol=0, atol=0, msg=name)
    assert len(optimizer.state) == len(list(model.parameters()))
    assert optimizer.param_groups[0]["lr"] > 0
