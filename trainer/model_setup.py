"""The model a run trains, wrapped for its parallel layout, with its optimizer, schedule and
loss scaler: what `Trainer` (loop.py) is built on, made in the order the seeded RNG expects."""

import dataclasses
from typing import TYPE_CHECKING

import torch

from protos import layout, trainer_config_pb2
from protos.enums import enum_name
from trainer import distributed, expert_parallel, fp8
from trainer.distributed import DistEnv
from trainer.model import Transformer, head_dim, select_ops
from trainer.optim import build_optimizer, build_scheduler
from trainer.sizing import flops

if TYPE_CHECKING:
    from trainer.parallel.engine import Engine


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # also seeds every CUDA device


def build_model(
    cfg: trainer_config_pb2.TrainerConfig,
    vocab_size: int,
    device: torch.device,
    recompute: str = "NONE",
) -> Transformer:
    """The Transformer of a resolved config, initialized from `train.seed`, on `device`."""
    seed_everything(cfg.train.seed)
    ops = select_ops(cfg.model.use_kernels, device)
    return Transformer(cfg.model, vocab_size, ops=ops, recompute=recompute).to(device)


@dataclasses.dataclass
class ModelSetup:
    """The parts of a training run that hold parameters, and how they are laid out."""

    model: torch.nn.Module  # wrapped for the layout; the bare model under an engine
    engine: "Engine | None"  # runs the step under a model-parallel layout (trainer/parallel)
    layout: layout.ParallelLayout
    parallelism: str  # SINGLE, DDP, FSDP, EXPERT, or the layout's description
    data_rank: int  # this rank's place among the ranks that read different rows
    data_ranks: int
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    flops_per_token: float
    n_params: int  # counted whole, before a pipeline layout keeps only this rank's stages
    n_matmul: int
    ops: str  # which ops the blocks run: "Triton kernels" or "PyTorch reference ops"


def set_up(
    cfg: trainer_config_pb2.TrainerConfig,
    env: DistEnv,
    vocab_size: int,
    dtype: torch.dtype,
    log,
) -> ModelSetup:
    """Build, convert (fp8), compile and wrap the model of a resolved config; its optimizer,
    schedule and loss scaler."""
    t, device = cfg.train, env.device
    parallelism = enum_name(t, "parallelism")
    if env.world_size == 1:
        parallelism = "SINGLE"
    model = build_model(cfg, vocab_size, device, enum_name(t, "recompute"))
    if fp8.enabled(cfg):  # #20: the blocks' Linear layers in float8 (CUDA 8.9+ only)
        swapped = fp8.convert(model, fp8.backend_for(device))
        log(f"fp8: {len(swapped)} Linear layers compute in float8 (tensorwise scaling)")
    flops_per_token = flops.flops_per_token(
        model.matmul_params(),
        cfg.model.n_layers,
        cfg.model.n_heads,
        head_dim(cfg.model),
        cfg.data.seq_len,
    )
    # Counted whole, before a pipeline layout keeps only this rank's stages.
    n_params, n_matmul = sum(p.numel() for p in model.parameters()), model.matmul_params()
    if t.compile:
        for block in model.layers:
            block.compile()
    # Tensor/pipeline/context parallel (trainer/parallel): the engine runs the step; ranks
    # of one data-parallel group read the same rows.
    lay = layout.from_train(t, env.world_size)
    engine = None
    data_rank, data_ranks = env.rank, env.world_size
    wrapped: torch.nn.Module
    if lay.model_parallel:
        from trainer.parallel import mesh
        from trainer.parallel.engine import Engine

        lay_mesh = mesh.build(lay, device)
        engine = Engine(model, lay_mesh, t.grad_accum, dtype)
        data_rank, data_ranks = lay_mesh.rank("dp"), lay.dp
        parallelism = lay.describe()
        wrapped = model
    elif parallelism == "EXPERT":
        ep = t.expert_parallel or env.world_size
        wrapped = expert_parallel.wrap(model, env, ep)
    else:
        wrapped = distributed.wrap(model, parallelism, env, dtype)
    optimizer = build_optimizer(wrapped, cfg.optim, device)
    return ModelSetup(
        model=wrapped,
        engine=engine,
        layout=lay,
        parallelism=parallelism,
        data_rank=data_rank,
        data_ranks=data_ranks,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.optim, t.steps),
        # fp16's 5 exponent bits underflow small gradients: the loss is scaled up before
        # backward and the gradients down before the update, and a step whose gradients
        # overflowed is skipped while the scale halves. bf16 has fp32's range and needs none.
        scaler=torch.amp.GradScaler(device.type, enabled=dtype == torch.float16),
        flops_per_token=flops_per_token,
        n_params=n_params,
        n_matmul=n_matmul,
        ops="Triton kernels" if model.ops.__name__ == "kernels" else "PyTorch reference ops",
    )
