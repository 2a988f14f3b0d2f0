import hashlib
import json

import pytest
import torch

from protos import trainer_config_pb2
from protos.files import json_bytes
from trainer import checkpoint

RUN = checkpoint.TrainingRun(
    kind="PRETRAIN",
    model=trainer_config_pb2.ModelConfig(dim=8, n_layers=1),
    vocab_size=2,
    dataset="/precooked/dataset",
    world_size=1,
)


def tiny_training(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def train_one_step(model, optimizer):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def save_steps(tmp_path, steps, keep_last=5):
    model, optimizer = tiny_training()
    saver = checkpoint.Checkpointer(tmp_path, keep_last, is_main=True)
    for step in steps:
        train_one_step(model, optimizer)
        saver.save(step, model, optimizer, {"step_state": step}, {"at": step}, RUN)
    return saver, model, optimizer


def test_save_then_load_restores_exactly(tmp_path):
    saver, model, optimizer = save_steps(tmp_path, [1, 2])
    found = saver.find()
    assert found is not None
    path, meta = found
    assert path.name == "step_00000002" and meta.step == 2
    assert meta.loader == [{"at": 2}]  # one entry per rank
    assert (meta.kind, meta.model, meta.dataset) == (RUN.kind, RUN.model, RUN.dataset)
    fresh_model, fresh_optimizer = tiny_training(seed=1)
    state = checkpoint.load(path, fresh_model, fresh_optimizer, rank=0)
    assert state == {"step_state": 2}
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)
    # The optimizer continues identically: one more step on both gives equal weights.
    torch.manual_seed(5)
    train_one_step(model, optimizer)
    torch.manual_seed(5)
    train_one_step(fresh_model, fresh_optimizer)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_keeps_only_the_last_k_and_no_temporary_files(tmp_path):
    save_steps(tmp_path, [10, 20, 30, 40], keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000030", "step_00000040"]


def test_a_save_that_died_midway_is_cleaned_up(tmp_path):
    save_steps(tmp_path, [1])
    stale = tmp_path / ".tmp-step_00000002-999"
    stale.mkdir()
    (stale / "model.pt").write_bytes(b"half")
    checkpoint.Checkpointer(tmp_path, 3, is_main=True)
    assert not stale.exists()
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_00000001"]


def damage_truncate(path):
    data = (path / "model.pt").read_bytes()
    (path / "model.pt").write_bytes(data[: len(data) // 2])


def damage_flip_a_byte(path):
    data = bytearray((path / "train.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "train.pt").write_bytes(bytes(data))


def damage_meta(path):
    (path / "meta.json").write_text('{"step": 3, "fil')


def test_damaged_latest_falls_back_to_the_previous_with_a_warning(tmp_path):
    for damage in (damage_truncate, damage_flip_a_byte, damage_meta):
        root = tmp_path / damage.__name__
        saver, *_ = save_steps(root, [1, 2, 3])
        damage(root / "step_00000003")
        warnings: list[str] = []
        found = saver.find(warn=warnings.append)
        assert found is not None, damage.__name__
        path, meta = found
        assert path.name == "step_00000002" and meta.step == 2, damage.__name__
        assert len(warnings) == 1 and "step_00000003" in warnings[0], warnings
        assert "WARNING" in warnings[0]


def test_nothing_valid_means_none(tmp_path):
    saver, *_ = save_steps(tmp_path, [1])
    damage_truncate(tmp_path / "step_00000001")
    assert saver.find(warn=lambda _: None) is None
    assert checkpoint.Checkpointer(tmp_path / "empty", 3, is_main=True).find() is None


def test_meta_json_written_before_checkpoint_meta_existed_still_loads(tmp_path):
    # meta.json as the trainer wrote it when meta was a plain dict: the format is unchanged, so
    # it loads, and writing it back gives the same bytes.
    path = tmp_path / "step_00000050"
    path.mkdir()
    (path / "model.pt").write_bytes(b"weights")
    old = {
        "dataset": "/state/precook/datasets/best_fit-256-0123456789abcdef",
        "files": {
            "model.pt": {"bytes": 7, "sha256": hashlib.sha256(b"weights").hexdigest()},
            "train.pt": {"bytes": 5, "sha256": hashlib.sha256(b"state").hexdigest()},
        },
        "kind": "SFT",
        "loader": [
            {
                "batch": 50,
                "batch_size": 8,
                "dataset": "0123456789abcdef",
                "epoch": 0,
                "rank": 0,
                "seed": 0,
                "split": "train",
                "world_size": 1,
            }
        ],
        "model": {
            "dim": 256,
            "ffn_dim": 704,
            "max_seq_len": 256,
            "n_heads": 8,
            "n_kv_heads": 8,
            "n_layers": 4,
            "norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "tie_embeddings": True,
            "use_kernels": True,
        },
        "saved_at": 1764400000.25,
        "step": 50,
        "vocab_size": 4096,
        "world_size": 1,
    }
    (path / "meta.json").write_bytes(json_bytes(old))
    meta = checkpoint.verify(path, files=("model.pt",))
    assert (meta.step, meta.kind, meta.vocab_size, meta.world_size) == (50, "SFT", 4096, 1)
    assert meta.model.dim == 256 and meta.model.max_seq_len == 256
    assert meta.loader[0]["batch"] == 50 and meta.files["model.pt"].bytes == 7
    assert json_bytes(meta.to_json()) == (path / "meta.json").read_bytes()


def test_meta_json_missing_a_field_names_the_file_and_the_field(tmp_path):
    save_steps(tmp_path, [1])
    meta_file = tmp_path / "step_00000001" / "meta.json"
    data = json.loads(meta_file.read_text())
    del data["vocab_size"]
    meta_file.write_text(json.dumps(data))
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.verify(tmp_path / "step_00000001")
    assert str(meta_file) in str(err.value) and "vocab_size" in str(err.value)
