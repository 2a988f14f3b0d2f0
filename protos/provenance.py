"""What a run ran, beyond its spec: the code's git commit and the precooked dataset's digest.

The trainer's rank 0 records them in `<run dir>/provenance.json` as it learns them (the code at
start, every attempt; the dataset once precooked); the launcher turns them into the MLflow
run's tags (launcher/tracking/records.py) and `kitchen diff` shows them, both from the run
directory, as they read checkpoints' digests.

How the commit is known: from the trainer's own source files. Under `bazel run` (//launcher:
submit, //trainer:train) Bazel's runfiles link to the files of the source tree, and run by
hand (`tools/py -m trainer.main`) they are those files: either way they lie in a git work
tree, and `git rev-parse HEAD` there is the commit, with "-dirty" when tracked files differ
from it (as tools/oci/workspace_status.sh stamps images). In an image there is no work tree:
the commit is recorded as unknown, with why, and the image's digest names the code instead.

A linked work tree (`git worktree add`) keeps its git directory elsewhere: its `.git` is a file
naming it (`git_dirs`). A sandbox that shows a trainer only its code must show those
directories too (launcher/executors/sandbox.py does, read-only), or git cannot answer there.
"""

import dataclasses
import json
import os
import subprocess

from protos.files import write_json_atomic
from protos.paths import PRECOOK_MANIFEST

PROVENANCE_FILE = "provenance.json"
GIT_TIMEOUT_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class CodeVersion:
    commit: str  # "<sha>" or "<sha>-dirty"; "" when unknown
    how: str  # where it was read, or why it is unknown


def _git(directory: str, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", directory, *args],
        capture_output=True, text=True, timeout=GIT_TIMEOUT_SECONDS, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def code_version(source: str = __file__) -> CodeVersion:
    """The commit of the work tree that holds `source` (this file: Kitchen's own code)."""
    directory = os.path.dirname(os.path.realpath(source))
    try:
        commit = _git(directory, "rev-parse", "HEAD")
        dirty = _git(directory, "status", "--porcelain", "--untracked-files=no")
        top = _git(directory, "rev-parse", "--show-toplevel")
    except OSError as err:  # no git installed, or not runnable here
        return CodeVersion("", f"unknown: cannot run git for {directory}: {err.strerror}")
    except subprocess.TimeoutExpired:
        return CodeVersion("", f"unknown: git in {directory} took over {GIT_TIMEOUT_SECONDS:g} s")
    except subprocess.CalledProcessError as err:
        why = (err.stderr or "").strip().splitlines()
        return CodeVersion("", f"unknown: {directory}: {why[0] if why else 'not a git work tree'}")
    return CodeVersion(f"{commit}-dirty" if dirty else commit, f"git work tree {top}")


def git_dirs(path: str) -> list[str]:
    """The git directories outside its work tree that git reads for the tree holding `path`:
    for a linked work tree, the directory its `.git` file names and that one's `commondir`
    (the repository's shared one). [] for an ordinary tree (`.git` is a directory inside it),
    for no work tree at all, and for a `.git` file that cannot be read (git says why later)."""
    directory = os.path.realpath(path)
    if not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    while not os.path.lexists(os.path.join(directory, ".git")):
        parent = os.path.dirname(directory)
        if parent == directory:
            return []
        directory = parent
    dot_git = os.path.join(directory, ".git")
    if os.path.isdir(dot_git):
        return []
    try:
        with open(dot_git, encoding="utf-8") as f:
            first = f.readline().strip()
    except (OSError, UnicodeDecodeError):
        return []
    if not first.startswith("gitdir:"):
        return []
    gitdir = os.path.realpath(os.path.join(directory, first[len("gitdir:") :].strip()))
    found = [gitdir]
    try:
        with open(os.path.join(gitdir, "commondir"), encoding="utf-8") as f:
            found.append(os.path.realpath(os.path.join(gitdir, f.read().strip())))
    except (OSError, UnicodeDecodeError):
        pass  # a submodule's git dir has no commondir: it is the whole repository
    return found


def dataset_digest(dataset_dir: str) -> str:
    """A precooked dataset's digest: its content-addressed cache key (trainer/data/cache.py:
    every input byte, the tokenizer and the parameters), from its manifest; "" if none."""
    try:
        with open(os.path.join(dataset_dir, PRECOOK_MANIFEST), encoding="utf-8") as f:
            key = json.load(f).get("key", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return key if isinstance(key, str) else ""


def read(run_dir: str) -> dict:
    """The run's provenance.json, {} when there is none (a run from before it, or damaged)."""
    try:
        with open(os.path.join(run_dir, PROVENANCE_FILE), encoding="utf-8") as f:
            facts = json.load(f)
    except (OSError, ValueError):
        return {}
    return facts if isinstance(facts, dict) else {}


def record_code(run_dir: str, attempt: int, version: CodeVersion) -> None:
    """At a process's start: `code` lists each commit the run's attempts ran, in order."""
    facts = read(run_dir)
    code = [c for c in facts.get("code", []) if isinstance(c, dict)]
    if not code or code[-1].get("commit") != version.commit:
        code.append({**dataclasses.asdict(version), "attempt": attempt})
    write_json_atomic(os.path.join(run_dir, PROVENANCE_FILE), {**facts, "code": code})


def record_dataset(run_dir: str, dataset_dir: str) -> None:
    """Once precooked: the dataset the run reads, and its digest."""
    facts = read(run_dir)
    dataset = {"path": dataset_dir, "digest": dataset_digest(dataset_dir)}
    write_json_atomic(os.path.join(run_dir, PROVENANCE_FILE), {**facts, "dataset": dataset})
