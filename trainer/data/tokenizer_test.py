import json

import numpy as np
import pytest

from trainer.data import testdata, tokenizer
from trainer.data.errors import DataConfigError
from trainer.data.manifest import to_json


@pytest.fixture(scope="module")
def texts():
    rng = np.random.default_rng(0)
    return [testdata.random_text(rng, int(n)) for n in testdata.doc_lengths(60, 0)]


def test_training_is_deterministic(texts, tmp_path):
    saved = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        saved.append(tokenizer.train_bpe(list(texts), 320).save(str(tmp_path / name)))
    assert saved[0].sha256 == saved[1].sha256
    a, b = ((tmp_path / name / "tokenizer.json").read_bytes() for name in ("a", "b"))
    assert a == b


def test_special_tokens_are_explicit(texts):
    tok = tokenizer.train_bpe(texts, 320)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.vocab_size == 320 and tok.token_dtype == "uint16"
    ids = tok.encode("kitchen token <|eos|>")
    assert ids and tok.bos_id not in ids and tok.eos_id not in ids  # no BOS/EOS added or parsed
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == "kitchen token <|eos|>"
    text = "héllo wörld ✓ tabs\tand\nnewlines"
    assert tok.decode(tok.encode(text)) == text  # byte-level: any text round-trips


def test_vocab_stops_short_on_a_tiny_corpus():
    tok = tokenizer.train_bpe(["ab ab ab"], 5000)
    assert 259 <= tok.vocab_size < 5000


def test_save_and_reload(texts, tmp_path):
    tok = tokenizer.train_bpe(texts, 300)
    section = tok.save(str(tmp_path))
    (tmp_path / "manifest.json").write_text(json.dumps({"tokenizer": to_json(section)}))
    again = tokenizer.load_tokenizer(str(tmp_path))
    assert again.encode(texts[3]) == tok.encode(texts[3])
    assert (again.vocab_size, again.bos_id, again.eos_id) == (300, 0, 1)


def test_tokenizer_json_file(texts, tmp_path):
    tok = tokenizer.train_bpe(texts, 300)
    tok.save(str(tmp_path))
    loaded = tokenizer.from_tokenizer_json(str(tmp_path / "tokenizer.json"))
    assert loaded.encode(texts[0]) == tok.encode(texts[0])
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (0, 1, 2)


def test_tokenizer_json_without_end_of_text_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel()
    hf.train_from_iterator(["a b c"], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    hf.save(str(tmp_path / "t.json"))
    with pytest.raises(DataConfigError, match="data.tokenizer_path: .*no end-of-text token"):
        tokenizer.from_tokenizer_json(str(tmp_path / "t.json"))
    with pytest.raises(DataConfigError, match="cannot load a tokenizer"):
        tokenizer.from_tokenizer_json(str(tmp_path / "missing.json"))


def test_cl100k_is_the_real_vocabulary(tmp_path):
    tok = tokenizer.cl100k()
    assert tok.vocab_size == 100277 and tok.token_dtype == "uint32"
    assert tok.encode("hello world") == [15339, 1917]  # cl100k_base's ids
    assert tok.bos_id == tok.eos_id == tok.pad_id == 100257  # <|endoftext|>
    assert len(tok.encode("<|endoftext|>")) > 1  # the string in a document is text
    section = tok.save(str(tmp_path))
    (tmp_path / "manifest.json").write_text(json.dumps({"tokenizer": to_json(section)}))
    assert tokenizer.load_tokenizer(str(tmp_path)).encode("naïve café") == tok.encode("naïve café")
