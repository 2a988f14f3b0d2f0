"""Gradient noise scale B_simple (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A): the batch size, in tokens, beyond which a bigger batch buys little.

Each step gives two gradient norms of the same weights: one micro-batch (B_small tokens) and
the whole step (B_big tokens). From them, unbiased estimates of the true gradient's squared
norm |G|^2 and of the per-token noise trace S follow; B_simple = S / |G|^2, with both
smoothed by an exponential moving average before dividing, as the paper does. The estimator
itself is the one the sizing tools use (trainer.sizing.batch).
"""

from trainer.sizing.batch import noise_scale_from_two_batches

DECAY = 0.95


class GradientNoiseScale:
    def __init__(self):
        self.g2 = self.s = 0.0  # moving averages, bias-corrected by `weight`
        self.weight = 0.0

    def update(self, small_sq: float, b_small: float, big_sq: float, b_big: float) -> None:
        """Squared norms of the mean per-token gradient over b_small and b_big tokens."""
        if not 0 < b_small < b_big:
            return
        g2, s = noise_scale_from_two_batches(b_small, small_sq, b_big, big_sq)
        self.g2 = DECAY * self.g2 + (1 - DECAY) * g2
        self.s = DECAY * self.s + (1 - DECAY) * s
        self.weight = DECAY * self.weight + (1 - DECAY)

    @property
    def value(self) -> float:
        """B_simple in tokens; 0 while unknown (no estimate yet, or |G|^2 not yet positive)."""
        if self.weight == 0 or self.g2 <= 0:
            return 0.0
        return self.s / self.g2

    def state_dict(self) -> dict:
        return {"g2": self.g2, "s": self.s, "weight": self.weight}

    def load_state_dict(self, state: dict) -> None:
        self.g2, self.s, self.weight = state["g2"], state["s"], state["weight"]
