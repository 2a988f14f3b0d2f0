import pytest
import torch

from protos import trainer_config_pb2
from trainer import config


def cfg_with(**fields):
    """A TrainerConfig with `section__field=value` set."""
    cfg = trainer_config_pb2.TrainerConfig()
    for key, value in fields.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_defaults_fill_every_optional_field():
    cfg = config.resolve(trainer_config_pb2.TrainerConfig())
    for section in ("data", "model", "optim", "train", "checkpoint", "generate"):
        msg = getattr(cfg, section)
        for field in msg.DESCRIPTOR.fields:
            if field.has_presence:
                assert msg.HasField(field.name), f"{section}.{field.name} has no default"
            if field.enum_type is not None:
                assert getattr(msg, field.name) != 0, f"{section}.{field.name} left UNSPECIFIED"
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads) == (256, 4, 8)
    assert cfg.model.n_kv_heads == 8 and cfg.model.max_seq_len == cfg.data.seq_len == 256
    assert cfg.model.ffn_dim == 704  # 8/3 * 256 = 682.7, up to a multiple of 64
    assert cfg.optim.lr == pytest.approx(3e-3) and cfg.train.steps == 200
    assert config.enum_name(cfg.train, "parallelism") == "SINGLE"
    fresh = config.resolve(trainer_config_pb2.TrainerConfig(), world_size=2)
    assert config.enum_name(fresh.train, "parallelism") == "DDP"


def test_set_fields_are_kept_and_input_not_changed():
    cfg = cfg_with(model__dim=128, model__n_heads=4, train__steps=7, data__seq_len=64)
    out = config.resolve(cfg)
    assert (out.model.dim, out.model.n_heads, out.train.steps) == (128, 4, 7)
    assert out.model.max_seq_len == 64
    assert not cfg.model.HasField("n_layers")  # resolve() copies


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"model__n_heads": 6}, "trainer.model.n_heads: 6 does not divide dim 256"),
        ({"model__n_kv_heads": 3}, "trainer.model.n_kv_heads: 3 does not divide n_heads 8"),
        (
            {"data__seq_len": 512, "model__max_seq_len": 256},
            "trainer.data.seq_len: 512 is longer than the model's positions",
        ),
        ({"model__dim": 40, "model__n_heads": 8}, "trainer.model.n_heads: 8 heads give head_dim 5"),
        ({"model__n_layers": 0}, "trainer.model.n_layers: 0 must be positive"),
        ({"data__vocab_size": 100}, "trainer.data.vocab_size: 100 cannot fit"),
        ({"optim__lr": -1.0}, "trainer.optim.lr"),
        ({"optim__beta2": 1.0}, "trainer.optim.beta2"),
        ({"train__dtype": "fp8"}, "trainer.train.dtype: 'fp8'"),
        ({"train__micro_batch": 0}, "trainer.train.micro_batch"),
        ({"train__spike_factor": 0.5}, "trainer.train.spike_factor"),
        ({"checkpoint__keep_last": 0}, "trainer.checkpoint.keep_last"),
        ({"generate__top_p": 0.0}, "trainer.generate.top_p"),
    ],
)
def test_bad_values_name_their_field(fields, message):
    with pytest.raises(config.ConfigError) as err:
        config.resolve(cfg_with(**fields))
    assert str(err.value).startswith(message), str(err.value)


def test_several_processes_need_ddp_or_fsdp():
    cfg = cfg_with(train__parallelism=trainer_config_pb2.SINGLE)
    assert config.resolve(cfg).train.parallelism == trainer_config_pb2.SINGLE
    with pytest.raises(config.ConfigError, match="trainer.train.parallelism: SINGLE with 2"):
        config.resolve(cfg, world_size=2)
    fsdp = cfg_with(train__parallelism=trainer_config_pb2.FSDP)
    assert config.resolve(fsdp, world_size=2).train.parallelism == trainer_config_pb2.FSDP


def test_sft_needs_prompt_response_data():
    with pytest.raises(config.ConfigError, match="trainer.data.format: SFT"):
        config.resolve(trainer_config_pb2.TrainerConfig(), kind="SFT")
    cfg = cfg_with(data__format=trainer_config_pb2.JSONL_CHAT)
    assert config.resolve(cfg, kind="SFT").data.format == trainer_config_pb2.JSONL_CHAT


def test_train_dtype_is_fp32_on_cpu_bf16_on_cuda():
    cfg = config.resolve(trainer_config_pb2.TrainerConfig())
    assert config.train_dtype(cfg, "cpu") == torch.float32
    assert config.train_dtype(cfg, "cuda") == torch.bfloat16
    bf16 = config.resolve(cfg_with(train__dtype="bf16"))
    assert config.train_dtype(bf16, "cpu") == torch.bfloat16
