"""Checks a submitted JobSpec: the schema's rules, then this launcher's pools and quotas.

The schema's rules (protos/validation.py) are the trainer's own: the job the launcher accepts
is the job the trainer accepts, and a broken job fails in the submit call, not hours later.
What only this launcher knows is checked here: the paths are ones its policy lets the job
use (launcher/path_policy.py), the pool exists and is big enough, the team's quota could ever
fit the job, the pool can run its image.
"""

from collections.abc import Callable

from launcher import path_policy
from launcher.executors import image
from protos import job_pb2, launcher_pb2
from protos.config_yaml import ConfigError
from protos.validation import validate_job_spec


def validate(
    spec: job_pb2.JobSpec,
    cfg: launcher_pb2.LauncherConfig,
    team_of_job: Callable[[str], str | None],
) -> str:
    """The pool the job runs in, or a ConfigError naming the first bad field. `team_of_job`
    gives a stored job's team (None: no such job), for the path policy."""
    validate_job_spec(spec)
    path_policy.check(spec, cfg, team_of_job)
    if spec.trainer.eval.allow_task_code and spec.team not in cfg.task_code_teams:
        raise ConfigError(
            "trainer.eval.allow_task_code",
            f"team {spec.team!r} may not run code from task files on this launcher "
            "(its task_code_teams; docs/eval.md)",
        )
    r = spec.resources
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
    if pool.executor == launcher_pb2.KUBERNETES:
        if not (spec.image or pool.kubernetes.image):
            raise ConfigError("image", f"pool {pool.name} runs containers: the job needs an image")
        if spec.image:  # the pool's own image is checked when the launcher starts (settings.py)
            image.check(spec.image, pulled=True)
    elif spec.image:
        image.check(spec.image)
        if nodes > 1:
            raise ConfigError(
                "image",
                f"pool {pool.name} runs an image on one node ({nodes} asked; several processes "
                "on it run under torchrun inside the image); across nodes, use a Kubernetes pool",
            )
    return pool.name
