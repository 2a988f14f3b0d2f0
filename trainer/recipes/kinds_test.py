"""What the one training core promises, checked for every training kind (#30): pretrain, SFT,
VLM align and finetune, reward, DPO, PPO, GRPO, distill. Each kind is its own Bazel target
(`-k KIND`), all from this file:

- kill -9 mid-run, rerun the same attempt: final weights bitwise equal to an uninterrupted run;
- 2 gloo processes under DDP and under FSDP match one process with 2 accumulation steps
  (losses within 1e-5 relative, weights within 1e-4);
- an injected non-finite loss (two steps in a row, max_bad_steps 2) rolls back to the last
  checkpoint, and a bit flipped in a replay-checked step is caught and rolled back.
"""

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainer.recipes import kinds_base
from trainer.recipes.kinds_base import run
from trainer.testing import (
    final_weights,
    subprocess_env,
    tiny_job,
    torchrun,
    train_command,
    train_losses,
    unpack_tree,
    wait_for_step,
    write_job,
)
from trainer.vlm.testing import vlm_job

STEPS = 6  # a checkpoint every 2


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A pretrained and an SFT checkpoint, chat prompts, preference pairs and scenes: under
    Bazel, unpacked from the tarball every kinds test shares (KINDS_BASE, built once by
    BUILD.bazel's kinds_base); run by hand, built here."""
    root = tmp_path_factory.mktemp("base")
    tarball = os.environ.get("KINDS_BASE")
    if tarball:
        return unpack_tree(Path(tarball), root)
    return kinds_base.build(root)


def text(base: Path, kind: str) -> dict:
    return tiny_job(base / "cache", kind=kind, steps=STEPS)


def rl(base: Path, kind: str, rl_section: dict, **train) -> dict:
    spec = tiny_job(base / "cache", kind=kind, steps=STEPS, train=train)
    spec["trainer"]["checkpoint"] = {"path": str(base / kinds_base.SFT)}
    spec["trainer"]["rl"] = rl_section
    return spec


def vlm(base: Path, stage: str) -> dict:
    return vlm_job(base, steps=STEPS, train={"micro_batch": 4}, vision={"stage": stage})


def sft(base: Path) -> dict:
    spec = text(base, "SFT")
    spec["trainer"]["data"].update(
        input=str(base / "chat.jsonl"),
        format="jsonl_chat",
        tokenizer="bpe_file",
        tokenizer_path=str(next((base / "cache" / "datasets").iterdir()) / "tokenizer.json"),
    )
    spec["trainer"]["checkpoint"] = {"path": str(base / kinds_base.PRETRAINED)}
    return spec


def distill(base: Path) -> dict:
    spec = text(base, "DISTILL")
    spec["trainer"]["distill"] = {"teacher_path": str(base / kinds_base.PRETRAINED)}
    return spec


PROMPTS = {"reward": "sentence", "eval_fraction": 0.03}  # ~6 held-out prompts: evals stay cheap
KINDS: dict[str, Callable[[Path], dict]] = {
    "pretrain": lambda b: text(b, "PRETRAIN"),
    "sft": sft,
    "vlm_align": lambda b: vlm(b, "ALIGN"),
    "vlm_finetune": lambda b: vlm(b, "FINETUNE"),
    "reward": lambda b: rl(b, "REWARD", {"preferences": str(b / "prefs.jsonl")}),
    "dpo": lambda b: rl(b, "DPO", {"preferences": str(b / "prefs.jsonl"), "beta": 0.1}),
    "ppo": lambda b: rl(
        b,
        "PPO",
        {"prompts": str(b / "chat.jsonl"), "group_size": 2, "rollout_prompts": 2, **PROMPTS},
        micro_batch=2,
    ),  # fmt: skip
    "grpo": lambda b: rl(
        b,
        "PPO",
        {
            "prompts": str(b / "chat.jsonl"),
            "algorithm": "grpo",
            "group_size": 4,
            "rollout_prompts": 2,
            **PROMPTS,
        },
        micro_batch=2,
    ),  # fmt: skip
    "distill": distill,
}


def job(base: Path, kind: str, name: str, health: dict | None = None, **train) -> Path:
    """The kind's job with a checkpoint every 2 steps, every step logged, `train` applied."""
    spec = KINDS[kind](base)
    t = spec["trainer"]
    t["health"] = health or {}
    t.setdefault("train", {}).update(steps=STEPS, log_every=1, eval_every=0, **train)
    t.setdefault("checkpoint", {})["every_steps"] = 2
    t["optim"] = {**t.get("optim", {}), "warmup_steps": 0, "lr": 1e-3}
    return write_job(base / f"{name}.yaml", spec)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_core_gives_every_kind_resume_scale_and_health(kind, base, tmp_path):
    straight = tmp_path / "straight"
    run(job(base, kind, f"{kind}-accum", grad_accum=2), straight)
    expected = dict(train_losses(straight))
    assert sorted(expected) == list(range(1, STEPS + 1))
    weights = final_weights(straight)

    # kill -9 after the step-2 checkpoint (each step slowed by 0.3 s), then the same command
    killed = tmp_path / "killed"
    config = job(base, kind, f"{kind}-accum", grad_accum=2)
    env = dict(subprocess_env(), KITCHEN_FAULTS="slow:0:0.3")
    with open(tmp_path / "killed.log", "wb") as out:
        process = subprocess.Popen(
            train_command("--config", config, "--run-dir", killed), env=env, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    wait_for_step(killed, 3, process, timeout=300)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(30)
    resumed = run(config, killed)
    assert "resumed from" in resumed.stdout
    got = final_weights(killed)
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], weights[k]) for k in weights), "resume is not bitwise"

    # 2 processes x 1 micro-batch under DDP and FSDP = 1 process x 2 micro-batches
    for parallelism in ("DDP", "FSDP"):
        run_dir = tmp_path / parallelism
        result = torchrun(
            job(base, kind, f"{kind}-{parallelism}", parallelism=parallelism), run_dir
        )
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        losses = dict(train_losses(run_dir))
        for step, loss in expected.items():
            assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-7), (parallelism, step)
        other = final_weights(run_dir)
        for name, value in weights.items():
            torch.testing.assert_close(other[name], value, rtol=1e-4, atol=1e-5, msg=name)

    # non-finite losses at steps 3 and 4 roll back to step 2; a bit flipped in the first run
    # of replay-checked step 5 is caught, and rolled back to step 4
    health = {"replay_check_every": 5}
    config = job(base, kind, f"{kind}-faults", health, max_bad_steps=2)
    result = run(config, tmp_path / "faults", faults="nanloss:0:3,nanloss:0:4,replayflip:0:5")
    assert "rolled back from step 4 to step_00000002" in result.stdout
    assert "silent data corruption at step 5" in result.stdout
    assert "rolled back to step_00000004" in result.stdout
