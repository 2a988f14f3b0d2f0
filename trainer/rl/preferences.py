"""Make preference pairs offline by rejection sampling: sample N responses per prompt from a
checkpoint, score them with a verifier or a REWARD checkpoint, keep the best as `chosen` and
the worst as `rejected` (a prompt whose samples all score the same teaches nothing: skipped).

    ./bazel run //trainer/rl:make_preferences -- --checkpoint CKPT --prompts data/chat.jsonl \
        --reward sentence --out data/preferences.jsonl [--samples 4] [--max-prompts 200]

Writes {"prompt", "chosen", "rejected", "chosen_score", "rejected_score"} per line, the input
of REWARD and DPO jobs (trainer.rl.preferences). Exit 2 on bad input, naming the flag or line.
"""

import argparse
import json
import sys
from typing import cast

import torch

from protos import trainer_config_pb2
from protos.config_yaml import ConfigError
from protos.enums import enum_value
from protos.exit_codes import ExitCode
from protos.files import write_atomic
from protos.paths import user_path
from trainer import distributed
from trainer.rl import data, policy
from trainer.rl import job as rljob


def parse_args(argv):
    p = argparse.ArgumentParser(prog="make_preferences", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="the policy to sample from (step_* dir)")
    p.add_argument("--prompts", required=True, help='JSONL with a "prompt" per line')
    p.add_argument("--out", required=True, help="the preference JSONL to write")
    p.add_argument(
        "--reward", default="reward_model", help="a verifier (sentence, has_number, ...)"
    )
    p.add_argument("--reward-model", default="", help="a REWARD checkpoint (--reward reward_model)")
    p.add_argument("--samples", type=int, default=4, help="responses per prompt (at least 2)")
    p.add_argument("--max-prompts", type=int, default=0, help="use at most this many (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def config(args) -> trainer_config_pb2.TrainerConfig:
    """The TrainerConfig an RlJob reads: the flags in their trainer.rl fields."""
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.checkpoint.path = user_path(args.checkpoint)
    cfg.model.use_kernels = True
    cfg.train.seed = args.seed
    reward = enum_value(cfg.rl, "reward", args.reward, "--reward")
    cfg.rl.reward = cast(trainer_config_pb2.RewardSource, reward)
    cfg.rl.reward_path = user_path(args.reward_model) if args.reward_model else ""
    cfg.rl.max_new_tokens = args.max_new_tokens
    cfg.rl.temperature = args.temperature
    cfg.rl.group_size = args.samples
    if args.samples < 2:
        raise ConfigError("--samples", f"{args.samples}: a pair needs at least 2")
    if cfg.rl.reward == trainer_config_pb2.REWARD_MODEL and not cfg.rl.reward_path:
        raise ConfigError("--reward-model", "needed with --reward reward_model")
    return cfg


def make(args, log=print) -> int:
    cfg = config(args)
    env = distributed.init()
    out = user_path(args.out)
    quiet = lambda message: None  # noqa: E731
    job = rljob.load_policy(cfg, env.device, quiet)
    score = rljob.scorer(cfg, job, env.device, quiet)
    prompts = data.read_prompts(user_path(args.prompts), "--prompts")
    prompts = list(dict.fromkeys(prompts))[: args.max_prompts or None]
    n = args.samples
    generator = torch.Generator(device=env.device).manual_seed(args.seed)
    lines, ties, total = [], 0, 0.0
    for i in range(0, len(prompts), 16):
        chunk = prompts[i : i + 16]
        ids = [job.prompt_ids(p) for p in chunk]
        sampled = policy.sample(
            job.actor.model, ids, n, args.max_new_tokens,
            temperature=args.temperature, eos_id=job.tokenizer.eos_id,
            generator=generator, max_len=job.max_len,
        ).sequences  # fmt: skip
        starts = [len(ids[k // n]) for k in range(len(sampled))]
        texts = [job.tokenizer.decode(s[b:]) for s, b in zip(sampled, starts, strict=True)]
        scores = score([chunk[k // n] for k in range(len(sampled))], texts, sampled, starts)
        total += float(scores.sum())
        for j, prompt in enumerate(chunk):
            group = scores[j * n : (j + 1) * n]
            best, worst = int(group.argmax()), int(group.argmin())
            if group[best] == group[worst] or texts[j * n + best] == texts[j * n + worst]:
                ties += 1
                continue
            pair = {
                "prompt": prompt,
                "chosen": texts[j * n + best],
                "rejected": texts[j * n + worst],
                "chosen_score": float(group[best]),
                "rejected_score": float(group[worst]),
            }
            lines.append(json.dumps(pair) + "\n")
    write_atomic(out, "".join(lines))
    log(
        f"sampled {n} responses for each of {len(prompts)} prompts from {cfg.checkpoint.path}: "
        f"mean score {total / (n * len(prompts)):.3f}; wrote {len(lines)} pairs to {out} "
        f"({ties} prompts skipped: every sample scored the same)"
    )
    return ExitCode.OK


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return make(args)
    except ConfigError as e:
        print(f"make_preferences: {e}", file=sys.stderr)
        return ExitCode.BAD_CONFIG


if __name__ == "__main__":
    sys.exit(main())
