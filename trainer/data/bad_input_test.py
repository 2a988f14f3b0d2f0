"""Each bad input of issue 3: a clear error naming the flag or the file and line, and nothing
half-written left in the cache."""

import os
import subprocess
import sys

import pytest

from protos.config_yaml import ConfigError
from trainer.data import corpus as corpus_mod
from trainer.data import testdata
from trainer.data.errors import CorpusError, DataConfigError
from trainer.data.precook import precook_dataset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def assert_nothing_left(cache: str) -> None:
    """No dataset, tokenized corpus or temporary file: at most empty lock files."""
    for dirpath, _, names in os.walk(cache):
        for name in names:
            path = os.path.join(dirpath, name)
            assert os.path.basename(dirpath) == "locks" and os.path.getsize(path) == 0, path
    for kind in ("datasets", "tokenized", "tmp"):
        assert not os.path.isdir(os.path.join(cache, kind)) or not os.listdir(
            os.path.join(cache, kind)
        )


def fails(cfg, cache, error, match):
    with pytest.raises(error, match=match):
        precook_dataset(cfg, cache, show_progress=False)
    assert_nothing_left(cache)


@pytest.fixture
def corpus(tmp_path):
    testdata.write_text_corpus(str(tmp_path / "c"), n=12)
    return tmp_path / "c"


def test_unreadable_file(corpus, tmp_path):
    os.symlink(corpus / "gone.txt", corpus / "doc-005x.txt")
    cfg = testdata.data_config(input=str(corpus))
    fails(cfg, str(tmp_path / "cache"), CorpusError, r"doc-005x\.txt: cannot read")


@pytest.mark.parametrize("workers", [1, 2])
def test_invalid_utf8_while_tokenizing(corpus, tmp_path, workers, monkeypatch):
    monkeypatch.setattr(corpus_mod, "UNIT_BYTES", 2048)  # several units: the error is in a worker
    (corpus / "doc-009.txt").write_bytes(b"ok line\n\xc3\x28 broken\n")
    cfg = testdata.data_config(input=str(corpus), workers=workers, tokenizer="CL100K")
    fails(cfg, str(tmp_path / "cache"), CorpusError, r"doc-009\.txt:2: invalid UTF-8 \(byte 0xc3")


def test_invalid_utf8_while_training_the_tokenizer(corpus, tmp_path):
    (corpus / "doc-003.txt").write_bytes(b"\xff")
    cfg = testdata.data_config(input=str(corpus))
    fails(cfg, str(tmp_path / "cache"), CorpusError, r"doc-003\.txt:1: invalid UTF-8")


def test_empty_corpus(tmp_path):
    (tmp_path / "c").mkdir()
    for i in range(3):
        (tmp_path / "c" / f"{i}.txt").write_text("  \n" * i)
    cfg = testdata.data_config(input=str(tmp_path / "c"))
    fails(cfg, str(tmp_path / "cache"), CorpusError, "every document is empty")
    cfg = testdata.data_config(input=str(tmp_path / "c" / "*.md"))
    fails(cfg, str(tmp_path / "cache"), DataConfigError, r"data\.input: .*matches no files")


def test_jsonl_line_without_the_field(tmp_path):
    rows = [{"text": "a document"}] * 5 + [{"content": "no text field"}]
    testdata.write_jsonl(str(tmp_path / "d.jsonl"), rows)
    cfg = testdata.data_config(input=str(tmp_path / "d.jsonl"), format="JSONL")
    fails(cfg, str(tmp_path / "cache"), CorpusError, r"d\.jsonl:6: no field 'text'")
    chat = testdata.data_config(input=str(tmp_path / "d.jsonl"), format="JSONL_CHAT")
    fails(chat, str(tmp_path / "cache"), CorpusError, r"d\.jsonl:1: no field 'prompt'")


def test_sequence_length_below_two(corpus, tmp_path):
    cfg = testdata.data_config(input=str(corpus), seq_len=1)
    fails(cfg, str(tmp_path / "cache"), ConfigError, r"data\.seq_len: 1 is not in \[2, ")


def test_vocabulary_that_cannot_fit(corpus, tmp_path):
    cfg = testdata.data_config(input=str(corpus), vocab_size=100)
    fails(cfg, str(tmp_path / "cache"), ConfigError, r"data\.vocab_size: 100 cannot fit")


def test_missing_tokenizer_file(corpus, tmp_path):
    cfg = testdata.data_config(
        input=str(corpus), tokenizer="BPE_FILE", tokenizer_path=str(tmp_path / "none.json")
    )
    fails(cfg, str(tmp_path / "cache"), DataConfigError, r"data\.tokenizer_path: .*none\.json")


def run_cli(*args):
    env = dict(os.environ)  # under Bazel PYTHONPATH already holds the runfiles
    env.setdefault("PYTHONPATH", os.pathsep.join([REPO, os.path.join(REPO, ".gen")]))
    command = [sys.executable, "-m", "trainer.data.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def test_cli_names_the_flag_and_exits_2(corpus, tmp_path):
    cache = str(tmp_path / "cache")
    out = run_cli("build", "--input", str(corpus), "--seq-len", "1", "--cache-dir", cache)
    assert out.returncode == 2
    assert "--seq-len (data.seq_len): 1 is not in [2, 1,048,576]" in out.stderr
    out = run_cli("analyze", "--input", str(corpus), "--seq-len", "64,1", "--cache-dir", cache)
    assert out.returncode == 2 and "--seq-len" in out.stderr
    out = run_cli("build", "--input", str(corpus), "--vocab-size", "200", "--cache-dir", cache)
    assert out.returncode == 2 and "--vocab-size (data.vocab_size): 200 cannot fit" in out.stderr
    assert_nothing_left(cache)
