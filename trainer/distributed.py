"""One process, or many under torchrun: DDP or FSDP2 (`fully_shard`), gloo on CPU, NCCL on GPU.

Every helper here also works without a process group, so the loop has one code path.
"""

import contextlib
import inspect
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.health.collectives import TRACKER, ddp_comm_hook


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init() -> DistEnv:
    """Join the torchrun process group if there is one; pick this process's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return DistEnv(rank, world_size, local_rank, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def wrap(
    model: torch.nn.Module,
    parallelism: str,
    env: DistEnv,
    param_dtype: torch.dtype,
    blocks: list[torch.nn.Module] | None = None,
):
    """The model, replicated (DDP) or sharded (FSDP) across the process group.

    FSDP shards each of `blocks` (default: the Transformer's layers) and then the root
    (embeddings, final norm, head, ...), so a block's parameters are gathered just before it
    runs and freed right after.
    """
    if not active() or parallelism == "SINGLE":
        return model
    if parallelism == "DDP":
        from torch.nn.parallel import DistributedDataParallel

        ids = [env.local_rank] if env.device.type == "cuda" else None
        # The only buffers are the rotary tables, derived and equal on every rank: no
        # broadcast before each forward (where a slow peer's wait would hide from the hook).
        # torch 2.13 renamed the switch; the GPU machines' 2.11 has only the old name.
        params = inspect.signature(DistributedDataParallel).parameters
        no_sync = (
            "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        )
        ddp = DistributedDataParallel(model, device_ids=ids, **{no_sync: False})
        ddp.register_comm_hook(None, ddp_comm_hook(TRACKER))  # times the wait on peers
        return ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers if blocks is None else blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DDP wrapper (FSDP2 shards in place, so there is none)."""
    return getattr(model, "module", model)


@contextlib.contextmanager
def whole(model: torch.nn.Module):
    """The bare module with every parameter whole for what runs outside its forward (a
    rollout's decoding, an evaluation that calls the blocks itself): under FSDP2 each sharded
    module is gathered for the block's duration (every rank must enter it, a collective) and
    resharded after; otherwise nothing is gathered."""
    bare = unwrap(model)
    sharded = [m for m in bare.modules() if hasattr(m, "unshard") and hasattr(m, "reshard")]
    for m in sharded:
        m.unshard()
    try:
        yield bare
    finally:
        for m in sharded:
            m.reshard()


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a step; wrap each
    micro-batch's forward. DDP decides in the forward; FSDP2 reads its switch when the
    backward reaches each layer, so the switch stays as set here until the next micro-batch's
    call (the training loop runs the backward after this block: restoring it on exit made
    FSDP reduce-scatter every micro-batch)."""
    if not active():
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with contextlib.nullcontext() if enabled else model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if active():
        with TRACKER.waiting():
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def broadcast_object(obj, src: int = 0):
    """`obj` from rank `src` on every rank."""
    if not active():
        return obj
    box = [obj]
    with TRACKER.waiting():
        dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not active():
        return [obj]
    out = [None] * dist.get_world_size()
    with TRACKER.waiting():
        dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if active():
        with TRACKER.waiting():
            dist.barrier()
