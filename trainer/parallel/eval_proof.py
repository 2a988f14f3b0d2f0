"""Held-out eval under several layouts in one torchrun launch: each layout's model is set up as
the trainer sets it up (trainer/model_setup.py) and scored by trainer/evaluate.py on a precooked
dataset's eval split; every rank's (loss, tokens) is recorded for eval_test.py, which compares
them with one process scoring the same rows.

    torchrun --nproc_per_node N -m trainer.parallel.eval_proof OUT CACHE DATASET tp2 cp2 ...

`CACHE` is the tiny job's cache directory, `DATASET` the dataset precooked from it.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from protos import job_pb2, trainer_config_pb2
from protos.config_yaml import job_spec_from_dict
from protos.validation import resolve_trainer
from trainer import distributed, evaluate, model_setup
from trainer.data.tokenizer import load_tokenizer
from trainer.recipes.lm import LanguageModelRecipe
from trainer.testing import tiny_job

EVAL_BATCHES = 2  # per data-parallel rank
MOE = {"moe_experts": 4, "moe_top_k": 2}
PP_ACCUM = {"grad_accum": 2}  # a pipeline trains a multiple of its degree of micro-batches

# name -> (processes, train fields, model fields) of each layout
LAYOUTS: dict[str, tuple[int, dict, dict]] = {
    "tp2": (2, {"tensor_parallel": 2}, {}),
    "tp2+sp": (2, {"tensor_parallel": 2, "sequence_parallel": True}, {}),
    "pp2:INTERLEAVED_1F1B": (  # 4 stages: rank 0 runs stages 0 and 2
        2,
        {"pipeline_parallel": 2, "pipeline_schedule": "INTERLEAVED_1F1B", **PP_ACCUM},
        {},
    ),
    "pp2:GPIPE,fsdp": (  # a pipeline under FSDP's mixed-precision wrapping (dp 1)
        2,
        {"pipeline_parallel": 2, "pipeline_schedule": "GPIPE", "parallelism": "FSDP", **PP_ACCUM},
        {},
    ),
    "cp2": (2, {"context_parallel": 2}, {}),
    "dp2": (2, {"parallelism": "DDP"}, {}),
    "fsdp2": (2, {"parallelism": "FSDP"}, {}),
    "ep2": (2, {"parallelism": "EXPERT", "expert_parallel": 2}, MOE),
    # products with data parallel, on 4 processes
    "fsdp2,tp2+sp": (
        4,
        {"parallelism": "FSDP", "tensor_parallel": 2, "sequence_parallel": True},
        {},
    ),
    "dp2,pp2:ONE_F_ONE_B": (4, {"pipeline_parallel": 2, **PP_ACCUM}, {}),
    "fsdp2,pp2:ONE_F_ONE_B": (  # FSDP gathers each stage's weights over data parallel
        4,
        {"pipeline_parallel": 2, "parallelism": "FSDP", **PP_ACCUM},
        {},
    ),
    "dp2,cp2": (4, {"context_parallel": 2}, {}),
    "ep2,dp2": (4, {"parallelism": "EXPERT", "expert_parallel": 2}, MOE),
}
MODEL_PARALLEL = ("tensor_parallel", "pipeline_parallel", "context_parallel")


def data_ranks(name: str) -> int:
    """The layout's data-parallel degree: the ranks that read different rows."""
    world, train, _ = LAYOUTS[name]
    model = 1
    for field in MODEL_PARALLEL:
        model *= train.get(field, 1)
    return world // model


def config(cache_dir, name: str, world_size: int) -> trainer_config_pb2.TrainerConfig:
    """The resolved tiny config of layout `name` on its processes; on 1 (`world_size` 1) the
    same model and eval rows (EVAL_BATCHES for each data-parallel rank of the layout)."""
    _, train, model = LAYOUTS[name]
    if world_size == 1:
        train = {"eval_batches": EVAL_BATCHES * data_ranks(name)}
    else:
        train = {**train, "eval_batches": EVAL_BATCHES}
    # untied: pipeline stages hold the embedding and the head apart
    model = {"n_layers": 4, "tie_embeddings": False, **model}
    job = tiny_job(cache_dir, model=model, train=train)
    return resolve_trainer(job_spec_from_dict(job).trainer, world_size=world_size)


def score(cfg, env, dataset: str) -> evaluate.HeldoutLoss | None:
    """The held-out loss of `cfg`'s seeded model, set up and evaluated as the trainer does."""
    vocab = load_tokenizer(dataset).vocab_size
    quiet = lambda _: None  # noqa: E731
    recipe = LanguageModelRecipe(cfg, job_pb2.PRETRAIN, env, dataset, vocab, torch.float32, quiet)
    parts = model_setup.set_up(cfg, env, recipe, torch.float32, log=quiet)
    return evaluate.heldout_loss(parts.model, dataset, cfg, env, torch.float32, parts.engine)


def main(argv: list[str]) -> None:
    out, cache, dataset = Path(argv[0]), argv[1], argv[2]
    env = distributed.init()
    try:
        for name in argv[3:]:
            result = score(config(cache, name, env.world_size), env, dataset)
            every_rank = distributed.gather_objects(result and result._asdict())
            if env.is_main:
                (out / f"{name}.json").write_text(json.dumps(every_rank))
            dist.barrier()
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
