"""trainer.profile on a real run: 2 processes under torchrun (gloo), rank 0's data loader slowed
by a fault (KITCHEN_FAULTS slowdata). Every rank's trace is Chrome trace JSON; rank 0's table
shows the wait it was given, rank 1's the collectives it spends waiting for rank 0."""

import json
import os

import pytest

from trainer import profile_table
from trainer.step_profiler import TABLE_JSON, TABLE_MD, trace_name
from trainer.testing import tiny_job, torchrun, write_job

SLOW_DATA_S = 0.2


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile")
    job = tiny_job(root / "cache", steps=6, profile={"start_step": 3, "steps": 2, "top_ops": 5})
    os.environ["KITCHEN_FAULTS"] = f"slowdata:0:{SLOW_DATA_S}"
    try:
        result = torchrun(write_job(root / "job.yaml", job), root / "run")
    finally:
        del os.environ["KITCHEN_FAULTS"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root / "run" / "profile", result.stdout


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_saves_a_chrome_trace(profiled, rank):
    with open(profiled[0] / trace_name(rank)) as f:
        trace = json.load(f)
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert spans and all({"name", "ts", "dur", "pid", "tid"} <= e.keys() for e in spans)
    assert sorted(e["name"] for e in spans if e["name"].startswith("kitchen/step ")) == [
        "kitchen/step 3",
        "kitchen/step 4",
    ]
    assert trace["distributedInfo"]["rank"] == rank


def test_the_table_is_logged_written_and_adds_up(profiled):
    directory, stdout = profiled
    text = (directory / TABLE_MD).read_text()
    for line in text.splitlines():
        assert line in stdout
    ranks = json.loads((directory / TABLE_JSON).read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        rows = [*r["ops"], r["other_ops"], r["outside_reading"], r["outside_ops"]]
        assert len(r["ops"]) == 5
        assert sum(row["share"] for row in rows) == pytest.approx(1.0, abs=0.01)
        assert r["data_wait"]["share"] + r["communication"]["share"] <= 1.0
    slow, waiting = ranks
    assert slow["data_wait"]["ms"] >= 1000 * SLOW_DATA_S  # the fault's sleep, every step
    assert waiting["data_wait"]["ms"] < 1000 * SLOW_DATA_S / 4
    assert waiting["communication"]["ms"] > 1000 * SLOW_DATA_S / 2  # waits for rank 0
    # what the table is computed from: the saved trace, again
    again = profile_table.analyse(profile_table.read_trace(str(directory / trace_name(0))), 5)
    assert again.render() in text
