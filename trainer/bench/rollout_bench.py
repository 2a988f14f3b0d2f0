"""Rollout benchmark (#14): what batching buys generation, and where a PPO step's time goes.

1. Rollout tokens/s: the same responses sampled with the KV cache as one batch
   (trainer.rl.policy.sample, one forward per new token for every row) and one sequence at a
   time, side by side in alternating rounds; no EOS, so both generate the same tokens.
2. The share of a PPO step spent generating: a rollout batch as trainer/rl/ppo.py builds it
   (sample, then policy and reference log-probabilities) against its update (ppo_epochs passes
   of forward, backward and AdamW in micro-batches), on the same model.

    python trainer/bench/rollout_bench.py [--out trainer/bench/rollout_results.md]

CPU always (fp32, one thread); CUDA too when present. Randomly initialized weights: speed does
not depend on what the model learned.
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

from protos import trainer_config_pb2
from protos.defaults import with_defaults
from protos.files import write_atomic
from trainer.model import Transformer
from trainer.rl import losses, policy

VOCAB = 4096
NO_EOS = -1  # an id never sampled: every row runs to max_new_tokens


def model_config(dim: int, layers: int, heads: int, seq: int) -> trainer_config_pb2.ModelConfig:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = dim, layers, heads
    cfg.data.seq_len = seq
    return with_defaults(cfg).model


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def rollout_speed(model, prompts, new_tokens, rounds, device) -> dict:
    gen = torch.Generator(device=device)

    def batched():
        policy.sample(model, prompts, 1, new_tokens, temperature=1.0, eos_id=NO_EOS,
                      generator=gen.manual_seed(0), max_len=10_000)  # fmt: skip

    def one_by_one():
        for p in prompts:
            policy.sample(model, [p], 1, new_tokens, temperature=1.0, eos_id=NO_EOS,
                          generator=gen.manual_seed(0), max_len=10_000)  # fmt: skip

    batched(), one_by_one()  # warm-up
    times: dict[str, list[float]] = {"batched": [], "one at a time": []}
    for r in range(rounds):
        order = [("batched", batched), ("one at a time", one_by_one)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            times[name].append(timed(fn))
    tokens = len(prompts) * new_tokens
    return {name: tokens / statistics.median(t) for name, t in times.items()}


def ppo_step_share(model, ref, prompts, group, new_tokens, epochs, micro_batch, device) -> dict:
    """(rollout seconds, update seconds) of one PPO step as ppo.py runs it (median of 3)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator(device=device).manual_seed(0)
    rollouts, updates = [], []
    for _ in range(3):
        start = time.perf_counter()
        out = policy.sample(model, prompts, group, new_tokens, temperature=1.0, eos_id=NO_EOS,
                            generator=gen, max_len=10_000)  # fmt: skip
        starts = [len(prompts[i // group]) for i in range(len(out))]
        batch = policy.make_batch(list(zip(out, starts, strict=True)), 0, device)
        with torch.no_grad():
            old = policy.token_logps(model, batch)
            policy.token_logps(ref, batch)
        advantages = torch.randn_like(old) * batch.mask
        if device.type == "cuda":
            torch.cuda.synchronize()
        rollouts.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(epochs):
            for idx in torch.randperm(len(out)).split(micro_batch):
                idx = idx.to(device)
                sub = policy.rows(batch, idx)
                _, logps, _ = policy.forward(model, sub)
                loss, _ = losses.clipped_policy_loss(
                    logps, old[idx], advantages[idx], sub.mask, 0.2
                )
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        updates.append(time.perf_counter() - start)
    return {"rollout": statistics.median(rollouts), "update": statistics.median(updates)}


def run(device: torch.device, dims, args) -> list[str]:
    torch.manual_seed(0)
    cfg = model_config(*dims)
    model = Transformer(cfg, VOCAB).to(device)
    ref = Transformer(cfg, VOCAB).to(device)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    prompt_len = 16
    prompts = [torch.randint(3, VOCAB, (prompt_len,)).tolist() for _ in range(args.prompts)]
    speed = rollout_speed(model, prompts, args.new_tokens, args.rounds, device)
    ratio = speed["batched"] / speed["one at a time"]
    share = ppo_step_share(
        model, ref, prompts[: args.rollout_prompts], args.group, args.new_tokens,
        args.epochs, args.micro_batch, device,
    )  # fmt: skip
    total = share["rollout"] + share["update"]
    return [
        f"## {device.type}: model dim {dims[0]}, {dims[1]} layers, {dims[2]} heads "
        f"({params:.2f} M parameters, vocabulary {VOCAB})",
        "",
        f"Rollout: {args.prompts} prompts of {prompt_len} tokens, {args.new_tokens} new tokens "
        f"each, temperature 1, median of {args.rounds} alternating rounds.",
        "",
        "| sampling | tokens/s | vs one at a time |",
        "|---|---|---|",
        f"| one sequence at a time | {speed['one at a time']:,.0f} | 1 |",
        f"| one batch of {args.prompts} (KV cache) | {speed['batched']:,.0f} | {ratio:.2f} |",
        "",
        f"PPO step: {args.rollout_prompts} prompts x {args.group} samples, {args.new_tokens} "
        f"new tokens, {args.epochs} epochs in micro-batches of {args.micro_batch} (median of 3):",
        "",
        "| part | seconds | share of the step |",
        "|---|---|---|",
        f"| rollout (sample, policy and reference log-probs) | {share['rollout']:.3f} | "
        f"{share['rollout'] / total:.0%} |",
        f"| update (forward, backward, AdamW) | {share['update']:.3f} | "
        f"{share['update'] / total:.0%} |",
        "",
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rollout_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the results (markdown) here")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rollout-prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    lines = [
        "# Rollout benchmark",
        "",
        f"{datetime.date.today()}, {platform.node()} ({platform.machine()}, "
        f"{os.cpu_count()} CPUs), "
        f"torch threads: {torch.get_num_threads()}, torch {torch.__version__}, "
        f"Python {platform.python_version()}.",
        f"Command: `trainer/bench/rollout_bench.py {' '.join(sys.argv[1:])}`",
        "",
    ]
    lines += run(torch.device("cpu"), (128, 2, 4, 256), args)
    if torch.cuda.is_available():
        lines += run(torch.device("cuda"), (1024, 8, 16, 2048), args)
    else:
        lines += ["## cuda", "", "No CUDA device here: not measured.", ""]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines += [f"Load average at the end (1, 5, 15 min): {load} on {os.cpu_count()} CPUs.", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
