"""The on-disk format of a precooked split: token shards plus an index of rows and documents.

    <split>/tokens-00000.bin     the rows' tokens end to end (no padding), uint16 or uint32,
                                 memory-mappable; a row never crosses a shard
    <split>/loss_mask-00000.bin  uint8 per token, 1 = a target of the loss (JSONL_CHAT only)
    <split>/rows.npy             int64 (rows, 4): shard, offset in shard, tokens, capacity
    <split>/segments.npy         int64 (segments, 3): start in the row, document, offset in it
    <split>/row_segments.npy     int64 (rows + 1,): row r owns segments [r] : [r + 1]

Each segment is a document (or a piece of one) that the model sees from position 0.
"""

import os

import numpy as np

from protos import files
from protos.files import FileDigest
from trainer.data.files import write_npy
from trainer.data.manifest import DatasetManifest
from trainer.data.packing import PackPlan

SPLITS = ("train", "eval")


def _shard_of_rows(row_len: np.ndarray, shard_tokens: int) -> np.ndarray:
    """Greedy: fill a shard with whole rows until the next would overflow it."""
    shard_of = np.empty(len(row_len), dtype=np.int64)
    shard, used = 0, 0
    for r, n in enumerate(row_len.tolist()):
        if used + n > shard_tokens and used:
            shard, used = shard + 1, 0
        shard_of[r] = shard
        used += n
    return shard_of


def write_split(
    directory: str,
    split: str,
    plan: PackPlan,
    documents: np.ndarray,
    doc_tokens: np.ndarray,
    doc_offsets: np.ndarray,
    shard_tokens: int,
    loss_mask: np.ndarray | None = None,
) -> dict[str, FileDigest]:
    """Write `plan` (over `documents`, indices into the tokenized corpus) under directory/split.

    `doc_tokens` is every document's tokens end to end, `doc_offsets` where each starts.
    Returns {relative path: its digest} for the manifest.
    """
    os.makedirs(os.path.join(directory, split), exist_ok=True)
    written: dict[str, FileDigest] = {}

    def put(name: str, write, data) -> None:
        rel = f"{split}/{name}"
        written[rel] = write(os.path.join(directory, rel), data)

    row_len = plan.row_len
    shard_of = _shard_of_rows(row_len, shard_tokens)
    offset_in_shard = np.zeros(plan.rows, dtype=np.int64)
    seg_doc = documents[plan.seg_doc]
    source = doc_offsets[seg_doc] + plan.seg_start
    n_shards = int(shard_of[-1]) + 1 if plan.rows else 0
    first_row = np.searchsorted(shard_of, np.arange(n_shards + 1))
    for shard in range(n_shards):
        lo, hi = int(first_row[shard]), int(first_row[shard + 1])
        tokens = np.empty(int(row_len[lo:hi].sum()), dtype=doc_tokens.dtype)
        mask = None if loss_mask is None else np.empty(len(tokens), dtype=np.uint8)
        at = 0
        for r in range(lo, hi):
            offset_in_shard[r] = at
            for s in range(plan.row_ptr[r], plan.row_ptr[r + 1]):
                n, src = int(plan.seg_len[s]), int(source[s])
                tokens[at : at + n] = doc_tokens[src : src + n]
                if mask is not None and loss_mask is not None:
                    mask[at : at + n] = loss_mask[src : src + n]
                at += n
        put(f"tokens-{shard:05d}.bin", files.write_bytes, tokens)
        if mask is not None:
            put(f"loss_mask-{shard:05d}.bin", files.write_bytes, mask)
    rows = np.stack([shard_of, offset_in_shard, row_len, plan.capacity], axis=1)
    seg_row = np.repeat(np.arange(plan.rows), np.diff(plan.row_ptr))
    row_begin = np.cumsum(row_len) - row_len  # in the stream of all rows' tokens
    seg_in_row = np.cumsum(plan.seg_len) - plan.seg_len - row_begin[seg_row]
    segments = np.stack([seg_in_row, seg_doc, plan.seg_start], axis=1)
    put("rows.npy", write_npy, rows.astype(np.int64).reshape(-1, 4))
    put("segments.npy", write_npy, segments.astype(np.int64).reshape(-1, 3))
    put("row_segments.npy", write_npy, plan.row_ptr.astype(np.int64))
    files.fsync_dir(os.path.join(directory, split))
    return written


class SplitReader:
    """Rows of one split of a precooked dataset; shards are memory-mapped on first use (so a
    reader made before a fork opens its own maps in each process)."""

    def __init__(self, dataset_path: str, manifest: DatasetManifest, split: str):
        if split not in manifest.splits:
            raise ValueError(f"{dataset_path}: no split {split!r} (has {list(manifest.splits)})")
        self.path, self.split = dataset_path, split
        self.dtype = np.dtype(manifest.token_dtype)
        self.has_loss_mask = manifest.loss_mask
        base = os.path.join(dataset_path, split)
        self.rows = np.load(os.path.join(base, "rows.npy"))
        self.segments = np.load(os.path.join(base, "segments.npy"))
        self.row_segments = np.load(os.path.join(base, "row_segments.npy"))
        self.n_shards = int(self.rows[:, 0].max()) + 1 if len(self.rows) else 0
        self._tokens: list[np.ndarray] | None = None  # memory maps, opened on first use
        self._masks: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def _open(self) -> list[np.ndarray]:
        base = os.path.join(self.path, self.split)
        shard = lambda name, dt: np.memmap(os.path.join(base, name), dtype=dt, mode="r")
        self._tokens = [shard(f"tokens-{i:05d}.bin", self.dtype) for i in range(self.n_shards)]
        if self.has_loss_mask:
            self._masks = [shard(f"loss_mask-{i:05d}.bin", np.uint8) for i in range(self.n_shards)]
        return self._tokens

    def row(self, r: int):
        """(tokens, document starts in the row, loss mask or None, capacity) of row r."""
        token_shards = self._tokens if self._tokens is not None else self._open()
        shard, offset, n, capacity = (int(v) for v in self.rows[r])
        starts = self.segments[self.row_segments[r] : self.row_segments[r + 1], 0]
        tokens = token_shards[shard][offset : offset + n]
        mask = None if self._masks is None else self._masks[shard][offset : offset + n]
        return tokens, starts, mask, capacity
