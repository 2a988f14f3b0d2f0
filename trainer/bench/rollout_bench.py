"""Rollout benchmark (#14, #30): rollouts on the inference engine against the static-batch
sampler they replaced, and where a PPO step's time goes.

1. Rollout tokens/s at the guide's PPO and GRPO settings (configs/guide_ppo.yaml: 8 prompts x
   4 samples; configs/guide_grpo.yaml: 4 prompts x 8; 24 new tokens each): trainer.rl.policy's
   `sample` (the inference engine: continuous batching over a paged KV cache) against
   BASELINE_static_batch_sample below, a copy of the sampler it replaced (prompts of one length
   decode together as one batch with a contiguous KV cache), side by side in alternating
   rounds. Prompts of varied lengths, as real questions are (uniform in PROMPT_LENGTHS tokens);
   no EOS, so both generate the same number of tokens.
2. The share of a PPO step spent generating: a rollout batch as trainer/rl/ppo.py builds it
   (sample on the engine, then policy and reference log-probabilities) against its update
   (ppo_epochs passes of forward, backward and AdamW in micro-batches), on the same model.

    python trainer/bench/rollout_bench.py [--out trainer/bench/rollout_results.md]

CPU always (fp32, one thread); CUDA too when present. Randomly initialized weights: speed does
not depend on what the model learned.
"""

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from protos import trainer_config_pb2
from protos.defaults import with_defaults
from protos.files import write_atomic
from trainer.model import Transformer
from trainer.rl import losses, policy

VOCAB = 4096
NO_EOS = -1  # an id never sampled: every row runs to max_new_tokens
PROMPT_LENGTHS = (8, 40)  # tokens of `<bos> question`, uniform
SETTINGS = {  # name: (rollout_prompts, group_size), configs/guide_ppo.yaml and guide_grpo.yaml
    "PPO": (8, 4),
    "GRPO": (4, 8),
}


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


# ---- BASELINE: the static-batch sampler the engine replaced (trainer/rl/policy.py `sample`
# ---- and trainer/model.py's KVCache before #30), copied here to be measured against. Not
# ---- product code: nothing imports it.


def BASELINE_sample_next(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """The old sampler as RL called it (top_k 0, top_p 1): one multinomial draw per row."""
    probs = (logits.float() / temperature).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class BASELINE_KVCache:
    """Keys and values of every layer for incremental decoding; `pos` tokens are filled."""

    def __init__(self, model: Transformer, batch: int, max_len: int, device, dtype):
        a = model.layers[0].attention
        shape = (batch, max_len, a.n_kv_heads, a.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers]
        self.pos = 0


def BASELINE_cached_logits(model: Transformer, ids: torch.Tensor, cache: BASELINE_KVCache):
    """The last position's logits of `ids` (B, S) after the cached positions (the removed
    `model(ids, positions, cache=cache)[:, -1]`: the same modules, the same attention)."""
    B, S = ids.shape
    pos = cache.pos
    positions = torch.arange(pos, pos + S, device=ids.device)[None].expand(B, -1)
    cos, sin = model.rope.cos_sin(positions)
    x = model.tok_embeddings(ids)
    mask = torch.ones(S, pos + S, dtype=torch.bool, device=ids.device).tril(pos)
    for i, block in enumerate(model.layers):
        a = block.attention
        h = block.attention_norm(x)
        q = a.wq(h).view(B, S, a.n_heads, a.head_dim)
        k = a.wk(h).view(B, S, a.n_kv_heads, a.head_dim)
        v = a.wv(h).view(B, S, a.n_kv_heads, a.head_dim)
        q, k = a.ops.apply_rope(q, k, cos, sin)
        cache.k[i][:, pos : pos + S], cache.v[i][:, pos : pos + S] = k, v
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            cache.k[i][:, : pos + S].transpose(1, 2),
            cache.v[i][:, : pos + S].transpose(1, 2),
            attn_mask=mask,
            enable_gqa=a.n_kv_heads != a.n_heads,
        ).transpose(1, 2)
        x = x + a.wo(out.reshape(B, S, -1))
        x = x + block.feed_forward(block.ffn_norm(x))
    cache.pos += S
    return F.linear(model.norm(x)[:, -1], model.output.weight).float()


@torch.no_grad()
def BASELINE_static_batch_sample(
    model, prompts, n, max_new_tokens, *, temperature, eos_id, generator, max_len
) -> list[list[int]]:
    """The old policy.sample: prompts of one length decode together as one batch."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    out: list[list[int]] = [[] for _ in range(len(prompts) * n)]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_length[len(p)].append(i)
    for length, members in by_length.items():
        rows = [i * n + j for i in members for j in range(n)]
        ids = torch.tensor([prompts[i] for i in members for _ in range(n)], device=device)
        new = min(max_new_tokens, max_len - length)
        cache = BASELINE_KVCache(model, len(rows), length + new, device, dtype)
        done = torch.zeros(len(rows), dtype=torch.bool, device=device)
        steps: list[torch.Tensor] = []
        for _ in range(new):
            logits = BASELINE_cached_logits(model, ids, cache)
            token = BASELINE_sample_next(logits, temperature, generator)
            token = torch.where(done, torch.full_like(token, eos_id), token)
            steps.append(token)
            done |= token == eos_id
            if bool(done.all()):
                break
            ids = token[:, None]
        generated = torch.stack(steps, 1).tolist() if steps else [[] for _ in rows]
        for row, tokens in zip(rows, generated, strict=True):
            end = tokens.index(eos_id) + 1 if eos_id in tokens else len(tokens)
            out[row] = prompts[row // n] + tokens[:end]
    return out


# ---- end of BASELINE


def rollout_speed(model, prompts, group, new_tokens, rounds, device) -> dict:
    """Tokens/s of the engine and the static-batch baseline, `group` samples per prompt."""
    gen = torch.Generator(device=device)
    kw = dict(temperature=1.0, eos_id=NO_EOS, max_len=10_000)

    def engine():
        policy.sample(model, prompts, group, new_tokens, generator=gen.manual_seed(0), **kw)

    def static_batch():
        BASELINE_static_batch_sample(
            model, prompts, group, new_tokens, generator=gen.manual_seed(0), **kw
        )

    engine(), static_batch()  # warm-up
    times: dict[str, list[float]] = {"engine": [], "static batch": []}
    for r in range(rounds):
        order = [("engine", engine), ("static batch", static_batch)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            times[name].append(timed(fn))
    tokens = len(prompts) * group * new_tokens
    return {name: tokens / statistics.median(t) for name, t in times.items()}


def ppo_step_share(model, ref, prompts, group, new_tokens, epochs, micro_batch, device) -> dict:
    """(rollout seconds, update seconds) of one PPO step as ppo.py runs it (median of 3)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator(device=device).manual_seed(0)
    rollouts, updates = [], []
    for _ in range(3):
        start = time.perf_counter()
        out = policy.sample(model, prompts, group, new_tokens, temperature=1.0, eos_id=NO_EOS,
                            generator=gen, max_len=10_000).sequences  # fmt: skip
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
    rng = random.Random(0)
    lines = [
        f"## {device.type}: model dim {dims[0]}, {dims[1]} layers, {dims[2]} heads "
        f"({params:.2f} M parameters, vocabulary {VOCAB})",
        "",
        f"Rollout: prompts of {PROMPT_LENGTHS[0]}-{PROMPT_LENGTHS[1]} tokens (uniform), "
        f"{args.new_tokens} new tokens each, temperature 1, no EOS, median of {args.rounds} "
        "alternating rounds.",
        "",
        "The engine decodes every sequence of a rollout in each step whatever its prompt's "
        "length (the baseline: one batch per prompt length, each to the end), and draws a token "
        "with one uniform number per row (the baseline: torch.multinomial).",
        "",
        "| setting | static batch (baseline) tokens/s | engine tokens/s | engine / baseline |",
        "|---|---|---|---|",
    ]
    prompts = {}
    for name, (count, group) in SETTINGS.items():
        prompts[name] = [
            torch.randint(3, VOCAB, (rng.randint(*PROMPT_LENGTHS),)).tolist() for _ in range(count)
        ]
        speed = rollout_speed(model, prompts[name], group, args.new_tokens, args.rounds, device)
        ratio = speed["engine"] / speed["static batch"]
        lines.append(
            f"| {name}: {count} prompts x {group} samples | {speed['static batch']:,.0f} | "
            f"{speed['engine']:,.0f} | {ratio:.2f} |"
        )
    count, group = SETTINGS["PPO"]
    share = ppo_step_share(
        model, ref, prompts["PPO"], group, args.new_tokens, args.epochs, args.micro_batch, device,
    )  # fmt: skip
    total = share["rollout"] + share["update"]
    return lines + [
        "",
        f"PPO step on the engine: {count} prompts x {group} samples, {args.new_tokens} new "
        f"tokens, {args.epochs} epochs in micro-batches of {args.micro_batch} (median of 3):",
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
    p.add_argument("--new-tokens", type=int, default=24)  # the guides' rl.max_new_tokens
    p.add_argument("--rounds", type=int, default=5)
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
