"""IMPORT: a random LlamaForCausalLM made here by transformers becomes a Kitchen checkpoint with
the same logits; what Kitchen's model cannot represent is refused naming the field."""

import json
from typing import Any

import pytest
import torch

from trainer import checkpoint, main
from trainer.testing import write_job

torch.set_num_threads(1)
LOGITS_ATOL = 1e-4  # fp32; the implementations differ only in operation order


def llama_dir(path, **overrides):
    """A small random LlamaForCausalLM saved with save_pretrained (safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    fields: dict[str, Any] = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=50000.0,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    model.save_pretrained(path)
    return model


def import_job(tmp_path, hf_dir, name="import"):
    job = {"name": name, "kind": "IMPORT", "trainer": {"hf": {"path": str(hf_dir)}}}
    config = write_job(tmp_path / f"{name}.yaml", job)
    return main.main(["--config", str(config), "--run-dir", str(tmp_path / name)])


@pytest.mark.parametrize(
    "tied, head_dim",
    [(False, None), (True, None), (False, 32)],  # 32: heads wider than hidden / heads (16)
)
def test_imported_model_gives_the_same_logits(tmp_path, tied, head_dim):
    extra = {"head_dim": head_dim} if head_dim else {}
    theirs = llama_dir(tmp_path / "hf", tie_word_embeddings=tied, **extra)
    assert import_job(tmp_path, tmp_path / "hf") == 0
    path = tmp_path / "import" / "checkpoints" / "step_00000000"
    ours, meta = checkpoint.load_model(path, torch.device("cpu"), use_kernels=False)
    assert (meta.step, meta.vocab_size, meta.model.n_kv_heads) == (0, 300, 2)
    assert meta.model.head_dim == (head_dim or 16)
    assert meta.model.rope_theta == 50000.0 and meta.model.tie_embeddings == tied
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = ours(ids, torch.arange(40).expand(2, -1)) - theirs(ids).logits
    assert diff.abs().max() < LOGITS_ATOL
    source = json.loads((path / "imported_from.json").read_text())
    assert set(source["files"]) == {"config.json", "model.safetensors"}


def _edit_config(hf_dir, **changes):
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"head_dim": 15}, "config.json: head_dim: 15: rotary needs even"),
        ({"head_dim": 32}, "model.layers.0.self_attn.q_proj.weight: shape [64, 64]"),
        ({"model_type": "mistral"}, "config.json: model_type"),
        ({"hidden_act": "gelu"}, "config.json: hidden_act"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
            "rope_parameters.rope_type",
        ),
        ({"intermediate_size": 192}, "model.layers.0.mlp.gate_proj.weight: shape [160, 64]"),
        ({"num_key_value_heads": 4}, "model.layers.0.self_attn.k_proj.weight: shape [32, 64]"),
    ],
)
def test_what_the_model_cannot_represent_is_refused_naming_the_field(
    tmp_path, capsys, changes, named
):
    llama_dir(tmp_path / "hf")
    _edit_config(tmp_path / "hf", **changes)
    capsys.readouterr()
    assert import_job(tmp_path, tmp_path / "hf") == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "import" / "checkpoints" / "step_00000000").exists()


def test_a_directory_that_is_not_there_exits_2_naming_it(tmp_path, capsys):
    assert import_job(tmp_path, tmp_path / "nowhere") == 2
    assert f"trainer.hf.path: {tmp_path / 'nowhere'}" in capsys.readouterr().err


def test_a_head_dim_model_is_exported_with_its_head_dim():
    """What the import reads back (the round trip of the import test above): config.json's
    head_dim and the projections' shapes follow model.head_dim, and an old checkpoint's model
    (head_dim unset) keeps hidden_size / heads."""
    from protos import trainer_config_pb2
    from trainer.interop import llama_format

    m = trainer_config_pb2.ModelConfig(dim=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=160)
    m.n_layers, m.max_seq_len, m.rope_theta, m.norm_eps = 2, 128, 1e4, 1e-5
    special = llama_format.SpecialTokens(bos_id=1, eos_id=2, pad_id=0)
    config = llama_format.hf_config(m, 300, special, "float32")
    assert config["head_dim"] == 32
    shapes = llama_format.expected_shapes(m, 300)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (128, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 128)
    assert llama_format.model_config(config, "config.json")[0].head_dim == 32
    m.ClearField("head_dim")
    config = llama_format.hf_config(m, 300, special, "float32")
    assert config["head_dim"] == 16
    back, vocab = llama_format.model_config(config, "config.json")
    assert (back.head_dim, vocab) == (16, 300)
