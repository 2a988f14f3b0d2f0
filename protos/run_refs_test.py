"""`run:NAME` resolves to the newest checkpoint of the newest run of that name, or is refused
naming the field."""

import os
import time

import pytest
from google.protobuf import json_format

from protos import attempt_pb2, job_pb2, trainer_config_pb2
from protos.config_yaml import ConfigError
from protos.paths import absolute_paths
from protos.run_refs import resolve, runs_on_disk


def _checkpoint(run_dir, step: int) -> str:
    path = os.path.join(run_dir, "checkpoints", f"step_{step:08d}")
    os.makedirs(path)
    return path


def _launcher_run(state, job_id: str, name: str) -> str:
    run_dir = os.path.join(state, "runs", job_id)
    attempt_dir = os.path.join(run_dir, "attempts", "001")
    os.makedirs(attempt_dir)
    attempt = attempt_pb2.Attempt(job_id=job_id, spec=job_pb2.JobSpec(name=name))
    with open(os.path.join(attempt_dir, "attempt.json"), "w") as f:
        f.write(json_format.MessageToJson(attempt))
    return run_dir


def test_newest_checkpoint_of_the_newest_run_of_that_name(tmp_path):
    state = str(tmp_path)
    old = _launcher_run(state, "j2", "guide-sft")
    _checkpoint(old, 100)
    _launcher_run(state, "j3", "guide-pretrain")
    _checkpoint(os.path.join(state, "runs", "j3"), 80)
    time.sleep(0.01)  # mtimes order the runs
    new = _launcher_run(state, "j5", "guide-sft")
    _checkpoint(new, 50)
    newest = _checkpoint(new, 100)
    os.makedirs(os.path.join(new, "checkpoints", ".tmp-step_00000150-7"))  # a save midway

    cfg = trainer_config_pb2.TrainerConfig()
    cfg.checkpoint.path = "run:guide-sft"
    cfg.eval.sweep = "run:guide-pretrain"
    absolute_paths(cfg)  # leaves references to the resolver
    assert cfg.checkpoint.path == "run:guide-sft"
    done = resolve(cfg, runs_on_disk(state))
    assert cfg.checkpoint.path == newest
    assert cfg.eval.sweep == os.path.join(state, "runs", "j3")
    assert [(r.field, r.reference, r.job_id) for r in done] == [
        ("checkpoint.path", "run:guide-sft", "j5"),
        ("eval.sweep", "run:guide-pretrain", "j3"),
    ]
    assert "run:guide-sft -> " in done[0].describe()


def test_a_run_by_hand_is_found_by_its_directory_name(tmp_path):
    path = _checkpoint(os.path.join(tmp_path, "runs", "tiny"), 200)
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.distill.teacher_path = "run:tiny"
    (found,) = resolve(cfg, runs_on_disk(str(tmp_path)))
    assert cfg.distill.teacher_path == path and found.job_id == ""


def test_a_serve_draft_model_is_a_checkpoint_field(tmp_path):
    path = _checkpoint(os.path.join(tmp_path, "runs", "small"), 50)
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.serve.draft_path = "run:small"
    (found,) = resolve(cfg, runs_on_disk(str(tmp_path)))
    assert cfg.serve.draft_path == path and found.field == "serve.draft_path"


@pytest.mark.parametrize(
    "section, field, value, problem",
    [
        ("checkpoint", "path", "run:nobody", "no successful run named 'nobody'"),
        ("checkpoint", "path", "run:", "after 'run:' comes a job name"),
        ("checkpoint", "path", "run:../j2", "after 'run:' comes a job name"),
        ("data", "input", "run:guide-sft", "only trainer.checkpoint.path"),
    ],
)
def test_refused_naming_the_field(tmp_path, section, field, value, problem):
    run_dir = _launcher_run(str(tmp_path), "j1", "guide-sft")
    _checkpoint(run_dir, 1)
    cfg = trainer_config_pb2.TrainerConfig()
    setattr(getattr(cfg, section), field, value)
    with pytest.raises(ConfigError) as e:
        resolve(cfg, runs_on_disk(str(tmp_path)))
    assert e.value.field == f"trainer.{section}.{field}"
    assert problem in e.value.problem


def test_a_run_without_a_checkpoint_is_passed_over(tmp_path):
    state = str(tmp_path)
    older = _launcher_run(state, "j1", "sft")
    path = _checkpoint(older, 10)
    _launcher_run(state, "j2", "sft")  # newer, but it never saved
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.rl.reference_path = "run:sft"
    resolve(cfg, runs_on_disk(state))
    assert cfg.rl.reference_path == path


def test_the_callers_candidates_decide(tmp_path):
    """The launcher offers only its team's successful jobs: others are never looked at."""
    theirs = _launcher_run(str(tmp_path), "j1", "sft")
    _checkpoint(theirs, 10)
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.checkpoint.path = "run:sft"
    with pytest.raises(ConfigError):
        resolve(cfg, lambda name: [])
