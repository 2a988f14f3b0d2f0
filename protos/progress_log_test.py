"""metrics.jsonl written and read back: lines, torn and bad lines, the last record of a step."""

import json
import math

import pytest

from protos import progress_pb2
from protos.progress_log import (
    LOG_NAME,
    ProgressLogError,
    append_progress,
    drop_unfinished_last_line,
    is_eval,
    last_per_step,
    progress_line,
    read_progress_log,
)


def step(n: int, attempt: int = 1, **fields) -> progress_pb2.Progress:
    p = progress_pb2.Progress(job_id="j-1", attempt=attempt, phase="train", step=n, loss=10.0 / n)
    p.step_time_seconds, p.tokens_per_second = 0.5, 100.0
    for name, value in fields.items():
        setattr(p, name, value)
    return p


def write(path, records, tail: str = "") -> None:
    for p in records:
        append_progress(path, p)
    with open(path, "a") as f:
        f.write(tail)


def test_records_round_trip_with_every_field_on_each_line(tmp_path):
    records = [step(1), step(2, loss=math.nan), step(2, phase="eval", eval_loss=3.5)]
    write(tmp_path / LOG_NAME, records)
    lines = (tmp_path / LOG_NAME).read_text().splitlines()
    # Every field without presence; a proto3 `optional` one (a serve heartbeat's, where 0 is
    # news) appears only when it was set.
    fields = {f.name for f in progress_pb2.Progress.DESCRIPTOR.fields if not f.has_presence}
    assert [set(json.loads(line)) for line in lines] == [fields] * 3
    assert json.loads(lines[1])["loss"] == "NaN" and json.loads(lines[0])["step"] == "1"
    log = read_progress_log(tmp_path)
    assert log.path == tmp_path / LOG_NAME and log.warnings == []
    assert [p.step for p in log.records] == [1, 2, 2] and math.isnan(log.records[1].loss)
    assert log.records[2] == records[2]
    assert read_progress_log(tmp_path / LOG_NAME).records == log.records  # the file itself


def test_a_missing_log_says_what_was_expected_and_an_empty_one_has_no_records(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"nothing: no such file .*{LOG_NAME}"):
        read_progress_log(tmp_path / "nothing")
    (tmp_path / LOG_NAME).write_text("")
    assert read_progress_log(tmp_path).records == []


def test_an_unfinished_last_line_is_skipped_with_a_warning(tmp_path):
    write(tmp_path / LOG_NAME, [step(1), step(2)], tail=progress_line(step(3))[:20])
    log = read_progress_log(tmp_path)
    assert [p.step for p in log.records] == [1, 2]
    (warning,) = log.warnings
    assert f"{LOG_NAME}:3: skipped an unfinished last line" in warning


@pytest.mark.parametrize(
    "bad_line, message",
    [('{"step": "ten"}', "step"), ('{"loss": 1.0, "colour": 3}', "colour"), ("[1]", "object")],
)
def test_a_bad_line_before_the_last_is_an_error_naming_file_line_and_field(
    tmp_path, bad_line, message
):
    path = tmp_path / LOG_NAME
    write(path, [step(1)], tail=bad_line + "\n")
    append_progress(path, step(2))
    with pytest.raises(ProgressLogError, match=rf"{LOG_NAME}:2: .*{message}"):
        read_progress_log(tmp_path)


def test_a_bad_last_line_that_ends_with_its_newline_is_an_error_too(tmp_path):
    write(tmp_path / LOG_NAME, [step(1)], tail="{cut\n")
    with pytest.raises(ProgressLogError, match=f"{LOG_NAME}:2: "):
        read_progress_log(tmp_path)


def test_the_next_attempt_drops_the_line_a_killed_one_left_unfinished(tmp_path):
    path = tmp_path / LOG_NAME
    assert drop_unfinished_last_line(path) == 0  # no log yet
    fragment = progress_line(step(3))[:25]
    write(path, [step(1), step(2)], tail=fragment)
    assert drop_unfinished_last_line(path) == len(fragment)
    assert drop_unfinished_last_line(path) == 0  # a clean log is left alone
    append_progress(path, step(3, attempt=2))
    log = read_progress_log(path)
    assert [(p.step, p.attempt) for p in log.records] == [(1, 1), (2, 1), (3, 2)]
    assert log.warnings == []
    path.write_text("x" * 70_000)  # a log that is one unfinished line, longer than a block
    assert drop_unfinished_last_line(path) == 70_000 and path.read_text() == ""


def test_the_last_record_of_a_step_counts_and_events_do_not():
    records = [step(n) for n in (1, 2, 3, 4)]
    records.append(step(4, message="checkpoint saved", step_time_seconds=0, loss=0))
    records.append(step(2, phase="eval", eval_loss=4.0))
    # Attempt 2 resumes from the step-2 checkpoint and redoes steps 3 and 4.
    records += [step(3, attempt=2, loss=3.0), step(4, attempt=2, loss=2.0)]
    records.append(step(4, attempt=2, phase="eval", eval_loss=2.5))
    trained = last_per_step(records)
    assert list(trained) == [1, 2, 3, 4]
    assert [(p.attempt, p.loss) for p in trained.values()] == [
        (1, 10.0),
        (1, 5.0),
        (2, 3.0),
        (2, 2.0),
    ]
    assert {s: p.eval_loss for s, p in last_per_step(records, is_eval).items()} == {2: 4.0, 4: 2.5}
    assert last_per_step(reversed(records))[4].attempt == 1  # it is the order that decides
