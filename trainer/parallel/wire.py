"""Counts the bytes this rank puts on the wire, collective by collective, while it runs.

A TorchDispatchMode sees every c10d operation (what `torch.distributed` calls) and every
functional collective (what DTensor calls), with its tensors and its group. Bytes are what a
ring algorithm sends per rank for that message: an all-reduce of N bytes over n ranks sends
2·(n−1)/n·N, an all-gather (n−1)·x of its x-byte input, a reduce-scatter or an all-to-all
(n−1)/n·N, a send N. The planner's formulas (trainer/sizing/comm.py) are checked against it.
"""

import collections
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode


def _bytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_bytes(t) for t in tensors)


def _group(group) -> dist.ProcessGroup:
    """A functional collective names its group; a c10d op holds it as a TorchScript object."""
    if isinstance(group, str):
        return _resolve_process_group(group)
    return group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)


def _size(group) -> int:
    return _group(group).size()


class WireCounter(TorchDispatchMode):
    """`with WireCounter(labels) as wire:` ... `wire.sent`: bytes by the label of the group
    they went over (`labels`: the group's global ranks -> label, e.g. "tp"; others count as
    "other". By ranks, not by group: a second mesh over the same ranks may reuse a group);
    `wire.seconds`: wall time spent in collectives, each waited for where it is issued (so
    on an asynchronous backend the counted step runs without overlap)."""

    def __init__(self, labels: dict[tuple[int, ...], str] | None = None):
        super().__init__()
        self.labels = labels or {}
        self.sent: collections.Counter[str] = collections.Counter()
        self.seconds = 0.0

    def _add(self, group, n_bytes: float) -> None:
        ranks = tuple(dist.get_process_group_ranks(_group(group)))
        self.sent[self.labels.get(ranks, "other")] += int(n_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        ns = func.namespace
        if ns not in ("c10d", "_c10d_functional"):
            return func(*args, **kwargs)
        if ns == "c10d":
            self._c10d(name, args)
        else:
            self._functional(name, args)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if ns == "c10d" and isinstance(out, tuple) and out:
            work = out[-1]
            if isinstance(work, torch.ScriptObject):  # a c10d Work: wait for it here
                dist.distributed_c10d.Work.unbox(work).wait()
        self.seconds += time.perf_counter() - start
        return out

    def _c10d(self, name: str, args) -> None:
        if name == "allreduce_":
            n = _size(args[1])
            self._add(args[1], 2 * (n - 1) / n * _bytes(args[0]))
        elif name == "allgather_":
            self._add(args[2], (_size(args[2]) - 1) * _bytes(args[1]))
        elif name == "_allgather_base_":  # FSDP's all-gather: (output, input, group, ...)
            self._add(args[2], (_size(args[2]) - 1) * _bytes(args[1]))
        elif name == "_reduce_scatter_base_":  # FSDP's reduce-scatter: (output, input, ...)
            self._add(args[2], (_size(args[2]) - 1) / _size(args[2]) * _bytes(args[1]))
        elif name == "alltoall_base_":
            self._add(args[2], (_size(args[2]) - 1) / _size(args[2]) * _bytes(args[1]))
        elif name == "send":
            self._add(args[1], _bytes(args[0]))

    def _functional(self, name: str, args) -> None:
        if name == "all_reduce":
            n = _size(args[2])
            self._add(args[2], 2 * (n - 1) / n * _bytes(args[0]))
        elif name == "all_gather_into_tensor":
            self._add(args[2], (args[1] - 1) * _bytes(args[0]))
        elif name == "reduce_scatter_tensor":
            self._add(args[3], (args[2] - 1) / args[2] * _bytes(args[0]))
        elif name == "all_to_all_single":
            self._add(args[3], (_size(args[3]) - 1) / _size(args[3]) * _bytes(args[0]))

    @property
    def total(self) -> int:
        return sum(self.sent.values())
