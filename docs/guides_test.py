"""Every command in the guides runs, in the guides' order, in one fresh workspace: the guides
cannot rot.

Each ```sh block of the guides below is read line by line (a trailing backslash continues a
line; blank lines and comment lines are ignored):
- `./bazel run //pkg:target [-- ARGS]` runs that binary from this test's runfiles with ARGS, the
  way `bazel run` does: working directory in the runfiles, BUILD_WORKING_DIRECTORY and
  BUILD_WORKSPACE_DIRECTORY = a temporary copy of the workspace (its configs/), no KITCHEN_*
  variables, so state lands in that copy's `.state/` as it would in a checkout;
- a trailing `# exits N` expects exit code N instead of 0;
- a trailing `# keeps running...` starts a server in the background, waits until it prints
  "serving on", and stops it with SIGINT (Ctrl-C) at the end of its guide, expecting exit 0;
- a trailing `# not run by the test: WHY` skips the line; a skipped `./bazel run` line is
  still checked: a known target, and its `--config` file exists (and parses, for a job);
- any other line fails the test.

What it cannot catch: the binaries run from this test's one runfiles tree, so a binary that
lacks a data dependency of its own (a file it finds in its runfiles under `bazel run`) can pass
here and fail for a user.
"""

import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from protos.config_yaml import ConfigError, load_job_spec

# In the order a newcomer follows them (docs/README.md): later guides use what earlier ones left.
GUIDES = (
    "README.md",
    "precook.md",
    "pretrain.md",
    "sft.md",
    "eval.md",
    "generate.md",
    "launcher.md",
    "serve.md",
    "images.md",
    "precook_scale.md",
    "parallelism.md",
    "reliability.md",
    "moe.md",
    "rlhf.md",
    "interop.md",
    "vlm.md",
    "observability.md",
)
# Each test target (docs/BUILD.bazel, GUIDE_GROUPS) runs one group: the guides a group's last
# ones need, in the order above, in one fresh workspace. A guide that only needs the precooked
# data, or the pretraining and SFT checkpoints, replays just those guides, so the groups run in
# parallel and a slow guide fails alone. Job ids stay those of the full path: the replayed
# guides are its prefix, and the guides after them start their jobs by hand
# (`//trainer:train --run-dir`). The rlhf and interop groups start from the workspace that
# docs/BUILD.bazel's guides_prefix action left after running their first guides the same way
# (GUIDES_PREFIX): trained once.
GROUPS = {
    # README to the launcher, the walkthrough; serve.md runs in the launcher guide's launcher
    # (its job is j3 there, after launcher.md's j1 and j2); observability.md reports on the
    # pretraining run.
    "path": (*GUIDES[:9], "observability.md"),
    "reliability": ("precook.md", "reliability.md"),
    "rlhf": ("precook.md", "pretrain.md", "sft.md", "rlhf.md"),
    # precook_scale.md's commands are all checked, not run (a corpus path, or 30 minutes).
    "moe": ("precook.md", "precook_scale.md", "moe.md"),
    "interop": ("precook.md", "pretrain.md", "sft.md", "interop.md"),
    "vlm": ("vlm.md",),  # its own synthetic scenes, text model and stages
    "parallelism": ("parallelism.md",),
}
GROUP = os.environ.get("GUIDE_GROUP", "path")
# Targets a guide names on a skipped line that these tests do not build (the cost is named);
# each is built and run by the test beside it.
UNBUILT_TARGETS = {
    "//images:push_trainer": "the 600 MB trainer image; //images:push_images_test runs it",
    "//images:push_trainer_cuda": "the 3.2 GB CUDA image (manual); image_bench.py pushes it",
    "//trainer/bench:packing_throughput_bench": "a benchmark: ~30 min on 2 CPUs",
    "//trainer/bench:speculative_bench": "a benchmark: trains two models, ~15 min on 2 CPUs",
}
JOB_TARGETS = ("//launcher:submit", "//trainer:train")
COMMAND_TIMEOUT_S = 600
READY = "serving on"

# Under Bazel, the runfiles (a test's, or guides_prefix's as a build action); outside it
# (GUIDE_BINARIES set by hand), the checkout.
if os.environ.get("TEST_SRCDIR") or os.environ.get("RUNFILES_DIR"):
    RUNFILES = Path(os.environ.get("TEST_SRCDIR") or os.environ["RUNFILES_DIR"]) / "kitchen"
else:
    RUNFILES = Path(__file__).resolve().parent.parent
DOCS = RUNFILES / "docs"


@dataclasses.dataclass
class Command:
    guide: str
    line: int
    text: str
    comment: str

    @property
    def where(self) -> str:
        return f"docs/{self.guide}:{self.line}"


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) at the first `#` outside quotes that starts a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1 :].strip()
    return line.strip(), ""


def commands_in(guide: str, text: str) -> list[Command]:
    out, block, pending, start = [], False, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            block = stripped == "```sh"
            continue
        if not block:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        code, comment = split_comment(pending + stripped)
        pending = ""
        if code:
            out.append(Command(guide, start, code, comment))
    return out


def canonical(label: str) -> str:
    """`//pkg` is `//pkg:pkg`, as Bazel reads it."""
    return label if ":" in label else f"{label}:{label.rsplit('/', 1)[-1]}"


def binaries() -> dict:
    """Label -> executable, from GUIDE_BINARIES ("//a:b=path //c:d=path", paths relative to
    the runfiles' workspace dir), which docs/BUILD.bazel fills with $(rootpath ...)."""
    spec = os.environ.get("GUIDE_BINARIES", "")
    pairs = (item.split("=", 1) for item in spec.split())
    return {canonical(label): str(RUNFILES / path) for label, path in pairs}


def parse_bazel_run(command: Command) -> tuple[str, list]:
    """(label, args) of `./bazel run //pkg:target -- args`; fails on anything else."""
    words = shlex.split(command.text)
    if words[:2] != ["./bazel", "run"] or len(words) < 3:
        pytest.fail(
            f"{command.where}: `{command.text}` is not a `./bazel run` command: mark it "
            "`# not run by the test: <why>`"
        )
    label = canonical(words[2])
    rest = words[3:]
    if rest and rest[0] != "--":
        pytest.fail(f"{command.where}: Bazel flags after the target are not supported: {rest}")
    return label, rest[1:]


def expected_exit(command: Command) -> int:
    found = re.search(r"\bexits (\d+)", command.comment)
    return int(found.group(1)) if found else 0


def config_arg(args: list) -> str:
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return ""


def new_workspace(path: Path) -> Path:
    """A stand-in for the checkout: the configs a guide names, nothing else."""
    shutil.copytree(RUNFILES / "configs", path / "configs")
    return path


def guide_env(workspace: Path) -> dict:
    """The environment `./bazel run` gives a binary run from `workspace`, no KITCHEN_*."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("KITCHEN_")}
    out.update(BUILD_WORKING_DIRECTORY=str(workspace), BUILD_WORKSPACE_DIRECTORY=str(workspace))
    return out


def prefix_guides() -> list[str]:
    """The guides the GUIDES_PREFIX tarball's action ran (docs/BUILD.bazel PREFIX_GUIDES): this
    group's first ones, whose workspace it starts from instead of running them again."""
    if not os.environ.get("GUIDES_PREFIX"):
        return []
    guides = os.environ["GUIDES_PREFIX_GUIDES"].split()
    assert list(GROUPS[GROUP][: len(guides)]) == guides, (GROUP, guides)
    return guides


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    ws = tmp_path_factory.mktemp("checkout")
    if prefix_guides():
        from trainer.testing import unpack_tree  # imports torch: only the groups that need it

        return unpack_tree(Path(os.environ["GUIDES_PREFIX"]), ws)
    return new_workspace(ws)


@pytest.fixture(scope="module")
def env(workspace):
    return guide_env(workspace)


@pytest.fixture(scope="module")
def outcomes():
    return {}


def log_dir() -> Path:
    out = Path(os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR") or os.environ.get("TMPDIR", "/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def check_skipped(command: Command, workspace: Path, known: dict) -> None:
    reason = command.comment.split("not run by the test:", 1)[1].strip()
    assert reason, f"{command.where}: say why the line is not run"
    if not command.text.startswith("./bazel run "):
        return
    label, args = parse_bazel_run(command)
    assert label in known or label in UNBUILT_TARGETS, (
        f"{command.where}: {label} is not a data dependency of this test"
    )
    config = config_arg(args)
    if config:
        path = workspace / config
        assert path.is_file(), f"{command.where}: {config} does not exist"
        if label in JOB_TARGETS:
            try:
                load_job_spec(str(path))
            except ConfigError as e:
                pytest.fail(f"{command.where}: {e}")


def start_server(command: Command, argv: list, env: dict, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, cwd=RUNFILES, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal gives it
        )  # fmt: skip
    deadline = time.monotonic() + 120
    while READY not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            pytest.fail(f"{command.where}: `{command.text}` exited {proc.returncode}:\n{tail(log)}")
        if time.monotonic() > deadline:
            stop_server(proc)
            pytest.fail(f"{command.where}: no '{READY}' within 120 s:\n{tail(log)}")
        time.sleep(0.2)
    return proc


def stop_server(proc: subprocess.Popen) -> int:
    """Ctrl-C: SIGINT to its process group; SIGKILL if it has not stopped after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def run_guide(guide: str, workspace: Path, env: dict) -> list[str]:
    known = binaries()
    commands = commands_in(guide, (DOCS / guide).read_text())
    assert commands, f"docs/{guide} has no ```sh commands"
    servers, report = [], []
    try:
        for n, command in enumerate(commands, 1):
            if "not run by the test:" in command.comment:
                check_skipped(command, workspace, known)
                continue
            label, args = parse_bazel_run(command)
            assert label in known, (
                f"{command.where}: {label} is not a data dependency of //docs:guides_test "
                "(add it to GUIDE_BINARIES in docs/BUILD.bazel)"
            )
            log = log_dir() / f"{guide[:-3]}-{n:02d}.log"
            argv = [known[label], *args]
            if "keeps running" in command.comment:
                servers.append((command, start_server(command, argv, env, log)))
                report.append(f"{command.where}: started `{command.text}`")
                continue
            began = time.monotonic()
            with open(log, "wb") as out:
                try:
                    code = subprocess.run(
                        argv, cwd=RUNFILES, env=env, stdout=out, stderr=subprocess.STDOUT,
                        timeout=COMMAND_TIMEOUT_S,
                    ).returncode  # fmt: skip
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{command.where}: over {COMMAND_TIMEOUT_S} s:\n{tail(log)}")
            seconds = time.monotonic() - began
            report.append(f"{command.where}: exit {code} in {seconds:.1f} s: {command.text}")
            assert code == expected_exit(command), (
                f"{command.where}: `{command.text}` exited {code}, the guide says "
                f"{expected_exit(command)}:\n{tail(log)}"
            )
    finally:
        for command, proc in servers:
            code = stop_server(proc)
            report.append(f"{command.where}: Ctrl-C, exit {code}: {command.text}")
    for command, proc in servers:
        assert proc.returncode == 0, f"{command.where}: exited {proc.returncode} on Ctrl-C"
    return report


def test_each_guide_is_run_here_or_says_where():
    with_commands = {p.name for p in DOCS.glob("*.md") if "```sh" in p.read_text()}
    assert with_commands == set(GUIDES)


def test_markers_are_understood():
    text = (
        "```sh\n./bazel run //a:b -- --config 'x # y' # exits 3\n"
        "./bazel run //c -- \\\n  --flag   # keeps running\n```\n"
        "```text\nnot a command\n```\n"
    )
    first, second = commands_in("g.md", text)
    assert (first.line, first.comment, expected_exit(first)) == (2, "exits 3", 3)
    assert parse_bazel_run(first) == ("//a:b", ["--config", "x # y"])
    assert (second.line, second.comment) == (3, "keeps running")
    assert parse_bazel_run(second) == ("//c:c", ["--flag"])
    (unmarked,) = commands_in("g.md", "```sh\ncat x.log\n```\n")
    with pytest.raises(pytest.fail.Exception, match="not run by the test"):
        parse_bazel_run(unmarked)


def test_guides_run_in_the_reading_order():
    """GUIDES is docs/README.md's reading path: the test replays what a newcomer does."""
    table = re.findall(r"^\| \d+ \| \[([\w.]+)\]", (DOCS / "README.md").read_text(), re.M)
    assert ["README.md", *table] == list(GUIDES)


def test_every_guide_runs_in_a_group_in_path_order():
    if os.environ.get("GUIDE_GROUPS"):  # docs/BUILD.bazel makes one target per group
        assert os.environ["GUIDE_GROUPS"].split() == list(GROUPS)
    in_groups = {g for group in GROUPS.values() for g in group}
    assert in_groups == set(GUIDES), set(GUIDES) ^ in_groups
    for name, group in GROUPS.items():
        assert list(group) == sorted(group, key=GUIDES.index), f"{name}: not in GUIDES order"


@pytest.mark.parametrize("guide", GROUPS[GROUP])
def test_guide_commands_run(guide, workspace, env, outcomes):
    if not os.environ.get("GUIDE_BINARIES"):
        pytest.skip("needs the binaries: ./bazel test //docs:guides_test")
    group = GROUPS[GROUP]
    failed = [g for g in group[: group.index(guide)] if outcomes.get(g) is not True]
    if failed:
        pytest.skip(f"follows {', '.join(failed)}, which did not pass")
    if guide in prefix_guides():
        outcomes[guide] = True
        pytest.skip(f"run by the action that built {os.environ['GUIDES_PREFIX']}")
    outcomes[guide] = False
    report = run_guide(guide, workspace, env)
    with open(log_dir() / "summary.txt", "a") as f:  # each command's time, beside its log
        f.write("\n".join(report) + "\n")
    outcomes[guide] = True


def test_state_landed_where_the_guides_look(workspace, outcomes):
    """With no KITCHEN_STATE_DIR, state goes to .state/ in the workspace: the paths the
    guides print and use (.state/runs/j2/checkpoints/...) are a user's."""
    if GROUP != "path" or not all(outcomes.get(g) for g in GROUPS[GROUP]):
        pytest.skip("the path's guides did not all run here")
    assert (workspace / ".state/runs/j2/checkpoints/step_00000080/model.pt").is_file()
    assert (workspace / ".state/launcher/jobs.sqlite").is_file()
