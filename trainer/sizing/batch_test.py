import numpy as np
import pytest

from trainer.sizing import batch


def test_two_batch_estimator_recovers_exact_expectations():
    # E|G_B|² = |G|² + tr(Σ)/B with |G|² = 2, tr(Σ) = 100: 12 at B=10, 3 at B=100.
    grad_sq, trace = batch.noise_scale_from_two_batches(10, 12.0, 100, 3.0)
    assert grad_sq == pytest.approx(2.0) and trace == pytest.approx(100.0)
    assert batch.b_simple(trace, grad_sq) == pytest.approx(50.0)


def test_two_batch_estimator_on_sampled_gradients():
    # Per-example gradients g = G + noise, noise ~ N(0, diag(σ²)); the true B_noise is
    # tr(Σ)/|G|². Averaging the squared norms of many mean gradients at two batch sizes (as
    # the trainer does with micro batches and the accumulated batch) recovers it.
    rng = np.random.default_rng(0)
    dim = 64
    g = rng.normal(size=dim) * 0.1
    sigma = rng.uniform(0.5, 1.5, size=dim)
    true = float((sigma**2).sum() / (g**2).sum())

    def mean_sq_norm(b: int, trials: int = 4000) -> float:
        means = g + rng.normal(size=(trials, dim)) * sigma / np.sqrt(b)
        return float((means**2).sum(axis=1).mean())

    small, big = 4, 64
    grad_sq, trace = batch.noise_scale_from_two_batches(
        small, mean_sq_norm(small), big, mean_sq_norm(big)
    )
    assert batch.b_simple(trace, grad_sq) == pytest.approx(true, rel=0.1)


def test_steps_and_data_tradeoff_at_the_noise_scale():
    assert batch.steps_and_data_overhead(1000.0, 1000.0) == (2.0, 2.0)
    steps, data = batch.steps_and_data_overhead(100.0, 1000.0)
    assert steps == pytest.approx(11.0) and data == pytest.approx(1.1)


def test_kaplan_prior_grows_as_loss_falls():
    assert batch.kaplan_critical_batch_tokens(1.0) == 2e8
    assert batch.kaplan_critical_batch_tokens(2.0) == pytest.approx(2e8 * 2 ** (-1 / 0.21))
    assert batch.kaplan_critical_batch_tokens(2.5) > batch.kaplan_critical_batch_tokens(3.0)
    b = batch.kaplan_critical_batch_tokens(3.0)
    assert batch.loss_where_critical(b) == pytest.approx(3.0)


def test_data_parallel_degree():
    assert batch.max_data_parallel(512, 4) == 128
    assert batch.grad_accumulation(512, 4, 8) == 16
    assert batch.grad_accumulation(512, 4, 6) is None
    with pytest.raises(ValueError, match="micro_batch"):
        batch.max_data_parallel(2, 4)


def test_estimator_rejects_bad_batch_sizes():
    with pytest.raises(ValueError, match="small_batch < big_batch"):
        batch.noise_scale_from_two_batches(8, 1.0, 8, 1.0)
    with pytest.raises(ValueError, match="positive"):
        batch.b_simple(1.0, 0.0)
