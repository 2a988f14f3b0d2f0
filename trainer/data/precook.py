"""precook_dataset: a DataConfig in, a packed, sharded, cached dataset directory out.

Two cached stages: the tokenized corpus (tokenized.py: inputs + tokenizer) and the dataset
(packing + shards, this file). Each is keyed by the content of what decides it, so a second
call with equal inputs and parameters finds the dataset and does nothing else.
"""

import os
import shutil
import time
from dataclasses import dataclass

import numpy as np

from protos.enums import enum_name
from protos.files import FileDigest
from protos.trainer_config_pb2 import DataConfig
from protos.validation import resolve_data
from trainer.data import cache as cache_mod
from trainer.data import curate, manifest, packing, shards, tokenized
from trainer.data.errors import DataConfigError
from trainer.data.manifest import (
    Counts,
    DatasetManifest,
    PrecookSettings,
    SplitStats,
    TokenizedManifest,
)
from trainer.data.mixture import plan_sources
from trainer.data.progress import Say, human, reporter
from trainer.data.tokenizer import Tokenizer, from_section


@dataclass(frozen=True)
class PrecookedDataset:
    path: str  # the dataset directory: manifest.json, tokenizer, train/ and eval/
    manifest: DatasetManifest
    cache_hit: bool
    tokenizer: Tokenizer


def dataset_key(cfg: DataConfig, tokenized_key: str) -> str:
    return cache_mod.key_of(
        {
            "stage": "dataset",
            "format_version": manifest.FORMAT_VERSION,
            "tokenized": tokenized_key,
            "seq_len": cfg.seq_len,
            "packing": enum_name(cfg, "packing"),
            "shard_tokens": cfg.shard_tokens,
            "curation": curate.identity(cfg),
        }
    )


def _loss_targets(plan, source: np.ndarray, mask: np.ndarray) -> int:
    """Tokens whose next token in the same segment is a loss target (JSONL_CHAT)."""
    return sum(
        int(mask[s + 1 : s + n].sum())
        for s, n in zip(source.tolist(), plan.seg_len.tolist(), strict=True)
    )


def _build_dataset(
    tmp: str, cfg: DataConfig, key: str, tok_path: str, tok_manifest: TokenizedManifest, say: Say
) -> DatasetManifest:
    strategy = enum_name(cfg, "packing").lower()
    dtype = np.dtype(tok_manifest.token_dtype)
    doc_tokens = np.memmap(os.path.join(tok_path, "tokens.bin"), dtype=dtype, mode="r")
    offsets = np.load(os.path.join(tok_path, "doc_offsets.npy"))
    chat = tok_manifest.loss_mask
    mask = None
    if chat:
        mask = np.memmap(os.path.join(tok_path, "loss_mask.bin"), dtype=np.uint8, mode="r")
    lengths = np.diff(offsets)
    written: dict[str, FileDigest] = {}
    splits: dict[str, SplitStats] = {}
    chosen = curate.select(cfg, tok_path, say)
    for split, docs in zip(shards.SPLITS, (chosen.train, chosen.eval), strict=True):
        start = time.perf_counter()
        plan = packing.pack(strategy, lengths[docs], cfg.seq_len)
        pack_s = time.perf_counter() - start
        written.update(
            shards.write_split(
                tmp, split, plan, docs, doc_tokens, offsets, cfg.shard_tokens, loss_mask=mask
            )
        )
        source = offsets[docs[plan.seg_doc]] + plan.seg_start
        splits[split] = SplitStats(
            documents=len(docs),
            tokens=plan.input_tokens,
            rows=plan.rows,
            segments=len(plan.seg_len),
            slots=plan.slots,
            padding_tokens=plan.padding_tokens,
            truncated_tokens=plan.truncated_tokens,
            target_tokens=_loss_targets(plan, source, mask) if chat else plan.target_tokens,
            shards=len([f for f in written if f.startswith(f"{split}/tokens-")]),
        )
        fill = 100 * plan.kept_tokens / max(plan.slots, 1)
        width = "<= " if strategy == "bucket" else ""
        say(
            f"{split}: {len(docs):,} documents -> {plan.rows:,} rows of {width}{cfg.seq_len} "
            f"({strategy}, packed in {pack_s:.2f} s): {fill:.2f}% of slots hold tokens, "
            f"{plan.truncated_tokens:,} tokens truncated"
        )
    section = tok_manifest.tokenizer
    # the tokenizer, and which record (file or JSONL line) each document id came from
    for name in (section.file, "doc_record.npy"):
        shutil.copyfile(os.path.join(tok_path, name), os.path.join(tmp, name))
        written[name] = tok_manifest.files[name]
    fmt = tok_manifest.inputs.format
    parts = splits.values()
    body = DatasetManifest(
        key=key,
        tokenized_key=tok_manifest.key,
        config=PrecookSettings(
            format=fmt,
            tokenizer=enum_name(cfg, "tokenizer"),
            vocab_size_requested=cfg.vocab_size if section.kind == "bpe" else None,
            eval_fraction=round(cfg.eval_fraction, 6),
            max_documents=cfg.max_documents,
            shard_tokens=cfg.shard_tokens,
            fields=tokenized.FIELDS[fmt](cfg),
        ),
        inputs=tok_manifest.inputs,
        tokenizer=section,
        vocab_size=section.vocab_size,
        token_dtype=tok_manifest.token_dtype,
        loss_mask=chat,
        seq_len=cfg.seq_len,
        packing=strategy,
        bucket_lengths=packing.bucket_lengths(cfg.seq_len) if strategy == "bucket" else None,
        documents=tok_manifest.documents,
        splits=splits,
        counts=Counts(
            documents=sum(s.documents for s in parts),
            tokens=sum(s.tokens for s in parts),
            rows=sum(s.rows for s in parts),
            padding_tokens=sum(s.padding_tokens for s in parts),
            truncated_tokens=sum(s.truncated_tokens for s in parts),
        ),
        files=written,
        curation=chosen.curation,
        sources=chosen.sources,
    )
    manifest.write_manifest(tmp, body)
    return manifest.read_manifest(tmp, DatasetManifest)  # as a cache hit would read it


def precook_dataset(
    cfg: DataConfig, cache_dir: str, *, show_progress: bool = True
) -> PrecookedDataset:
    """Precook `cfg` (a kitchen.v1.DataConfig; unset fields take their defaults) under
    `cache_dir` (or else `cfg.cache_dir`), or find it there already precooked. Raises
    ConfigError for a config that cannot work, PrecookError for input that cannot be
    precooked. Tokenizes in `spawn`ed worker processes, so a script that calls it must do so
    under `if __name__ == "__main__":`."""
    say = reporter(show_progress)
    cfg = resolve_data(cfg)
    cache_dir = cache_dir or cfg.cache_dir
    if not cache_dir:
        raise DataConfigError("cache_dir", "no directory to precook into")
    start = time.perf_counter()
    plan = plan_sources(cfg)
    cache = cache_mod.Cache(cache_dir)
    tok_key = tokenized.tokenized_key(cfg, plan)
    key = dataset_key(cfg, tok_key)
    hashed_s = time.perf_counter() - start
    name = f"{enum_name(cfg, 'packing').lower()}-{cfg.seq_len}-{key[:16]}"

    def build(tmp: str) -> DatasetManifest:
        say(
            f"cache miss: precooking {plan.records:,} records ({human(plan.bytes, 'B')}) "
            f"of {plan.description}"
        )
        tok_path, tok_manifest, tok_hit = tokenized.tokenize_corpus(
            cfg, plan, cache, show_progress, say
        )
        if tok_hit:
            say(f"tokenized corpus found in the cache ({tok_path}): packing only")
        return _build_dataset(tmp, cfg, key, tok_path, tok_manifest, say)

    path, found, hit = cache.get_or_build(DatasetManifest, name, key, build, say)
    if hit:
        say(
            f"cache hit: {path} (inputs and parameters unchanged; hashed "
            f"{human(plan.bytes, 'B')} in {hashed_s:.2f} s, nothing tokenized or packed)"
        )
    else:
        say(f"done in {time.perf_counter() - start:.1f} s: {path}")
    return PrecookedDataset(path, found, hit, from_section(found.tokenizer, path))
