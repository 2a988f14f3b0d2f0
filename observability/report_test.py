"""`kitchen report` on metrics.jsonl files written the way the trainer writes them."""

import base64
import math
import re

import pytest

from observability import report
from protos import progress_pb2
from protos.progress_log import progress_line

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def progress(step: int, attempt: int = 1, **fields) -> progress_pb2.Progress:
    """A plausible logged step: loss falls, MFU 40 %, a slow checkpoint step every 50."""
    checkpoint = step % 50 == 0
    p = progress_pb2.Progress(
        job_id="j-0042",
        attempt=attempt,
        phase="train",
        step=step,
        total_steps=300,
        loss=2.5 + 8 * math.exp(-step / 60) + 0.02 * math.sin(step),
        tokens_per_second=8192 / (0.5 if not checkpoint else 2.0),
        step_time_seconds=2.0 if checkpoint else 0.5 + 0.01 * math.sin(step),
        data_time_seconds=0.01,
        mfu=0.4 * (0.25 if checkpoint else 1.0),
        mfu_basis="table:H100-SXM",
        peak_memory_bytes=3 * 2**30,
        padding_fraction=0.02,
        goodput=min(0.95, 0.5 + step / 100),
        tokens_total=8192 * step,
    )
    for name, value in fields.items():
        setattr(p, name, value)
    return p


def write_log(path, records, tail: str = "") -> None:
    path.write_text("".join(progress_line(r) + "\n" for r in records) + tail)


def healthy_run_with_a_restart() -> list:
    """Attempt 1 logs steps 1-180 and dies; attempt 2 resumes from the step-150 checkpoint."""
    records = [progress(s) for s in range(1, 181)]
    records.insert(150, progress(150, message="checkpoint saved", step_time_seconds=0))
    records += [progress(150, attempt=2, message="resumed from step 150", step_time_seconds=0)]
    records += [progress(s, attempt=2) for s in range(151, 301)]
    records += [
        progress(s, 2, phase="eval", eval_loss=3.0 - s / 1000, step_time_seconds=0)
        for s in (100, 200, 300)
    ]
    return records


def render(tmp_path, records, tail: str = "") -> str:
    write_log(tmp_path / "metrics.jsonl", records, tail)
    page, _ = report.render_html(tmp_path)
    return page


def images(page: str) -> list[bytes]:
    return [
        base64.b64decode(m) for m in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    ]


def test_report_of_a_healthy_run_with_a_restart(tmp_path):
    assert report.main([str(tmp_path / "nothing")]) == 2
    write_log(tmp_path / "metrics.jsonl", healthy_run_with_a_restart())
    assert report.main([str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    pngs = images(page)
    assert len(pngs) == 5 and all(png.startswith(PNG_SIGNATURE) for png in pngs)
    for row in (
        "j-0042",
        "300 of 300",
        "<th>Attempts</th><td class='num'>2<",
        "2.46M tokens",
        "16.4k tokens/s",
        "40.0% (peak from table:H100-SXM)",
        "Best eval loss</th><td class='num'>2.7000",
        "3.00 GiB",
    ):
        assert row in page
    assert "class='problem'" not in page
    assert "every 50 steps: a sawtooth" in page
    assert "1 restart, resumed at step 151; 30 logged steps were computed again" in page
    assert "resumed from step 150" in page  # the events table


def test_nan_loss_data_stall_and_low_goodput_are_problems(tmp_path):
    records = [progress(s, data_time_seconds=0.2, goodput=0.6) for s in range(1, 201)]
    records += [progress(s, loss=math.nan, goodput=0.6) for s in range(201, 221)]
    account = "goodput 60.0% of 100 s wall (productive 60 s; badput: data 40 s)"
    records.append(progress(220, message=account, step_time_seconds=0, goodput=0.6))
    page = render(tmp_path, records)
    assert "Loss is NaN or infinite.</b> From step 201 (20 logged steps)" in page
    assert "Waiting for data.</b> Loading input takes 40% of a median step" in page
    assert "Low goodput.</b> Only 60% of wall time" in page
    assert f"The trainer&#x27;s account: {account}." in page


def test_mfu_sag_and_a_lasting_loss_spike_are_problems(tmp_path):
    records = [progress(s, mfu=0.4 if s < 200 or s > 240 else 0.2) for s in range(1, 281)]
    records += [progress(s, loss=9.0) for s in range(281, 290)]
    page = render(tmp_path, records)
    assert re.search(r"MFU sagged.</b> From around step (19\d|2[0-3]\d) MFU stayed below 70%", page)
    assert "Loss spikes.</b> 9 logged steps" in page and "the run is diverging" in page


def test_quantities_the_run_did_not_log_are_named_not_drawn_as_zero(tmp_path):
    page = render(tmp_path, [progress(s, mfu=0, mfu_basis="", goodput=0) for s in range(1, 50)])
    assert "MFU: not logged by this run." in page and "Goodput: not logged" in page
    assert len(images(page)) == 3 and "MFU (median)" not in page


def test_an_unfinished_last_line_is_a_warning_on_the_page_and_stderr(tmp_path, capsys):
    write_log(tmp_path / "metrics.jsonl", [progress(1), progress(2)], tail='{"job_id": "j-00')
    assert report.main([str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "2 records, 2 training steps" in page
    assert "metrics.jsonl:3: skipped an unfinished last line" in page
    assert "warning: " in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"step": "1"}\n{"step": "ten"}\n{"step": "2"}\n', ":2: not a kitchen.v1.Progress"),
        ("", ": no progress records"),
    ],
)
def test_a_bad_or_empty_log_is_an_error_and_writes_no_report(tmp_path, capsys, content, message):
    (tmp_path / "metrics.jsonl").write_text(content)
    assert report.main([str(tmp_path)]) == 2
    assert f"metrics.jsonl{message}" in capsys.readouterr().err
    assert not (tmp_path / "report.html").exists()
