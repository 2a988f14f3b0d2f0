"""Hostile jobs on a real launcher with auth on: under the sandbox they read no secret, no other
team's file and no launcher state; the same job without the sandbox reads them (so the probe
can tell). Also: SIGTERM still reaches a sandboxed trainer, and a path swapped for a symlink
after submit is refused when the attempt starts."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from launcher import settings
from launcher.client import Client
from launcher.executors import sandbox
from launcher.executors.base import Launch, Status, attempt_dir
from launcher.executors.local import LocalExecutor
from launcher.testdata.harness import config, spec, started, wait_for
from protos import attempt_pb2, job_pb2, launcher_pb2, provenance
from protos.config_yaml import ConfigError
from protos.git_testing import commit_all, git, needs_git

HOSTILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "testdata", "hostile_trainer.py")
SECRET = "s3cret-the-launcher-holds-7f3a"
FINAL = (job_pb2.SUCCEEDED, job_pb2.FAILED)


@pytest.fixture
def world(tmp_path, monkeypatch):
    """Two teams' data (a link in team a's dataset points at team b's secret), a tokens file
    whose admin token holds SECRET, and SECRET in the launcher's own environment."""
    monkeypatch.setenv("KITCHEN_TOKEN", SECRET)
    data = tmp_path / "data"
    (data / "a" / "ds").mkdir(parents=True)
    (data / "b").mkdir()
    (data / "a" / "ds" / "train.txt").write_text("team a's text\n")
    (data / "b" / "secret.txt").write_text(SECRET)
    os.symlink(data / "b" / "secret.txt", data / "a" / "ds" / "link")
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        f"tokens:\n  - {{token: admin-{SECRET}, user: ops, team: infra, admin: true}}\n"
        "  - {token: tok-a, user: alice, team: a}\n  - {token: tok-b, user: bob, team: b}\n"
    )
    return tmp_path


def hostile_job(world, client, team, read, write=()):
    targets = {"read": read, "write": list(write), "secret": SECRET}
    (world / "targets.json").write_text(json.dumps(targets))  # the file the trainer is given
    s = spec(name=f"probe-{team}", team=team)
    s.trainer.data.input = str(world / "data" / team / ("ds" if team == "a" else ""))
    s.retry.max_attempts = 1
    job = wait_for(client, client.submit(s).id, FINAL)
    probe = os.path.join(job.run_dir, "probe.json")
    assert os.path.exists(probe), job
    with open(probe) as f:
        return job, json.load(f)


def cfg_of(world, mode, auth=True):
    cfg = config(world, sandbox=launcher_pb2.SandboxConfig(mode=mode))
    (world / "targets.json").write_text("{}")
    cfg.trainer_cmd[:] = [sys.executable, HOSTILE, "--targets", str(world / "targets.json")]
    cfg.paths.allowed_roots.append(str(world / "data" / "{team}"))
    if auth:
        cfg.tokens_file = str(world / "tokens.yaml")
    return cfg


def attack(world, cfg, token_a, token_b):
    with started(cfg) as (launcher, admin):
        admin.close()
        a, b = Client(launcher.address, token=token_a), Client(launcher.address, token=token_b)
        job_b, _ = hostile_job(world, b, "b", read=[])
        with open(os.path.join(job_b.run_dir, "secret.txt"), "w") as f:
            f.write(SECRET)  # team b's run holds a secret
        state = launcher.cfg.state_dir
        read = [
            str(world / "tokens.yaml"),  # the admin token
            os.path.join(state, "jobs.sqlite"),
            os.path.join(job_b.run_dir, "secret.txt"),  # another team's run
            str(world / "data" / "b" / "secret.txt"),  # another team's data
            str(world / "data" / "a" / "ds" / "link"),  # a link in an allowed dir
        ]
        write = [str(world / "data" / "a" / "ds" / "train.txt")]  # named: read-only
        job_a, probe = hostile_job(world, a, "a", read, write)
        a.close()
        b.close()
        return job_a, probe, read


def test_a_sandboxed_job_sees_no_secret_and_no_other_teams_file(world):
    cfg = cfg_of(world, launcher_pb2.SANDBOX_BWRAP)
    job, probe, read = attack(world, cfg, "tok-a", "tok-b")
    assert job.state == job_pb2.SUCCEEDED, job
    for path in read:
        assert probe["read"][path].startswith("denied"), (path, probe["read"][path])
    assert all(v.startswith("denied") for v in probe["write"].values()), probe["write"]
    assert not probe["env_has_secret"] and "KITCHEN_TOKEN" not in probe["env"]
    assert probe["proc_secret"] == [] and probe["through_proc_root"] == {}
    assert len(probe["pids_seen"]) <= 3, probe["pids_seen"]  # its own PID namespace
    assert probe["own_run_dir_writable"] == probe["cache_writable"] == "WROTE"
    assert (world / "data" / "a" / "ds" / "train.txt").read_text() == "team a's text\n"
    state = cfg.state_dir
    assert os.stat(state).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(state, "jobs.sqlite")).st_mode & 0o777 == 0o600


def test_without_the_sandbox_the_same_job_reads_them(world):
    """The control: the probe does find what is there to find (auth off: SANDBOX_NONE)."""
    cfg = cfg_of(world, launcher_pb2.SANDBOX_NONE, auth=False)
    job, probe, read = attack(world, cfg, None, None)
    assert job.state == job_pb2.SUCCEEDED, job
    assert probe["read"][read[0]].startswith("READ tokens:")
    assert probe["read"][read[3]] == "READ " + SECRET
    assert probe["read"][read[4]] == "READ " + SECRET
    assert not probe["env_has_secret"]  # the environment rule holds without the sandbox too


def test_sandbox_none_is_refused_with_auth_on(world):
    with pytest.raises(ConfigError, match="sandbox.mode"):
        settings.resolve(cfg_of(world, launcher_pb2.SANDBOX_NONE))


def _sandbox(world, team_of=lambda job_id: None) -> sandbox.Sandbox:
    resolved = settings.resolve(cfg_of(world, launcher_pb2.SANDBOX_BWRAP))
    return sandbox.Sandbox(resolved, sandbox.code_dirs(resolved, {}), team_of)


def _launch(world, code: str, team="a", data_input="") -> Launch:
    run_dir = world / "state" / "runs" / "j1"
    run_dir.mkdir(parents=True, exist_ok=True)
    job = job_pb2.Job(id="j1", attempts=1, run_dir=str(run_dir))
    job.spec.team = team
    job.spec.trainer.data.input = data_input
    handle = {"attempt_dir": attempt_dir(str(run_dir), 1), "launched_at": time.time()}
    cache = str(world / "state" / "precook" / team)
    handoff = attempt_pb2.Attempt(job_id="j1", number=1, run_dir=str(run_dir), cache_dir=cache)
    return Launch(job, handoff, [sys.executable, "-c", code], {}, handle)


def test_a_directory_swapped_for_a_link_after_submit_is_refused_at_start(world):
    real = world / "data" / "a" / "ds2"
    real.mkdir()
    box = _sandbox(world)
    launch = _launch(world, "pass", data_input=str(real))
    box.command(launch, launch.argv, {}, [])  # as submitted: fine
    real.rmdir()
    os.symlink(world / "data" / "b", real)  # swapped after submit
    with pytest.raises(ConfigError, match="trainer.data.input"):
        box.command(launch, launch.argv, {}, [])


def test_sigterm_reaches_a_sandboxed_trainer_which_checkpoints_and_exits_75(world):
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    ex = LocalExecutor([], sandbox=_sandbox(world))
    launch = _launch(world, code)
    handle, _ = ex.start(launch)
    deadline = time.monotonic() + 20
    while "ready" not in open(launch.log_path).read():
        assert time.monotonic() < deadline, open(launch.log_path).read()
        time.sleep(0.05)
    while not os.path.exists(os.path.join(launch.attempt_dir, "pid.json")):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ex.terminate(handle)
    while (seen := ex.poll({"j1": handle})["j1"]).status != Status.EXITED:
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)
    assert seen.exit_code == 75


def test_sigkill_ends_every_process_of_the_sandbox(world):
    ex = LocalExecutor([], sandbox=_sandbox(world))
    launch = _launch(world, "import time; print('ready', flush=True); time.sleep(60)")
    handle, _ = ex.start(launch)
    deadline = time.monotonic() + 20
    while "ready" not in open(launch.log_path).read():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    while not os.path.exists(os.path.join(launch.attempt_dir, "pid.json")):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pids = json.load(open(os.path.join(launch.attempt_dir, "pid.json")))
    ex.kill(handle)
    while (seen := ex.poll({"j1": handle})["j1"]).status != Status.EXITED:
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)
    assert seen.exit_code == 128 + signal.SIGKILL
    assert not os.path.exists(f"/proc/{pids['term_pid']}")


def test_an_export_job_writes_its_hf_path_and_nothing_else_it_names(world):
    out = world / "data" / "a" / "hf"  # not there yet: the launcher makes it
    code = (
        "import sys\n"
        f"open({str(out / 'config.json')!r}, 'w').write('{{}}')\n"
        "try:\n"
        f"    open({str(world / 'data' / 'a' / 'ds' / 'x')!r}, 'w')\n"
        "except OSError as e:\n"
        "    print('refused', e.strerror, flush=True)\n"
    )
    launch = _launch(world, code, data_input=str(world / "data" / "a" / "ds"))
    launch.job.spec.kind = job_pb2.EXPORT
    launch.job.spec.trainer.hf.path = str(out)
    ex = LocalExecutor([], sandbox=_sandbox(world))
    handle, _ = ex.start(launch)
    deadline = time.monotonic() + 20
    while (seen := ex.poll({"j1": handle})["j1"]).status != Status.EXITED:
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)
    assert seen.exit_code == 0, open(launch.log_path).read()
    assert (out / "config.json").read_text() == "{}"
    assert "refused Read-only file system" in open(launch.log_path).read()


def test_the_store_connection_string_file_is_one_of_the_launchers_secrets(tmp_path):
    """A dsn_file in a directory the sandbox shows (the repository's configs/, say) reads as
    /dev/null inside it, like the tokens file."""
    dsn = tmp_path / "configs" / "pg-dsn"
    cfg = launcher_pb2.LauncherConfig(tokens_file=str(tmp_path / "tokens.yaml"))
    cfg.store.postgres.dsn_file = str(dsn)
    assert sandbox.launcher_secrets(cfg) == [str(tmp_path / "tokens.yaml"), str(dsn)]


@needs_git
def test_a_sandboxed_trainer_in_a_git_worktree_records_its_commit(world):
    """The code lies in a linked work tree (`git worktree add`), whose `.git` file names a git
    dir outside it: the sandbox shows that dir too, so the trainer's provenance has the commit."""
    repo, tree = world / "repo", world / "tree"
    repo.mkdir()
    (repo / "code.py").write_text("x = 1\n")
    commit_all(repo)
    git(repo, "worktree", "add", "-q", "-b", "side", str(tree))
    assert (tree / ".git").is_file()
    head = git(tree, "rev-parse", "HEAD")
    kitchen = os.path.dirname(os.path.dirname(os.path.abspath(provenance.__file__)))
    env = {"PYTHONPATH": os.pathsep.join([str(tree), kitchen]), "PATH": "/usr/bin:/bin"}
    resolved = settings.resolve(cfg_of(world, launcher_pb2.SANDBOX_BWRAP))
    code = (
        "import dataclasses, json; from protos import provenance\n"
        f"print(json.dumps(dataclasses.asdict(provenance.code_version({str(tree / 'code.py')!r}))))"
    )
    launch = _launch(world, code)

    def version_seen(readonly: tuple[str, ...]) -> dict:
        box = sandbox.Sandbox(resolved, readonly, lambda job_id: None)
        argv = box.command(launch, launch.argv, env, [])
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    readonly = sandbox.code_dirs(resolved, env)
    git_dir = os.path.realpath(repo / ".git")
    assert git_dir in readonly
    assert version_seen(readonly) == {"commit": head, "how": f"git work tree {tree}"}
    # Without the repository's git dir (as before): git cannot read the tree, nor can we.
    hidden = tuple(p for p in readonly if p != git_dir)
    assert version_seen(hidden)["commit"] == ""
