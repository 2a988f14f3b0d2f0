"""Distributed precook (tasks.py): 4 task processes write the same bytes as one machine; a
killed task runs again alone, and finished tasks are not redone. The same job as a Slurm array
through the launcher: tests/precook_tasks_test.py."""

import json
import os
import signal

import pytest

from protos import trainer_config_pb2
from trainer.data import cli, corpus, progress, tasks, testdata
from trainer.data.precook import precook_dataset
from trainer.data.progress import reporter

say = reporter(False)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """A two-source mixture (text files, JSONL) with filters and both dedups on."""
    root = tmp_path_factory.mktemp("mix")
    testdata.write_text_corpus(str(root / "a"), n=60, seed=0)
    texts = testdata.write_text_corpus(str(root / "b-texts"), n=40, seed=5)
    testdata.write_jsonl(str(root / "b.jsonl"), [{"body": t} for t in texts + texts[:5]])
    cfg = testdata.data_config(dedup_exact=True, near_dup_threshold=0.8, min_doc_tokens=8)
    cfg.sources.add(name="a", input=str(root / "a"), weight=3)
    cfg.sources.add(name="b", input=str(root / "b.jsonl"), format=trainer_config_pb2.JSONL,
                    text_field="body", token_budget=4000)  # fmt: skip
    return cfg


@pytest.fixture(autouse=True)
def small_units(monkeypatch):
    """Units of ~4 kB (not 1 MB), so that each of 4 tasks gets several."""
    monkeypatch.setattr(corpus, "UNIT_BYTES", 4096)


def tree(path: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(path):
        for n in names:
            full = os.path.join(dirpath, n)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


@pytest.fixture(scope="module")
def one_machine(mixture, tmp_path_factory):
    """The dataset precooked in one process (with the default 1 MB units: the unit size must
    not change a byte)."""
    ds = precook_dataset(mixture, str(tmp_path_factory.mktemp("one")), show_progress=False)
    m = ds.manifest
    assert m.curation is not None and m.sources is not None
    assert m.curation.deduplicated.exact_duplicates == 5  # b's repeated lines
    assert set(m.sources) == {"a", "b"}
    return tree(ds.path)


def test_four_processes_match_one_machine_and_a_killed_task_reruns_alone(
    mixture, one_machine, tmp_path
):
    job = tasks.prepare(mixture, str(tmp_path), 4, say)
    assert all(len(job.units_of(i)) >= 2 for i in range(4)), "every task must have work"
    killed: list[int] = []

    def kill_task_2_once(index, proc):
        if index == 2 and not killed:
            proc.send_signal(signal.SIGKILL)  # a real kill of the running task process
            killed.append(proc.pid)

    attempts = tasks.run_local(job, retries=1, on_start=kill_task_2_once)
    assert killed and attempts == {0: 1, 1: 1, 2: 2, 3: 1}
    parts = {i: os.stat(job.part(i)).st_mtime_ns for i in range(4)}
    assert tasks.run_local(job) == {0: 0, 1: 0, 2: 0, 3: 0}  # finished: nothing redone
    assert {i: os.stat(job.part(i)).st_mtime_ns for i in range(4)} == parts
    ds = tasks.merge(job, str(tmp_path), say)
    assert tree(ds.path) == one_machine
    assert not os.path.exists(job.directory)


def test_merge_refuses_a_job_with_a_missing_part(mixture, tmp_path):
    job = tasks.prepare(mixture, str(tmp_path), 4, say)
    assert tasks.run_task(job.directory, 0) and not tasks.run_task(job.directory, 0)
    with pytest.raises(tasks.TaskError, match=r"tasks \[1, 2, 3\] have not finished"):
        tasks.merge(job, str(tmp_path), say)


class TenSecondsACall:
    """A clock for trainer/data/progress.py whose every reading is 10 s after the last: the
    progress line is due after every unit."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 10.0
        return self.now


def test_a_running_task_logs_its_units_for_the_launchers_hang_detector(
    mixture, tmp_path, monkeypatch, capsys
):
    job = tasks.prepare(mixture, str(tmp_path), 2, say)
    monkeypatch.setattr(progress, "time", TenSecondsACall())
    assert tasks.run_task(job.directory, 1)
    units = job.units_of(1)
    records = sum(job.plan.units[u].n_records for u in units)
    lines = capsys.readouterr().err.splitlines()
    # One line after each unit, then the final one, each with the records read so far.
    assert len(units) > 1 and len(lines) == len(units) + 1
    assert all(ln.startswith("  task 1: tokenize  ") for ln in lines)
    assert f"  {records:,}/{records:,} records (100%)" in lines[-1]


def test_two_runs_of_one_task_at_once_leave_one_whole_part(mixture, tmp_path, monkeypatch):
    """A second run of task 0 starts and finishes while the first is between units (an
    orphaned Slurm step beside its retry): each writes its own directory, the first to finish
    renames it to the part, the other finds the part there and discards its own."""
    job = tasks.prepare(mixture, str(tmp_path), 2, say)
    n = len(job.units_of(0))
    save = tasks._save_result
    inner: list[bool | None] = []  # what the second run returned

    def save_then_race(path, result):
        save(path, result)
        if not inner:  # the outer run's first unit is written: the second run goes now
            inner.append(None)  # before the call: the second run saves units too
            inner[0] = tasks.run_task(job.directory, 0)

    monkeypatch.setattr(tasks, "_save_result", save_then_race)
    assert n > 1 and tasks.run_task(job.directory, 0) is False  # the inner run finished first
    assert inner == [True]
    parts = os.path.dirname(job.part(0))
    assert sorted(os.listdir(parts)) == [os.path.basename(job.part(0))]  # no directory left
    assert len(os.listdir(job.part(0))) == n


def test_precook_build_tasks_flag_runs_local_tasks_to_the_same_dataset(tmp_path, capsys):
    root = str(tmp_path / "corpus")
    testdata.write_text_corpus(root, n=30, seed=3)
    flags = ["--input", root, "--vocab-size", "300", "--seq-len", "64", "--workers", "1"]
    flags += ["--eval-fraction", "0.1", "--cache-dir", str(tmp_path / "cache"), "--json"]
    assert cli.main(["build", *flags, "--tasks", "3"]) == 0
    built = json.loads(capsys.readouterr().out)
    one = precook_dataset(testdata.data_config(input=root), str(tmp_path / "one"))
    assert os.path.basename(built["path"]) == os.path.basename(one.path)
    assert tree(built["path"]) == tree(one.path)
    assert cli.main(["build", *flags, "--tasks", "0"]) == 2
    assert "--tasks (data.tasks): 0 is not in" in capsys.readouterr().err
