"""manifest.json on disk is the format precook always wrote: manifests_v1/ holds two written by
precook before the manifest was a dataclass (6 chat records, bucket packing, seq_len 64)."""

import json
import os
import shutil

import pytest

from trainer.data import manifest, testdata
from trainer.data.manifest import DatasetManifest, TokenizedManifest
from trainer.data.precook import precook_dataset

OLD = os.path.join(os.path.dirname(__file__), "manifests_v1")


def key_paths(value, prefix=""):
    """Every object key in a JSON value, as dotted paths (what a reader looks up)."""
    if not isinstance(value, dict):
        return set()
    paths = set()
    for k, v in value.items():
        paths |= {f"{prefix}{k}"} | key_paths(v, f"{prefix}{k}.")
    return paths


@pytest.mark.parametrize(
    "kind, name", [(DatasetManifest, "dataset.json"), (TokenizedManifest, "tokenized.json")]
)
def test_an_old_manifest_loads_and_writes_back_byte_for_byte(tmp_path, kind, name):
    shutil.copyfile(os.path.join(OLD, name), tmp_path / manifest.MANIFEST)
    found = manifest.read_manifest(str(tmp_path), kind)
    assert found.files and found.tokenizer.vocab_size == 300
    again = tmp_path / "again"
    again.mkdir()
    manifest.write_manifest(str(again), found)
    with open(os.path.join(OLD, name), "rb") as f:
        assert (again / manifest.MANIFEST).read_bytes() == f.read()


def test_precook_writes_the_fields_it_always_wrote(tmp_path):
    testdata.write_chat_corpus(str(tmp_path / "chat.jsonl"), n=6, seed=0)
    cfg = testdata.data_config(
        input=str(tmp_path / "chat.jsonl"), format="JSONL_CHAT", packing="BUCKET"
    )
    ds = precook_dataset(cfg, str(tmp_path / "cache"), show_progress=False)
    assert isinstance(ds.manifest, DatasetManifest) and ds.manifest.counts.documents == 6
    with open(os.path.join(OLD, "dataset.json")) as f:
        old = json.load(f)
    with open(os.path.join(ds.path, manifest.MANIFEST)) as f:
        new = json.load(f)
    added = key_paths(new) - key_paths(old)  # #21's sections only, each optional to a reader
    assert key_paths(old) <= key_paths(new)
    assert {p.split(".")[0] for p in added} == {"curation", "sources"}
    assert new["config"] == old["config"] and new["counts"] == old["counts"]


def write(directory, data) -> str:
    with open(os.path.join(directory, manifest.MANIFEST), "w") as f:
        json.dump(data, f)
    return os.path.join(directory, manifest.MANIFEST)


def test_a_bad_manifest_is_refused_naming_the_file_and_the_field(tmp_path):
    with open(os.path.join(OLD, "dataset.json")) as f:
        good = json.load(f)
    cases = [
        ({k: v for k, v in good.items() if k != "counts"}, "counts: missing"),
        ({**good, "counts": {**good["counts"], "rows": "6"}}, "counts.rows: expected int"),
        ({**good, "splits": {"train": None}}, "splits.train: expected an object"),
        ({**good, "loss_mask": 1}, "loss_mask: expected bool"),
        ({**good, "kind": "tokenized"}, "kind 'tokenized', expected 'dataset'"),
        ({**good, "format_version": 0}, "format version 0"),
    ]
    for data, message in cases:
        name = write(tmp_path, data)
        with pytest.raises(ValueError) as err:
            manifest.read_manifest(str(tmp_path), DatasetManifest)
        assert str(err.value).startswith(f"{name}: ") and message in str(err.value), err.value
    (tmp_path / manifest.MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json: not valid JSON"):
        manifest.read_manifest(str(tmp_path), DatasetManifest)
