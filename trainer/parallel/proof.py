"""Trains a tiny model under several layouts in one torchrun launch and records what the
proof test (parallel_test.py) compares with one process: the loss of every step, the
gradient norms and the final weights (gathered whole on rank 0).

    torchrun --nproc_per_node 4 -m trainer.parallel.proof OUT_DIR tp2 tp2+sp pp2:GPIPE ...

A layout name is `+`/`x`-free shorthand parsed by `parse`; `resume:A>B` trains two steps
under A, saves a distributed checkpoint, and trains the last step under B from it;
`plain:fsdp4` trains without the engine, as the trainer runs `parallelism: FSDP` alone.
"""

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from protos import trainer_config_pb2
from protos.layout import ParallelLayout, Schedule
from trainer import distributed
from trainer.grad_noise import GradientNoiseScale
from trainer.lm_loss import packed_rows_loss, summed_loss
from trainer.model import Transformer, attention_layout, select_ops
from trainer.optim import build_optimizer
from trainer.parallel import dcp, mesh
from trainer.parallel.engine import Engine
from trainer.parallel.wire import WireCounter
from trainer.step import train_step

STEPS, ROWS, GRAD_ACCUM, SEQ, VOCAB, SEED = 3, 4, 2, 32, 96, 7  # ROWS: per micro-batch, all ranks
LR, CLIP = 1e-2, 1.0


def model_config() -> trainer_config_pb2.ModelConfig:
    return trainer_config_pb2.ModelConfig(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        max_seq_len=SEQ,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
        use_kernels=False,
    )


def optim_config() -> trainer_config_pb2.OptimConfig:
    return trainer_config_pb2.OptimConfig(
        lr=LR, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=CLIP
    )


def parse(name: str, world_size: int) -> ParallelLayout:
    """`tp2`, `tp2+sp`, `cp2`, `pp2:GPIPE`, `pp2:INTERLEAVED_1F1B`, `dp4`, `fsdp2`, joined by
    `,` (`pp2:ONE_F_ONE_B,tp2+sp`); the data-parallel degree fills the world size."""
    fields: dict = {}
    for part in name.split(","):
        kind, _, schedule = part.partition(":")
        if kind.endswith("+sp"):
            fields["sequence_parallel"], kind = True, kind[:-3]
        if kind.startswith("fsdp"):  # the data-parallel dimension shards
            fields["fsdp"], kind = True, "dp" + kind[4:]
        fields[kind[:2]] = int(kind[2:])
        if schedule:
            fields["schedule"] = Schedule(schedule)
            fields["virtual_stages"] = 2 if schedule == "INTERLEAVED_1F1B" else 1
    model = fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1)
    fields.setdefault("dp", world_size // model)
    return ParallelLayout(**fields)


def batch(step: int, micro: int, rows: int, seq: int = SEQ, vocab: int = VOCAB) -> dict:
    """Micro-batch `micro` of step `step`: `rows` packed rows (documents of random lengths,
    positions restarting at each, no label across a document boundary), the same on every
    rank for the same arguments."""
    g = torch.Generator().manual_seed(SEED * 1000 + step * 10 + micro)
    input_ids = torch.randint(0, vocab, (rows, seq), generator=g)
    document_ids = torch.zeros(rows, seq, dtype=torch.long)
    for r in range(rows):
        cuts = torch.randint(1, seq, (2,), generator=g).tolist()
        for c in cuts:
            document_ids[r, c:] += 1
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    idx = torch.arange(seq).expand(rows, seq)
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    labels = input_ids.roll(-1, dims=1)
    labels[:, :-1][document_ids[:, 1:] != document_ids[:, :-1]] = -100
    labels[:, -1] = -100
    return {
        "input_ids": input_ids,
        "position_ids": idx - last_start,
        "document_ids": document_ids,
        "labels": labels,
    }


def global_batches(step: int) -> list[dict]:
    return [batch(step, k, ROWS) for k in range(GRAD_ACCUM)]


def rank_batches(step: int, dp: int, dp_rank: int) -> list[dict]:
    """This data-parallel rank's rows of each micro-batch of step `step`."""
    rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    return [{k: v[rows] for k, v in b.items()} for b in global_batches(step)]


def n_tokens(batches: list[dict]) -> float:
    return float(sum(int((b["labels"] != -100).sum()) for b in batches))


def build_model() -> Transformer:
    torch.manual_seed(SEED)
    return Transformer(model_config(), VOCAB, ops=select_ops(False, "cpu"))


def reference(steps: int = STEPS) -> dict:
    """One process, the trainer's way: every micro-batch of the global batch, clip, AdamW."""
    model = build_model()
    optimizer = build_optimizer(model, optim_config(), "cpu")
    losses, norms = [], []
    for step in range(steps):
        batches = global_batches(step)
        total, loss_sum = n_tokens(batches), 0.0
        for b in batches:
            mask = attention_layout(b["document_ids"], "cpu", torch.float32)
            loss = summed_loss(model, b["input_ids"], b["position_ids"], mask, b["labels"])
            (loss / total).backward()
            loss_sum += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum / total)
    return {"losses": losses, "grad_norms": norms, "weights": model.state_dict()}


def wire_labels(m: mesh.Mesh) -> dict[tuple[int, ...], str]:
    """This rank's groups (by their global ranks) -> mesh dimension, for WireCounter."""

    def ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(group))

    labels = {ranks(m.replicas.get_group()): "dp_cp"}
    for name, degree in m.layout.dims():
        if degree > 1:
            labels[ranks(m.group(name))] = name
    return labels


def train(lay: ParallelLayout, steps: range, engine: Engine | None = None, optimizer=None):
    """(engine, optimizer, per-step losses, norms, bytes rank 0 sent in step 1 by mesh
    dimension) after `steps` under `lay`."""
    if engine is None:
        engine = Engine(
            build_model(), mesh.build(lay, torch.device("cpu")), GRAD_ACCUM, torch.float32
        )
        optimizer = build_optimizer(engine.part, optim_config(), "cpu")
    assert optimizer is not None
    dp_rank = engine.mesh.rank("dp")
    losses, norms, wire = [], [], {}
    for step in steps:
        total = n_tokens(global_batches(step))
        # Step 1 (the pipeline's schedule is built by then) counts the bytes sent.
        with WireCounter(wire_labels(engine.mesh)) if step == 1 else contextlib.nullcontext() as w:
            share = engine.forward_backward(rank_batches(step, lay.dp, dp_rank), total)
            norms.append(engine.clip(CLIP))
        if w is not None:
            wire = dict(w.sent)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(share)
        losses.append(float(share) / total)
    return engine, optimizer, losses, norms, wire


def train_plain(lay: ParallelLayout, steps: range):
    """The trainer's path without the engine (`parallelism: FSDP` with no model parallelism):
    distributed.wrap shards the model and trainer/step.py's train_step (the loop's own step)
    runs each step. Returns (the model, the layout's mesh, losses, norms, bytes rank 0 sent in
    step 1 by mesh dimension)."""
    model = distributed.wrap(build_model(), "FSDP", distributed.init(), torch.float32)
    optimizer = build_optimizer(model, optim_config(), "cpu")
    lay_mesh = mesh.build(lay, torch.device("cpu"))  # for the wire's labels and full_weights
    losses, norms, wire = [], [], {}
    for step in steps:
        batches = rank_batches(step, lay.dp, dist.get_rank())
        counter = WireCounter(wire_labels(lay_mesh))
        with counter if step == 1 else contextlib.nullcontext() as w:
            loss, norm = train_step(
                model,
                batches,
                n_tokens(global_batches(step)),
                loss_fn=lambda m, b: packed_rows_loss(m, b, "cpu", torch.float32),
                units=[float((b["labels"] != -100).sum()) for b in batches],
                optimizer=optimizer,
                scaler=torch.amp.GradScaler("cpu", enabled=False),
                noise=GradientNoiseScale(),
                device=torch.device("cpu"),
                dtype=torch.float32,
                autocast=False,
                grad_clip=CLIP,
                world_size=lay.dp,
            )
        if w is not None:
            wire = dict(w.sent)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
        norms.append(norm)
    return model, lay_mesh, losses, norms, wire


def run(name: str, out: Path) -> None:
    world = dist.get_world_size()
    if name.startswith("plain:"):
        lay = parse(name.removeprefix("plain:"), world)
        model, lay_mesh, losses, norms, wire = train_plain(lay, range(STEPS))
        _record(name, out, lay, dcp.full_weights(model, lay_mesh.group("pp")), losses, norms, wire)
        return
    first, _, then = name.removeprefix("resume:").partition(">")
    lay = parse(first, world)
    if not then:
        engine, _, losses, norms, wire = train(lay, range(STEPS))
    else:
        engine, optimizer, losses, norms, wire = train(lay, range(STEPS - 1))
        path = out / f"dcp-{first}"
        dcp.save(path, engine.part, optimizer)
        lay = parse(then, world)
        engine = Engine(
            build_model(), mesh.build(lay, torch.device("cpu")), GRAD_ACCUM, torch.float32
        )
        optimizer = build_optimizer(engine.part, optim_config(), "cpu")
        dcp.load(path, engine.part, optimizer)
        engine, _, more, more_norms, _ = train(lay, range(STEPS - 1, STEPS), engine, optimizer)
        losses, norms = losses + more, norms + more_norms
    weights = dcp.full_weights(engine.part, engine.mesh.group("pp"))
    _record(name, out, lay, weights, losses, norms, wire)


def _record(name: str, out: Path, lay: ParallelLayout, weights: dict, losses, norms, wire):
    if dist.get_rank() == 0:
        torch.save(weights, out / f"{name}.weights.pt")
        record = {"layout": lay.describe(), "losses": losses, "grad_norms": norms}
        record["wire_bytes"] = wire  # rank 0's, in step 1
        (out / f"{name}.json").write_text(json.dumps(record))


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    distributed.init()
    try:
        for name in argv[1:]:
            run(name, out)
            dist.barrier()
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
