"""A checkpoint named by a spec may be another team's file: loading it runs no code.

The payload is a pickle whose unpickling runs a shell command (writes a marker); torch.load
with weights_only=False does run it (the control), the trainer's loaders refuse it."""

import os
import pickle

import pytest
import torch

from trainer import checkpoint


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def poisoned(tmp_path, name):
    ck = tmp_path / "step_00000004"
    ck.mkdir(exist_ok=True)
    torch.save({"model": Payload(tmp_path / "ran"), "x": torch.zeros(2)}, ck / name)
    return ck


def test_the_payload_is_real(tmp_path):
    ck = poisoned(tmp_path, "model.pt")
    torch.load(ck / "model.pt", weights_only=False)
    assert (tmp_path / "ran").exists()


def test_resuming_from_a_poisoned_checkpoint_runs_nothing(tmp_path):
    ck = poisoned(tmp_path, "train.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        checkpoint.load(ck, None, None, rank=0)
    assert not (tmp_path / "ran").exists()
