"""How large a batch is still useful: the gradient noise scale and data-parallel degree.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training"). A mini-batch gradient of B
examples is the true gradient G plus noise whose variance falls as 1/B. While the noise dominates,
doubling B halves the steps needed (perfect scaling); once B is large the gradient is already
accurate and more examples per step mostly waste compute. The crossover is the noise scale

    B_noise = tr(Σ) / |G|²        (Σ: per-example gradient covariance)

estimated in practice by B_simple, with the trade-off between steps S and examples E

    S / S_min = 1 + B_noise / B,     E / E_min = 1 + B / B_noise

so at B = B_noise training takes twice the minimum steps and twice the minimum data: the
critical batch size B_crit ≈ B_noise is where both costs are balanced.

B_noise is not a constant of the model: as the loss falls the true gradient |G| shrinks faster
than the noise, so B_noise grows during training (by orders of magnitude over a run). That is
why large runs ramp their batch size up, and why the trainer measures B_simple online from
gradient norms at two batch sizes (one micro batch and the accumulated global batch) instead
of trusting a guess. Before a run, the only prior is an empirical fit from another dataset:
Kaplan et al. 2020 (eq. 1.4, WebText2, GPT-2 tokenizer): B_crit(L) ≈ 2·10⁸ tokens · L^(-1/0.21),
L the loss in nats/token. It gives the order of magnitude, no more.
"""

KAPLAN_B_STAR_TOKENS = 2e8
KAPLAN_ALPHA_B = 0.21


def noise_scale_from_two_batches(
    small_batch: float, small_sq_norm: float, big_batch: float, big_sq_norm: float
) -> tuple[float, float]:
    """Unbiased |G|² and tr(Σ) from squared gradient norms at two batch sizes.

    McCandlish et al. 2018, appendix A.1: E|G_B|² = |G|² + tr(Σ)/B, solved for two sizes.
    Batch sizes may be in examples or tokens; B_simple comes out in the same unit.
    Single estimates are noisy (tr(Σ) can even come out negative): average each of the two
    over many steps, then take the ratio.
    """
    if not 0 < small_batch < big_batch:
        raise ValueError(f"need 0 < small_batch < big_batch, got {small_batch}, {big_batch}")
    grad_sq = (big_batch * big_sq_norm - small_batch * small_sq_norm) / (big_batch - small_batch)
    trace_sigma = (small_sq_norm - big_sq_norm) / (1.0 / small_batch - 1.0 / big_batch)
    return grad_sq, trace_sigma


def b_simple(trace_sigma: float, grad_sq: float) -> float:
    """B_simple = tr(Σ) / |G|², the estimate of the critical batch size."""
    if grad_sq <= 0:
        raise ValueError(f"|G|² estimate must be positive, got {grad_sq}")
    return trace_sigma / grad_sq


def steps_and_data_overhead(batch: float, b_noise: float) -> tuple[float, float]:
    """(S/S_min, E/E_min) for training at `batch` when the noise scale is `b_noise`."""
    return 1.0 + b_noise / batch, 1.0 + batch / b_noise


def kaplan_critical_batch_tokens(loss_nats: float) -> float:
    """Kaplan et al. 2020's fit B_crit(L) = B*·L^(-1/α_B) in tokens (a prior from WebText2)."""
    if loss_nats <= 0:
        raise ValueError(f"loss must be positive, got {loss_nats}")
    return KAPLAN_B_STAR_TOKENS * loss_nats ** (-1.0 / KAPLAN_ALPHA_B)


def max_data_parallel(global_batch: int, micro_batch: int) -> int:
    """Largest useful data-parallel degree: every rank needs at least one micro batch a step.

    Beyond global_batch / micro_batch ranks, extra GPUs would have nothing to compute (or
    would force a larger global batch than the one chosen).
    """
    if micro_batch < 1 or global_batch < micro_batch:
        raise ValueError(
            f"need 1 <= micro_batch <= global_batch, got {micro_batch}, {global_batch}"
        )
    return global_batch // micro_batch


def grad_accumulation(global_batch: int, micro_batch: int, data_parallel: int) -> int | None:
    """Micro batches each rank accumulates per step, or None when the sizes do not divide."""
    per_step = micro_batch * data_parallel
    if global_batch % per_step:
        return None
    return global_batch // per_step


def loss_where_critical(batch_tokens: float) -> float:
    """The loss (nats) above which `batch_tokens` exceeds Kaplan's B_crit prior: (B*/B)^α_B."""
    return (KAPLAN_B_STAR_TOKENS / batch_tokens) ** KAPLAN_ALPHA_B
