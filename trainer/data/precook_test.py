import os

import numpy as np
import pytest

from trainer.data import corpus as corpus_mod
from trainer.data import precook, shards, testdata, tokenized
from trainer.data.loader import PackedRowLoader
from trainer.data.precook import precook_dataset


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    texts = testdata.write_text_corpus(str(root), n=40, seed=0)
    return str(root), texts


def expected_documents(ds, texts):
    """Each document as precook should lay it out: <bos> text <eos>, by document id."""
    records = np.load(os.path.join(ds.path, "doc_record.npy"))
    tok = ds.tokenizer
    return [[tok.bos_id, *tok.encode(texts[r]), tok.eos_id] for r in records.tolist()]


def pieces(ds):
    """{document id: [(offset in document, tokens)]} read back from every split's shards."""
    out: dict[int, list[tuple[int, list[int]]]] = {}
    for split in shards.SPLITS:
        reader = shards.SplitReader(ds.path, ds.manifest, split)
        for r in range(len(reader)):
            tokens, starts, _, capacity = reader.row(r)
            lo, hi = reader.row_segments[r], reader.row_segments[r + 1]
            segs = reader.segments[lo:hi]
            assert len(tokens) <= capacity
            ends = np.append(segs[1:, 0], len(tokens))
            for (start, doc, offset), end in zip(segs.tolist(), ends.tolist(), strict=True):
                out.setdefault(doc, []).append((offset, tokens[start:end].tolist()))
    return out


@pytest.mark.parametrize("packing", ["CONCAT", "BEST_FIT"])
def test_every_input_token_exactly_once(corpus, tmp_path, packing):
    root, texts = corpus
    cfg = testdata.data_config(input=root, packing=packing)
    ds = precook_dataset(cfg, str(tmp_path), show_progress=False)
    want = expected_documents(ds, texts)
    got = pieces(ds)
    assert sorted(got) == list(range(len(want)))
    for doc, parts in got.items():
        rebuilt = [t for _, part in sorted(parts) for t in part]
        assert rebuilt == want[doc], f"document {doc}"
    counts = ds.manifest.counts
    assert counts.tokens == sum(map(len, want)) and counts.truncated_tokens == 0
    assert counts.documents == 40 and ds.manifest.documents.eval == 4


@pytest.mark.parametrize("packing", ["PAD", "BUCKET"])
def test_truncated_tokens_counted_exactly(corpus, tmp_path, packing):
    root, texts = corpus
    ds = precook_dataset(
        testdata.data_config(input=root, packing=packing), str(tmp_path), show_progress=False
    )
    want = expected_documents(ds, texts)
    got = pieces(ds)
    for doc, parts in got.items():
        assert parts == [(0, want[doc][:64])]  # one row per document: its first 64 tokens
    truncated = sum(max(0, len(w) - 64) for w in want)
    assert truncated > 0
    assert ds.manifest.counts.truncated_tokens == truncated
    slots = sum(s.slots for s in ds.manifest.splits.values())
    kept = sum(min(64, len(w)) for w in want)
    assert ds.manifest.counts.padding_tokens == slots - kept


def test_document_boundaries_in_the_loader(corpus, tmp_path):
    root, texts = corpus
    ds = precook_dataset(testdata.data_config(input=root), str(tmp_path), show_progress=False)
    want = expected_documents(ds, texts)
    reader = shards.SplitReader(ds.path, ds.manifest, "train")
    loader = PackedRowLoader(ds.path, "train", batch_size=1, seed=0)
    for r in range(len(reader)):
        batch = loader.batch([r])
        ids, pos = batch["input_ids"][0], batch["position_ids"][0]
        doc_ids, labels = batch["document_ids"][0], batch["labels"][0]
        lo, hi = reader.row_segments[r], reader.row_segments[r + 1]
        for k, (start, doc, offset) in enumerate(reader.segments[lo:hi].tolist()):
            n = min(len(want[doc]) - offset, 64 - start)
            piece = ids[start : start + n].tolist()
            assert piece == want[doc][offset : offset + n]
            assert pos[start : start + n].tolist() == list(range(n))
            assert set(doc_ids[start : start + n].tolist()) == {k}
            assert labels[start : start + n - 1].tolist() == piece[1:]
            assert labels[start + n - 1] == -100  # no target across a document boundary
        used = int(reader.rows[r, 2])
        assert (doc_ids[used:] == -1).all() and (labels[used:] == -100).all()


def test_two_runs_give_identical_bytes(corpus, tmp_path, monkeypatch):
    """Also across worker counts: one in-process run, one with two spawned workers."""
    root, _ = corpus
    monkeypatch.setattr(corpus_mod, "UNIT_BYTES", 4096)  # many work units for the workers
    paths = []
    for workers in (1, 2):
        cfg = testdata.data_config(input=root, workers=workers)
        paths.append(precook_dataset(cfg, str(tmp_path / f"w{workers}"), show_progress=False).path)
    listing = [
        sorted(os.path.relpath(os.path.join(d, f), p) for d, _, fs in os.walk(p) for f in fs)
        for p in paths
    ]
    assert listing[0] == listing[1] and "train/tokens-00000.bin" in listing[0]
    for rel in listing[0]:
        a, b = (open(os.path.join(p, rel), "rb").read() for p in paths)
        assert a == b, rel


def test_cache_hit_does_no_work_and_any_change_misses(corpus, tmp_path, monkeypatch):
    root, texts = corpus
    cache = str(tmp_path / "cache")
    first = precook_dataset(testdata.data_config(input=root), cache, show_progress=False)
    assert not first.cache_hit

    def no_work(*args, **kwargs):
        raise AssertionError("a cache hit must not tokenize or pack")

    with monkeypatch.context() as m:
        m.setattr(tokenized, "_build", no_work)
        m.setattr(precook, "_build_dataset", no_work)
        hit = precook_dataset(testdata.data_config(input=root), cache, show_progress=False)
    assert hit.cache_hit and hit.path == first.path and hit.manifest == first.manifest

    with monkeypatch.context() as m:  # a new parameter: packs again from the cached tokens
        m.setattr(tokenized, "_build", no_work)
        other = precook_dataset(
            testdata.data_config(input=root, seq_len=32), cache, show_progress=False
        )
    assert not other.cache_hit and other.path != first.path

    changed = tmp_path / "changed"
    testdata.write_text_corpus(str(changed), n=40, seed=0)
    with open(changed / "doc-007.txt", "a") as f:
        f.write("x")  # one more byte
    miss = precook_dataset(testdata.data_config(input=str(changed)), cache, show_progress=False)
    assert not miss.cache_hit and miss.path != first.path

    vocab = precook_dataset(
        testdata.data_config(input=root, vocab_size=301), cache, show_progress=False
    )
    assert not vocab.cache_hit and vocab.tokenizer.vocab_size == 301


def test_damaged_entry_is_rebuilt(corpus, tmp_path):
    root, _ = corpus
    cfg = testdata.data_config(input=root)
    ds = precook_dataset(cfg, str(tmp_path), show_progress=False)
    shard = os.path.join(ds.path, "train", "tokens-00000.bin")
    data = bytearray(open(shard, "rb").read())
    data[10] ^= 0xFF
    open(shard, "wb").write(data)
    again = precook_dataset(cfg, str(tmp_path), show_progress=False)
    assert not again.cache_hit
    assert open(shard, "rb").read() != bytes(data)


def test_failed_build_leaves_nothing_and_a_stale_temp_dir_is_cleared(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    cfg = testdata.data_config(input=root)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # as if interrupted while writing shards

    with monkeypatch.context() as m:
        m.setattr(shards, "write_split", crash)
        with pytest.raises(KeyboardInterrupt):
            precook_dataset(cfg, str(tmp_path), show_progress=False)
    assert os.listdir(tmp_path / "datasets") == [] and os.listdir(tmp_path / "tmp") == []
    assert len(os.listdir(tmp_path / "tokenized")) == 1  # the finished first stage is kept
    name = os.listdir(tmp_path / "locks")[-1].removesuffix(".lock")
    stale = tmp_path / "tmp" / f"{name}.killed"
    stale.mkdir()
    (stale / "manifest.json").write_text("{}")
    ds = precook_dataset(cfg, str(tmp_path), show_progress=False)
    assert not ds.cache_hit and os.listdir(tmp_path / "tmp") == []


def test_chat_loss_mask_marks_response_tokens(tmp_path):
    rows = testdata.write_chat_corpus(str(tmp_path / "chat.jsonl"), n=20)
    cfg = testdata.data_config(
        input=str(tmp_path / "chat.jsonl"), format="JSONL_CHAT", packing="PAD", seq_len=4096
    )
    ds = precook_dataset(cfg, str(tmp_path / "cache"), show_progress=False)
    assert ds.manifest.loss_mask and ds.manifest.counts.truncated_tokens == 0
    records = np.load(os.path.join(ds.path, "doc_record.npy"))
    tok = ds.tokenizer
    loader = PackedRowLoader(ds.path, "train", batch_size=1)
    reader = loader.rows
    for r in range(len(reader)):
        doc = int(reader.segments[reader.row_segments[r], 1])
        row = rows[int(records[doc])]
        batch = loader.batch([r])
        labels = batch["labels"][0]
        targets = labels[labels != -100].tolist()
        assert targets == tok.encode(row["response"]) + [tok.eos_id]
        prompt_len = 1 + len(tok.encode(row["prompt"]))
        assert batch["input_ids"][0, 1:prompt_len].tolist() == tok.encode(row["prompt"])
    train = ds.manifest.splits["train"]
    assert train.target_tokens == sum(
        len(tok.encode(rows[int(records[d])]["response"])) + 1
        for d in reader.segments[:, 1].tolist()
    )


def test_cl100k_dataset_is_uint32(corpus, tmp_path):
    root, texts = corpus
    cfg = testdata.data_config(input=root, tokenizer="CL100K", max_documents=5)
    ds = precook_dataset(cfg, str(tmp_path), show_progress=False)
    assert ds.manifest.token_dtype == "uint32" and ds.tokenizer.vocab_size == 100277
    reader = shards.SplitReader(ds.path, ds.manifest, "train")
    assert reader.row(0)[0].dtype == np.uint32


def test_concurrent_builders_of_one_entry_build_it_once(corpus, tmp_path):
    """Training ranks all ask for the dataset at once: one builds, the others wait and hit."""
    import multiprocessing

    root, _ = corpus
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=testdata.precook_to_queue, args=(root, str(tmp_path), queue))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len({path for path, _ in results}) == 1
    assert sorted(hit for _, hit in results) == [False, True, True]
