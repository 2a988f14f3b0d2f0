"""PackedRowLoader: batches of precooked rows for the trainer, resumable exactly.

Each epoch the split's rows are shuffled with (seed, epoch) and cut into global batches of
`batch_size` rows; global batch g goes to rank g % world_size, so ranks never share a row
within an epoch. Rows that do not fill the last global batches are completed with rows from the
start of the same epoch's order (as torch's DistributedSampler pads), so every rank gets the
same number of full batches, and a split smaller than one batch still works. With bucket
packing a batch takes rows of one bucket only, and is as long as that bucket.

The loader is its own iterator and its position is (epoch, batch): `state_dict()` saves it,
`load_state_dict()` restores it, and the next batch is the one an uninterrupted loader would
have produced.
"""

import numpy as np
import torch

from trainer.data.manifest import DatasetManifest, read_manifest
from trainer.data.shards import SplitReader

IGNORE = -100  # label of positions with no target, as torch's cross-entropy expects


class PackedRowLoader:
    def __init__(
        self,
        dataset_path: str,
        split: str = "train",
        batch_size: int = 8,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size} must be at least 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size {world_size})")
        self._open(dataset_path, split)
        self.split, self.batch_size, self.seed = split, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.pad_id = self.manifest.tokenizer.pad_id
        self.epoch, self._batch = 0, 0
        self._order = self._epoch_order(0)

    def _open(self, dataset_path: str, split: str) -> None:
        """Read the split's manifest and rows; `_capacity`: each row's length (its group)."""
        self.manifest = read_manifest(dataset_path, DatasetManifest)
        self.rows = SplitReader(dataset_path, self.manifest, split)
        if len(self.rows) == 0:
            raise ValueError(
                f"{dataset_path}: split {split!r} has no rows "
                f"(eval_fraction {self.manifest.config.eval_fraction})"
            )
        self.seq_len = self.manifest.seq_len
        self._capacity = self.rows.rows[:, 3]

    def _global_batches(self, epoch: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        capacity = self._capacity
        batches = []
        # one group of rows for fixed-length packings, one per bucket for bucket packing
        for cap in np.unique(capacity):
            rows = rng.permutation(np.flatnonzero(capacity == cap))
            n = -(-len(rows) // self.batch_size) * self.batch_size
            batches += list(np.resize(rows, n).reshape(-1, self.batch_size))
        if len(batches) > 1 and len(np.unique(capacity)) > 1:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        per_rank = -(-len(batches) // self.world_size)
        return [batches[i % len(batches)] for i in range(per_rank * self.world_size)]

    def _epoch_order(self, epoch: int) -> list[np.ndarray]:
        return self._global_batches(epoch)[self.rank :: self.world_size]

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return len(self._order)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        rows = self._order[self._batch]
        self._batch += 1
        if self._batch == len(self._order):  # roll over now: `epoch` counts finished epochs
            self.epoch, self._batch = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        return self.batch(rows)

    def batch(self, rows) -> dict:
        """The tensors for the given row indices (all of one length)."""
        parts = [self.rows.row(int(r)) for r in rows]
        width = max(p[3] for p in parts)
        shape = (len(parts), width)
        input_ids = np.full(shape, self.pad_id, dtype=np.int64)
        labels = np.full(shape, IGNORE, dtype=np.int64)
        position_ids = np.zeros(shape, dtype=np.int64)
        document_ids = np.full(shape, -1, dtype=np.int32)
        for i, (tokens, starts, mask, _) in enumerate(parts):
            n = len(tokens)
            ends = np.append(starts[1:], n)
            seg_len = ends - starts
            input_ids[i, :n] = tokens
            document_ids[i, :n] = np.repeat(np.arange(len(starts), dtype=np.int32), seg_len)
            position_ids[i, :n] = np.arange(n) - np.repeat(starts, seg_len)
            target = np.append(input_ids[i, 1:n], IGNORE)
            if mask is not None:  # only loss-masked tokens (SFT responses) are targets
                target[:-1][mask[1:] == 0] = IGNORE
            target[ends - 1] = IGNORE  # a document's last token predicts nothing in this row
            labels[i, :n] = target
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids),
            "document_ids": torch.from_numpy(document_ids),
        }

    def state_dict(self) -> dict:
        return {
            "dataset": self.manifest.key,
            "split": self.split,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "rank": self.rank,
            "epoch": self.epoch,
            "batch": self._batch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`'s position. Any rank may load any rank's state: ranks advance in
        lockstep, so one saved position serves them all."""
        for name in ("dataset", "split", "seed", "batch_size", "world_size"):
            if state[name] != self.state_dict()[name]:
                raise ValueError(
                    f"loader state was saved with {name}={state[name]!r}, this loader has "
                    f"{name}={self.state_dict()[name]!r}: the batch order would differ"
                )
        self.epoch, self._batch = int(state["epoch"]), int(state["batch"])
        self._order = self._epoch_order(self.epoch)

    def resume_state(self, saved: list[dict]) -> dict:
        """This rank's position from the positions a checkpoint saved (any writer rank's
        serves: `resharded`)."""
        return resharded(saved[0], self.world_size, self.rank)


def resharded(state: dict, world_size: int, rank: int) -> dict:
    """A saved position (any rank's `state_dict()`) for rank `rank` of `world_size` ranks: a
    run resumed under another data-parallel degree reads on from the same global batch. Ranks
    advance in lockstep, so `batch` per rank is `batch * world_size` global batches into the
    epoch; ValueError if the new ranks cannot start there together. (Only an epoch's padded
    tail differs: it is filled up to a multiple of the number of ranks.)"""
    consumed = int(state["batch"]) * int(state["world_size"])
    if consumed % world_size:
        raise ValueError(
            f"the loader position ({consumed} global batches into epoch {state['epoch']}, "
            f"{state['world_size']} data-parallel ranks) is not a whole round of {world_size} "
            "ranks: the data order cannot continue exactly"
        )
    return {**state, "world_size": world_size, "rank": rank, "batch": consumed // world_size}
