"""The profile table's arithmetic on a hand-made trace whose every share is known."""

import json

import pytest

from trainer import profile_table
from trainer.profile_table import DATA_WAIT, STEP, TraceError, analyse, read_trace

MAIN, GLOO = 100, 200  # thread ids


def span(name, ts, dur, tid=MAIN, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def trace(*events, rank=0, world=2) -> dict:
    return {
        "traceEvents": list(events),
        "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world},
    }


# Two steps of 1000 us. Step 1: data wait 0-200 (aten::stack 50 inside), aten::mm 300-600
# (aten::copy_ 100 inside), c10d::allreduce_ 700-720 while gloo's thread works 650-850.
# Step 2 (2000-3000): data wait 2000-2100, aten::mm 2200-2400, gloo 2050-2150 (half of it
# inside the data wait: counted once, as data wait). A span outside the steps is ignored.
STEPS = trace(
    span(f"{STEP} 7", 0, 1000, cat="user_annotation"),
    span(DATA_WAIT, 0, 200, cat="user_annotation"),
    span("aten::stack", 20, 50),
    span("aten::mm", 300, 300),
    span("aten::copy_", 400, 100),
    span("c10d::allreduce_", 700, 20),
    span("gloo:all_reduce", 650, 200, tid=GLOO, cat="user_annotation"),
    span(f"{STEP} 8", 2000, 1000, cat="user_annotation"),
    span(DATA_WAIT, 2000, 100, cat="user_annotation"),
    span("aten::mm", 2200, 200),
    span("gloo:all_reduce", 2050, 100, tid=GLOO, cat="user_annotation"),
    span("aten::mm", 5000, 999),
    {"ph": "i", "name": "an instant, not a span", "ts": 10},
)


def test_shares_of_a_known_trace():
    t = analyse(STEPS, top=2)
    assert (t.steps, t.rank, t.world_size, t.device) == ([7, 8], 0, 2, "cpu")
    assert t.step_ms == pytest.approx(1.0)
    assert t.data_wait.share == pytest.approx(300 / 2000)
    assert t.data_wait.ms == pytest.approx(0.15)
    # gloo 650-850 and 2100-2150 (2050-2100 is the data wait), c10d's 700-720 within it
    assert t.communication.share == pytest.approx(250 / 2000)
    assert [(r.name, r.calls, round(r.share, 9)) for r in t.ops] == [
        ("aten::mm", 1.0, 400 / 2000),  # (200 + 200) self
        ("aten::copy_", 0.5, 100 / 2000),
    ]
    assert t.other_ops.name == "(2 other operators)"
    assert t.other_ops.share == pytest.approx((50 + 20) / 2000)
    assert t.outside_reading.share == pytest.approx((150 + 100) / 2000)
    everything = [*t.ops, t.other_ops, t.outside_reading, t.outside_ops]
    assert sum(r.share for r in everything) == pytest.approx(1.0)
    assert t.kernels == [] and t.gpu_busy is None


def test_cuda_kernels_are_counted_on_the_gpu_and_nccl_as_communication():
    t = analyse(
        trace(
            span(f"{STEP} 1", 0, 1000, cat="user_annotation"),
            span("cudaLaunchKernel", 10, 5, cat="cuda_runtime"),
            span("sm90_gemm", 100, 300, tid=7, cat="kernel"),
            span("sm90_gemm", 450, 100, tid=7, cat="kernel"),
            span("ncclDevKernel_AllReduce_Sum_f32", 600, 200, tid=8, cat="kernel"),
        )
    )
    assert [(r.name, r.calls, r.share) for r in t.kernels] == [("sm90_gemm", 2, 0.4)]
    assert t.gpu_busy is not None and t.gpu_busy.share == pytest.approx(0.4)
    assert t.communication.share == pytest.approx(0.2)
    assert [r.name for r in t.ops] == ["cudaLaunchKernel"]


def test_the_table_renders_every_row_as_markdown():
    t = analyse(STEPS, top=2)
    text = t.render() + profile_table.render_ranks([t])
    assert "Profile of steps 7-8 on rank 0 of 2 (cpu): 1.0 ms a step." in text
    assert "| data-loader wait | 15.0% | 0.1 |" in text
    assert "| communication (a collective in flight) | 12.5% | 0.1 |" in text
    assert "| aten::mm | 1 | 0.20 | 20.0% |" in text
    assert "| aten::copy_ | 0.5 | 0.05 | 5.0% |" in text
    assert "| 0 | 1.0 | 15.0% | 12.5% |" in text


def test_a_file_that_is_not_a_profile_is_named(tmp_path):
    bad = tmp_path / "trace.json"
    bad.write_text("{not json")
    with pytest.raises(TraceError, match=str(bad)):
        read_trace(str(bad))
    bad.write_text(json.dumps({"traceEvents": [span("aten::mm", 0, 5)]}))
    with pytest.raises(TraceError, match="no 'kitchen/step' spans"):
        analyse(read_trace(str(bad)), source=str(bad))
