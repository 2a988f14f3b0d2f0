"""The RLHF losses as pure tensor functions: no model, no config, hand-checkable.

Conventions follow TRL so its users read the numbers the same way: DPO's implicit rewards are
beta * (policy - reference) log-probabilities; GRPO normalizes within each group with the
sample (unbiased) standard deviation plus 1e-4; PPO's KL estimate per token is
log pi - log pi_ref (k1), GRPO's is exp(ref - pi) - (ref - pi) - 1 (k3, never negative).
"""

import torch
import torch.nn.functional as F

from protos import trainer_config_pb2

GRPO_EPS = 1e-4


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    *,
    loss: trainer_config_pb2.DpoLoss = trainer_config_pb2.SIGMOID_LOSS,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards) from per-sequence log-probabilities.

    SIGMOID_LOSS: -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h), h the log-ratio margin
    (conservative DPO when label_smoothing ls > 0). IPO: (h - 1 / (2 beta))^2 (pass mean
    per-token log-probabilities for IPO, as its paper and TRL do). The rewards carry no grad.
    """
    chosen_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    if loss == trainer_config_pb2.IPO_LOSS:
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(
            -beta * h
        )
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def reward_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Per-pair Bradley-Terry loss -log sigmoid(chosen - rejected) of a reward model's scores."""
    return -F.logsigmoid(chosen_scores - rejected_scores)


def grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r - group mean) / (group std + 1e-4) for rewards laid out group after group (N * G,)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    return ((groups - mean) / (std + GRPO_EPS)).view(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit variance over the masked entries (PPO's advantage normalization)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) by generalized advantage estimation over (B, T) response tokens;
    `mask` is 1 on response tokens, which come first-to-last with padding after them."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    T = rewards.shape[1]
    for t in reversed(range(T)):
        next_value = values[:, t + 1] * mask[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def clipped_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(PPO's clipped surrogate loss, share of tokens clipped), both means over `mask`."""
    ratio = torch.exp(logps - old_logps)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).float(), mask).detach()


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
) -> torch.Tensor:
    """0.5 * max((v - R)^2, (clip(v, old +- c) - R)^2), mean over `mask`."""
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token exp(ref - pi) - (ref - pi) - 1: an unbiased, non-negative KL estimate."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1
