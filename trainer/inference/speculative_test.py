"""Sampled speculative decoding gives plain sampling's distribution: statistical tests.

Each test compares counts by Pearson's chi-square test, goodness of fit against a known
distribution or homogeneity of two samples, and fails when the p-value is below ALPHA = 1e-4:
a correct rule fails one comparison with probability 1e-4 (over the choice of seeds; the seeds
are fixed, so a given run is deterministic), under 1e-3 for the file's five. Cells expected to
hold fewer than MIN_COUNT draws are pooled into one, so the chi-square approximation holds.
Each test also checks that both of the rule's branches ran (drafts kept and rejected), and the
first shows the test has power: a wrong rule (every draft kept) fails it by far.
"""

import pytest
import torch

from trainer.inference.engine import Engine, Request, SamplingParams
from trainer.inference.speculative import verify_sampled
from trainer.inference.testing import EOS, decode, perturbed, serve_config, tiny_model

torch.set_num_threads(1)

ALPHA = 1e-4
MIN_COUNT = 20


def chi_square_p(observed: list[list[int]], expected: list[float] | None = None) -> float:
    """The p-value of Pearson's test: `observed` one row of counts per sample; with `expected`
    (probabilities) goodness of fit of the one row, else homogeneity of the rows."""
    counts = torch.tensor(observed, dtype=torch.float64)
    if expected is not None:
        exp = torch.tensor(expected, dtype=torch.float64)[None] * counts.sum()
    else:
        exp = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    small = exp.sum(0) < MIN_COUNT * len(observed)
    if small.any():  # pool the rare cells into one
        counts = torch.cat([counts[:, ~small], counts[:, small].sum(1, keepdim=True)], 1)
        exp = torch.cat([exp[:, ~small], exp[:, small].sum(1, keepdim=True)], 1)
    stat = float(((counts - exp) ** 2 / exp.clamp(min=1e-12)).sum())
    df = (counts.shape[1] - 1) * (counts.shape[0] - 1 if expected is None else 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def first_tokens(p: torch.Tensor, q: torch.Tensor | None, n: int, always_keep=False):
    """n first tokens of a one-token draft verified against p (2, vocab): the draft drawn
    from q (None: prompt lookup's fixed draft token 0). Their counts, and the drafts kept."""
    gen = torch.Generator().manual_seed(1)
    counts, kept = [0] * p.shape[1], 0
    for _ in range(n):
        if q is None:
            draft = 0
        else:
            draft = int(torch.multinomial(q[0], 1, generator=gen))
        if always_keep:
            tokens = [draft]
        else:
            tokens = verify_sampled(p, [draft], q, gen)
        counts[tokens[0]] += 1
        kept += len(tokens) == 2
    return counts, kept


@pytest.mark.parametrize("draft", ["model", "prompt_lookup"])
def test_the_rejection_rule_samples_the_target_distribution(draft):
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(2, 6, generator=gen).softmax(-1) ** 1.5
    p = p / p.sum(-1, keepdim=True)
    q = (torch.rand(1, 6, generator=gen) * 3).softmax(-1) if draft == "model" else None
    n = 20000
    counts, kept = first_tokens(p, q, n)
    assert 0 < kept < n  # both branches: kept, and rejected then resampled
    assert chi_square_p([counts], p[0].tolist()) > ALPHA
    if q is not None:  # the test has power: keeping every draft samples q, and it fails
        wrong, _ = first_tokens(p, q, n, always_keep=True)
        assert chi_square_p([wrong], p[0].tolist()) < 1e-12


N = 2000  # requests per engine: seeds
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]  # repeats: prompt lookup finds drafts


@pytest.fixture(scope="module")
def models():
    target = tiny_model(32)
    return target, perturbed(target, 0.1, 32)


def sample_answers(model, draft, speculative_tokens: int, seeds: range):
    """The first three tokens of one prompt sampled once per seed (top-k 3: 27 outcomes)."""
    cfg = serve_config(
        speculative_tokens=speculative_tokens, max_running=512, max_batch_tokens=4096
    )
    engine = Engine(model, cfg, decode=decode, eos_id=EOS, max_len=32, draft=draft)
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=s) for s in seeds]
    requests = [Request(str(s), list(PROMPT), p) for s, p in zip(seeds, params, strict=True)]
    for r in requests:
        engine.add(r)
    while engine.has_work():
        engine.step()
    return [tuple(r.output) for r in requests], engine


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup"])
def test_sampled_speculation_answers_as_plain_sampling(models, drafter):
    """The joint distribution of the first three tokens (the first sampled after the prompt,
    the next ones verified from a draft) with speculation equals plain sampling's: two
    independent samples (other seeds) of N answers each, chi-square homogeneity."""
    target, draft = models
    plain, _ = sample_answers(target, None, 0, range(N))
    spec, engine = sample_answers(target, draft if drafter == "model" else None, 4, range(N, 2 * N))
    assert 0 < engine.accepted < engine.drafted  # drafts kept and rejected
    outcomes = sorted(set(plain) | set(spec))
    rows = [[answers.count(o) for o in outcomes] for answers in (plain, spec)]
    assert chi_square_p(rows) > ALPHA, rows


def test_a_seeded_sampled_request_is_reproducible(models):
    target, draft = models
    first, _ = sample_answers(target, draft, 4, range(50))
    again, _ = sample_answers(target, draft, 4, range(50))
    assert first == again


def test_a_draft_with_another_vocabulary_is_refused():
    target = tiny_model(32)
    draft = torch.nn.Module()
    draft.output = torch.nn.Linear(8, 65, bias=False)  # the target's 64 and one
    with pytest.raises(ValueError, match="serve.draft_path: the draft model has a 65-token"):
        Engine(target, serve_config(), decode=decode, eos_id=EOS, max_len=32, draft=draft)
