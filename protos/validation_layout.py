"""Which parallel layouts a trainer config can run (part of rule 3, protos/validation.py):
tensor/pipeline/context parallel fit the world size, the model and the data
(`validate_layout`, protos/layout.py), mixture-of-experts routing and expert parallelism fit
the experts and the processes (`validate_moe`), and fp8 composes only with what its float8
linears were built for (`validate_fp8`)."""

from protos import defaults, layout, trainer_config_pb2
from protos.rules import check


def validate_layout(cfg: trainer_config_pb2.TrainerConfig, world_size: int) -> None:
    """The parallel layout (protos/layout.py) fits the world size, the model and the data."""
    t, m, seq = cfg.train, cfg.model, cfg.data.seq_len
    tp, pp, cp = t.tensor_parallel, t.pipeline_parallel, t.context_parallel
    where = "trainer.train."
    check(
        world_size % (tp * pp * cp) == 0,
        where + "tensor_parallel",
        f"tensor {tp} x pipeline {pp} x context {cp} = {tp * pp * cp} does not divide the "
        f"world size {world_size} (the data-parallel degree is what is left)",
    )
    lay = layout.from_train(t, world_size)
    if not lay.model_parallel:
        check(not t.sequence_parallel, where + "sequence_parallel", "needs tensor_parallel > 1")
        return
    check(
        defaults.DTYPES.get(t.dtype.lower()) != "float16",
        where + "dtype",
        f"fp16 is not combined with tensor/pipeline/context parallel ({lay.describe()}): its loss "
        "scaling runs in the data-parallel step only; use bf16",
    )
    check(
        m.n_heads % tp == 0, where + "tensor_parallel", f"{tp} does not divide n_heads {m.n_heads}"
    )
    check(
        m.n_kv_heads % tp == 0,
        where + "tensor_parallel",
        f"{tp} does not divide n_kv_heads {m.n_kv_heads}",
    )
    check(
        m.ffn_dim % tp == 0, where + "tensor_parallel", f"{tp} does not divide ffn_dim {m.ffn_dim}"
    )
    check(
        not t.sequence_parallel or tp > 1,
        where + "sequence_parallel",
        "needs tensor_parallel > 1 (it splits the norm regions across the TP ranks)",
    )
    check(
        not t.sequence_parallel or seq % (tp * 2 * cp) == 0,
        where + "sequence_parallel",
        f"seq_len {seq} is not divisible by tensor_parallel {tp} x 2 x context_parallel {cp}",
    )
    check(
        seq % (2 * cp) == 0,
        where + "context_parallel",
        f"seq_len {seq} is not divisible by 2 x context_parallel = {2 * cp} (each rank takes "
        "two chunks, one early and one late, to balance the causal mask)",
    )
    stages = pp * t.pipeline_virtual_stages
    interleaved = t.pipeline_schedule == trainer_config_pb2.INTERLEAVED_1F1B
    check(
        interleaved == (t.pipeline_virtual_stages > 1),
        where + "pipeline_virtual_stages",
        f"{t.pipeline_virtual_stages} stages per rank: more than 1 is the INTERLEAVED_1F1B "
        "schedule, which needs at least 2",
    )
    if pp == 1:
        return
    check(
        m.n_layers % stages == 0,
        where + "pipeline_parallel",
        f"n_layers {m.n_layers} is not divisible by {stages} stages "
        f"(pipeline_parallel {pp} x pipeline_virtual_stages {t.pipeline_virtual_stages})",
    )
    check(
        not m.tie_embeddings,
        "trainer.model.tie_embeddings",
        "the input embedding and the output head live on different pipeline stages: set false",
    )
    check(
        t.grad_accum % pp == 0,
        where + "grad_accum",
        f"{t.grad_accum} micro-batches per step: a pipeline of {pp} stages needs a multiple "
        f"of {pp}",
    )


def validate_moe(cfg: trainer_config_pb2.TrainerConfig, world_size: int) -> None:
    """The mixture-of-experts rules (#18): routing fits the experts, expert parallelism fits
    the processes and the experts."""
    m, t = cfg.model, cfg.train
    expert = t.parallelism == trainer_config_pb2.EXPERT
    check(
        expert or t.expert_parallel == 0,
        "trainer.train.expert_parallel",
        "only applies to parallelism EXPERT",
    )
    if m.moe_experts == 0:
        check(
            not expert,
            "trainer.train.parallelism",
            "EXPERT shards experts across ranks: set trainer.model.moe_experts",
        )
        return
    check(
        m.moe_top_k <= m.moe_experts,
        "trainer.model.moe_top_k",
        f"{m.moe_top_k} is more than moe_experts {m.moe_experts}",
    )
    check(
        m.moe_every <= m.n_layers,
        "trainer.model.moe_every",
        f"{m.moe_every} is more than n_layers {m.n_layers}: no layer would be MoE",
    )
    check(
        any((i + 1) % m.moe_every == 0 for i in range(m.moe_first_dense, m.n_layers)),
        "trainer.model.moe_first_dense",
        f"{m.moe_first_dense} dense layers first leave no MoE layer of {m.n_layers} "
        f"(moe_every {m.moe_every})",
    )
    if not expert:
        return
    ep = t.expert_parallel or world_size
    check(
        world_size % ep == 0,
        "trainer.train.expert_parallel",
        f"{ep} does not divide the {world_size} processes",
    )
    check(
        m.moe_experts % ep == 0,
        "trainer.train.expert_parallel",
        f"{ep} ranks cannot share moe_experts {m.moe_experts} evenly",
    )


def validate_fp8(cfg: trainer_config_pb2.TrainerConfig) -> None:
    """fp8 (trainer/fp8.py) composes with SINGLE and DDP on one device type; the device itself
    (fp8 matmuls: CUDA 8.9+) is checked by the trainer, which knows it."""
    t = cfg.train
    if t.dtype.lower() not in defaults.FP8_DTYPES:
        return
    where = "trainer.train.dtype"
    lay = layout.from_train(t, 1)
    check(
        not lay.model_parallel,
        where,
        f"fp8 is not combined with tensor/pipeline/context parallel ({lay.describe()}): its "
        "float8 linears take plain tensors, not sharded DTensor weights; use bf16",
    )
    check(
        t.parallelism not in (trainer_config_pb2.FSDP, trainer_config_pb2.EXPERT),
        where,
        f"fp8 runs with SINGLE or DDP, not {trainer_config_pb2.Parallelism.Name(t.parallelism)} "
        "(FSDP's and expert parallelism's fp8 paths are not built or measured): use bf16",
    )
    check(
        cfg.model.dim % 16 == 0,
        "trainer.model.dim",
        f"{cfg.model.dim} is not a multiple of 16, which fp8 matmuls need (train.dtype fp8)",
    )
