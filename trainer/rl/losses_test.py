"""trainer.rl.losses against values worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from protos import trainer_config_pb2
from trainer.rl import losses


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def softplus(x):
    return math.log1p(math.exp(x))  # -log sigmoid(-x)


def test_dpo_sigmoid_loss_and_rewards():
    # pair 0: chosen ratio -1 - -2 = 1, rejected ratio -3 - -2 = -1, h = 2, beta h = 0.2
    # pair 1: chosen ratio 0, rejected ratio 0.5, h = -0.5, beta h = -0.05
    out, chosen, rejected = losses.dpo_loss(t(-1, -4), t(-3, -4.5), t(-2, -4), t(-2, -5), 0.1)
    assert out.tolist() == pytest.approx([softplus(-0.2), softplus(0.05)])
    assert chosen.tolist() == pytest.approx([0.1, 0.0])
    assert rejected.tolist() == pytest.approx([-0.1, 0.05])


def test_dpo_label_smoothing_and_ipo():
    # h = 2, beta = 0.5: beta h = 1. Smoothing 0.1: 0.9 softplus(-1) + 0.1 softplus(1).
    out, _, _ = losses.dpo_loss(t(0), t(-2), t(0), t(0), 0.5, label_smoothing=0.1)
    assert out.item() == pytest.approx(0.9 * softplus(-1) + 0.1 * softplus(1))
    # IPO: (h - 1 / (2 beta))^2 = (2 - 1)^2 = 1
    ipo, _, _ = losses.dpo_loss(t(0), t(-2), t(0), t(0), 0.5, loss=trainer_config_pb2.IPO_LOSS)
    assert ipo.item() == pytest.approx(1.0)


def test_dpo_loss_gradient_raises_chosen_and_lowers_rejected():
    chosen, rejected = t(-2.0).requires_grad_(), t(-2.0).requires_grad_()
    out, _, _ = losses.dpo_loss(chosen, rejected, t(-2), t(-2), 0.1)
    out.sum().backward()
    # d/dh softplus(-beta h) at h = 0 is -beta / 2
    assert chosen.grad.item() == pytest.approx(-0.05)
    assert rejected.grad.item() == pytest.approx(0.05)


def test_reward_loss_is_bradley_terry():
    # scores differ by 0: log 2; by 1: softplus(-1); by -1: softplus(1)
    out = losses.reward_loss(t(0.0, 2.0, 0.0), t(0.0, 1.0, 1.0))
    assert out.tolist() == pytest.approx([math.log(2), softplus(-1), softplus(1)])


def test_grpo_advantages_normalize_within_each_group():
    # group 1: [1, 0, 0, 1], mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735
    # group 2: all 1: std 0, every advantage 0
    adv = losses.grpo_advantages(t(1, 0, 0, 1, 1, 1, 1, 1), 4)
    a = 0.5 / (math.sqrt(1 / 3) + losses.GRPO_EPS)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="groups of 3"):
        losses.grpo_advantages(t(1, 0, 0, 1), 3)


def test_gae_by_hand():
    # one row, 3 tokens, gamma 1, lambda 0.5, values [1, 2, 0], reward 3 at the last token.
    # deltas: t2 = 3 + 0 - 0 = 3; t1 = 0 + 0 - 2 = -2; t0 = 0 + 2 - 1 = 1
    # A2 = 3; A1 = -2 + 0.5 * 3 = -0.5; A0 = 1 + 0.5 * -0.5 = 0.75. The 4th token is padding.
    adv, ret = losses.gae(t(0, 0, 3, 9)[None], t(1, 2, 0, 5)[None], t(1, 1, 1, 0)[None], 1, 0.5)
    assert adv[0].tolist() == pytest.approx([0.75, -0.5, 3, 0])
    assert ret[0].tolist() == pytest.approx([1.75, 1.5, 3, 0])


def test_clipped_policy_loss_and_fraction():
    # ratios e^0 = 1 and e^0.5 = 1.6487 (clipped to 1.2 for a positive advantage)
    logps, old = t(0.0, 0.5), t(0.0, 0.0)
    loss, frac = losses.clipped_policy_loss(logps, old, t(1.0, 1.0), t(1, 1), 0.2)
    assert loss.item() == pytest.approx(-(1 + 1.2) / 2)
    assert frac.item() == pytest.approx(0.5)
    # a negative advantage is not clipped from above: -(-1) * 1.6487
    loss, frac = losses.clipped_policy_loss(logps, old, t(-1.0, -1.0), t(1, 1), 0.2)
    assert loss.item() == pytest.approx((1 + math.exp(0.5)) / 2)
    assert frac.item() == 0


def test_clipped_value_loss():
    # v 3, old 1, R 3: clipped v = 1.2, max((0)^2, (1.8)^2) = 3.24, half is 1.62
    assert losses.clipped_value_loss(t(3), t(1), t(3), t(1), 0.2).item() == pytest.approx(1.62)


def test_k3_kl_is_zero_at_equal_and_positive_elsewhere():
    kl = losses.k3_kl(t(-1.0, -1.0), t(-1.0, -2.0))
    assert kl.tolist() == pytest.approx([0.0, math.exp(-1) + 1 - 1])
