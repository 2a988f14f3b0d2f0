"""ImageRowLoader: batches of an image+text dataset (images.py), resumable exactly.

The order is PackedRowLoader's: each epoch the split's rows are shuffled with (seed, epoch),
cut into global batches, batch g goes to rank g % world_size, and the position is (epoch,
batch), saved by `state_dict()` and restored by `load_state_dict()`.
"""

import os

import numpy as np
import torch

from trainer.data.loader import IGNORE, PackedRowLoader
from trainer.data.manifest import ImageDatasetManifest, read_manifest


class ImageSplit:
    """One split of an image+text dataset, memory-mapped."""

    def __init__(self, dataset_path: str, split: str):
        self.manifest = read_manifest(dataset_path, ImageDatasetManifest)
        base = os.path.join(dataset_path, split)
        S = self.manifest.image_size
        self.images = np.memmap(os.path.join(base, "images.bin"), dtype=np.uint8, mode="r")
        self.images = self.images.reshape(-1, S, S, 3)
        self.tokens = np.load(os.path.join(base, "tokens.npy"))
        self.targets = np.load(os.path.join(base, "targets.npy"))
        self.rows = np.load(os.path.join(base, "rows.npy"))  # image, text length, qtype

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, rows) -> dict:
        """images (B, S, S, 3) uint8, input_ids (B, T), labels (B, T): labels[t] is token t+1
        when it is a target, else IGNORE; qtype (B,) for evaluation."""
        rows = np.asarray(rows, dtype=np.int64)
        tokens = self.tokens[rows].astype(np.int64)
        labels = np.full_like(tokens, IGNORE)
        keep = self.targets[rows, 1:] == 1
        labels[:, :-1][keep] = tokens[:, 1:][keep]
        return {
            "images": torch.from_numpy(np.ascontiguousarray(self.images[self.rows[rows, 0]])),
            "input_ids": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "qtype": torch.from_numpy(self.rows[rows, 2].copy()),
        }


class ImageRowLoader(PackedRowLoader):
    """PackedRowLoader's order and position over an image+text split (every row the same
    length, so one group of rows)."""

    def _open(self, dataset_path: str, split: str) -> None:
        self.data = ImageSplit(dataset_path, split)
        if len(self.data) == 0:
            raise ValueError(f"{dataset_path}: split {split!r} has no rows")
        self.manifest = self.data.manifest  # type: ignore[assignment]
        self._capacity = np.zeros(len(self.data), dtype=np.int64)

    def batch(self, rows) -> dict:
        return self.data.batch(rows)
