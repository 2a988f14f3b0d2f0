"""Gradients across the mesh: summed over the replicas, measured and clipped over the shards.

Ranks along data parallel saw different rows and ranks along context parallel different
tokens of the same rows, with the same weights: their gradients are summed (the loss is
already divided by the global token count), one flat all-reduce, as DDP does in buckets.
Tensor-parallel weights are DTensors whose gradients DTensor keeps consistent itself; pipeline
stages own disjoint weights, so the global norm adds their squares over the pipeline group.
"""

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def sum_over(params: list[torch.nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sum every gradient of `params` over `group`, in place (one message)."""
    if dist.get_world_size(group) == 1:
        return
    grads = [_local(p.grad) for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(reduced)


def global_norm(params: list[torch.nn.Parameter], pp_group: dist.ProcessGroup) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, the same on every rank."""
    squares = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad)
        if isinstance(norm, DTensor):  # a sharded weight: the shards' norms combine
            norm = norm.full_tensor()
        squares += norm.double().cpu() ** 2
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squares, group=pp_group)
    return squares.sqrt().float()


def clip(params: list[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients as torch.nn.utils.clip_grad_norm_ does, given the global norm."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            _local(p.grad).mul_(coef.to(p.grad.dtype))
