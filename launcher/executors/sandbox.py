"""Local-pool attempts run under bubblewrap: a job sees its own files and nothing of the launcher's.

`Sandbox.command(launch, argv, env, gpus)` is the bwrap command around a trainer argv. Mounts, in
this order (a later one covers an earlier one):
1. read-only: the system (/usr, /bin, /lib*, /etc), the trainer's code (each PYTHONPATH entry,
   the Python installation, the trainer and torchrun commands' files, the directories a
   Bazel runfiles tree links into, and the git directories of a linked work tree holding any
   of these, for the commit in provenance.json) and `sandbox.readonly`;
2. the launcher's state dir as an empty tmpfs, and its secret files (tokens_file, tls_key, the
   metrics token, the PostgreSQL store's dsn_file) as /dev/null, wherever step 1 made them
   visible;
3. writable: the attempt's precook cache dir, the job's run directory and an EXPORT job's
   hf.path; /tmp is the attempt's own `tmp/` (mounted first of all);
4. read-only: the launcher's TLS root certificate (public), and each path the spec names,
   checked against the path policy again now (symlinks resolved now, not at submit) and bound
   at the target it resolves to: a link placed in an allowed directory, or a directory
   swapped for a link after submit, leads nowhere, because only the checked target is in the
   sandbox;
5. a fresh /proc in a new PID namespace (no other process is visible, so no
   /proc/<pid>/environ or /proc/<pid>/root of the launcher), a minimal /dev with the attempt's
   GPUs' device nodes only, no capabilities, no new privileges, a new IPC and UTS namespace.
The environment is base.job_env's (bwrap --clearenv). The network is the host's: the trainer
reports to the launcher over it. docs/launcher.md says what this does and does not stop.
"""

import dataclasses
import os
import sys
from collections.abc import Callable

from launcher import path_policy
from launcher.executors.base import Launch
from protos import job_pb2, launcher_pb2, provenance
from protos.paths import path_fields
from tools.oci import gpus as gpu_nodes

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")
RUNFILES = ".runfiles"


@dataclasses.dataclass(frozen=True)
class Sandbox:
    cfg: launcher_pb2.LauncherConfig  # resolved
    readonly: tuple[str, ...]  # step 1, computed once (code_dirs)
    team_of_job: Callable[[str], str | None]  # for the path policy (None: no such job)

    def command(self, launch: Launch, argv: list, env: dict, gpus: list[int]) -> list:
        """The bwrap argv running `argv` for `launch` (its spec's paths checked again: a
        ConfigError names the first the policy now refuses)."""
        spec = launch.job.spec
        path_policy.check(spec, self.cfg, self.team_of_job)
        out = ["bwrap", "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        out += ["--unshare-cgroup-try", "--cap-drop", "ALL"]
        tmp = os.path.join(launch.attempt_dir, "tmp")
        os.makedirs(tmp, exist_ok=True)
        out += ["--bind", tmp, "/tmp"]  # first: code, the run dir, ... may lie under /tmp
        for path in self.readonly:
            out += ["--ro-bind", path, path]
        for link in SYSTEM_DIRS:  # /lib64 -> usr/lib64 (where ld.so is looked for), /bin, ...
            if os.path.islink(link):
                out += ["--symlink", os.readlink(link), link]
        state = os.path.realpath(self.cfg.state_dir)
        if any(_inside(state, p) for p in self.readonly):
            out += ["--tmpfs", state]
        for secret in launcher_secrets(self.cfg):
            if any(_inside(secret, p) for p in self.readonly):
                out += ["--ro-bind", "/dev/null", secret]
        writable = [launch.attempt.cache_dir, launch.job.run_dir, *_outputs(spec)]
        for path in dict.fromkeys(writable):
            os.makedirs(path, exist_ok=True)
            out += ["--bind", os.path.realpath(path), path]
        named = [getattr(message, name) for _, message, name in path_fields(spec.trainer)]
        for path in [*named, launch.attempt.tls_ca]:  # the CA: to check the launcher's cert
            if path and os.path.exists(path) and not any(_inside(path, w) for w in writable):
                out += ["--ro-bind", os.path.realpath(path), path]
        out += ["--proc", "/proc", "--dev", "/dev"]
        for node in gpu_nodes.device_nodes(gpus) if gpus else ():
            out += ["--dev-bind", node.path, node.path]
        if gpus:  # only these GPUs exist inside, numbered 0..k-1: host indices would miss
            env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
        out += ["--chdir", launch.job.run_dir, "--clearenv"]
        for key, value in sorted(env.items()):
            out += ["--setenv", key, value]
        return [*out, "--", *argv]


def _outputs(spec: job_pb2.JobSpec) -> list[str]:
    """The paths a spec names for the job to write (besides its run dir and cache dir)."""
    if spec.kind == job_pb2.EXPORT and spec.trainer.hf.path:
        return [spec.trainer.hf.path]
    return []


def launcher_secrets(cfg: launcher_pb2.LauncherConfig) -> list[str]:
    """The launcher's own secret files, resolved: never readable in a sandbox."""
    files = (
        cfg.tokens_file, cfg.tls_key, cfg.exposure.metrics_token_file,
        cfg.store.postgres.dsn_file,
    )  # fmt: skip
    return [os.path.realpath(f) for f in files if f]


def code_dirs(cfg: launcher_pb2.LauncherConfig, env: dict) -> tuple[str, ...]:
    """Step 1's directories: what a trainer started with `env` needs to run, none inside
    another (a path that does not exist here is left out)."""
    wanted = [*SYSTEM_DIRS, sys.prefix, sys.base_prefix, *cfg.sandbox.readonly]
    wanted.append(os.path.dirname(os.path.realpath(sys.executable)))
    wanted += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for arg in [*cfg.trainer_cmd, *cfg.torchrun_cmd]:
        if os.path.isabs(arg) and os.path.exists(arg):
            wanted += [arg, arg + RUNFILES]
    for path in list(wanted):
        if RUNFILES in path and os.path.isdir(path):
            wanted += _link_roots(path)
    found = [p for p in wanted if os.path.exists(p)]
    # Code in a linked git work tree: its git dirs lie outside it, and without them the
    # trainer's provenance.json says "commit unknown" (protos/provenance.py).
    found += [d for p in list(found) for d in provenance.git_dirs(p) if os.path.exists(d)]
    linked = {p for p in SYSTEM_DIRS if os.path.islink(p)}  # made links in the sandbox too
    # Each at its own path and at its target: a link to it, or through it, resolves in the
    # sandbox as it does here (Bazel's sandboxes link whole runfiles trees).
    named = [os.path.abspath(p) for p in found if p not in linked]
    return _outermost([*named, *map(os.path.realpath, found)])


def _link_roots(runfiles: str) -> list[str]:
    """Where a Bazel runfiles tree's symlinks point, as roots: `<tree>/ws/pkg/f.py` linking to
    `/src/pkg/f.py` gives `/src` (the tree's relative path stripped), else the link's dir."""
    top = runfiles[: runfiles.index(RUNFILES) + len(RUNFILES)]
    roots = set()
    for where, dirs, files in os.walk(runfiles):
        for name in dirs + files:
            link = os.path.join(where, name)
            if not os.path.islink(link):
                continue
            rel = os.path.relpath(link, top).split(os.sep, 1)[-1]  # without the workspace
            for target in _hops(link):  # each link of a chain must resolve in the sandbox
                root = target[: -len(rel) - 1] if target.endswith(os.sep + rel) else ""
                roots.add(root or os.path.dirname(target))
    return sorted(roots)


def _hops(link: str) -> list[str]:
    """Every path a chain of symlinks passes through, up to its final target."""
    hops, seen = [], 0
    while os.path.islink(link) and seen < 40:
        link = os.path.join(os.path.dirname(link), os.readlink(link))
        hops.append(os.path.normpath(link))
        seen += 1
    return [*hops, os.path.realpath(link)]


def _outermost(paths) -> tuple[str, ...]:
    kept: list[str] = []
    for path in sorted(set(paths) - {"/", "/tmp"}):  # everything; another job's /tmp
        if not any(_inside(path, k) for k in kept):
            kept.append(path)
    return tuple(kept)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(os.path.join(root, ""))
