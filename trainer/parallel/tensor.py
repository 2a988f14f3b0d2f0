"""Tensor parallelism (Megatron's column/row split) and sequence parallelism, with DTensor.

In each block, the query/key/value and the MLP's gate/up projections are split by output
columns (each TP rank owns n_heads / tp heads and ffn_dim / tp hidden units); the attention
output and the MLP's down projection are split by input rows, and their partial outputs are
summed: one all-reduce after attention and one after the MLP, forward and backward.

With sequence parallelism the norms, the residual stream between blocks, run on a 1/tp slice
of the sequence instead of being repeated on every TP rank: each all-reduce becomes a
reduce-scatter (into sequence slices) and an all-gather (before the next projection), the same
bytes, with the norms' activations divided by tp. The embedding and the output head stay
replicated (a small model's vocabulary is not worth splitting); the first block takes its
slice of the embedded sequence and the final norm gathers it back.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

# A block and its attention are called with (x, cos, sin, layout): only x moves.
REST = (None,) * 3


def apply(model: nn.Module, tp: DeviceMesh, sequence_parallel: bool) -> None:
    """Split every block of `model` (a Transformer, or a pipeline stage's part of one) across
    `tp` in place. The attention modules learn their local head counts."""
    size = tp.size()
    if size == 1:
        return
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()
    for block in model.layers:
        if not hasattr(block, "attention"):  # a layer another pipeline stage owns
            continue
        plan: dict = {
            "attention": PrepareModuleInput(
                input_layouts=(residual, *REST),
                desired_input_layouts=(Replicate(), *REST),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=residual),
            "feed_forward": PrepareModuleInput(
                input_layouts=(residual,), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        }
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp, plan)
        block.attention.n_heads //= size
        block.attention.n_kv_heads //= size
    if not sp:
        return
    # The residual stream is a sequence slice between blocks: cut it after the embedding (no
    # communication, every rank has the whole sequence), gather it before the final norm.
    # (Under pipeline parallelism only the first stage embeds and only the last has the norm;
    # between stages the hidden states travel as sequence slices.)
    slicing = {}
    if hasattr(model, "norm"):
        slicing["norm"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    if hasattr(model, "tok_embeddings"):
        slicing["layers.0"] = PrepareModuleInput(
            input_layouts=(Replicate(), *REST),
            desired_input_layouts=(Shard(1), *REST),
            use_local_output=True,
        )
    parallelize_module(model, tp, slicing)
