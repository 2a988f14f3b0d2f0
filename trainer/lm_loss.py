"""The language-model loss: the summed next-token cross entropy of a forward's final hidden
states, through the fused linear + cross-entropy op (`kernels.fused_linear_cross_entropy`, or
its PyTorch reference: whichever `model.ops` is), so the (tokens x vocabulary) logits are never
materialized whole. It is a `Head` (trainer/model.py): the recipe passes it to the forward.

The sum runs over the tokens that carry a label (not -100); the caller divides by the global
count. A mixture-of-experts model's balancing terms join the gradient, not the value."""

import torch

from trainer import moe
from trainer.model import Head, Layout, attention_layout


def next_token_loss(labels: torch.Tensor) -> Head:
    """The head that returns the summed cross entropy of `labels` (B, T)."""

    def head(model, h: torch.Tensor) -> torch.Tensor:
        penalty = moe.collect(model)  # MoE balancing terms of this forward (None when dense)
        weight = model.output.weight
        if torch.is_autocast_enabled(h.device.type):
            dtype = torch.get_autocast_dtype(h.device.type)
            h, weight = h.to(dtype), weight.to(dtype)
        loss = model.ops.fused_linear_cross_entropy(
            h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1), reduction="sum"
        )
        return moe.with_penalty(loss, penalty)

    return head


def summed_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    layout: Layout | None,
    labels: torch.Tensor,
) -> torch.Tensor:
    """`model`'s summed next-token loss on one batch (the model may be wrapped: DDP, FSDP)."""
    return model(input_ids, position_ids, layout, head=next_token_loss(labels))


def packed_rows_loss(model: torch.nn.Module, batch: dict, device, dtype) -> torch.Tensor:
    """The summed loss of a batch of packed rows (trainer/data/loader.py's dicts, on the CPU):
    attention kept within each document, every tensor moved to `device`."""
    layout = attention_layout(batch["document_ids"], device, dtype)
    b = {key: v.to(device, non_blocking=True) for key, v in batch.items()}
    return summed_loss(model, b["input_ids"], b["position_ids"], layout, b["labels"])
