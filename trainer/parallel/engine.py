"""One training step under any layout: the parallel pieces composed in torchtitan's order.

`Engine` takes a freshly built Transformer (every rank builds the same one from the seed) and
applies, in place: pipeline (keep this rank's stages), tensor (+ sequence) parallel, context
parallel, FSDP over the data-parallel dimension (shard.py). `forward_backward` runs the
micro-batches of one step and leaves each weight's gradient of (summed loss / global token
count) on the rank that owns it; `clip` then measures and clips the global norm. The
optimizer steps `engine.part`'s parameters as usual. The loss is the language model's
(trainer/lm_loss.py; a pipeline's last stage applies it to its logits): the recipes that allow
a model-parallel layout are the language-model ones (trainer/recipes/).
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from protos.layout import ParallelLayout
from trainer.distributed import gradient_sync
from trainer.lm_loss import summed_loss
from trainer.model import Layout, Transformer, attention_layout
from trainer.parallel import context, grads, pipeline, shard, tensor
from trainer.parallel.mesh import Mesh


class Engine:
    def __init__(self, model: Transformer, mesh: Mesh, n_microbatches: int, dtype: torch.dtype):
        """`n_microbatches`: micro-batches per step (train.grad_accum); the pipeline splits
        their concatenation back into as many."""
        self.mesh, self.layout = mesh, mesh.layout
        lay: ParallelLayout = self.layout
        self.device = next(model.parameters()).device
        self.dtype = dtype
        self.cp_rank = mesh.rank("cp")
        self.pp_rank = mesh.rank("pp")
        if lay.pp > 1:
            pipeline.keep_part(model, lay, self.pp_rank)
        tensor.apply(model, mesh["tp"], lay.sequence_parallel)
        if lay.cp > 1:
            context.apply(model, mesh.group("cp"))
        self.stages = (
            pipeline.stage_modules(model, lay, self.pp_rank, self.attention_layout)
            if lay.pp > 1
            else []
        )
        self.sharded = lay.fsdp and lay.dp > 1
        if self.sharded:
            shard.apply(model, self.stages or [model], mesh["dp"], dtype)
        # Gradients FSDP has not already summed: over data and context parallel, or context
        # parallel alone when FSDP reduce-scattered over data parallel.
        self.replicas = mesh.group("cp") if self.sharded else mesh.replicas.get_group()
        self.part: nn.Module = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.loss_scale = 1.0
        self.n_microbatches = n_microbatches
        self.schedule: Any = None  # built at the first step, from the micro-batches' shapes

    def attention_layout(self, document_ids: torch.Tensor) -> Layout:
        """The mask of this rank's tokens; `document_ids` are whole rows under context
        parallel (context.shard_batch keeps them whole)."""
        if self.layout.cp > 1:
            return context.layout(document_ids.cpu(), self.layout.cp, self.cp_rank, self.device)
        return attention_layout(document_ids.cpu(), self.device, self.dtype)

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ops = self.part.ops
        flat = logits.reshape(-1, logits.shape[-1])
        return ops.cross_entropy(flat, labels.reshape(-1), reduction="sum") * self.loss_scale

    def forward_backward(self, batches: list[dict], n_tokens: float) -> torch.Tensor:
        """Forward and backward the step's micro-batches; gradients summed over the replicas.
        Returns this rank's share of the summed loss: adding every rank's share gives the
        global summed loss (tensor-parallel ranks compute the same loss: each adds 1/tp)."""
        batches = [context.shard_batch(b, self.layout.cp, self.cp_rank) for b in batches]
        batches = [{k: v.to(self.device) for k, v in b.items()} for b in batches]
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.layout.pp == 1:
            for k, b in enumerate(batches):
                mask = self.attention_layout(b["document_ids"])
                with gradient_sync(self.part, k == len(batches) - 1):  # FSDP: the last only
                    loss = summed_loss(
                        self.part, b["input_ids"], b["position_ids"], mask, b["labels"]
                    )
                    (loss / n_tokens).backward()
                loss_sum += loss.detach()
        else:
            self.loss_scale = 1.0 / n_tokens
            whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
            if self.schedule is None:
                self.schedule = pipeline.build_schedule(
                    self.part,
                    self.stages,
                    self.layout,
                    self.pp_rank,
                    self.mesh.group("pp"),
                    batches[0],
                    self.n_microbatches,
                    self._pipeline_loss,
                )
            losses: list[torch.Tensor] = []
            self.schedule.step(
                whole["input_ids"],
                whole["position_ids"],
                whole["document_ids"],
                target=whole["labels"],
                losses=losses,
            )
            for loss in losses:  # only on the rank of the last stage
                loss_sum += loss.detach().double() * n_tokens
        grads.sum_over(self.params, self.replicas)
        return loss_sum / self.layout.tp

    @property
    def data_rank(self) -> tuple[int, int]:
        """(this rank's place along data parallel, the degree): the ranks that read different
        rows; the tensor, context and pipeline ranks of one model replica read the same."""
        return self.mesh.rank("dp"), self.layout.dp

    @torch.no_grad()
    def heldout_sums(self, batch: dict) -> torch.Tensor:
        """(summed loss, labelled tokens) in float64 of one held-out batch, forward only, as
        this rank's share of its model replica: context-parallel ranks hold their tokens',
        pipeline ranks other than the last stage's zeros, tensor-parallel peers each the
        whole. `replica_sum` of the shares is the replica's; the batch is whole rows, the
        same on every rank of the replica."""
        b = context.shard_batch(batch, self.layout.cp, self.cp_rank)
        b = {k: v.to(self.device) for k, v in b.items()}
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.layout.pp == 1:
            mask = self.attention_layout(b["document_ids"])
            loss = summed_loss(self.part, b["input_ids"], b["position_ids"], mask, b["labels"])
            sums[0] = loss.double()
        else:
            logits = pipeline.forward_only(
                self.stages, self.layout, self.pp_rank, self.mesh.group("pp"), b
            )
            if logits is None:  # not the last stage: the loss is counted there
                return sums
            flat = logits.reshape(-1, logits.shape[-1])
            sums[0] = self.part.ops.cross_entropy(flat, b["labels"].reshape(-1), reduction="sum")
        sums[1] = (b["labels"] != -100).sum()
        return sums

    def replica_sum(self, sums: torch.Tensor) -> torch.Tensor:
        """`heldout_sums` shares added over the model replica (context and pipeline ranks,
        not the tensor-parallel peers, who hold the same whole), in place: the replica's
        totals, on each of its ranks."""
        for name in ("cp", "pp"):
            if self.mesh[name].size() > 1:
                dist.all_reduce(sums, group=self.mesh.group(name))
        return sums

    def clip(self, max_norm: float) -> float:
        """Clip to `max_norm` (0: no clipping); the global gradient norm before clipping."""
        norm = grads.global_norm(self.params, self.mesh.group("pp"))
        if max_norm > 0:
            grads.clip(self.params, max_norm, norm)
        return float(norm)
