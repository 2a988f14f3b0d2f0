import math

import pytest
import torch
import torch.nn.functional as F

from protos.config_yaml import job_spec_from_dict
from protos.validation import resolve_trainer
from trainer import evaluate
from trainer.data.loader import PackedRowLoader
from trainer.data.precook import precook_dataset
from trainer.distributed import DistEnv
from trainer.model import attention_layout
from trainer.model_setup import build_model
from trainer.testing import tiny_job

torch.set_num_threads(1)
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    cfg = resolve_trainer(job_spec_from_dict(tiny_job(cache, train={"eval_batches": 3})).trainer)
    ds = precook_dataset(cfg.data, str(cache), show_progress=False)
    return cfg, ds, build_model(cfg, ds.tokenizer.vocab_size, "cpu")


def test_heldout_loss_is_the_mean_token_cross_entropy_of_the_eval_split(setup):
    cfg, ds, model = setup
    result = evaluate.heldout_loss(model, ds.path, cfg, CPU, torch.float32)
    loader = PackedRowLoader(ds.path, split="eval", batch_size=4, seed=cfg.train.seed)
    total = tokens = 0
    with torch.no_grad():
        for _ in range(3):
            b = next(loader)
            layout = attention_layout(b["document_ids"], "cpu", torch.float32)
            logits = model(b["input_ids"], b["position_ids"], layout)
            total += F.cross_entropy(
                logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100, reduction="sum"
            ).item()
            tokens += int((b["labels"] != -100).sum())
    assert result.tokens == tokens
    assert result.loss == pytest.approx(total / tokens, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(result.loss))
    # An untrained model is close to uniform over the vocabulary.
    assert abs(result.loss - math.log(ds.tokenizer.vocab_size)) < 0.5
    assert model.training  # evaluation leaves the mode as it found it


class Oracle(torch.nn.Module):
    """Knows which candidate is the true continuation (row 0 of each question) and, after
    the true context (not after <bos> alone), gives its tokens log-odds `bias`: +10 must
    always pick it, -10 never."""

    def __init__(self, vocab, bias):
        super().__init__()
        self.vocab, self.bias = vocab, bias

    def forward(self, ids, positions):
        logits = torch.zeros(*ids.shape, self.vocab)
        if ids.shape[1] == 2 * evaluate.CONTEXT:
            logits[0, :-1].scatter_(-1, ids[0, 1:, None], self.bias)
        return logits


def test_choice_accuracy_scores_the_true_continuation_against_decoys(setup):
    cfg, ds, model = setup
    accuracy, asked = evaluate.choice_accuracy(model, ds.path, cfg, CPU, torch.float32)
    assert asked > 0 and accuracy < 0.5, accuracy  # untrained: near chance (25%)
    vocab = ds.tokenizer.vocab_size
    assert evaluate.choice_accuracy(Oracle(vocab, 10.0), ds.path, cfg, CPU, torch.float32) == (
        1.0,
        asked,
    )
    assert evaluate.choice_accuracy(Oracle(vocab, -10.0), ds.path, cfg, CPU, torch.float32) == (
        0.0,
        asked,
    )
