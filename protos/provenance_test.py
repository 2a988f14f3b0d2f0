"""provenance.json: the commit of a real git work tree (clean, then dirty), a dataset's digest,
and each attempt's commit kept in order."""

import json
import os

from protos import provenance
from protos.git_testing import commit_all, git, needs_git
from protos.provenance import CodeVersion


@needs_git
def test_the_commit_of_the_work_tree_holding_the_code(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    source = repo / "pkg" / "code.py"
    source.write_text("x = 1\n")
    head = commit_all(repo)
    link = tmp_path / "runfiles" / "code.py"  # as Bazel's runfiles link to the source tree
    link.parent.mkdir()
    link.symlink_to(source)
    assert provenance.code_version(str(link)) == CodeVersion(head, f"git work tree {repo}")
    source.write_text("x = 2\n")
    assert provenance.code_version(str(link)).commit == f"{head}-dirty"
    (repo / "pkg" / "untracked.py").write_text("")  # untracked files do not make it dirty
    source.write_text("x = 1\n")
    assert provenance.code_version(str(link)).commit == head


@needs_git
def test_code_outside_a_work_tree_is_unknown_and_says_why(tmp_path):
    (tmp_path / "code.py").write_text("")
    version = provenance.code_version(str(tmp_path / "code.py"))
    assert version.commit == ""
    assert version.how.startswith(f"unknown: {tmp_path}: fatal: not a git repository")


def test_attempts_and_dataset_are_recorded(tmp_path):
    dataset = tmp_path / "datasets" / "best_fit-64-abc"
    dataset.mkdir(parents=True)
    (dataset / "manifest.json").write_text(json.dumps({"key": "f00d", "format": 1}))
    run = str(tmp_path / "run")
    os.makedirs(run)
    assert provenance.read(run) == {}
    provenance.record_code(run, 1, CodeVersion("aaa", "git work tree /src"))
    provenance.record_dataset(run, str(dataset))
    provenance.record_code(run, 2, CodeVersion("aaa", "git work tree /src"))  # a retry
    provenance.record_code(run, 3, CodeVersion("bbb-dirty", "git work tree /src"))
    facts = provenance.read(run)
    assert [(c["commit"], c["attempt"]) for c in facts["code"]] == [("aaa", 1), ("bbb-dirty", 3)]
    assert facts["dataset"] == {"path": str(dataset), "digest": "f00d"}
    assert provenance.dataset_digest(str(tmp_path)) == ""  # no manifest: no digest claimed


@needs_git
def test_git_dirs_of_a_linked_work_tree(tmp_path):
    repo, tree = tmp_path / "repo", tmp_path / "tree"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "code.py").write_text("")
    commit_all(repo)
    git(repo, "worktree", "add", "-q", "-b", "side", str(tree))
    assert provenance.git_dirs(str(repo / "pkg" / "code.py")) == []  # .git is inside the tree
    assert provenance.git_dirs(str(tree / "pkg" / "code.py")) == [
        str(repo / ".git" / "worktrees" / "tree"),
        str(repo / ".git"),
    ]
    assert provenance.git_dirs(str(tmp_path)) == []  # no work tree
