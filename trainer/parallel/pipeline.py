"""Pipeline parallelism: the layers cut into stages, micro-batches flowing through them.

With `pp` ranks and `v` stages per rank there are pp·v stages of n_layers / (pp·v) layers;
rank r runs stages r, r + pp, ... (the looped assignment the interleaved schedule needs).
Stage 0 also embeds, the last stage also applies the final norm and the head and computes the
loss. Between stages flow the hidden states and, alongside, the position and document ids each
stage needs for its rotary tables and its mask.

Each rank keeps one `part` of the model: the Transformer with the layers of other ranks
replaced by `Elsewhere` (so names stay `layers.<i>...` whatever the layout: checkpoints load
across layouts) and the embedding or head dropped where another rank has them.

Schedules (torch.distributed.pipelining): GPIPE runs every forward then every backward (all
micro-batches' activations alive at once); ONE_F_ONE_B alternates once the pipeline is full
(at most pp in flight); INTERLEAVED_1F1B gives each rank v smaller stages, cutting the idle
"bubble" from (pp−1)/(m+pp−1) of the step towards (pp−1)/(v·m+pp−1), for more messages.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from protos.layout import ParallelLayout, Schedule
from trainer.model import Layout, Transformer

LayoutFn = Callable[[torch.Tensor], Layout]


class Elsewhere(nn.Module):
    """Stands in for a layer another pipeline rank owns; it has no weights and never runs."""

    def forward(self, *args):
        raise RuntimeError("a layer owned by another pipeline rank was called")


def stage_ids(layout: ParallelLayout, pp_rank: int) -> list[int]:
    return [pp_rank + k * layout.pp for k in range(layout.virtual_stages)]


def stage_layers(n_layers: int, layout: ParallelLayout, stage: int) -> range:
    per = n_layers // layout.stages
    return range(stage * per, (stage + 1) * per)


def keep_part(model: Transformer, layout: ParallelLayout, pp_rank: int) -> Transformer:
    """`model` pruned in place to what pipeline rank `pp_rank` runs."""
    stages = stage_ids(layout, pp_rank)
    owned = {i for s in stages for i in stage_layers(model.n_layers, layout, s)}
    for i in range(model.n_layers):
        if i not in owned:
            model.layers[i] = Elsewhere()
    if 0 not in stages:
        del model.tok_embeddings
    if layout.stages - 1 not in stages:
        del model.norm, model.output
    return model


class Stage(nn.Module):
    """One pipeline stage's forward over the shared `part`. First stage: (input_ids,
    position_ids, document_ids); later ones: (hidden, position_ids, document_ids). Returns the
    same triple, or the logits at the last stage."""

    def __init__(
        self, part: Transformer, layers: range, first: bool, last: bool, layout_fn: LayoutFn
    ):
        super().__init__()
        self.embed = part.tok_embeddings if first else None
        self.blocks = nn.ModuleList(part.layers[i] for i in layers)
        self.norm = part.norm if last else None
        self.output = part.output if last else None
        self.rope, self.layout_fn = part.rope, layout_fn

    def forward(self, x, position_ids, document_ids):
        if self.embed is not None:
            x = self.embed(x)
        cos, sin = self.rope.cos_sin(position_ids)
        mask = self.layout_fn(document_ids)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        if self.norm is None or self.output is None:
            return x, position_ids, document_ids
        return torch.nn.functional.linear(self.norm(x), self.output.weight).float()


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def stage_modules(
    part: Transformer, layout: ParallelLayout, pp_rank: int, layout_fn: LayoutFn
) -> list[Stage]:
    """This rank's stages over `part`, in stage order (built with the engine, before FSDP
    shards them: each Stage module is the FSDP root of its embedding, norm and head, which it
    gathers as its forward starts)."""
    total = layout.stages
    return [
        Stage(part, stage_layers(len(part.layers), layout, s), s == 0, s == total - 1, layout_fn)
        for s in stage_ids(layout, pp_rank)
    ]


def build_schedule(
    part: Transformer,
    modules: list[Stage],
    layout: ParallelLayout,
    pp_rank: int,
    group,
    micro_batch: dict[str, torch.Tensor],
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """The schedule that runs this rank's stage `modules`; `schedule.step(...)` is one step.

    `micro_batch`: one micro-batch as this rank feeds it (its shapes are the stages' input
    shapes: the stages are told them rather than inferring them from a trial forward, which
    would index the rotary tables with uninitialized position ids)."""
    total = layout.stages
    ids, positions, docs = (micro_batch[k] for k in ("input_ids", "position_ids", "document_ids"))
    rows, seq = ids.shape
    hidden_seq = seq // layout.tp if layout.sequence_parallel else seq
    block = next(b for b in part.layers if not isinstance(b, Elsewhere))
    dim, vocab = block.ffn_norm.weight.shape[-1], part.vocab_size
    hidden = _meta((rows, hidden_seq, dim), torch.float32).requires_grad_()
    side = (_meta(tuple(positions.shape), positions.dtype), _meta(tuple(docs.shape), docs.dtype))
    stages = []
    for s, module in zip(stage_ids(layout, pp_rank), modules, strict=True):
        first, last = s == 0, s == total - 1
        inputs = (_meta((rows, seq), ids.dtype) if first else hidden, *side)
        outputs = (_meta((rows, seq, vocab), torch.float32),) if last else (hidden, *side)
        stages.append(
            PipelineStage(
                module, s, total, ids.device, input_args=inputs, output_args=outputs, group=group
            )
        )
    if layout.schedule is Schedule.INTERLEAVED_1F1B:
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn, scale_grads=False)
    single = {Schedule.GPIPE: ScheduleGPipe, Schedule.ONE_F_ONE_B: Schedule1F1B}[layout.schedule]
    return single(stages[0], n_microbatches, loss_fn, scale_grads=False)


def forward_only(
    modules: list[Stage],
    layout: ParallelLayout,
    pp_rank: int,
    group,
    micro_batch: dict[str, torch.Tensor],
) -> torch.Tensor | None:
    """One micro-batch through every stage, forward only (held-out eval): the logits on the
    rank of the last stage, None on the others.

    Stage s runs on pipeline rank s % pp and sends its hidden states to the next with plain
    point-to-point messages, in stage order: no schedule, so any batch shape goes (a bucket's
    width, an eval batch before the first training step). The hidden states travel as fp32,
    as the training schedule declares them."""
    ids, positions, docs = (micro_batch[k] for k in ("input_ids", "position_ids", "document_ids"))
    rows, seq = ids.shape
    hidden_seq = seq // layout.tp if layout.sequence_parallel else seq
    dim = next(b for b in modules[0].blocks).ffn_norm.weight.shape[-1]
    x: torch.Tensor = ids
    for s in range(layout.stages):
        if s % layout.pp != pp_rank:
            continue
        if s > 0:
            x = torch.empty(rows, hidden_seq, dim, dtype=torch.float32, device=ids.device)
            dist.recv(x, group=group, group_src=(s - 1) % layout.pp)
        out = modules[s // layout.pp](x, positions, docs)
        if s == layout.stages - 1:
            return out
        dist.send(out[0].float().contiguous(), group=group, group_dst=(s + 1) % layout.pp)
    return None
