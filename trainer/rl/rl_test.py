"""RLHF end to end on a tiny model trained here: SFT checkpoint -> rejection-sampled
preferences -> reward model, DPO and GRPO, each measured on held-out prompts; and bad input.

The SENTENCE verifier (one line ending with a full stop) is the skill: the SFT model answers in
that format about one time in eight. The numbers are deterministic (fixed seeds, one thread);
the assertions leave a margin below what was measured (docs/rlhf.md has the full runs).
"""

import json
import signal

import pytest
import torch

from protos.exit_codes import ExitCode
from trainer import main
from trainer.rl import preferences
from trainer.testing import (
    chat_file,
    sft_job,
    start_trainer,
    tiny_job,
    wait_for_step,
    write_job,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """(work dir, precook cache, an SFT checkpoint that answers "What is i plus i?")."""
    tmp = tmp_path_factory.mktemp("rl")
    cache = tmp / "cache"
    pretrain = write_job(tmp / "pretrain.yaml", tiny_job(cache, steps=30))
    assert main.main(["--config", str(pretrain), "--run-dir", str(tmp / "pre")]) == 0
    chat = chat_file(tmp / "chat.jsonl")
    spec = sft_job(cache, chat, tmp / "pre/checkpoints/step_00000030", steps=40)
    assert (
        main.main(
            ["--config", str(write_job(tmp / "sft.yaml", spec)), "--run-dir", str(tmp / "sft")]
        )
        == 0
    )
    return tmp, cache, tmp / "sft/checkpoints/step_00000040"


def rl_job(sft, name, kind, steps, lr, rl, **train):
    tmp, cache, checkpoint = sft
    spec = tiny_job(cache, kind=kind, steps=steps, optim={"lr": lr, "warmup_steps": 0})
    spec["trainer"]["train"].update({"log_every": 5, **train})
    spec["trainer"]["checkpoint"] = {"path": str(checkpoint), "every_steps": 0}
    spec["trainer"]["rl"] = rl
    return write_job(tmp / f"{name}.yaml", spec)


def run(tmp, config, name) -> dict:
    assert main.main(["--config", str(config), "--run-dir", str(tmp / name)]) == 0
    return json.loads((tmp / name / "rl.json").read_text())


def test_preferences_reward_model_dpo_and_grpo_measurably_improve(sft, capsys):
    tmp, _, checkpoint = sft
    prefs = tmp / "prefs.jsonl"
    args = ["--checkpoint", str(checkpoint), "--prompts", str(tmp / "chat.jsonl")]
    # Seed 1: with rollouts on the inference engine (a seed per response), the reward model's
    # held-out accuracy measured 54% (seed 0), 96%, 100%, 96% (seeds 1-3): seed 0's pairs are
    # ones this tiny reward model does not separate; with the old sampler 100%, 100%, 100%, 97%.
    args += ["--out", str(prefs), "--reward", "sentence", "--samples", "8", "--seed", "1"]
    assert preferences.main(args) == 0
    pairs = [json.loads(line) for line in prefs.read_text().splitlines()]
    assert len(pairs) > 60
    assert all(p["chosen_score"] > p["rejected_score"] for p in pairs)

    pref_rl = {"preferences": str(prefs), "eval_fraction": 0.25}
    reward = run(tmp, rl_job(sft, "rm", "REWARD", 80, 3e-3, pref_rl, micro_batch=8), "rm")
    assert reward["heldout_pairs"] >= 20
    assert reward["heldout_accuracy"] >= 0.75  # measured 100% on 32 pairs; chance is 50%

    dpo_rl = dict(pref_rl, pass_verifier="sentence", beta=0.1)
    dpo = run(tmp, rl_job(sft, "dpo", "DPO", 60, 1e-3, dpo_rl), "dpo")
    # measured 11.7% -> 57.8% of 128 samples, KL 8.5 nats
    assert dpo["pass_rate_after"] >= dpo["pass_rate_before"] + 0.2
    assert dpo["kl_after"] > 0

    grpo_rl: dict[str, object] = {
        "prompts": str(tmp / "chat.jsonl"),
        "reward": "sentence",
        "algorithm": "grpo",
    }
    grpo_rl.update(group_size=8, rollout_prompts=4, kl_coef=0.05)
    grpo = run(tmp, rl_job(sft, "grpo", "PPO", 80, 3e-3, grpo_rl, micro_batch=16), "grpo")
    # measured 7.1% -> 26.8% of 56 samples (rollouts on the inference engine, #30)
    assert grpo["pass_rate_after"] >= grpo["pass_rate_before"] + 0.15
    assert grpo["kl_after"] > 0
    assert 0 < grpo["rollout_share"] < 1
    out = capsys.readouterr().out
    assert "of each step spent generating" in out
    # The trained policy is an ordinary checkpoint: a GENERATE job loads it.
    assert (tmp / "grpo/checkpoints/step_00000080/model.pt").exists()


def test_bad_input_is_refused_before_any_work(sft, capsys):
    tmp, cache, checkpoint = sft
    bad = tmp / "bad.jsonl"
    good = {"prompt": "What is 1 plus 1?", "chosen": "2.", "rejected": "3"}
    bad.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "p", "chosen": "a"}) + "\n")
    config = rl_job(sft, "bad", "DPO", 2, 1e-3, {"preferences": str(bad)})
    assert (
        main.main(["--config", str(config), "--run-dir", str(tmp / "bad")]) == ExitCode.BAD_CONFIG
    )
    assert f'trainer.rl.preferences: {bad}:2: field "rejected" missing' in capsys.readouterr().err

    # chosen identical to rejected: counted and skipped
    same = tmp / "same.jsonl"
    lines = [dict(good, prompt=f"What is {i} plus 1?") for i in range(40)]
    lines += [dict(good, rejected="2.")] * 3
    same.write_text("".join(json.dumps(x) + "\n" for x in lines))
    config = rl_job(
        sft, "same", "REWARD", 1, 1e-3, {"preferences": str(same), "eval_fraction": 0.3}
    )
    assert main.main(["--config", str(config), "--run-dir", str(tmp / "same")]) == 0
    assert "3 skipped: chosen identical to rejected" in capsys.readouterr().out

    # A reference with another vocabulary: exit 2 naming the field, nothing trained.
    other = tiny_job(cache, steps=1)
    other["trainer"]["data"].update(vocab_size=300)
    other["trainer"]["checkpoint"] = {"every_steps": 1}
    assert (
        main.main(
            ["--config", str(write_job(tmp / "other.yaml", other)), "--run-dir", str(tmp / "other")]
        )
        == 0
    )
    rl = {
        "prompts": str(tmp / "chat.jsonl"),
        "reward": "sentence",
        "reference_path": str(tmp / "other/checkpoints/step_00000001"),
    }
    config = rl_job(sft, "mismatch", "PPO", 1, 1e-3, rl)
    capsys.readouterr()
    assert (
        main.main(["--config", str(config), "--run-dir", str(tmp / "mismatch")])
        == ExitCode.BAD_CONFIG
    )
    err = capsys.readouterr().err
    assert "trainer.rl.reference_path" in err and "300-token vocabulary" in err
    assert not (tmp / "mismatch" / "checkpoints").exists()


def test_sigterm_saves_and_exits_preempted(sft):
    tmp, _, _ = sft
    rl = {"prompts": str(tmp / "chat.jsonl"), "reward": "sentence", "algorithm": "grpo"}
    config = rl_job(sft, "stopped", "PPO", 500, 1e-3, rl, log_every=1)
    run_dir = tmp / "stopped"
    process = start_trainer("--config", config, "--run-dir", run_dir, log_path=tmp / "stop.log")
    step = wait_for_step(run_dir, 1, process, timeout=240)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == ExitCode.PREEMPTED
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert saved and int(saved[-1].name.removeprefix("step_")) >= step
