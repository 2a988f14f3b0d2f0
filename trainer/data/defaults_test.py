import pytest

from protos import trainer_config_pb2 as pb
from trainer.data import defaults
from trainer.data.errors import DataConfigError


def test_with_defaults_fills_unset_fields_and_leaves_the_input_alone():
    cfg = pb.DataConfig(seq_len=512)
    out = defaults.with_defaults(cfg)
    assert not cfg.HasField("vocab_size") and cfg.packing == 0
    assert (out.seq_len, out.vocab_size, out.text_field, out.shard_tokens) == (
        512,
        4096,
        "text",
        16 * 2**20,
    )
    assert out.eval_fraction == pytest.approx(0.02) and out.workers >= 1
    assert defaults.enum_name(out, "packing") == "BEST_FIT"
    assert defaults.enum_name(out, "format") == "TEXT_FILES"
    assert defaults.enum_name(out, "tokenizer") == "BPE_TRAIN"


def test_explicit_zero_is_kept():
    out = defaults.with_defaults(pb.DataConfig(eval_fraction=0.0, max_documents=0))
    assert out.eval_fraction == 0.0


@pytest.mark.parametrize(
    "fields, field, message",
    [
        ({"seq_len": 1}, "seq_len", "must be at least 2"),
        ({"vocab_size": 258}, "vocab_size", "needs at least 259"),
        ({"tokenizer": pb.BPE_FILE}, "tokenizer_path", "is required"),
        ({"shard_tokens": 100, "seq_len": 256}, "shard_tokens", "smaller than one row"),
        ({"workers": 0}, "workers", "at least 1"),
        ({"eval_fraction": 1.0}, "eval_fraction", "not in"),
        ({"max_documents": -1}, "max_documents", "negative"),
        ({"format": pb.JSONL, "text_field": ""}, "text_field", "must name"),
        (
            {"format": pb.JSONL_CHAT, "prompt_field": "x", "response_field": "x"},
            "response_field",
            "same field",
        ),
    ],
)
def test_each_bad_field_is_named(fields, field, message):
    with pytest.raises(DataConfigError, match=message) as err:
        defaults.resolve(pb.DataConfig(**fields))
    assert err.value.field == field and str(err.value).startswith(f"data.{field}: ")


def test_vocab_size_is_only_checked_for_a_trained_bpe():
    defaults.resolve(pb.DataConfig(tokenizer=pb.CL100K, vocab_size=10))


def test_enum_names_are_case_insensitive():
    cfg = pb.DataConfig()
    assert defaults.enum_value(cfg, "packing", "best_fit") == pb.BEST_FIT
    with pytest.raises(DataConfigError, match="data.packing: 'zip' is not one of PAD, CONCAT"):
        defaults.enum_value(cfg, "packing", "zip")
