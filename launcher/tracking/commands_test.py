"""`kitchen track import` into the embedded store (sqlite, no server) and `kitchen diff`,
through the real `kitchen` command line, on run directories in the trainer's own format."""

import io
import json
import random

import pytest
from mlflow.tracking import MlflowClient

from launcher import cli
from launcher.settings import embedded_tracking_uri
from launcher.tracking import diff
from launcher.tracking.run_dir import read_run
from launcher.tracking.testing import write_run
from protos import job_pb2, provenance

STEPS = 50


def _spec(lr: float) -> job_pb2.JobSpec:
    spec = job_pb2.JobSpec(name="tiny", kind=job_pb2.PRETRAIN, team="nlp", owner="ada")
    spec.trainer.optim.lr = lr
    spec.trainer.train.steps = STEPS
    return spec


def _losses(seed: int, part_at: int | None = None) -> list[float]:
    """A falling curve with seeded noise (sigma 0.01); from `part_at` on, 0.15 higher."""
    noise = random.Random(seed)
    return [
        4.0 - step / 50 + noise.gauss(0, 0.01) + (0.15 if part_at and step >= part_at else 0)
        for step in range(1, STEPS + 1)
    ]


def _kitchen(*argv) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main(list(argv), out=out), out.getvalue()


def test_import_a_finished_run(tmp_path, capsys):
    write_run(tmp_path / "run", "job-1", _spec(3e-4), _losses(0))
    state = str(tmp_path / "state")
    code, out = _kitchen("track", "import", str(tmp_path / "run"), "--state-dir", state)
    assert code == 0, capsys.readouterr().err
    assert f"over {STEPS} steps" in out
    client = MlflowClient(embedded_tracking_uri(state))
    experiment = client.get_experiment_by_name("kitchen/nlp")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert len(client.get_metric_history(run.info.run_id, "loss")) == STEPS
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [STEPS]
    assert run.data.params["trainer.train.steps"] == str(STEPS)
    assert run.data.tags["kitchen.job_id"] == "job-1"
    assert run.info.status == "FINISHED"
    # Importing again writes the same run, not a second one, and no value twice.
    assert _kitchen("track", "import", str(tmp_path / "run"), "--state-dir", state)[0] == 0
    (again,) = client.search_runs([experiment.experiment_id])
    assert len(client.get_metric_history(again.info.run_id, "loss")) == STEPS


def test_import_of_a_directory_that_is_no_run_says_why(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert _kitchen("track", "import", str(tmp_path / "empty"))[0] == 2
    assert "metrics.jsonl: no such file" in capsys.readouterr().err
    write_run(tmp_path / "run", "job-1", _spec(3e-4), _losses(0))
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": "x"}\n{"step": 1}\n')
    assert _kitchen("diff", str(tmp_path / "run"), str(tmp_path / "run"))[0] == 2
    assert "metrics.jsonl:1: not a kitchen.v1.Progress" in capsys.readouterr().err


def test_diff_names_the_field_and_the_step_where_losses_part(tmp_path):
    write_run(tmp_path / "a", "job-a", _spec(3e-4), _losses(1))
    write_run(tmp_path / "b", "job-b", _spec(1e-3), _losses(2, part_at=30))
    code, out = _kitchen("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 0
    assert "trainer.optim.lr" in out and "0.0003" in out and "0.001" in out
    assert "config: 1 of" in out  # only lr: the defaults applied agree
    assert "the curves part at step 30" in out
    d = diff.compare(read_run(str(tmp_path / "a")), read_run(str(tmp_path / "b")))
    assert d.loss is not None and d.loss.step == 30
    assert 0.005 < d.loss.noise < 0.03  # two curves of sigma 0.01: ~0.014


def test_diff_note_lands_on_run_bs_page(tmp_path, capsys):
    write_run(tmp_path / "a", "job-a", _spec(3e-4), _losses(1))
    write_run(tmp_path / "b", "job-b", _spec(1e-3), _losses(2, part_at=30))
    state = str(tmp_path / "state")
    diff_b = ("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--note", "--state-dir", state)
    assert _kitchen(*diff_b)[0] == 2  # B is not in MLflow yet
    assert "`kitchen track import` it first" in capsys.readouterr().err
    assert _kitchen("track", "import", str(tmp_path / "b"), "--state-dir", state)[0] == 0
    code, out = _kitchen(*diff_b)
    assert code == 0 and "noted on run" in out
    client = MlflowClient(embedded_tracking_uri(state))
    experiment = client.get_experiment_by_name("kitchen/nlp")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    note = run.data.tags["mlflow.note.content"]
    assert "against job-a" in note and "the curves part at step 30" in note


@pytest.mark.parametrize("other_seed", [1, 3])
def test_diff_of_runs_that_agree(tmp_path, other_seed):
    write_run(tmp_path / "a", "job-a", _spec(3e-4), _losses(1))
    write_run(tmp_path / "b", "job-b", _spec(3e-4), _losses(other_seed))
    out = _kitchen("diff", str(tmp_path / "a"), str(tmp_path / "b"))[1]
    assert "config: 0 of" in out
    if other_seed == 1:
        assert f"identical at all {STEPS} shared steps" in out
    else:  # the same run up to noise: noise alone must not count as parting
        assert "the curves do not part" in out


def _provenance(run_dir, commit: str, digest: str) -> None:
    """What the trainer records (protos/provenance.py), and a profile (trainer.profile)."""
    dataset = run_dir / "dataset"
    dataset.mkdir()
    (dataset / "manifest.json").write_text(json.dumps({"key": digest}))
    provenance.record_code(str(run_dir), 1, provenance.CodeVersion(commit, "git work tree /src"))
    provenance.record_dataset(str(run_dir), str(dataset))
    (run_dir / "profile").mkdir()
    (run_dir / "profile" / "trace_rank0.json").write_text('{"traceEvents": []}')
    (run_dir / "profile" / "profile.md").write_text("Profile of steps 5-6\n")


def test_commit_dataset_digest_and_profile_reach_the_run_and_the_diff(tmp_path):
    write_run(tmp_path / "a", "job-a", _spec(3e-4), _losses(1))
    write_run(tmp_path / "b", "job-b", _spec(3e-4), _losses(1))
    _provenance(tmp_path / "a", "a" * 40, "d1" * 32)
    _provenance(tmp_path / "b", "b" * 40 + "-dirty", "d2" * 32)
    state = str(tmp_path / "state")
    assert _kitchen("track", "import", str(tmp_path / "b"), "--state-dir", state)[0] == 0
    client = MlflowClient(embedded_tracking_uri(state))
    experiment = client.get_experiment_by_name("kitchen/nlp")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    tags = run.data.tags
    assert tags["kitchen.git_commit"] == tags["mlflow.source.git.commit"] == "b" * 40 + "-dirty"
    assert tags["kitchen.dataset_digest"] == "d2" * 32
    assert tags["kitchen.dataset"] == str(tmp_path / "b" / "dataset")
    profile = {a.path for a in client.list_artifacts(run.info.run_id, "profile")}
    assert profile == {"profile/profile.md", "profile/trace_rank0.json"}
    out = _kitchen("diff", str(tmp_path / "a"), str(tmp_path / "b"))[1]
    rows = {line[:19].strip(): line[19:].split() for line in out.splitlines()}
    assert rows["code commit"] == ["a" * 40, "b" * 40 + "-dirty"]
    assert rows["dataset digest"] == ["d1" * 6, "d2" * 6]  # shortened, as git shortens commits
    assert "identical at all" in out  # the same curve, other code and data: the diff says so
