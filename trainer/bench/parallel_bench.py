"""Step time, bytes sent and communication share of each layout, side by side in one launch.

    torchrun --standalone --nproc_per_node 4 -m trainer.bench.parallel_bench OUT.json [LAYOUT ...]

On CPU (gloo) or GPUs (NCCL, one per process: the same code). Each layout trains the same
model on the same global batch (8 rows of 256 tokens in 4 micro-batches per step) for a few
warm-up steps, then `STEPS` timed steps; one more step is run under WireCounter for the bytes
and the time inside collectives. Rank 0 prints a table (ratios to the first layout) and
writes OUT.json. Layout names as in proof.py.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from protos import trainer_config_pb2
from trainer import distributed
from trainer.model import Transformer, select_ops
from trainer.optim import build_optimizer
from trainer.parallel import mesh, proof
from trainer.parallel.engine import Engine
from trainer.parallel.wire import WireCounter

DIM, LAYERS, HEADS, KV_HEADS, SEQ, VOCAB = 256, 4, 8, 4, 256, 4096
ROWS, MICRO_BATCHES, WARMUP, STEPS = 8, 4, 2, 5
DEFAULT = ("dp4", "tp2", "tp2+sp", "pp2:GPIPE", "pp2:ONE_F_ONE_B", "pp2:INTERLEAVED_1F1B", "cp2")


def model(device: torch.device) -> Transformer:
    cfg = trainer_config_pb2.ModelConfig(
        dim=DIM,
        n_layers=LAYERS,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        ffn_dim=704,
        max_seq_len=SEQ,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
        use_kernels=False,
    )
    torch.manual_seed(0)
    return Transformer(cfg, VOCAB, ops=select_ops(False, device)).to(device)


def measure(name: str, device: torch.device) -> dict:
    lay = proof.parse(name, dist.get_world_size())
    engine = Engine(model(device), mesh.build(lay, device), MICRO_BATCHES, torch.float32)
    optimizer = build_optimizer(engine.part, proof.optim_config(), device)
    dp_rank = engine.mesh.rank("dp")
    rows = slice(dp_rank * ROWS // lay.dp, (dp_rank + 1) * ROWS // lay.dp)

    def step(i: int) -> None:
        batches = [proof.batch(i, k, ROWS, SEQ, VOCAB) for k in range(MICRO_BATCHES)]
        total = proof.n_tokens(batches)
        engine.forward_backward([{k: v[rows] for k, v in b.items()} for b in batches], total)
        engine.clip(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(WARMUP):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for i in range(STEPS):
        step(WARMUP + i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / STEPS
    with WireCounter(proof.wire_labels(engine.mesh)) as wire:
        counted_start = time.perf_counter()
        step(WARMUP + STEPS)
        counted = time.perf_counter() - counted_start
    mine = {"step_s": seconds, "comm_share": wire.seconds / counted, "sent": dict(wire.sent)}
    everyone = distributed.gather_objects(mine)
    return {
        "layout": lay.describe(),
        "step_s": max(r["step_s"] for r in everyone),
        "comm_share": sum(r["comm_share"] for r in everyone) / len(everyone),
        "sent_by_rank0": everyone[0]["sent"],
        "sent_max_bytes": max(sum(r["sent"].values()) for r in everyone),
    }


def main(argv: list[str]) -> None:
    out, names = Path(argv[0]), argv[1:] or list(DEFAULT)
    env = distributed.init()
    results = []
    try:
        for name in names:
            results.append(measure(name, env.device))
            dist.barrier()
    finally:
        distributed.shutdown()
    if env.rank != 0:
        return
    base = results[0]["step_s"]
    tokens = ROWS * MICRO_BATCHES * SEQ
    print(f"{'layout':<28}{'step':>10}{'vs first':>10}{'tok/s':>10}{'comm':>7}{'MB sent':>10}")
    for r in results:
        sent_mb = r["sent_max_bytes"] / 1e6
        print(
            f"{r['layout']:<28}{r['step_s'] * 1e3:>8.0f}ms{r['step_s'] / base:>9.2f}x"
            f"{tokens / r['step_s']:>10,.0f}{r['comm_share']:>7.0%}{sent_mb:>10.2f}"
        )
    machine = {"device": str(env.device), "world_size": env.world_size, "torch": torch.__version__}
    out.write_text(json.dumps({"machine": machine, "results": results}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
