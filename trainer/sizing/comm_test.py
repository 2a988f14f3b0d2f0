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


def test_fsdp_gathers_per_micro_batch_and_reduce_scatters_once():
    """Without a pipeline each extra micro-batch gathers the blocks twice and the root once
    more; in a pipeline the blocks once more; the fp32 reduce-scatter stays once per step."""
    fsdp = ParallelLayout(dp=4, fsdp=True)
    piped = ParallelLayout(dp=2, pp=2, fsdp=True)

    def data(lay, m):
        return comm.comm_bytes(TINY, comm.Step(32, 1, m, activation_bytes=2), lay).data

    d, layer = TINY.dim, 2 * 64 * 4 * 16 + 2 * 64 * 2 * 16 + 3 * 64 * 128 + 2 * 64
    blocks, root = 4 * layer, 2 * TINY.vocab * d + d
    assert data(fsdp, 3) - data(fsdp, 2) == pytest.approx(3 / 4 * 2 * (2 * blocks + root))
    assert data(fsdp, 1) == pytest.approx(3 / 4 * (2 * (2 * blocks + root) + 4 * (blocks + root)))
    stage_blocks, stage_root = 2 * layer, TINY.vocab * d
    assert data(piped, 3) - data(piped, 2) == pytest.approx(1 / 2 * 2 * stage_blocks)
    assert data(piped, 1) == pytest.approx(
        1 / 2 * (2 * (2 * stage_blocks + stage_root) + 4 * (stage_blocks + stage_root))
    )


def test_fsdp_shards_over_data_parallel_and_all_reduces_shards_over_context():
    step = comm.Step(seq_len=32, micro_batch=1, micro_batches=2, activation_bytes=4)
    with_cp = comm.comm_bytes(TINY, step, ParallelLayout(dp=2, cp=2, fsdp=True))
    without = comm.comm_bytes(TINY, step, ParallelLayout(dp=2, fsdp=True))
    replicated = comm.comm_bytes(TINY, step, ParallelLayout(dp=2, cp=2))
    params = comm.rank_params(TINY, ParallelLayout(dp=2, cp=2))
    assert with_cp.data == without.data
    assert with_cp.context - replicated.context == pytest.approx(2 * 1 / 2 * 4 * params / 2)
