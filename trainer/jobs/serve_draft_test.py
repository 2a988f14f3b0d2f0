"""serve.draft_path: a draft checkpoint is loaded when it reads the served model's tokens, and
refused naming the field when it does not (another vocabulary, fewer positions)."""

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from protos import defaults, trainer_config_pb2
from trainer import checkpoint
from trainer.jobs.context import BadInput, JobContext
from trainer.jobs.serve import load_draft
from trainer.model import Transformer


def save(directory: Path, vocab: int, max_seq_len: int, dim: int = 16) -> Path:
    """A checkpoint of a small Transformer: its directory."""
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = dim, 1, 2
    cfg.model.max_seq_len, cfg.model.use_kernels = max_seq_len, False
    model_cfg = defaults.with_defaults(cfg).model
    model = Transformer(model_cfg, vocab)
    run = checkpoint.TrainingRun("PRETRAIN", model_cfg, vocab, "", 1)
    saver = checkpoint.Checkpointer(directory, 1, is_main=True)
    optimizer = torch.optim.AdamW(model.parameters())
    return saver.save(1, model, optimizer, {}, {}, run)


def context(draft_path: Path) -> JobContext:
    """What load_draft reads of a job's context: its config, device and log."""
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.serve.draft_path, cfg.serve.speculative_tokens = str(draft_path), 4
    cfg.model.use_kernels = False
    ctx = SimpleNamespace(cfg=cfg, env=SimpleNamespace(device="cpu"), log=lambda line: None)
    return cast(JobContext, ctx)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[Path, checkpoint.CheckpointMeta]:
    path = save(tmp_path_factory.mktemp("target"), vocab=64, max_seq_len=64, dim=32)
    return path, checkpoint.verify(path, files=("model.pt",))


def test_a_draft_with_the_targets_vocabulary_is_loaded(tmp_path, target):
    path, meta = target
    draft = load_draft(context(save(tmp_path, 64, 64)), path, meta, 64)
    assert draft is not None and draft.output.weight.shape[0] == 64


@pytest.mark.parametrize(
    "vocab, max_seq_len, problem",
    [
        (65, 64, "has a 65-token vocabulary, the served model 64"),
        (64, 32, "reads 32 positions, the served model 64"),
    ],
)
def test_a_draft_that_cannot_read_the_targets_tokens_is_refused(
    tmp_path, target, vocab, max_seq_len, problem
):
    path, meta = target
    with pytest.raises(BadInput, match="trainer.serve.draft_path: ") as e:
        load_draft(context(save(tmp_path, vocab, max_seq_len)), path, meta, 64)
    assert problem in str(e.value)
