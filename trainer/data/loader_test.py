import json

import numpy as np
import pytest
import torch

from trainer.data import testdata
from trainer.data.loader import PackedRowLoader, resharded
from trainer.data.precook import precook_dataset


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    testdata.write_text_corpus(str(root), n=60, seed=2)
    cache = str(tmp_path_factory.mktemp("cache"))
    made = {}
    for packing in ("BEST_FIT", "BUCKET"):
        cfg = testdata.data_config(input=str(root), packing=packing, seq_len=96)
        made[packing] = precook_dataset(cfg, cache, show_progress=False).path
    return made


def rows_of(batch):
    """Row contents as hashable tuples (to compare batches and find overlaps)."""
    return [tuple(r) for r in batch["input_ids"].tolist()]


def take(loader, n):
    return [next(loader) for _ in range(n)]


def test_batches_have_the_contract_shapes_and_dtypes(datasets):
    loader = PackedRowLoader(datasets["BEST_FIT"], "train", batch_size=4, seed=1)
    batch = next(loader)
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    dtypes = {"input_ids": torch.int64, "labels": torch.int64, "position_ids": torch.int64}
    dtypes["document_ids"] = torch.int32
    for name, dtype in dtypes.items():
        assert batch[name].shape == (4, 96) and batch[name].dtype == dtype
    ids, labels, docs = batch["input_ids"], batch["labels"], batch["document_ids"]
    same_doc = docs[:, 1:] == docs[:, :-1]
    assert torch.equal(labels[:, :-1][same_doc], ids[:, 1:][same_doc])
    assert (labels[:, :-1][~same_doc] == -100).all() and (labels[:, -1] == -100).all()


def test_resume_mid_epoch_and_across_epochs_is_exact(datasets):
    path = datasets["BEST_FIT"]
    reference = PackedRowLoader(path, "train", batch_size=3, seed=7)
    n = len(reference)
    assert n >= 4
    stream = take(reference, 2 * n + 3)
    for stop in (1, n // 2, n, n + 2):  # mid-epoch, at the boundary, into the second epoch
        first = PackedRowLoader(path, "train", batch_size=3, seed=7)
        take(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # a checkpoint stores plain JSON
        resumed = PackedRowLoader(path, "train", batch_size=3, seed=7)
        resumed.load_state_dict(state)
        assert resumed.epoch == stop // n
        for k, batch in enumerate(take(resumed, 4)):
            want = stream[stop + k]
            for name in want:
                assert torch.equal(batch[name], want[name]), (stop, k, name)


def test_epochs_reshuffle_and_seeds_differ(datasets):
    path = datasets["BEST_FIT"]
    a = PackedRowLoader(path, "train", batch_size=2, seed=0)
    n = len(a)
    epoch0, epoch1 = take(a, n), take(a, n)
    flat = lambda batches: [r for b in batches for r in rows_of(b)]
    assert flat(epoch0) != flat(epoch1) and sorted(flat(epoch0)) == sorted(flat(epoch1))
    b = PackedRowLoader(path, "train", batch_size=2, seed=1)
    assert flat(take(b, n)) != flat(epoch0)
    again = PackedRowLoader(path, "train", batch_size=2, seed=0)
    assert flat(take(again, n)) == flat(epoch0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_share_no_row_and_cover_the_split(datasets, world_size):
    path = datasets["BEST_FIT"]
    loaders = [
        PackedRowLoader(path, "train", batch_size=2, seed=3, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    lengths = {len(loader) for loader in loaders}
    assert len(lengths) == 1  # every rank steps the same number of times
    n_rows = len(loaders[0].rows)
    seen = [[tuple(r) for r in loader._order] for loader in loaders]
    row_ids = [int(i) for rank in seen for batch in rank for i in batch]
    assert set(row_ids) == set(range(n_rows))  # the epoch covers every row
    first = [set(int(i) for b in rank for i in b) for rank in seen]
    filler = len(row_ids) - n_rows  # rows repeated to fill the last global batches
    assert filler < 2 * world_size
    overlap = sum(len(first[a] & first[b]) for a in range(world_size) for b in range(a))
    assert overlap <= filler
    if filler == 0:
        assert overlap == 0


def test_rank_sharding_without_filler_has_no_overlap(datasets):
    path = datasets["BEST_FIT"]
    n_rows = len(PackedRowLoader(path, "train").rows)
    batch = next(b for b in range(1, 9) if n_rows % (2 * b) == 0)
    loaders = [
        PackedRowLoader(path, "train", batch_size=batch, seed=5, rank=r, world_size=2)
        for r in range(2)
    ]
    rows = [set(int(i) for b in loader._order for i in b) for loader in loaders]
    assert not rows[0] & rows[1] and len(rows[0] | rows[1]) == n_rows


def test_bucket_batches_are_one_bucket_wide(datasets):
    loader = PackedRowLoader(datasets["BUCKET"], "train", batch_size=4, seed=0)
    buckets = loader.manifest.bucket_lengths
    assert buckets == [48, 96]
    widths = set()
    for batch in take(loader, len(loader)):
        width = batch["input_ids"].shape[1]
        widths.add(width)
        used = (batch["document_ids"] >= 0).sum(dim=1)
        smaller = max([0] + [b for b in buckets if b < width])
        assert ((used > smaller) & (used <= width)).all()  # every row belongs in this bucket
    assert widths == set(buckets)


def test_tiny_split_still_gives_full_batches(datasets):
    loader = PackedRowLoader(datasets["BEST_FIT"], "eval", batch_size=64)
    assert len(loader) == 1
    assert next(loader)["input_ids"].shape == (64, 96)


def test_state_from_another_order_is_refused(datasets):
    a = PackedRowLoader(datasets["BEST_FIT"], "train", batch_size=2, seed=0)
    b = PackedRowLoader(datasets["BEST_FIT"], "train", batch_size=4, seed=0)
    with pytest.raises(ValueError, match="batch_size=2.*batch_size=4"):
        b.load_state_dict(a.state_dict())
    other = PackedRowLoader(datasets["BUCKET"], "train", batch_size=2, seed=0)
    with pytest.raises(ValueError, match="dataset="):
        other.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="rank 2 is not in"):
        PackedRowLoader(datasets["BEST_FIT"], rank=2, world_size=2)


def test_padding_rows_are_masked(datasets):
    loader = PackedRowLoader(datasets["BEST_FIT"], "train", batch_size=8, seed=0)
    for batch in take(loader, len(loader)):
        pad = batch["document_ids"] == -1
        assert (batch["labels"][pad] == -100).all()
        assert (batch["input_ids"][pad] == 2).all()  # <|pad|>
        assert np.all(np.diff(pad.int().numpy(), axis=1) >= 0)  # padding only at the end


def test_a_position_resharded_for_other_ranks_reads_on_from_the_same_global_batch(datasets):
    """Four steps of one rank (2 batches a step), resumed by 2 ranks: rank r's next batch is
    the one-rank loader's batch 4 + r, the next round 6 + r."""
    path = datasets["BEST_FIT"]
    one = PackedRowLoader(path, "train", batch_size=2, seed=4)
    after = [rows_of(b) for b in take(one, 8)]
    resumed = PackedRowLoader(path, "train", batch_size=2, seed=4)
    take(resumed, 4)
    for r in range(2):
        two = PackedRowLoader(path, "train", batch_size=2, seed=4, rank=r, world_size=2)
        two.load_state_dict(resharded(resumed.state_dict(), 2, r))
        assert [rows_of(b) for b in take(two, 2)] == [after[4 + r], after[6 + r]]
    take(resumed, 1)
    with pytest.raises(ValueError, match="not a whole round of 2 ranks"):
        resharded(resumed.state_dict(), 2, 0)
