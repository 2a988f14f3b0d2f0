"""Which files a job may name: the path policy (pure: no I/O but realpath).

Checked at submit, and again where the files are opened: a local pool's sandbox
(launcher/executors/sandbox.py) checks it when the attempt starts and mounts only the targets
it approved, so a symlink swapped in after submit leads nowhere.

A trainer runs as the launcher's user, so a path in a spec is a request to read or write with
the launcher's rights. The rules (kitchen.v1.PathPolicy in protos/launcher.proto):
1. Every path field (protos/paths.path_fields: each mixture source's input too) and an image
   given as a layout directory (`image: /...`) is absolute (`submit` makes them so).
2. Symlinks are resolved first: a link in an allowed directory that points out is refused.
3. Inside the launcher's state dir only `precook/<team>/` (the team's content-addressed
   cache; all of `precook/` for a job with no team, auth off) and `runs/<id>/...` of a job of
   the same team are allowed: never the database, the tokens file, another team's datasets
   or run directory.
4. Elsewhere, a path must lie inside one of `allowed_roots` ("{team}" and "{owner}" expanded).
   With no roots configured, any path is allowed while auth is off (one user, the embedded
   launcher: convenient), and none while auth is on (a shared launcher must say what it
   shares).
"""

import os
from collections.abc import Callable

from protos import job_pb2, launcher_pb2
from protos.config_yaml import ConfigError
from protos.paths import path_fields


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(os.path.join(root, ""))


def _expand(root: str, spec: job_pb2.JobSpec) -> str:
    return os.path.realpath(root.replace("{team}", spec.team).replace("{owner}", spec.owner))


def check(
    spec: job_pb2.JobSpec,
    cfg: launcher_pb2.LauncherConfig,
    team_of_job: Callable[[str], str | None],
) -> None:
    """A ConfigError naming the first path field the policy refuses. `cfg` is resolved;
    `team_of_job(id)` is the team of a stored job, None when there is no such job."""
    state = os.path.realpath(cfg.state_dir)
    roots = [_expand(r, spec) for r in cfg.paths.allowed_roots]
    anything = not roots and not cfg.tokens_file
    named = [(f"trainer.{where}", getattr(message, name)) for where, message, name in
             path_fields(spec.trainer)]  # fmt: skip
    if spec.image.startswith("/"):  # an OCI layout directory (else a registry reference)
        named.append(("image", spec.image))
    for field, value in named:
        if not value:
            continue
        if not os.path.isabs(value):
            raise ConfigError(field, f"{value!r} is relative: give an absolute path")
        real = os.path.realpath(value)
        if _inside(real, state):
            _check_state_path(real, state, spec.team, team_of_job, field)
        elif not anything and not any(_inside(real, root) for root in roots):
            allowed = ", ".join(roots) if roots else "none configured (paths.allowed_roots)"
            shown = value if real == value else f"{value} (-> {real})"
            raise ConfigError(field, f"{shown} is outside the directories jobs may use: {allowed}")


def _check_state_path(real, state, team, team_of_job, field) -> None:
    parts = os.path.relpath(real, state).split(os.sep)
    if parts[0] == "precook":
        if not team or parts[1:2] == [team]:
            return
        yours = os.path.join(state, "precook", team)
        raise ConfigError(field, f"{real}: the precook cache is per team: yours is {yours}")
    if parts[0] == "runs" and len(parts) >= 2:
        owner = team_of_job(parts[1])
        if owner is None:
            raise ConfigError(field, f"{real}: no job {parts[1]!r} owns that run directory")
        if owner != team:
            raise ConfigError(field, f"{real} belongs to team {owner!r}'s job, not {team!r}'s")
        return
    raise ConfigError(
        field, f"{real} is the launcher's own state: only precook/ and your team's runs/ are shared"
    )
