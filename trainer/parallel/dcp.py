"""Distributed checkpoints (torch.distributed.checkpoint) that load under another layout.

Every rank writes its own shards; keys are the full model's names (`layers.3.attention.wq.
weight`, whatever pipeline stage holds layer 3) and the optimizer state is flattened to one
key per weight (`state.layers.3....exp_avg`), so a checkpoint written with TP=2 can be read
with DP=2 or PP=2: DCP reads, for each key this rank holds, the slices it needs. A model
without a process group (one process) or wrapped in DDP or FSDP reads them too.

The trainer's checkpoints (trainer/checkpoint.py) keep this directory as `dcp/` beside a
`model.pt` of the whole model's weights (`full_weights`), which evaluation, generation, export
and fine-tuning read as they read any checkpoint.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from trainer.parallel import dcp_check

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    return {"model": model_sd, "optimizer": optim_sd}


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: every rank writes its shards of model and optimizer under `path`."""
    dcp.save(_state(model, optimizer), checkpoint_id=str(path))


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: fill this rank's part of `model` and `optimizer` from `path` (checked to
    hold data only first: it may be another team's, dcp_check.py)."""
    dcp_check.check(path)
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=OPTIONS,
    )


def full_weights(part: nn.Module, pp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Collective: the whole model's weights on CPU on global rank 0 ({} elsewhere): DTensor
    shards gathered (every rank takes part), pipeline parts merged over `pp_group`."""
    mine = {}
    for name, value in part.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        mine[name] = value.detach().cpu().clone()
    if 0 not in dist.get_process_group_ranks(pp_group):
        return {}
    parts: list[dict] = [{} for _ in range(dist.get_world_size(pp_group))]
    dist.gather_object(mine, parts if dist.get_rank() == 0 else None, dst=0, group=pp_group)
    return {k: v for p in parts for k, v in p.items()} if dist.get_rank() == 0 else {}
