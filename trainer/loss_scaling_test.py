"""fp16 training with dynamic loss scaling, in process on the CPU (fp16 autocast): the loss
falls, the scaler's state travels in the checkpoint, and a step whose scaled gradients
overflow changes no weight while the scale halves."""

import pytest
import torch

from protos.config_yaml import ConfigError, job_spec_from_dict
from protos.progress_log import read_progress_log
from protos.validation import resolve_trainer
from trainer import checkpoint, loop
from trainer.data.precook import precook_dataset
from trainer.distributed import DistEnv
from trainer.recipes.lm import lm_trainer
from trainer.testing import tiny_job

torch.set_num_threads(1)
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def fp16_trainer(cache, run_dir, steps: int, **train) -> loop.Trainer:
    spec = job_spec_from_dict(tiny_job(cache, steps=steps, train={"dtype": "fp16", **train}))
    cfg = resolve_trainer(spec.trainer)
    ds = precook_dataset(cfg.data, str(cache), show_progress=False)
    return lm_trainer(cfg, run_dir, CPU, ds.path, ds.tokenizer.vocab_size, log=lambda _: None)


def test_fp16_trains_and_checkpoints_its_loss_scale(cache, tmp_path):
    trainer = fp16_trainer(cache, tmp_path, steps=8)
    assert trainer.dtype == torch.float16 and trainer.scaler.is_enabled()
    assert trainer.run() == loop.Outcome.DONE
    losses = [r.loss for r in read_progress_log(tmp_path).records if r.phase == "train"]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    newest = checkpoint.checkpoints(tmp_path / "checkpoints")[-1]
    state = torch.load(newest / "train.pt", weights_only=False)["ranks"][0]
    assert state["grad_scaler"]["scale"] == trainer.scaler.get_scale() > 0
    resumed = fp16_trainer(cache, tmp_path, steps=8)
    resumed.resume_or_init()
    assert resumed.step == 8 and resumed.scaler.get_scale() == trainer.scaler.get_scale()


def test_an_overflowing_step_changes_nothing_and_halves_the_scale(cache, tmp_path):
    trainer = fp16_trainer(cache, tmp_path, steps=4)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)  # fp16 max is 65,504
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.advance()
    after = list(trainer.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert trainer.scaler.get_scale() == 2.0**99


def test_fp16_with_fsdp_is_refused_naming_the_field(cache):
    spec = job_spec_from_dict(tiny_job(cache, train={"dtype": "fp16", "parallelism": "FSDP"}))
    with pytest.raises(ConfigError) as refused:
        resolve_trainer(spec.trainer, world_size=2)
    assert refused.value.field == "trainer.train.dtype" and "bf16" in str(refused.value)


def test_fp16_with_tensor_parallel_is_refused_naming_the_field(cache):
    job = tiny_job(cache, train={"dtype": "fp16", "tensor_parallel": 2, "parallelism": "DDP"})
    with pytest.raises(ConfigError) as refused:
        resolve_trainer(job_spec_from_dict(job).trainer, world_size=2)
    assert refused.value.field == "trainer.train.dtype" and "bf16" in str(refused.value)
