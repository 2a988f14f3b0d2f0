"""The planner's bytes per layout and bubble (trainer/parallel/parallel_test.py checks the
bytes against a real 4-process run)."""

import pytest

from protos.layout import ParallelLayout, Schedule
from trainer.sizing import comm

TINY = comm.ModelShape(layers=4, dim=64, heads=4, kv_heads=2, ffn_dim=128, vocab=96)


def test_pure_data_parallel_all_reduces_the_fp32_gradient_once():
    step = comm.Step(seq_len=32, micro_batch=1, micro_batches=2, activation_bytes=4)
    sent = comm.comm_bytes(TINY, step, ParallelLayout(dp=4))
    params = comm.rank_params(TINY, ParallelLayout(dp=4))
    assert sent.data == pytest.approx(2 * 3 / 4 * 4 * params)
    assert sent.tensor == sent.context == sent.pipeline == 0


def test_bubble_shrinks_with_micro_batches_and_interleaving():
    one_f_one_b = ParallelLayout(pp=4)
    interleaved = ParallelLayout(pp=4, schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=2)
    assert comm.bubble_fraction(one_f_one_b, 4) == pytest.approx(3 / 7)
    assert comm.bubble_fraction(one_f_one_b, 32) == pytest.approx(3 / 35)
    assert comm.bubble_fraction(interleaved, 4) == pytest.approx(3 / 11)
    assert comm.bubble_fraction(ParallelLayout(dp=4), 4) == 0


def test_tensor_parallel_bytes_grow_with_sequence_and_not_with_dp():
    step = comm.Step(seq_len=4096, micro_batch=1, micro_batches=8)
    a = comm.comm_bytes(TINY, step, ParallelLayout(dp=1, tp=4))
    b = comm.comm_bytes(TINY, step, ParallelLayout(dp=8, tp=4))
    assert a.tensor == b.tensor
    longer = comm.comm_bytes(TINY, comm.Step(8192, 1, 8), ParallelLayout(tp=4))
    assert longer.tensor == pytest.approx(2 * a.tensor)
