import pytest

from protos import progress_pb2
from protos.progress_log import LOG_NAME, append_progress, progress_line, read_progress_log
from trainer.metrics import Goodput, MetricsLogger
from trainer.plots import loss_curves, plot_loss


def test_goodput_splits_wall_time_and_survives_restarts_and_rollbacks():
    g = Goodput(started=1000.0)
    g.add("startup", 5.0)
    g.add("productive", 30.0)
    g.add("data", 1.0)
    g.checkpointed()
    g.add("productive", 4.0)
    g.rolled_back()  # the 4 s since the checkpoint are redone: lost, not productive
    assert g.seconds["productive"] == 30.0 and g.seconds["lost"] == 4.0
    state = dict(g.state_dict(), wall=50.0, saved_at=2000.0)

    # A new attempt starts 12 s after that checkpoint was saved: those 12 s are lost too.
    resumed = Goodput(started=2012.0)
    resumed.resume(state)
    assert resumed.seconds["lost"] == 16.0 and resumed.seconds["startup"] == 5.0
    assert resumed.earlier_wall == 62.0
    assert resumed.wall() >= 62.0
    assert 0 < resumed.fraction() <= 30.0 / 62.0
    assert "badput: startup 5.0 s" in resumed.summary()


def test_a_record_averages_the_steps_since_the_last_and_has_every_field(tmp_path):
    m = MetricsLogger(
        tmp_path,
        is_main=True,
        model_flops_per_token=1e6,
        peak=(1e12, "measured"),
        world_size=2,
        log=print,
    )
    m.identity.update(job_id="j", attempt=1, total_steps=10)
    m.step(tokens=900, positions=1000, padding=100, loss=2.0, step_time=0.5, data_time=0.1)
    m.step(tokens=900, positions=1000, padding=100, loss=None, step_time=0.5, data_time=0.1)
    p = m.emit(step=2, grad_norm=1.5, lr=1e-3)
    assert p.loss == 2.0  # the skipped step (None) does not count
    assert p.tokens_per_second == pytest.approx(1800.0)
    assert p.step_time_seconds == pytest.approx(0.5) and p.data_time_seconds == pytest.approx(0.1)
    # Per device: 900 tokens/s x 1e6 FLOPs = 0.9 GFLOP/s of a 1 TFLOP/s peak.
    assert p.mfu == pytest.approx(9e-4) and p.tflops == pytest.approx(9e-4)
    assert p.mfu_basis == "measured" and p.padding_fraction == pytest.approx(0.1)
    (record,) = read_progress_log(tmp_path).records
    assert record == p and record.job_id == "j" and record.step == 2
    assert "MFU 0.1% (measured)" in m.human_line(p)


def test_loss_curves_keep_the_last_value_of_a_redone_step(tmp_path):
    Progress = progress_pb2.Progress
    for p in [
        Progress(phase="train", step=1, loss=5.0, step_time_seconds=1.0),
        Progress(phase="train", step=2, loss=4.0, step_time_seconds=1.0),
        Progress(phase="train", step=2, message="checkpoint saved"),  # an event
        Progress(phase="train", step=2, loss=3.5, step_time_seconds=1.0),  # redone
        Progress(phase="eval", step=2, eval_loss=3.9),
    ]:
        append_progress(tmp_path / LOG_NAME, p)
    with open(tmp_path / LOG_NAME, "a") as f:
        f.write(progress_line(Progress(phase="train", step=3))[:10])  # being written
    train, heldout = loss_curves(read_progress_log(tmp_path).records)
    assert train == {1: 5.0, 2: 3.5} and heldout == {2: 3.9}
    png = plot_loss(tmp_path)
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_a_new_logger_drops_the_line_a_killed_attempt_left_unfinished(tmp_path):
    said: list[str] = []
    append_progress(tmp_path / LOG_NAME, progress_pb2.Progress(phase="train", step=1))
    fragment = '{"job_id": "j", "st'  # the attempt was killed while writing this line
    with open(tmp_path / LOG_NAME, "a") as f:
        f.write(fragment)
    m = MetricsLogger(
        tmp_path, is_main=True, model_flops_per_token=1e6, peak=(1e12, "measured"),
        world_size=1, log=said.append,
    )  # fmt: skip
    assert len(said) == 1 and f"dropped an unfinished last line ({len(fragment)} bytes)" in said[0]
    m.emit(step=2)
    log = read_progress_log(tmp_path)
    assert [r.step for r in log.records] == [1, 2] and log.warnings == []


def test_an_mfu_above_the_calibrated_peak_is_flagged_once(tmp_path):
    said: list[str] = []
    m = MetricsLogger(
        tmp_path, is_main=True, model_flops_per_token=1e6, peak=(1e6, "measured"),
        world_size=1, log=said.append,
    )  # fmt: skip
    for step in (1, 2):
        m.step(tokens=100, positions=100, padding=0, loss=1.0, step_time=0.1, data_time=0.0)
        assert m.emit(step=step).mfu > 1
    assert len(said) == 1 and "exceeds the measured peak" in said[0]
