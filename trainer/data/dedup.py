"""Deduplication: exact (a hash of the normalized text) and near-duplicate (MinHash with LSH).

Signatures are computed while tokenizing, one document at a time, in the workers (or the
distributed tasks), and stored beside the tokens: doc_exact.npy (uint64 per document) and,
when near-dup dedup is on, doc_minhash.bin (uint32, NUM_PERM per document). The decision is
global and runs where the dataset is packed, over signatures only (never the text):

- exact: the first document of each normalized-text hash is kept.
- near: documents whose signatures agree in all ROWS values of any of the BANDS bands are
  candidates (LSH); a candidate pair is joined when the fraction of agreeing values (the
  estimated Jaccard similarity of their 5-word shingle sets) reaches the threshold; each
  connected group keeps its first document.

Normalization: lower case, punctuation to spaces, runs of white space to one space.
"""

import hashlib
import re
import zlib
from dataclasses import dataclass

import numpy as np

NUM_PERM = 128
SHINGLE_WORDS = 5
_MERSENNE = np.uint64((1 << 61) - 1)
_PERM_A, _PERM_B = (
    np.random.default_rng(0x5EED).integers(1, 1 << 32, size=(2, NUM_PERM), dtype=np.uint64) | 1
)
_SHINGLE_MUL = np.uint64(0x9E3779B97F4A7C15)  # odd: a 5-gram's hash mixes every word in
_BLOCK = 4096  # shingles hashed at once: memory stays ~4 MB per worker on any document
_PUNCT = re.compile(r"[^\w\s]+")
SIGNATURES = "doc_minhash.bin"  # in the tokenized corpus: uint32 (documents, NUM_PERM)
DEDUP_VERSION = 1  # part of the cache key: bump when a signature's definition changes


def words(text: str) -> list[str]:
    return _PUNCT.sub(" ", text.lower()).split()


def exact_hash(ws: list[str]) -> int:
    return int.from_bytes(hashlib.blake2b(" ".join(ws).encode(), digest_size=8).digest(), "little")


def minhash(ws: list[str]) -> np.ndarray:
    """The NUM_PERM uint32 MinHash signature of the 5-word shingles of `ws`."""
    word_hash = np.fromiter((zlib.crc32(w.encode()) for w in ws), np.uint64, count=len(ws))
    k = min(SHINGLE_WORDS, len(word_hash))
    if k == 0:
        return np.full(NUM_PERM, 0xFFFFFFFF, dtype=np.uint32)
    n = len(word_hash) - k + 1
    shingle = np.zeros(n, dtype=np.uint64)
    for j in range(k):  # polynomial hash of each window; uint64 arithmetic wraps by design
        shingle = shingle * _SHINGLE_MUL + word_hash[j : j + n]
    shingle = (shingle >> np.uint64(29)) ^ (shingle & np.uint64(0xFFFFFFFF))
    sig = np.full(NUM_PERM, np.iinfo(np.uint64).max, dtype=np.uint64)
    for lo in range(0, n, _BLOCK):
        block = shingle[lo : lo + _BLOCK, None]
        sig = np.minimum(sig, ((block * _PERM_A + _PERM_B) % _MERSENNE).min(axis=0))
    return (sig & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def signatures(texts: list[str], near: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(exact hash uint64 per text, MinHash (texts, NUM_PERM) uint32 or None unless `near`)."""
    split = [words(t) for t in texts]
    exact = np.fromiter((exact_hash(ws) for ws in split), np.uint64, count=len(texts))
    if not near:
        return exact, None
    sigs = np.empty((len(texts), NUM_PERM), dtype=np.uint32)
    for i, ws in enumerate(split):
        sigs[i] = minhash(ws)
    return exact, sigs


def lsh_shape(threshold: float) -> tuple[int, int]:
    """(bands, rows) with bands * rows == NUM_PERM whose LSH threshold (1/b)^(1/r) lies safely
    below `threshold`: candidates are verified afterwards, so recall is what banding must give."""
    for rows in (16, 8, 4, 2, 1):
        bands = NUM_PERM // rows
        if (1 / bands) ** (1 / rows) <= threshold - 0.05:
            return bands, rows
    return NUM_PERM, 1


@dataclass(frozen=True)
class DedupCounts:
    exact_duplicates: int
    near_duplicates: int


def exact_keep(exact: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """The `candidates` (ascending document ids) that are the first of their hash."""
    _, first = np.unique(exact[candidates], return_index=True)
    return np.sort(candidates[first])


def _root(parent: np.ndarray, i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = int(parent[i])
    return i


def near_keep(sigs: np.ndarray, candidates: np.ndarray, threshold: float) -> np.ndarray:
    """The `candidates` (ascending document ids) left when each group of near-duplicates keeps
    its first document. `sigs` may be a memory map: bands are read one at a time."""
    n = len(candidates)
    parent = np.arange(n)
    bands, rows = lsh_shape(threshold)
    mix = np.random.default_rng(0xBA4D).integers(1, 1 << 63, size=rows, dtype=np.uint64) | 1
    for band in range(bands):
        part = np.asarray(sigs[candidates, band * rows : (band + 1) * rows], dtype=np.uint64)
        key = (part * mix).sum(axis=1)  # wraps: a hash of the band's values
        order = np.argsort(key, kind="stable")
        k = key[order]
        same = np.flatnonzero(k[1:] == k[:-1]) + 1  # positions equal to their predecessor
        if not len(same):
            continue
        run_start = np.maximum.accumulate(np.where(np.r_[True, k[1:] != k[:-1]], np.arange(n), 0))
        for pos in same.tolist():
            a, b = int(order[run_start[pos]]), int(order[pos])
            ra, rb = _root(parent, a), _root(parent, b)
            if ra == rb:
                continue
            agree = np.mean(sigs[candidates[a]] == sigs[candidates[b]])
            if agree >= threshold:
                parent[max(ra, rb)] = min(ra, rb)  # the group's root is its first document
    roots = np.fromiter((_root(parent, i) for i in range(n)), np.int64, count=n)
    return candidates[roots == np.arange(n)]
