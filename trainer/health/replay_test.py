"""The replay check on one process (trainer/health/replay.py), in a real Trainer on a tiny model.

Three runs of the same 8-step job, a checkpoint every 2 steps: without the check, with a replay
every 3 steps (steps 3 and 6), and with the same check while KITCHEN_FAULTS flips one weight bit
in the first of the two runs of step 6. The clean check changes nothing, bit for bit; the
faulted run is caught at step 6, rolls back to step 4 and ends where the clean runs end.
"""

import socket

import pytest
import torch

from protos.config_yaml import ConfigError, job_spec_from_dict
from protos.progress_log import is_training_step, read_progress_log
from protos.validation import resolve_trainer
from trainer import loop
from trainer.data.precook import precook_dataset
from trainer.distributed import DistEnv
from trainer.health import faults, replay
from trainer.recipes.lm import lm_trainer
from trainer.testing import tiny_job, train_losses

torch.set_num_threads(1)
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
EVERY, FAULTY_STEP, STEPS = 3, 6, 8


def train(cache, run_dir, every: int) -> tuple[loop.Trainer, list[str]]:
    job = tiny_job(
        cache,
        steps=STEPS,
        checkpoint={"every_steps": 2},
        health={"replay_check_every": every},
    )
    cfg = resolve_trainer(job_spec_from_dict(job).trainer)
    ds = precook_dataset(cfg.data, str(cache), show_progress=False)
    messages: list[str] = []
    trainer = lm_trainer(cfg, run_dir, CPU, ds.path, ds.tokenizer.vocab_size, log=messages.append)
    assert trainer.run() == loop.Outcome.DONE
    return trainer, messages


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    out = {"off": train(cache, tmp_path_factory.mktemp("off"), every=0)}
    out["on"] = train(cache, tmp_path_factory.mktemp("on"), every=EVERY)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(faults.ENV, f"replayflip:0:{FAULTY_STEP}")
        out["faulty"] = train(cache, tmp_path_factory.mktemp("faulty"), every=EVERY)
    return out


def weights(trainer: loop.Trainer) -> dict[str, torch.Tensor]:
    return trainer.model.state_dict()


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_clean_replay_check_changes_nothing(runs):
    (off, _), (on, messages) = runs["off"], runs["on"]
    assert any("replay checks every 3 steps" in m for m in messages)
    assert not any("silent data corruption" in m for m in messages)
    assert train_losses(on.run_dir) == train_losses(off.run_dir)  # floats compared exactly
    assert_bitwise_equal(weights(on), weights(off))
    last = [r for r in read_progress_log(on.run_dir).records if is_training_step(r)][-1]
    assert (last.sdc_checks, last.sdc_rollbacks) == (STEPS // EVERY, 0)


def test_a_corrupted_first_run_is_caught_rolled_back_and_training_ends_clean(runs):
    (off, _), (faulty, messages) = runs["off"], runs["faulty"]
    caught = [m for m in messages if "silent data corruption" in m]
    assert caught == [
        f"silent data corruption at step {FAULTY_STEP}: a replayed step did not reproduce its "
        f"parameters and optimizer state bitwise; suspect rank 0 on {socket.gethostname()}: "
        "rolled back to step_00000004"
    ]
    losses = train_losses(faulty.run_dir)
    # Step 6 was rolled back before it was logged; steps 5 and 6 were trained again.
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    assert dict(losses) == dict(train_losses(off.run_dir))
    assert_bitwise_equal(weights(faulty), weights(off))
    records = read_progress_log(faulty.run_dir).records
    last = [r for r in records if is_training_step(r)][-1]
    # Checks at 3, 6 (failed) and 6 again after the rollback; the metric the alert reads.
    assert (last.sdc_checks, last.sdc_rollbacks) == (3, 1)
    assert [(r.rank, r.sdc_mismatches) for r in last.ranks] == [(0, 1)]
    assert faulty.goodput.seconds["sdc_rollback"] > 0


@pytest.mark.parametrize(
    "device, dtype, parallelism, why",
    [
        ("cpu", torch.bfloat16, "SINGLE", "in torch.bfloat16"),
        ("cuda", torch.float32, "DDP", "only on CPU"),
        ("cpu", torch.float32, "FSDP", "not FSDP"),
    ],
)
def test_a_step_that_need_not_reproduce_is_refused_naming_the_field(
    device, dtype, parallelism, why
):
    with pytest.raises(ConfigError, match="trainer.health.replay_check_every") as error:
        replay.ReplayChecker(4, torch.device(device), dtype, parallelism)
    assert why in str(error.value)
    assert replay.ReplayChecker(0, torch.device(device), dtype, parallelism).every == 0


def test_the_replay_fault_fires_once_on_its_step():
    injector = faults.Injector(faults.parse("replayflip:0:6"), rank=0)
    assert [injector.replay_flip_due(s) for s in (3, 6, 6)] == [False, True, False]
    assert "first run of replay-checked step 6" in str(faults.parse("replayflip:1:6")[0])


def test_under_ddp_the_first_step_of_a_process_is_not_replayed():
    cpu = torch.device("cpu")
    ddp = replay.ReplayChecker(1, cpu, torch.float32, "DDP")
    assert [ddp.due(step) for step in (5, 6, 7)] == [False, True, True]  # e.g. resumed at 4
    single = replay.ReplayChecker(2, cpu, torch.float32, "SINGLE")
    assert [single.due(step) for step in (1, 2, 3, 4)] == [False, True, False, True]
