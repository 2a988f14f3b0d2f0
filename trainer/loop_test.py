"""The loop's loss guard, in process: a bad loss skips its update; several in a row roll the
run back to its last checkpoint; with no checkpoint, training stops with a clear error."""

import math

import pytest
import torch

from protos.config_yaml import job_spec_from_dict
from protos.progress_log import is_training_step, read_progress_log
from protos.validation import resolve_trainer
from trainer import loop
from trainer.data.precook import precook_dataset
from trainer.distributed import DistEnv
from trainer.recipes.lm import lm_trainer
from trainer.testing import tiny_job

torch.set_num_threads(1)
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def make_trainer(cache, run_dir, bad_calls, **sections):
    """A Trainer whose train_step reports NaN on the given (1-based) calls."""
    spec = job_spec_from_dict(tiny_job(cache, **sections))
    cfg = resolve_trainer(spec.trainer)
    ds = precook_dataset(cfg.data, str(cache), show_progress=False)
    messages: list[str] = []
    trainer = lm_trainer(cfg, run_dir, CPU, ds.path, ds.tokenizer.vocab_size, log=messages.append)
    real_step, calls, updates = trainer.train_step, [], []

    def train_step(batches, counts, n_tokens):
        loss, grad_norm = real_step(batches, counts, n_tokens)
        calls.append(trainer.step + 1)
        return (math.nan if len(calls) in bad_calls else loss), grad_norm

    trainer.train_step = train_step  # type: ignore[method-assign]  # a NaN on bad_calls
    trainer.optimizer.register_step_post_hook(lambda *_: updates.append(trainer.step + 1))
    return trainer, calls, updates, messages


def test_a_nan_loss_skips_only_its_update(cache, tmp_path):
    trainer, calls, updates, _ = make_trainer(cache, tmp_path, bad_calls={3}, steps=6)
    assert trainer.run() == loop.Outcome.DONE
    assert calls == [1, 2, 3, 4, 5, 6] and updates == [1, 2, 4, 5, 6]
    train = [r for r in read_progress_log(tmp_path).records if r.phase == "train"]
    assert [r.skipped_steps for r in train] == [0, 0, 1, 1, 1, 1]
    assert all(r.rollbacks == 0 for r in train)
    assert math.isnan(train[2].loss)  # no accepted step to average


def test_bad_steps_in_a_row_roll_back_to_the_last_checkpoint(cache, tmp_path):
    trainer, calls, updates, messages = make_trainer(
        cache, tmp_path, bad_calls={5, 6, 7}, steps=8, checkpoint={"every_steps": 4}
    )
    assert trainer.run() == loop.Outcome.DONE
    # Steps 5-7 were rejected; the third in a row restored step 4 and training went on from
    # there, with fresh batches (the loader is not rewound: the bad data is not replayed).
    assert calls == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8]
    assert updates == [1, 2, 3, 4, 5, 6, 7, 8]
    assert trainer.loader.state_dict()["batch"] == len(calls)
    assert any("rolled back from step 7 to step_00000004" in m for m in messages)
    records = read_progress_log(tmp_path).records
    last = [r for r in records if is_training_step(r)][-1]
    assert (last.skipped_steps, last.rollbacks) == (3, 1)
    assert any("rolled back" in r.message for r in records)
    # The redone steps count as lost progress, not as goodput.
    assert trainer.goodput.seconds["lost"] > 0


def test_rollback_without_a_checkpoint_is_a_clear_failure(cache, tmp_path):
    trainer, *_ = make_trainer(
        cache, tmp_path, bad_calls={1, 2, 3}, steps=5, checkpoint={"every_steps": 0}
    )
    with pytest.raises(loop.TrainingError, match="no checkpoint to roll back to"):
        trainer.run()
