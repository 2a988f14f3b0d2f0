import glob
import os
import time

import pytest

from protos import job_pb2, launcher_pb2, trainer_config_pb2
from protos.config_yaml import ConfigError, job_spec_from_dict, load_job_spec, load_message

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(tmp_path, text, name="job.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_full_job_maps_one_to_one(tmp_path):
    path = _write(
        tmp_path,
        """
name: tiny
kind: pretrain          # enums by name, any case
priority: 5
resources: {nodes: 1, processes_per_node: 2, pool: cpu}
retry: {max_attempts: 4, backoff_seconds: 1.5}
trainer:
  data: {seq_len: 128, tokenizer: bpe_train, vocab_size: 2048}
  model: {dim: 64, n_layers: 2}
  optim: {lr: 3e-3}     # YAML 1.1 would read this as a string
  train: {steps: 10, dtype: fp32}
""",
    )
    spec = load_job_spec(path)
    assert spec.kind == job_pb2.PRETRAIN
    assert spec.resources.processes_per_node == 2
    assert spec.retry.backoff_seconds == 1.5
    assert spec.trainer.data.tokenizer == trainer_config_pb2.BPE_TRAIN
    assert spec.trainer.optim.lr == pytest.approx(3e-3)
    assert spec.trainer.train.HasField("steps") and spec.trainer.train.steps == 10
    # Optional fields left out stay unset, so the trainer's defaults apply.
    assert not spec.trainer.model.HasField("n_heads")


@pytest.mark.parametrize(
    "text, field, problem",
    [
        ("kind: pretrain\ntrainer: {model: {n_heads: x}}", "trainer.model.n_heads", "expected int"),
        ("kind: pretrain\ntrainer: {model: {n_head: 4}}", "trainer.model.n_head", "'n_heads'"),
        ("kind: pretrian", "kind", "expected one of PRECOOK, PRETRAIN"),
        ("kind: sft\npriority: 1.5", "priority", "expected int"),
        ("kind: sft\nname: 12", "name", "expected a string"),
        ("kind: sft\nresources: [1, 2]", "resources", "expected a mapping"),
        ("kind: sft\ntrainer: {train: {compile: 1}}", "trainer.train.compile", "true or false"),
        ("kind: sft\npriority: 99999999999", "priority", "out of range"),
        ("kind: sft\nkind: eval", "kind", "duplicate key (line 2)"),
        ("- a\n- b", "", "expected a mapping"),
    ],
)
def test_bad_fields_name_their_path_and_file(tmp_path, text, field, problem):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_job_spec(path)
    assert err.value.field == field
    assert problem in str(err.value)
    assert str(err.value).startswith(path + ": ")


def test_unreadable_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_job_spec(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job_spec(_write(tmp_path, "kind: [unclosed"))
    with pytest.raises(ConfigError, match="empty"):
        load_job_spec(_write(tmp_path, "# nothing\n"))


def test_dict_form_and_repeated_messages(tmp_path):
    spec = job_spec_from_dict({"kind": "EVAL", "trainer": {"checkpoint": {"path": "x"}}})
    assert spec.kind == job_pb2.EVAL and spec.trainer.checkpoint.path == "x"
    path = _write(
        tmp_path,
        "pools:\n  - {name: cpu, nodes: 2}\n  - {name: gpu, executor: slurm, gpus_per_node: 8}\n"
        "trainer_cmd: [python3, -m, trainer.main]\n",
    )
    cfg = load_message(path, launcher_pb2.LauncherConfig())
    assert [p.name for p in cfg.pools] == ["cpu", "gpu"]
    assert cfg.pools[1].executor == launcher_pb2.SLURM
    with pytest.raises(ConfigError) as err:
        load_message(_write(tmp_path, "pools:\n  - {name: cpu, nodez: 2}\n"), cfg)
    assert err.value.field == "pools[0].nodez"


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))))
def test_shipped_configs_load(path):
    if os.path.basename(path).startswith("launcher"):
        load_message(path, launcher_pb2.LauncherConfig())
    else:
        assert load_job_spec(path).kind != job_pb2.JOB_KIND_UNSPECIFIED


# ---- hostile configs: each is refused quickly with a clear error, never a traceback or a hang


def _timed_refusal(path) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_job_spec(str(path))
    return str(err.value), time.monotonic() - started


def test_a_billion_laughs_is_refused_before_anything_is_expanded(tmp_path):
    """`name:` (a string field) given 10**9 "lol"s in ten nested lists of aliases: building
    the value, or showing it in the error, never finishes."""
    laughs = ['&a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    laughs += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    path = tmp_path / "laughs.yaml"
    path.write_text("kind: PRETRAIN\nname: [" + ", ".join(laughs) + "]\n")
    message, seconds = _timed_refusal(path)
    assert "more than 100000 values with aliases expanded" in message
    assert seconds < 5, seconds  # not minutes (a generous bound on a shared 2-core machine)


def test_deep_nesting_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("kind: PRETRAIN\nname: " + "[" * 100 + "]" * 100 + "\n")
    message, _ = _timed_refusal(path)
    assert "nested deeper than 64 (line 2)" in message
    path.write_text("kind: PRETRAIN\nname: " + "[" * 100_000 + "]" * 100_000 + "\n")
    message, _ = _timed_refusal(path)  # libyaml's own bound (1000) comes first: still no traceback
    assert "exceeded maximum nesting depth" in message


def test_a_list_as_a_mapping_key_is_an_error_not_a_traceback(tmp_path):
    path = tmp_path / "key.yaml"
    path.write_text("kind: PRETRAIN\n? [a, b]\n: 1\n")
    message, _ = _timed_refusal(path)
    assert "a mapping key must be a name, not a sequence (line 2)" in message


def test_a_fifo_is_refused_instead_of_waited_on(tmp_path):
    path = tmp_path / "fifo.yaml"
    os.mkfifo(path)
    message, seconds = _timed_refusal(path)
    assert "not a regular file" in message and seconds < 5


def test_a_huge_config_is_refused_unread_and_no_value_is_echoed(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("kind: PRETRAIN\nname: " + "x" * 50_000_000 + "\n")
    message, _ = _timed_refusal(path)
    assert "larger than 1048576 bytes" in message
    path.write_text("kind: PRETRAIN\nresources: {nodes: '" + "9" * 500_000 + "'}\n")
    message, _ = _timed_refusal(path)  # a long wrong value: the message shows its start only
    assert "resources.nodes: expected int" in message and len(message) < 400
