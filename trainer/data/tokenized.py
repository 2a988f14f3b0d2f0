"""Stage one of precook: the corpus tokenized, document after document, cached on its own.

Packing at another seq_len or with another strategy, and `precook analyze`, reuse it. Worker
processes tokenize work units in parallel; the parent writes their results in corpus order, with
at most two units per worker in flight, so memory stays bounded whatever the corpus size.

    tokens.bin       every document as <bos> text <eos>, end to end (uint16 or uint32)
    loss_mask.bin    uint8 per token, 1 = a loss target (JSONL_CHAT: response tokens and <eos>)
    doc_offsets.npy  int64 (documents + 1,): document d is tokens[offsets[d] : offsets[d + 1]]
    doc_split.npy    uint8: 0 = train, 1 = eval
    doc_record.npy   int64: the record (file, or non-blank JSONL line) each document came from
    doc_source.npy   int32: the mixture source of each document (mixture.py)
    doc_alpha.npy, doc_line_repeat.npy   float32 features the filters read (filters.py)
    doc_exact.npy    uint64: the hash of each document's normalized text (dedup.py)
    doc_minhash.bin  uint32 (documents, NUM_PERM) MinHash signatures, when near-dup dedup is on
"""

import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import multiprocessing
import os
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from protos import files
from protos.defaults import SPECIAL_TOKENS
from protos.enums import enum_name
from protos.files import FileDigest
from protos.trainer_config_pb2 import DataConfig
from trainer.data import cache as cache_mod
from trainer.data import dedup, filters, manifest, tokenizer
from trainer.data.corpus import CorpusPlan, SourceReader, input_hashes, read_unit
from trainer.data.errors import CorpusError, DataConfigError
from trainer.data.files import write_npy
from trainer.data.manifest import (
    DocumentCounts,
    Inputs,
    TokenCounts,
    TokenizedManifest,
    TokenizerSection,
)
from trainer.data.progress import Progress, Say

SIGNATURES = dedup.SIGNATURES
FEATURE_FILES = {  # file -> DocFeatures attribute
    "doc_source.npy": "source",
    "doc_alpha.npy": "alpha",
    "doc_line_repeat.npy": "line_repeat",
    "doc_exact.npy": "exact",
}
_worker: dict[str, Any] = {}  # per-process state of a tokenizing worker
FIELDS: dict[str, Callable[[DataConfig], dict[str, str]]] = {  # part of the cache key
    "TEXT_FILES": lambda cfg: {},
    "JSONL": lambda cfg: {"text": cfg.text_field},
    "JSONL_CHAT": lambda cfg: {"prompt": cfg.prompt_field, "response": cfg.response_field},
}


def eval_count(records: int, eval_fraction: float) -> int:
    """Records held out: eval_fraction of them, at least one if any, never all."""
    if eval_fraction <= 0 or records < 2:
        return 0
    return min(records - 1, max(1, round(eval_fraction * records)))


def is_eval(record: np.ndarray, records: int, n_eval: int) -> np.ndarray:
    """Spread the eval records evenly over the corpus: deterministic, and known before reading."""
    record = np.asarray(record, dtype=np.int64)
    return (record + 1) * n_eval // records > record * n_eval // records


def tokenizer_identity(cfg: DataConfig) -> dict[str, Any]:
    """What decides the tokenizer, for the cache key."""
    import tokenizers

    kind = enum_name(cfg, "tokenizer")
    if kind == "BPE_TRAIN":
        return {
            "kind": kind,
            "vocab_size": cfg.vocab_size,
            "tokenizers": tokenizers.__version__,
            "special_tokens": list(SPECIAL_TOKENS),
        }
    path = cfg.tokenizer_path if kind == "BPE_FILE" else tokenizer.cl100k_file()
    try:
        return {"kind": kind, "sha256": files.sha256_file(path)}
    except OSError as err:
        raise DataConfigError("tokenizer_path", f"{path}: cannot read: {err.strerror}") from None


@dataclass(frozen=True)
class DocFeatures:
    """What filters, dedup and the mixture need of each document of a unit (no text)."""

    source: np.ndarray  # int32
    alpha: np.ndarray  # float32
    line_repeat: np.ndarray  # float32
    exact: np.ndarray  # uint64
    minhash: np.ndarray | None  # uint32 (documents, dedup.NUM_PERM), when near-dup is on


def _load_worker(
    section: TokenizerSection,
    directory: str,
    sources: list[SourceReader],
    near: bool,
    skip_invalid_utf8: bool,
) -> None:
    _worker.update(
        tok=tokenizer.from_section(section, directory),
        sources=sources,
        near=near,
        skip=skip_invalid_utf8,
    )


def _init_worker_process(*args) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    os.environ["RAYON_NUM_THREADS"] = "1"
    _load_worker(*args)


def _layout(tok, bodies: list, response_from: list | None):
    """Tokens of documents laid out as <bos> body <eos>; the loss mask when `response_from`
    (where each body's response starts) is given."""
    body_len = np.fromiter((len(b) for b in bodies), dtype=np.int64, count=len(bodies))
    lengths = body_len + 2
    ends = np.cumsum(lengths)
    starts = ends - lengths
    flat = np.fromiter(itertools.chain.from_iterable(bodies), dtype=np.int64, count=body_len.sum())
    tokens = np.empty(int(ends[-1]) if len(ends) else 0, dtype=tok.token_dtype)
    is_body = np.ones(len(tokens), dtype=bool)
    is_body[starts] = is_body[ends - 1] = False
    tokens[starts] = tok.bos_id
    tokens[ends - 1] = tok.eos_id
    tokens[is_body] = flat
    mask = None
    if response_from is not None:  # <bos> prompt: no target; response <eos>: targets
        prompt_len = np.asarray(response_from, dtype=np.int64)
        counts = np.stack([1 + prompt_len, body_len - prompt_len + 1], axis=1).ravel()
        mask = np.repeat(np.tile(np.array([0, 1], np.uint8), len(bodies)), counts)
    return tokens, lengths, mask


def tokenize_unit(unit):
    """Tokenize one work unit: (record of each document, lengths, tokens, loss mask or None,
    sources skipped as not UTF-8, number of empty documents skipped, DocFeatures)."""
    tok, reader = _worker["tok"], _worker["sources"][unit.source]
    cfg, fmt = reader.cfg, reader.fmt
    records = list(read_unit(unit, cfg, fmt, _worker["skip"]))
    skipped = [r.source for r in records if fmt == "TEXT_FILES" and r.text is None]
    if fmt == "JSONL_CHAT":
        kept = [r for r in records if r.response.strip()]
        prompts = tok.encode_batch([r.prompt for r in kept])
        responses = tok.encode_batch([r.response for r in kept])
        bodies = [p + r for p, r in zip(prompts, responses, strict=True)]
        tokens, lengths, mask = _layout(tok, bodies, [len(p) for p in prompts])
        texts = [f"{r.prompt}\n{r.response}" for r in kept]
    else:
        kept = [r for r in records if r.text is not None and r.text.strip()]
        tokens, lengths, mask = _layout(tok, tok.encode_batch([r.text for r in kept]), None)
        texts = [r.text for r in kept if r.text is not None]
    index = np.array([r.index for r in kept], dtype=np.int64)
    alpha, repeat = filters.text_features(texts)
    exact, sigs = dedup.signatures(texts, _worker["near"])
    source = np.full(len(kept), unit.source, dtype=np.int32)
    features = DocFeatures(source, alpha, repeat, exact, sigs)
    n_empty = len(records) - len(kept) - len(skipped)
    return index, lengths, tokens, mask, skipped, n_empty, features


def _results(plan: CorpusPlan, workers: int, init_args: tuple):
    """tokenize_unit over every unit, in corpus order: inline, or `workers` processes."""
    workers = min(workers, len(plan.units))
    if workers <= 1:
        _load_worker(*init_args)
        try:
            yield from map(tokenize_unit, plan.units)
        finally:
            _worker.clear()
        return
    ctx = multiprocessing.get_context("spawn")  # no inherited tokenizer thread pools
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker_process, initargs=init_args
    ) as pool:
        pending: collections.deque[concurrent.futures.Future] = collections.deque()
        units = iter(plan.units)
        try:
            for unit in itertools.islice(units, 2 * workers):
                pending.append(pool.submit(tokenize_unit, unit))
            while pending:
                result = pending.popleft().result()
                for unit in itertools.islice(units, 1):
                    pending.append(pool.submit(tokenize_unit, unit))
                yield result
        finally:
            for future in pending:
                future.cancel()


def _train_texts(plan: CorpusPlan, n_eval: int) -> Iterator[str]:
    for unit in plan.units:
        reader = plan.reader(unit)
        fmt = reader.fmt
        for r in read_unit(unit, reader.cfg, fmt, plan.skip_invalid_utf8):
            if is_eval(r.index, plan.records, n_eval):
                continue
            if fmt == "JSONL_CHAT":
                yield r.prompt
                yield r.response
            elif r.text is not None:
                yield r.text


def make_tokenizer(cfg: DataConfig, plan: CorpusPlan, say: Say) -> tokenizer.Tokenizer:
    """The tokenizer of a resolved DataConfig: loaded, or trained on the train split."""
    n_eval = eval_count(plan.records, cfg.eval_fraction)
    return tokenizer_of(cfg, _train_texts(plan, n_eval), say)


def tokenizer_of(cfg: DataConfig, train_texts: Iterable[str], say: Say) -> tokenizer.Tokenizer:
    """`cfg`'s tokenizer: loaded, or trained on `train_texts` (only then read)."""
    kind = enum_name(cfg, "tokenizer")
    if kind == "BPE_FILE":
        return tokenizer.from_tokenizer_json(cfg.tokenizer_path)
    if kind == "CL100K":
        return tokenizer.cl100k()
    say(f"training a byte-level BPE tokenizer (vocab {cfg.vocab_size:,}) on the train split")
    start = time.perf_counter()
    tok = tokenizer.train_bpe(train_texts, cfg.vocab_size)
    say(f"BPE trained in {time.perf_counter() - start:.1f} s")
    if tok.vocab_size < cfg.vocab_size:
        say(
            f"note: the BPE stopped at {tok.vocab_size:,} tokens, short of --vocab-size "
            f"{cfg.vocab_size:,}: the corpus has no more pairs of tokens to merge"
        )
    return tok


def worker_args(cfg: DataConfig, plan: CorpusPlan, section: TokenizerSection, directory: str):
    """What a tokenizing worker is started with (the tokenizer saved in `directory`)."""
    near = cfg.near_dup_threshold > 0
    return (section, directory, plan.sources, near, plan.skip_invalid_utf8)


def _build(
    tmp: str,
    cfg: DataConfig,
    plan: CorpusPlan,
    key: str,
    show_progress: bool,
    say: Say,
    tok: tokenizer.Tokenizer | None = None,
    results: Iterator | None = None,
) -> TokenizedManifest:
    """Tokenize into `tmp`: in worker processes, or from `results` (tokenize_unit's output for
    every unit in corpus order) made elsewhere with `tok` (tasks.py)."""
    fmt = plan.fmt
    n_eval = eval_count(plan.records, cfg.eval_fraction)
    if tok is None:
        tok = make_tokenizer(cfg, plan, say)
    section = tok.save(tmp)
    chat = fmt == "JSONL_CHAT"
    offsets, records = array("q", [0]), array("q")
    skipped, empty = [], 0
    features: list[DocFeatures] = []
    bar = Progress("tokenize", plan.records, enabled=show_progress)
    if results is None:
        results = _results(plan, cfg.workers, worker_args(cfg, plan, section, tmp))
    near = cfg.near_dup_threshold > 0
    mask_file = open(os.path.join(tmp, "loss_mask.bin"), "wb") if chat else contextlib.nullcontext()
    sig_file = open(os.path.join(tmp, SIGNATURES), "wb") if near else contextlib.nullcontext()
    with open(os.path.join(tmp, "tokens.bin"), "wb") as out, mask_file as masks, sig_file as sig:
        for index, lengths, tokens, mask, skip, n_empty, feats in results:
            out.write(tokens.tobytes())
            if masks is not None:
                masks.write(mask.tobytes())
            if sig is not None and feats.minhash is not None:
                sig.write(feats.minhash.tobytes())
            features.append(dataclasses.replace(feats, minhash=None))
            offsets.extend((offsets[-1] + np.cumsum(lengths)).tolist())
            records.extend(index.tolist())
            skipped += skip
            empty += n_empty
            bar.update(len(index) + len(skip) + n_empty, len(tokens))
        for f in (out, masks, sig):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
    bar.close()
    if len(records) == 0:
        raise CorpusError(f"{plan.description}: every document is empty: nothing to train on")
    skipped = [os.path.relpath(s, plan.root) for s in skipped]
    if skipped:
        say(f"skipped {len(skipped)} stdlib files that are not UTF-8 (test fixtures): {skipped}")
    record = np.frombuffer(records, dtype=np.int64)
    split = is_eval(record, plan.records, n_eval).astype(np.uint8)
    offsets_np = np.frombuffer(offsets, dtype=np.int64)
    doc_tokens = np.diff(offsets_np)
    sizes = {"tokens.bin": int(offsets_np[-1]) * np.dtype(tok.token_dtype).itemsize}
    if chat:
        sizes["loss_mask.bin"] = int(offsets_np[-1])
    if near:
        sizes[SIGNATURES] = len(record) * dedup.NUM_PERM * 4
    listed = {
        name: FileDigest(size, files.sha256_file(os.path.join(tmp, name)))
        for name, size in sizes.items()
    }
    index = {"doc_offsets.npy": offsets_np, "doc_split.npy": split, "doc_record.npy": record}
    for name, attr in FEATURE_FILES.items():
        index[name] = np.concatenate([getattr(f, attr) for f in features])
    for name, arr in index.items():
        listed[name] = write_npy(os.path.join(tmp, name), arr)
    tok_file = os.path.join(tmp, section.file)
    listed[section.file] = FileDigest(os.path.getsize(tok_file), section.sha256)
    body = TokenizedManifest(
        key=key,
        inputs=Inputs(
            description=plan.description,
            format=fmt,
            files=input_hashes(plan),
            bytes=plan.bytes,
            records=plan.records,
        ),
        tokenizer=section,
        token_dtype=tok.token_dtype,
        loss_mask=chat,
        documents=DocumentCounts(
            total=len(record),
            train=int((split == 0).sum()),
            eval=int(split.sum()),
            skipped_not_utf8=skipped,
            skipped_empty=empty,
        ),
        tokens=TokenCounts(
            total=int(doc_tokens.sum()),
            train=int(doc_tokens[split == 0].sum()),
            eval=int(doc_tokens[split == 1].sum()),
        ),
        files=listed,
        sources=[r.name for r in plan.sources],
    )
    manifest.write_manifest(tmp, body)
    return manifest.read_manifest(tmp, TokenizedManifest)  # as a cache hit would read it


def tokenized_key(cfg: DataConfig, plan: CorpusPlan) -> str:
    """The cache key of the tokenized corpus: inputs, tokenizer, split and format."""
    parts = {
        "stage": "tokenized",
        "format_version": manifest.FORMAT_VERSION,
        "format": plan.fmt,
        "fields": FIELDS[plan.fmt](cfg),
        "max_documents": cfg.max_documents,
        "eval_fraction": cfg.eval_fraction,
        "tokenizer": tokenizer_identity(cfg),
        "skip_invalid_utf8": plan.skip_invalid_utf8,
        "inputs": input_hashes(plan),
        "sources": [(r.name, r.fmt, FIELDS[r.fmt](r.cfg)) for r in plan.sources],
        "signatures": {"version": dedup.DEDUP_VERSION, "minhash": cfg.near_dup_threshold > 0},
    }
    return cache_mod.key_of(parts)


def entry_name(cfg: DataConfig, key: str) -> str:
    """The cache entry's directory name of a tokenized corpus."""
    return f"{enum_name(cfg, 'tokenizer').lower()}-{key[:16]}"


def tokenize_corpus(
    cfg: DataConfig, plan: CorpusPlan, cache: cache_mod.Cache, show_progress: bool, say: Say
) -> tuple[str, TokenizedManifest, bool]:
    """(path, manifest, hit) of the tokenized corpus of a resolved DataConfig."""
    key = tokenized_key(cfg, plan)
    build = lambda tmp: _build(tmp, cfg, plan, key, show_progress, say)
    return cache.get_or_build(TokenizedManifest, entry_name(cfg, key), key, build, say)
