"""Real git repositories for the provenance tests (protos/provenance_test.py and the sandbox's,
launcher/executors/sandbox_test.py): git itself, run with a fixed identity."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(repo: Path, *args: str) -> str:
    """`git -C repo ARGS`'s output, stripped; an error if it fails."""
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t")
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env
    ).stdout.strip()


def commit_all(repo: Path) -> str:
    """Makes `repo` (its files already written) a repository with one commit of them all;
    returns that commit."""
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "one")
    return git(repo, "rev-parse", "HEAD")
