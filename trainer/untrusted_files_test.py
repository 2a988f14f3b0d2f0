"""A checkpoint named by a spec may be another team's file: loading it runs no code.

The payload is a pickle whose unpickling runs a shell command (writes a marker); torch.load
with weights_only=False does run it (the control), the trainer's loaders refuse it: model.pt
and train.pt, and a distributed checkpoint's `.metadata` and byte items (dcp_check.py)."""

import io
import os
import pickle
import warnings

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from trainer import checkpoint
from trainer.parallel import dcp as kitchen_dcp
from trainer.parallel import dcp_check


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


def dcp_checkpoint(tmp_path):
    """A real one-process DCP checkpoint of a model and its AdamW state (byte items too)."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    where = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process
        kitchen_dcp.save(where, model, opt)
    return where, model, opt


def test_a_clean_distributed_checkpoint_passes_and_loads(tmp_path):
    where, model, opt = dcp_checkpoint(tmp_path)
    dcp_check.check(where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kitchen_dcp.load(where, model, opt)


def test_poisoned_dcp_metadata_is_refused_before_dcp_reads_it(tmp_path):
    where, model, opt = dcp_checkpoint(tmp_path)
    (where / ".metadata").write_bytes(pickle.dumps(Payload(tmp_path / "ran")))
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not checkpoint metadata"):
        kitchen_dcp.load(where, model, opt)
    assert not (tmp_path / "ran").exists()


def test_a_poisoned_byte_item_is_refused_and_dcp_itself_would_run_it(tmp_path, monkeypatch):
    where, model, opt = dcp_checkpoint(tmp_path)
    meta = pickle.loads((where / ".metadata").read_bytes())
    blob = io.BytesIO()
    torch.save(Payload(tmp_path / "ran"), blob)
    (where / "evil.distcp").write_bytes(blob.getvalue())
    index = next(i for i in meta.storage_data if isinstance(
        meta.state_dict_metadata[i.fqn], BytesStorageMetadata))  # fmt: skip
    meta.storage_data[index] = _StorageInfo("evil.distcp", 0, len(blob.getvalue()))
    (where / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(pickle.UnpicklingError, match=f"{index.fqn}: refused"):
        kitchen_dcp.load(where, model, opt)
    assert not (tmp_path / "ran").exists()
    monkeypatch.setattr(dcp_check, "check", lambda path: None)  # the control: unchecked,
    with warnings.catch_warnings():  # torch's own reader runs the payload
        warnings.simplefilter("ignore")
        try:
            kitchen_dcp.load(where, model, opt)
        except Exception:  # noqa: S110 - whatever it does after unpickling, it has run it
            pass
    assert (tmp_path / "ran").exists()
