"""Distributed checkpoints (torch.distributed.checkpoint) that load under another layout.

Every rank writes its own shards; keys are the full model's names (`layers.3.attention.wq.
weight`, whatever pipeline stage holds layer 3) and the optimizer state is flattened to one
key per weight (`state.layers.3....exp_avg`), so a checkpoint written with TP=2 can be read
with DP=2 or PP=2: DCP reads, for each key this rank holds, the slices it needs.
"""

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    return {"model": model_sd, "optimizer": optim_sd}


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: every rank writes its shards of model and optimizer under `path`."""
    dcp.save(_state(model, optimizer), checkpoint_id=str(path))


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: fill this rank's part of `model` and `optimizer` from `path`."""
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=OPTIONS,
    )
