"""Mixtures: several sources read into one corpus, then sampled to their weights or budgets.

Reading: each source is planned as a corpus of its own (corpus.plan_corpus with the source's
input, format and field), and the plans are laid end to end: records are numbered across all
sources, units remember their source, file paths are prefixed with the source's name. One
tokenizer (trained on the train split of all sources, or given) serves every source.

Sampling, when the dataset is packed (after filters and dedup): a source with a token budget
gets that many train tokens; the weighted sources share the train tokens they have together,
in proportion to their weights. A source's epochs are its target / the tokens it has: whole
epochs repeat every document, the fraction left takes a seeded random subset (mixture_seed,
the source's index). Eval documents are never resampled. The selected documents (repeats
included) stay in corpus order; the loader shuffles rows.
"""

import dataclasses
from dataclasses import dataclass

import numpy as np

from protos.enums import enum_name
from protos.trainer_config_pb2 import DataConfig
from trainer.data.corpus import CorpusPlan, SourceReader, plan_corpus

SINGLE = "input"  # the source name of a config without sources


def plan_sources(cfg: DataConfig) -> CorpusPlan:
    """The corpus plan of a defaulted DataConfig: its input, or its sources end to end."""
    fmt = enum_name(cfg, "format")
    if not cfg.sources:
        return plan_corpus(cfg, fmt)
    out = CorpusPlan(
        description="mixture of " + ", ".join(s.name for s in cfg.sources), root="/", fmt=fmt
    )
    for i, src in enumerate(cfg.sources):
        one = DataConfig()
        one.CopyFrom(cfg)
        del one.sources[:]
        one.input = src.input
        if src.format:
            one.format = src.format
        if src.text_field:
            one.text_field = src.text_field
        src_fmt = enum_name(one, "format")
        plan = plan_corpus(one, src_fmt)
        out.units += [
            dataclasses.replace(u, source=i, first_record=u.first_record + out.records)
            for u in plan.units
        ]
        out.files += [dataclasses.replace(f, relpath=f"{src.name}/{f.relpath}") for f in plan.files]
        out.records += plan.records
        out.sources.append(SourceReader(src.name, one, src_fmt))
    return out


def source_names(cfg: DataConfig) -> list[str]:
    return [s.name for s in cfg.sources] or [SINGLE]


@dataclass(frozen=True)
class SourceStats:
    """One source in a packed dataset's manifest."""

    documents: int  # train documents left after filters and dedup
    tokens: int  # their tokens
    target_tokens: int  # what the weight or budget asks for
    selected_documents: int  # train documents in the dataset, repeats counted
    selected_tokens: int
    epochs: float  # selected_tokens / tokens


def _targets(cfg: DataConfig, available: list[int]) -> list[int]:
    if not cfg.sources:
        return available
    weighted = [i for i, s in enumerate(cfg.sources) if not s.token_budget]
    weights = np.array([cfg.sources[i].weight or 1.0 for i in weighted], dtype=np.float64)
    pool = sum(available[i] for i in weighted)
    targets = [int(s.token_budget) for s in cfg.sources]
    for i, w in zip(weighted, weights.tolist(), strict=True):
        targets[i] = int(round(pool * w / weights.sum()))
    return targets


def _sample(docs: np.ndarray, lengths: np.ndarray, target: int, rng) -> np.ndarray:
    """Whole epochs of `docs`, then a seeded random subset reaching the remaining tokens."""
    have = int(lengths.sum())
    if have == 0 or target <= 0:
        return docs[:0]
    full, rest = divmod(target, have)
    parts = [np.tile(docs, full)]
    if rest:
        order = rng.permutation(len(docs))
        reach = np.cumsum(lengths[order])
        parts.append(docs[order[: int(np.searchsorted(reach, rest)) + 1]])
    return np.sort(np.concatenate(parts), kind="stable")


def select_train(
    cfg: DataConfig, train_docs: np.ndarray, doc_source: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, dict[str, SourceStats]]:
    """(train documents to pack, repeats included, in corpus order; stats per source)."""
    names = source_names(cfg)
    mine = [train_docs[doc_source[train_docs] == i] for i in range(len(names))]
    available = [int(lengths[d].sum()) for d in mine]
    chosen, stats = [], {}
    for i, (name, docs, target) in enumerate(
        zip(names, mine, _targets(cfg, available), strict=True)
    ):
        picked = docs if not cfg.sources else _sample(docs, lengths[docs], target, _rng(cfg, i))
        chosen.append(picked)
        got = int(lengths[picked].sum())
        stats[name] = SourceStats(
            documents=len(docs),
            tokens=available[i],
            target_tokens=target,
            selected_documents=len(picked),
            selected_tokens=got,
            epochs=round(got / max(available[i], 1), 4),
        )
    return np.sort(np.concatenate(chosen), kind="stable"), stats


def _rng(cfg: DataConfig, source: int) -> np.random.Generator:
    return np.random.default_rng([cfg.mixture_seed, source])


def identity(cfg: DataConfig) -> dict:
    """What of the mixture decides the dataset, for the cache key."""
    return {
        "seed": cfg.mixture_seed,
        "sources": [
            {"name": s.name, "weight": s.weight or 1.0, "token_budget": s.token_budget}
            for s in cfg.sources
        ],
    }
