"""Packing: how tokenized documents become fixed-size rows, and what each way wastes.

A plan works on document lengths only (tokens stay on disk): each row is a list of segments
(document, offset in the document, length) laid end to end, then padding up to the row's
capacity. Every segment starts a new document for the model: positions restart at 0 and
attention does not cross it, so a plan's segment starts are the row's document boundaries.

- pad:      one document per row, padded to seq_len; the rest of a longer document is dropped.
- concat:   all documents end to end, cut every seq_len tokens; documents cross row boundaries.
- best_fit: documents longer than a row cut into row-sized chunks, then best-fit-decreasing
            bin packing of the pieces (Ding et al. 2024, "Fewer Truncations Improve Language
            Modeling"); nothing is dropped and almost nothing padded. O(n log n).
- bucket:   one document per row, padded only up to the smallest of a few bucket lengths
            (seq_len, seq_len/2, ...) that holds it; batches take rows of one bucket.
"""

from dataclasses import dataclass

import numpy as np

MIN_BUCKET = 64  # below this a bucket saves less than its batches cost


@dataclass
class PackPlan:
    strategy: str
    seq_len: int
    capacity: np.ndarray  # (rows,) slots per row: seq_len, or the bucket length
    row_ptr: np.ndarray  # (rows + 1,) row r holds segments row_ptr[r] : row_ptr[r + 1]
    seg_doc: np.ndarray  # (segments,) index into the lengths that were packed
    seg_start: np.ndarray  # (segments,) offset of the segment in its document
    seg_len: np.ndarray  # (segments,)
    input_tokens: int  # sum of the document lengths

    @property
    def rows(self) -> int:
        return len(self.capacity)

    @property
    def row_len(self) -> np.ndarray:
        """Tokens (not padding) per row."""
        return np.add.reduceat(self.seg_len, self.row_ptr[:-1]) if self.rows else self.capacity

    @property
    def slots(self) -> int:
        return int(self.capacity.sum())

    @property
    def kept_tokens(self) -> int:
        return int(self.seg_len.sum())

    @property
    def padding_tokens(self) -> int:
        return self.slots - self.kept_tokens

    @property
    def truncated_tokens(self) -> int:
        return self.input_tokens - self.kept_tokens

    @property
    def target_tokens(self) -> int:
        """Tokens with a next-token target: each segment's last token has none in its row."""
        return self.kept_tokens - len(self.seg_len)


def _plan(strategy, seq_len, lengths, capacity, row_ptr, seg_doc, seg_start, seg_len):
    i64 = lambda a: np.asarray(a, dtype=np.int64)
    return PackPlan(
        strategy=strategy,
        seq_len=seq_len,
        capacity=i64(capacity),
        row_ptr=i64(row_ptr),
        seg_doc=i64(seg_doc),
        seg_start=i64(seg_start),
        seg_len=i64(seg_len),
        input_tokens=int(lengths.sum()),
    )


def _one_per_row(strategy, lengths, seq_len, capacity) -> PackPlan:
    n = len(lengths)
    doc = np.arange(n)
    kept = np.minimum(lengths, seq_len)
    return _plan(strategy, seq_len, lengths, capacity, np.arange(n + 1), doc, 0 * doc, kept)


def bucket_lengths(seq_len: int) -> list[int]:
    """seq_len, seq_len/2, ... (rounded up) down to the first length at or below MIN_BUCKET."""
    caps, c = [seq_len], seq_len
    while c > MIN_BUCKET:
        c = (c + 1) // 2
        caps.append(c)
    return sorted(caps)


def pack_pad(lengths: np.ndarray, seq_len: int) -> PackPlan:
    return _one_per_row("pad", lengths, seq_len, np.full(len(lengths), seq_len))


def pack_bucket(lengths: np.ndarray, seq_len: int) -> PackPlan:
    caps = np.asarray(bucket_lengths(seq_len))
    need = np.minimum(lengths, seq_len)
    return _one_per_row("bucket", lengths, seq_len, caps[np.searchsorted(caps, need)])


def pack_concat(lengths: np.ndarray, seq_len: int) -> PackPlan:
    """Cut the stream of all documents every seq_len tokens; the last row may be short."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1]) if len(ends) else 0
    if total == 0:
        return _one_per_row("concat", lengths[:0], seq_len, lengths[:0])
    rows = -(-total // seq_len)
    cuts = np.union1d(starts[lengths > 0], np.arange(rows, dtype=np.int64) * seq_len)
    seg_end = np.append(cuts[1:], total)
    doc = np.searchsorted(starts, cuts, side="right") - 1
    # (a zero-length document shares its start with the next one; side=right picks that one)
    row_ptr = np.searchsorted(cuts // seq_len, np.arange(rows + 1), side="left")
    capacity = np.full(rows, seq_len)
    return _plan(
        "concat", seq_len, lengths, capacity, row_ptr, doc, cuts - starts[doc], seg_end - cuts
    )


class _CapacityIndex:
    """The set of remaining capacities of open rows (integers 0..seq_len), as a 64-ary bitmap
    tree: find the smallest member >= x, add and remove in O(log64 seq_len) word operations."""

    def __init__(self, size: int):
        self.levels = []
        n = size + 1
        while True:
            n = (n + 63) >> 6
            self.levels.append([0] * n)
            if n == 1:
                break

    def next_at_least(self, x: int, level: int = 0) -> int:
        """The smallest member >= x, or -1."""
        words = self.levels[level]
        w = x >> 6
        if w >= len(words):
            return -1
        bits = words[w] >> (x & 63)
        if bits:
            return x + (bits & -bits).bit_length() - 1
        if level + 1 == len(self.levels):
            return -1
        w = self.next_at_least(w + 1, level + 1)
        if w < 0:
            return -1
        bits = words[w]
        return (w << 6) + (bits & -bits).bit_length() - 1

    def add(self, c: int) -> None:
        for words in self.levels:
            w = c >> 6
            before = words[w]
            words[w] = before | (1 << (c & 63))
            if before:  # the word was already marked in the level above
                return
            c = w

    def remove(self, c: int) -> None:
        for words in self.levels:
            w = c >> 6
            words[w] &= ~(1 << (c & 63))
            if words[w]:
                return
            c = w


def best_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Bin of each item (items are placed largest first, ties in input order) and bin count.

    Each item goes into the open bin with the least room that still holds it, else a new bin.
    Bins with equal room are interchangeable, so the index keeps one stack of bins per room.
    """
    order = np.argsort(-sizes, kind="stable")
    rooms = _CapacityIndex(capacity)
    bins_with_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    bin_of = np.empty(len(sizes), dtype=np.int64)
    n_bins = 0
    for i, size in zip(order.tolist(), sizes[order].tolist(), strict=True):
        room = rooms.next_at_least(size)
        if room < 0:
            b, left = n_bins, capacity - size
            n_bins += 1
        else:
            stack = bins_with_room[room]
            b = stack.pop()
            if not stack:
                rooms.remove(room)
            left = room - size
        if left:
            stack = bins_with_room[left]
            if not stack:
                rooms.add(left)
            stack.append(b)
        bin_of[i] = b
    return bin_of, n_bins


def pack_best_fit(lengths: np.ndarray, seq_len: int) -> PackPlan:
    full = lengths // seq_len
    rest = lengths - full * seq_len
    # Full chunks fill a row alone: row per chunk, no search needed.
    full_doc = np.repeat(np.arange(len(lengths)), full)
    first_full = np.cumsum(full) - full
    full_start = (np.arange(len(full_doc)) - np.repeat(first_full, full)) * seq_len
    rest_doc = np.flatnonzero(rest)
    bin_of, n_bins = best_fit_decreasing(rest[rest_doc], seq_len)
    placed = np.lexsort((-rest[rest_doc], bin_of))  # by bin, largest piece first in a bin
    seg_doc = np.concatenate([full_doc, rest_doc[placed]])
    seg_start = np.concatenate([full_start, (full * seq_len)[rest_doc[placed]]])
    seg_len = np.concatenate([np.full(len(full_doc), seq_len), rest[rest_doc[placed]]])
    per_bin = np.bincount(bin_of, minlength=n_bins)
    per_row = np.concatenate([np.ones(len(full_doc), np.int64), per_bin])
    row_ptr = np.concatenate([[0], np.cumsum(per_row)])
    capacity = np.full(len(per_row), seq_len)
    return _plan("best_fit", seq_len, lengths, capacity, row_ptr, seg_doc, seg_start, seg_len)


PACKERS = {"pad": pack_pad, "concat": pack_concat, "best_fit": pack_best_fit, "bucket": pack_bucket}
STRATEGIES = tuple(PACKERS)


def pack(strategy: str, lengths, seq_len: int) -> PackPlan:
    """Plan rows for documents of `lengths` tokens; strategy is one of STRATEGIES."""
    return PACKERS[strategy](np.asarray(lengths, dtype=np.int64), seq_len)
