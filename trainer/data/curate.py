"""Which tokenized documents a dataset packs: filters, then exact and near-duplicate dedup,
then the mixture's sampling of the train split. Runs over per-document arrays only (lengths,
features, signatures), never the text, so it is cheap to redo at another threshold.
"""

import os
from dataclasses import dataclass

import numpy as np

from protos.trainer_config_pb2 import DataConfig
from trainer.data import dedup, filters, mixture
from trainer.data.dedup import DedupCounts
from trainer.data.filters import FilterCounts
from trainer.data.mixture import SourceStats
from trainer.data.progress import Say


@dataclass(frozen=True)
class Curation:
    """Documents in, dropped (by each reason) and kept, in the dataset's manifest."""

    documents: int
    filtered: FilterCounts
    deduplicated: DedupCounts
    kept: int


@dataclass(frozen=True)
class Selection:
    train: np.ndarray  # tokenized document ids to pack, repeats included, in corpus order
    eval: np.ndarray
    curation: Curation
    sources: dict[str, SourceStats]


def identity(cfg: DataConfig) -> dict:
    """What of curation and mixing decides the dataset, for the cache key."""
    fields = ("min_doc_tokens", "max_doc_tokens", "min_alpha_fraction")
    return {
        "filters": {f: getattr(cfg, f) for f in (*fields, "max_repeated_line_fraction")},
        "dedup_exact": cfg.dedup_exact,
        "near_dup_threshold": cfg.near_dup_threshold,
        "dedup_version": dedup.DEDUP_VERSION,
        "mixture": mixture.identity(cfg),
    }


def active(cfg: DataConfig) -> bool:
    """Whether any filter or dedup is on (a resolved DataConfig): worth a line of report."""
    return bool(
        cfg.dedup_exact
        or cfg.near_dup_threshold > 0
        or cfg.min_doc_tokens
        or cfg.max_doc_tokens
        or cfg.min_alpha_fraction > 0
        or cfg.max_repeated_line_fraction < 1
    )


def select(cfg: DataConfig, tok_path: str, say: Say) -> Selection:
    """The documents of each split of the tokenized corpus at `tok_path` to pack."""
    load = lambda name: np.load(os.path.join(tok_path, name))
    lengths = np.diff(load("doc_offsets.npy"))
    doc_split = load("doc_split.npy")
    keep, filtered = filters.apply(cfg, lengths, load("doc_alpha.npy"), load("doc_line_repeat.npy"))
    survivors = np.flatnonzero(keep)
    exact_dups = near_dups = 0
    if cfg.dedup_exact:
        kept = dedup.exact_keep(load("doc_exact.npy"), survivors)
        exact_dups, survivors = len(survivors) - len(kept), kept
    if cfg.near_dup_threshold > 0:
        sigs = np.memmap(os.path.join(tok_path, dedup.SIGNATURES), dtype=np.uint32, mode="r")
        sigs = sigs.reshape(len(lengths), dedup.NUM_PERM)
        kept = dedup.near_keep(sigs, survivors, cfg.near_dup_threshold)
        near_dups, survivors = len(survivors) - len(kept), kept
    curation = Curation(
        documents=len(lengths),
        filtered=filtered,
        deduplicated=DedupCounts(exact_dups, near_dups),
        kept=len(survivors),
    )
    f = filtered
    if active(cfg):
        say(
            f"curation: {len(lengths):,} documents; filters dropped {f.too_short:,} short, "
            f"{f.too_long:,} long, {f.low_alpha:,} low-alpha, {f.repeated_lines:,} repetitive; "
            f"dedup dropped {exact_dups:,} exact and {near_dups:,} near duplicates; "
            f"{len(survivors):,} kept"
        )
    split_of = doc_split[survivors]
    train, stats = mixture.select_train(
        cfg, survivors[split_of == 0], load("doc_source.npy"), lengths
    )
    for name, s in stats.items() if cfg.sources else ():
        say(
            f"source {name}: {s.tokens:,} train tokens, {s.selected_tokens:,} taken "
            f"({s.epochs:g} epochs, {s.selected_documents:,} documents)"
        )
    return Selection(train, survivors[split_of == 1], curation, stats)
