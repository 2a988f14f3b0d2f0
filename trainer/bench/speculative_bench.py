"""Speculative decoding: plain decoding, prompt lookup and a draft model, side by side in one run.

    python -m trainer.bench.speculative_bench [--rounds 1] [--steps 200]

A draft only pays when it guesses what the target would say, so the models must have learned
something: the script first trains, on CPU, a target (dim 64, 3 layers) and a draft (dim 32,
1 layer: ~8x fewer parameters) on the same synthetic language, an order-2 Markov chain over
16 tokens whose rows are peaked (a few likely continuations per context), so the next token
depends on the context and a smaller model learns most of it. The held-out loss of both is
printed beside the chain's own entropy (the best any model can do).

Then one engine per setting (trainer/inference/engine.py, no HTTP: the engine's own speed)
decodes the same requests: prompts of 48 tokens from the chain, 64 new tokens each, end of
text switched off so every request does the same work; 2 requests one at a time, and 8 at
once; greedy and sampled (temperature 1). Settings: plain; prompt lookup, k = 4; the draft
model, k = 2 and 4. Printed per row: generated tokens/s, engine steps, and the acceptance rate
(accepted / drafted tokens), with each setting's speed as a ratio of plain's in the same round.
The steps do not depend on the machine's load; the tokens/s do.
"""

import argparse
import functools
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from protos import defaults, trainer_config_pb2
from trainer.bench.machine import machine
from trainer.inference.engine import Engine, Request, SamplingParams
from trainer.model import Transformer

print = functools.partial(print, flush=True)  # noqa: A001  # progress shows as it runs

VOCAB = 16
MAX_LEN = 128
PROMPT, NEW = 48, 64
SEQ, BATCH = 64, 8  # training rows


def chain(seed: int = 0) -> torch.Tensor:
    """(VOCAB, VOCAB, VOCAB) next-token probabilities of an order-2 Markov chain, each row
    peaked: Dirichlet(0.05) puts most of a row's mass on a few tokens."""
    gen = torch.Generator().manual_seed(seed)
    alpha = torch.full((VOCAB * VOCAB, VOCAB), 0.05)
    g = torch._standard_gamma(alpha, generator=gen)
    return (g / g.sum(-1, keepdim=True)).view(VOCAB, VOCAB, VOCAB)


def sample_chain(p: torch.Tensor, rows: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, length, dtype=torch.long)
    out[:, :2] = torch.randint(VOCAB, (rows, 2), generator=gen)
    for t in range(2, length):
        out[:, t] = torch.multinomial(p[out[:, t - 2], out[:, t - 1]], 1, generator=gen)[:, 0]
    return out


def entropy(p: torch.Tensor, data: torch.Tensor) -> float:
    """The chain's mean entropy (nats) at the data's positions: the loss floor."""
    rows = p[data[:, :-2], data[:, 1:-1]]
    return float(-(rows * rows.clamp(min=1e-30).log()).sum(-1).mean())


def build(dim: int, layers: int, heads: int) -> Transformer:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = dim, layers, heads
    cfg.model.max_seq_len, cfg.model.use_kernels = MAX_LEN, False
    return Transformer(defaults.with_defaults(cfg).model, VOCAB)


def loss(model: Transformer, batch: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(batch.shape[1] - 1)[None].expand(batch.shape[0], -1)
    logits = model(batch[:, :-1], positions)
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def train(model: Transformer, data: torch.Tensor, steps: int, seed: int) -> None:
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for group in opt.param_groups:  # linear warm-up, cosine decay
            group["lr"] = (
                3e-3 * min(1, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / steps))
            )
        batch = data[torch.randint(len(data), (BATCH,), generator=gen)]
        opt.zero_grad()
        loss(model, batch).backward()
        opt.step()
    model.eval()


def serve_cfg(k: int, running: int) -> trainer_config_pb2.ServeConfig:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.serve.speculative_tokens, cfg.serve.max_running = k, running
    cfg.serve.num_blocks, cfg.serve.max_batch_tokens = 1024, 1024
    return defaults.with_defaults(cfg).serve


def decode_all(target, draft, k: int, prompts: list[list[int]], temperature: float, running: int):
    """(tokens/s, steps, drafted, accepted) of decoding every prompt, `running` at once."""
    engine = Engine(
        target, serve_cfg(k, running), decode=lambda ids: "", eos_id=VOCAB, max_len=MAX_LEN,
        draft=draft,
    )  # fmt: skip
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=NEW, temperature=temperature, seed=i)
        engine.add(Request(str(i), prompt, params))
    steps, start = 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    return len(prompts) * NEW / seconds, steps, engine.drafted, engine.accepted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole comparison")
    p.add_argument("--steps", type=int, default=200, help="training steps of each model")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    load = os.getloadavg()[0]
    p_chain = chain()
    data = sample_chain(p_chain, 2048, SEQ + 1, seed=1)
    held_out = sample_chain(p_chain, 64, SEQ + 1, seed=2)
    torch.manual_seed(0)
    target, draft = build(64, 3, 4), build(32, 1, 2)
    print(f"training the target and the draft, {args.steps} steps each", file=sys.stderr)
    began = time.perf_counter()
    train(target, data, args.steps, seed=3)
    train(draft, data, args.steps, seed=4)
    trained = time.perf_counter() - began
    with torch.no_grad():
        losses = [float(loss(m, held_out)) for m in (target, draft)]
    sizes = [sum(x.numel() for x in m.parameters()) / 1e6 for m in (target, draft)]
    prompts = sample_chain(p_chain, 8, PROMPT, seed=5).tolist()
    print(
        f"# speculative decoding bench: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; load "
        f"average {load:.1f} at the start"
    )
    print(
        f"\nTrained {args.steps} steps each ({trained:.0f} s): target {sizes[0]:.2f} M "
        f"parameters, held-out loss {losses[0]:.3f}; draft {sizes[1]:.2f} M, "
        f"{losses[1]:.3f}; the chain's entropy (the floor) {entropy(p_chain, held_out):.3f} nats."
    )
    settings: list[tuple[str, Transformer | None, int]] = [
        ("plain", None, 0),
        ("prompt lookup, k=4", None, 4),
    ]
    settings += [("draft model, k=2", draft, 2), ("draft model, k=4", draft, 4)]
    for number in range(1, args.rounds + 1):
        print(f"\nRound {number}:\n")
        print("| requests at once | sampling | decoding | tokens/s | vs plain | steps | accepted |")
        print("|---|---|---|---|---|---|---|")
        for running, temperature in [(1, 0.0), (1, 1.0), (8, 0.0), (8, 1.0)]:
            batch = prompts[:2] if running == 1 else prompts
            plain = None
            for name, d, k in settings:
                tps, steps, drafted, accepted = decode_all(
                    target, d, k, batch, temperature, running
                )
                plain = plain or tps
                rate = f"{accepted / drafted:.0%} of {drafted}" if drafted else "-"
                how = "greedy" if temperature == 0 else "temperature 1"
                print(
                    f"| {running} | {how} | {name} | {tps:,.0f} | {tps / plain:.2f}x | "
                    f"{steps} | {rate} |"
                )
    print(f"\nLoad average {os.getloadavg()[0]:.1f} at the end.")


if __name__ == "__main__":
    main()
