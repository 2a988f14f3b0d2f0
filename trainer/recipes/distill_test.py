"""The distillation loss: zero (with no gradient) against a teacher with the student's own
weights, the language-model loss itself at alpha 0, and a forward KL that grows as the
temperature sharpens a real difference."""

import pytest
import torch

from protos.config_yaml import job_spec_from_dict
from protos.validation import resolve_trainer
from trainer.lm_loss import packed_rows_loss
from trainer.model import Transformer
from trainer.recipes.distill import DistillRecipe
from trainer.testing import tiny_job

VOCAB, B, T = 512, 2, 16


def recipe_with(student: Transformer, teacher: Transformer, alpha: float, temperature: float):
    cfg = resolve_trainer(job_spec_from_dict(tiny_job("/unused", kind="DISTILL")).trainer)
    cfg.distill.alpha, cfg.distill.temperature = alpha, temperature
    r = DistillRecipe.__new__(DistillRecipe)  # the loss needs only these
    r.cfg, r.device, r.dtype, r.teacher = cfg, torch.device("cpu"), torch.float32, teacher.eval()
    r.ids = VOCAB  # the data tokenizer's ids
    return r


def batch() -> dict:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, VOCAB, (B, T), generator=g)
    labels[:, :3] = -100  # a prompt: no label
    return {
        "input_ids": torch.randint(0, VOCAB, (B, T), generator=g),
        "labels": labels,
        "position_ids": torch.arange(T).expand(B, T),
        "document_ids": torch.zeros(B, T, dtype=torch.long),
    }


@pytest.fixture
def models():
    cfg = resolve_trainer(job_spec_from_dict(tiny_job("/unused")).trainer)
    torch.manual_seed(0)
    student = Transformer(cfg.model, VOCAB)
    same = Transformer(cfg.model, VOCAB)
    same.load_state_dict(student.state_dict())
    other = Transformer(cfg.model, VOCAB)  # another seed's weights
    return student, same, other


def test_a_teacher_with_the_students_weights_teaches_nothing(models):
    student, same, _ = models
    loss = recipe_with(student, same, alpha=1.0, temperature=1.0).loss(student, batch())
    loss.backward()
    assert float(loss) == pytest.approx(0.0, abs=1e-4)
    assert max(float(p.grad.abs().max()) for p in student.parameters()) < 1e-5


def test_a_teacher_padded_past_the_tokenizer_is_read_on_its_ids_only(models):
    """A published teacher pads its embedding past the tokenizer (rows no token encodes to):
    the same weights padded with 64 rows of noise teach nothing, as the unpadded ones."""
    student, _, _ = models
    cfg = resolve_trainer(job_spec_from_dict(tiny_job("/unused")).trainer)
    padded = Transformer(cfg.model, VOCAB + 64)
    rows = padded.state_dict()  # the embedding and the head: 64 rows past VOCAB
    state = {
        k: v if v.shape == rows[k].shape else torch.cat([v, 10 * torch.randn(64, *v.shape[1:])])
        for k, v in student.state_dict().items()
    }
    padded.load_state_dict(state)
    loss = recipe_with(student, padded, alpha=1.0, temperature=1.0).loss(student, batch())
    assert float(loss) == pytest.approx(0.0, abs=1e-4)


def test_alpha_0_is_the_language_model_loss(models):
    student, _, other = models
    b = batch()
    loss = recipe_with(student, other, alpha=0.0, temperature=2.0).loss(student, b)
    assert float(loss) == pytest.approx(float(packed_rows_loss(student, b, "cpu", torch.float32)))


def test_the_distillation_term_is_the_forward_kl(models):
    student, _, other = models
    b = batch()
    got = float(recipe_with(student, other, alpha=1.0, temperature=1.0).loss(student, b))
    labelled = b["labels"] != -100
    with torch.no_grad():
        p = other(b["input_ids"], b["position_ids"])[labelled].log_softmax(-1)
        q = student(b["input_ids"], b["position_ids"])[labelled].log_softmax(-1)
    expected = float((p.exp() * (p - q)).sum())  # KL(teacher || student), summed over tokens
    assert got == pytest.approx(expected, rel=1e-4)
    assert got > 0
