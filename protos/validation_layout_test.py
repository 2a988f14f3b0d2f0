"""Parallel layouts in the one validation (#17): a layout that cannot run names the field at
fault and the numbers; the ones that fit resolve, FSDP with every other dimension, FP8 with
what it composes with."""

import pytest

from protos import job_pb2, layout, trainer_config_pb2
from protos.validation import validate_job_spec
from protos.validation_testing import error, spec_with


def layout_spec(processes: int = 4, **fields) -> job_pb2.JobSpec:
    """A spec on `processes` processes with train/model fields `fields` (#17 layouts)."""
    spec = spec_with(resources__processes_per_node=processes)
    for key, value in fields.items():
        section, name = key.split("__")
        setattr(getattr(spec.trainer, section), name, value)
    return spec


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"train__tensor_parallel": 3},
            "trainer.train.tensor_parallel: tensor 3 x pipeline 1 x context 1 = 3 does not "
            "divide the world size 4",
        ),
        (
            {"train__tensor_parallel": 4, "model__n_kv_heads": 2},
            "trainer.train.tensor_parallel: 4 does not divide n_kv_heads 2",
        ),
        (
            {"train__pipeline_parallel": 4, "model__n_layers": 6, "model__tie_embeddings": False},
            "trainer.train.pipeline_parallel: n_layers 6 is not divisible by 4 stages",
        ),
        (
            {"train__pipeline_parallel": 2},
            "trainer.model.tie_embeddings: the input embedding and the output head",
        ),
        (
            {"train__context_parallel": 4, "data__seq_len": 36},
            "trainer.train.context_parallel: seq_len 36 is not divisible by 2 x "
            "context_parallel = 8",
        ),
        (
            {"train__sequence_parallel": True},
            "trainer.train.sequence_parallel: needs tensor_parallel > 1",
        ),
        (
            {
                "train__pipeline_schedule": trainer_config_pb2.INTERLEAVED_1F1B,
                "train__pipeline_parallel": 2,
                "train__pipeline_virtual_stages": 1,
                "model__tie_embeddings": False,
                "train__grad_accum": 2,
            },
            "trainer.train.pipeline_virtual_stages: 1 stages per rank",
        ),  # fmt: skip
    ],
)
def test_layouts_that_cannot_run_name_the_field_and_numbers(fields, message):
    assert message in error(layout_spec(**fields))


def test_a_layout_that_fits_resolves():
    cfg = validate_job_spec(
        layout_spec(
            train__tensor_parallel=2,
            train__pipeline_parallel=2,
            train__pipeline_schedule=trainer_config_pb2.INTERLEAVED_1F1B,
            train__grad_accum=4,
            model__tie_embeddings=False,
        )
    )
    assert cfg.train.pipeline_virtual_stages == 2


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"train__tensor_parallel": 2},
            "trainer.train.dtype: fp8 is not combined with tensor/pipeline/context parallel",
        ),
        (
            {"train__parallelism": trainer_config_pb2.FSDP},
            "trainer.train.dtype: fp8 runs with SINGLE or DDP, not FSDP",
        ),
        ({"model__dim": 72, "model__n_heads": 4, "model__n_kv_heads": 4}, "trainer.model.dim: 72"),
    ],
)
def test_fp8_refuses_what_it_cannot_compose_with(fields, message):
    """#20: fp8's float8 linears (trainer/fp8.py); the device is checked by the trainer."""
    assert message in error(layout_spec(train__dtype="fp8", **fields))


def test_fp8_resolves_with_ddp():
    cfg = validate_job_spec(layout_spec(train__dtype="FP8"))
    assert cfg.train.dtype == "FP8" and cfg.train.parallelism == trainer_config_pb2.DDP


def test_fsdp_composes_with_tensor_pipeline_and_context_parallel():
    """The data-parallel dimension shards (trainer/parallel/shard.py) under any layout."""
    cfg = validate_job_spec(
        layout_spec(
            16,
            train__parallelism=trainer_config_pb2.FSDP,
            train__tensor_parallel=2,
            train__pipeline_parallel=2,
            train__context_parallel=2,
            train__grad_accum=2,
            model__tie_embeddings=False,
        )
    )
    lay = layout.from_train(cfg.train, 16)
    assert lay.describe() == "pp2(ONE_F_ONE_Bx1) x fsdp2 x cp2 x tp2"
