"""FSDP (FSDP2's `fully_shard`) on the data-parallel dimension, composed with the others.

As torchtitan composes it: tensor (and context) parallel first, then every block of this rank
is sharded over the mesh's "dp" dimension (a tensor-parallel weight becomes a DTensor sharded
on both dimensions), then the root: the whole part when no pipeline runs, else each pipeline
Stage module, which torch.distributed.pipelining recognizes: it holds the gradient
reduce-scatter back until the last micro-batch of the step and runs it then.

The reduce-scatter sums (divide factor 1): the loss is already divided by the global token
count, as for every other layout (grads.py). Ranks along context parallel hold the same
shards and saw other tokens: their gradients are still all-reduced by the engine.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply(part: nn.Module, roots: list[nn.Module], dp: DeviceMesh, param_dtype: torch.dtype):
    """Shard `part`'s blocks and then `roots` (the modules whose forward runs: [part], or the
    pipeline stages) over `dp`, in place."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    sharded: list[FSDPModule] = []
    for block in part.layers:
        if any(True for _ in block.parameters()):  # not a layer another pipeline rank owns
            sharded.append(fully_shard(block, mesh=dp, mp_policy=mp))
    sharded += [fully_shard(root, mesh=dp, mp_policy=mp) for root in roots]
    for module in sharded:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
