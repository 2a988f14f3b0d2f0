"""Curation: near-duplicate dedup finds planted near-duplicates (precision and recall >= 0.95),
filters drop and count what they should, mixtures follow their weights and budgets
deterministically, and the loader's exact resume holds on a mixture."""

import json
import os

import numpy as np
import pytest
import torch

from protos import trainer_config_pb2
from trainer.data import dedup, testdata
from trainer.data.loader import PackedRowLoader
from trainer.data.precook import precook_dataset

LETTERS = "abcdefghijklmnopqrstuvwxyz"
# 5,000 made-up words: unrelated documents share almost no 5-word shingle
BIG_VOCAB = [a + b + c for a in LETTERS for b in LETTERS for c in LETTERS][:5000]


def near_duplicate(rng, words: list[str], edits: int) -> str:
    """`words` with `edits` substitutions, one deletion, and its case and punctuation changed
    (which normalization must undo)."""
    out = list(words)
    for i in rng.choice(len(out), size=edits, replace=False):
        out[i] = str(rng.choice(BIG_VOCAB))
    del out[int(rng.integers(len(out)))]
    return ", ".join(" ".join(out[i : i + 9]).upper() for i in range(0, len(out), 9)) + "!"


def planted_corpus(seed: int = 0):
    """(texts, ids of planted near-duplicates): 300 originals, 60 near-duplicates of them
    (1 to 4 substituted words in 150-400), 30 hard negatives (half of an original, half new)."""
    rng = np.random.default_rng(seed)
    originals = [list(rng.choice(BIG_VOCAB, size=int(rng.integers(150, 400)))) for _ in range(300)]
    texts = [" ".join(w) for w in originals]
    planted = set()
    for k in range(60):
        planted.add(len(texts))
        texts.append(near_duplicate(rng, originals[k], int(rng.integers(1, 5))))
    for k in range(60, 90):
        half = originals[k][: len(originals[k]) // 2]
        texts.append(" ".join(half + list(rng.choice(BIG_VOCAB, size=len(half)))))
    order = rng.permutation(len(texts))  # duplicates anywhere, not only after their original
    first = {int(o): i for i, o in enumerate(order)}
    return [texts[o] for o in order], order, planted, first


def test_minhash_lsh_precision_and_recall_on_planted_near_duplicates():
    texts, order, planted, _ = planted_corpus()
    _, sigs = dedup.signatures(texts, near=True)
    kept = dedup.near_keep(sigs, np.arange(len(texts)), threshold=0.7)
    dropped = set(range(len(texts))) - set(kept.tolist())
    # ground truth: in each (original, copy) pair the later one in corpus order is the duplicate
    position = {int(o): i for i, o in enumerate(order)}
    truth = set()
    for copy in planted:
        original = copy - 300
        truth.add(max(position[original], position[copy]))
    hits = len(dropped & truth)
    precision, recall = hits / max(len(dropped), 1), hits / len(truth)
    assert precision >= 0.95 and recall >= 0.95, (precision, recall, len(dropped), len(truth))


def test_exact_dedup_normalizes_case_punctuation_and_space():
    a, b, c = "Hello,  World!\n", "hello world", "hello world again"
    exact, _ = dedup.signatures([a, b, c], near=False)
    assert dedup.exact_keep(exact, np.arange(3)).tolist() == [0, 2]


def test_precook_reports_what_filters_and_dedup_dropped(tmp_path):
    texts, _, planted, _ = planted_corpus(seed=1)
    rng = np.random.default_rng(2)
    rows = [{"text": t} for t in texts]
    rows += [{"text": "tiny"}] * 3  # 3 short (and 2 of them exact duplicates of the first)
    rows += [{"text": "1234 5678 90 ;;; --- " * 20}]  # low alpha
    rows += [{"text": "same line here\n" * 30 + " ".join(rng.choice(BIG_VOCAB, 200))}]  # repetitive
    testdata.write_jsonl(str(tmp_path / "c.jsonl"), rows)
    cfg = testdata.data_config(
        input=str(tmp_path / "c.jsonl"), format="JSONL", vocab_size=1000, seq_len=256,
        dedup_exact=True, near_dup_threshold=0.7, min_doc_tokens=8, min_alpha_fraction=0.4,
        max_repeated_line_fraction=0.5,
    )  # fmt: skip
    m = precook_dataset(cfg, str(tmp_path / "cache"), show_progress=False).manifest
    c = m.curation
    assert c is not None
    assert (c.filtered.too_short, c.filtered.low_alpha, c.filtered.repeated_lines) == (3, 1, 1)
    assert c.deduplicated.near_duplicates >= 0.95 * len(planted)
    assert c.deduplicated.near_duplicates <= len(planted) / 0.95
    assert c.kept == c.documents - 5 - c.deduplicated.near_duplicates
    assert m.counts.documents == c.kept  # every kept document is packed, once (no mixture)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    testdata.write_text_corpus(str(root / "small"), n=20, seed=1)
    testdata.write_text_corpus(str(root / "large"), n=80, seed=2)
    return str(root)


def mixture(root: str, **fields) -> trainer_config_pb2.DataConfig:
    cfg = testdata.data_config(**fields)
    cfg.sources.add(name="small", input=f"{root}/small", weight=1)
    cfg.sources.add(name="large", input=f"{root}/large", weight=1)
    return cfg


def test_mixture_follows_weights_deterministically(sources, tmp_path):
    one = precook_dataset(mixture(sources), str(tmp_path / "a"), show_progress=False)
    again = precook_dataset(mixture(sources), str(tmp_path / "b"), show_progress=False)
    for name in one.manifest.files:
        with (
            open(os.path.join(one.path, name), "rb") as f,
            open(os.path.join(again.path, name), "rb") as g,
        ):
            assert f.read() == g.read(), name
    s = one.manifest.sources
    assert s is not None
    total = s["small"].tokens + s["large"].tokens
    longest = 700  # words per document at most (testdata), each at least one token
    for name in ("small", "large"):  # equal weights: half the tokens each
        assert s[name].target_tokens == pytest.approx(total / 2, abs=1)
        assert s[name].target_tokens <= s[name].selected_tokens
        assert s[name].selected_tokens < s[name].target_tokens + 4 * longest
    assert s["small"].epochs > 1 > s["large"].epochs  # the small source is upsampled
    assert (
        one.manifest.splits["train"].tokens
        == s["small"].selected_tokens + s["large"].selected_tokens
    )
    other_seed = precook_dataset(
        mixture(sources, mixture_seed=7), str(tmp_path / "c"), show_progress=False
    )
    assert other_seed.manifest.key != one.manifest.key and other_seed.manifest.sources
    assert other_seed.manifest.sources["large"].target_tokens == s["large"].target_tokens


def test_a_token_budget_takes_that_many_tokens(sources, tmp_path):
    cfg = mixture(sources)
    cfg.sources[0].weight = 0
    cfg.sources[0].token_budget = 20_000
    s = precook_dataset(cfg, str(tmp_path), show_progress=False).manifest.sources
    assert s is not None
    assert s["small"].target_tokens == 20_000 <= s["small"].selected_tokens
    assert s["large"].target_tokens == s["large"].tokens  # the only weighted source: all of it


def test_loader_resumes_exactly_on_a_mixture(sources, tmp_path):
    path = precook_dataset(mixture(sources), str(tmp_path), show_progress=False).path
    take = lambda loader, k: [next(loader) for _ in range(k)]
    stream = take(PackedRowLoader(path, "train", batch_size=4, seed=3), 12)
    first = PackedRowLoader(path, "train", batch_size=4, seed=3)
    take(first, 5)
    resumed = PackedRowLoader(path, "train", batch_size=4, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for want, got in zip(stream[5:], take(resumed, 7), strict=True):
        assert all(torch.equal(want[k], got[k]) for k in want)
