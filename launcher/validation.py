"""Checks a submitted JobSpec against this launcher's pools and quotas; names the bad field.

The trainer checks its own config in full (and exits 2 naming the field); here we reject what
can be known before a job is queued, so a broken job fails in the submit call, not hours later.
"""

import re

from launcher.executors import image
from protos import job_pb2, launcher_pb2
from protos.config_yaml import ConfigError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# TrainerConfig fields that must be positive when set (0 or less can never work).
POSITIVE = {
    "data": ("vocab_size", "seq_len", "shard_tokens", "workers"),
    "model": ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len", "rope_theta"),
    "optim": ("lr",),
    "train": ("steps", "micro_batch", "grad_accum", "log_every", "eval_batches"),
    "generate": ("max_new_tokens",),
}


def validate(spec: job_pb2.JobSpec, cfg: launcher_pb2.LauncherConfig) -> str:
    """The pool the job runs in, or a ConfigError naming the first bad field."""
    if not spec.name:
        raise ConfigError("name", "a job needs a name")
    if not NAME.match(spec.name):
        raise ConfigError("name", f"{spec.name!r}: use letters, digits, '.', '_', '-' (max 63)")
    if spec.kind == job_pb2.JOB_KIND_UNSPECIFIED:
        kinds = ", ".join(n for n in job_pb2.JobKind.keys() if not n.endswith("UNSPECIFIED"))
        raise ConfigError("kind", f"a job needs a kind: one of {kinds}")
    r = spec.resources
    for field in ("nodes", "gpus_per_node", "processes_per_node"):
        if getattr(r, field) < 0:
            raise ConfigError(f"resources.{field}", f"{getattr(r, field)} is negative")
    pools = {p.name: p for p in cfg.pools}
    pool_name = r.pool or cfg.default_pool
    pool = pools.get(pool_name)
    if pool is None:
        raise ConfigError("resources.pool", f"no pool {pool_name!r}; pools: {', '.join(pools)}")
    nodes = r.nodes or 1
    if nodes > pool.nodes:
        raise ConfigError(
            "resources.nodes", f"{nodes} nodes, but pool {pool.name} has {pool.nodes}"
        )
    if pool.executor == launcher_pb2.LOCAL and nodes > 1:
        raise ConfigError("resources.nodes", f"pool {pool.name} runs on one machine: use 1 node")
    if r.gpus_per_node > pool.gpus_per_node:
        raise ConfigError(
            "resources.gpus_per_node",
            f"{r.gpus_per_node} GPUs, but nodes of pool {pool.name} have {pool.gpus_per_node}",
        )
    gpus = nodes * (r.gpus_per_node or pool.gpus_per_node)
    for quota in cfg.quotas:
        if quota.team == spec.team and (
            (quota.max_nodes and nodes > quota.max_nodes)
            or (quota.max_gpus and gpus > quota.max_gpus)
        ):
            raise ConfigError(
                "resources",
                f"{nodes} nodes / {gpus} GPUs exceed team {spec.team}'s quota "
                f"({quota.max_nodes or 'any'} nodes / {quota.max_gpus or 'any'} GPUs): "
                "it could never run",
            )
    for field in ("max_attempts", "backoff_seconds", "max_backoff_seconds"):
        if getattr(spec.retry, field) < 0:
            raise ConfigError(f"retry.{field}", f"{getattr(spec.retry, field)} is negative")
    if spec.hang_timeout_seconds < 0:
        raise ConfigError("hang_timeout_seconds", f"{spec.hang_timeout_seconds} is negative")
    if pool.executor == launcher_pb2.KUBERNETES and not (spec.image or pool.kubernetes.image):
        raise ConfigError("image", f"pool {pool.name} runs containers: the job needs an image")
    if spec.image and pool.executor in (launcher_pb2.LOCAL, launcher_pb2.SLURM):
        image.check(spec.image)
        if nodes > 1 or (r.processes_per_node or 1) > 1:
            raise ConfigError(
                "image", f"pool {pool.name} runs an image as one process on one node, not torchrun"
            )
    _check_trainer(spec.trainer)
    return pool.name


def _check_trainer(trainer):
    for section, fields in POSITIVE.items():
        message = getattr(trainer, section)
        for field in fields:
            if message.HasField(field) and getattr(message, field) <= 0:
                value = getattr(message, field)
                raise ConfigError(f"trainer.{section}.{field}", f"must be positive, got {value}")
    data = trainer.data
    if data.HasField("eval_fraction") and not 0 <= data.eval_fraction < 1:
        raise ConfigError(
            "trainer.data.eval_fraction", f"must be in [0, 1), got {data.eval_fraction}"
        )
