"""PPO jobs: on-policy RL from a verifier or a reward model (InstructGPT; TRL's PPOTrainer and
GRPOTrainer). One step: sample `rl.group_size` responses to each of `rl.rollout_prompts`
prompts with the KV cache, score them, then `rl.ppo_epochs` passes of clipped updates over
them in micro-batches of `train.micro_batch` responses.

CLIPPED_PPO: per-token reward -kl_coef * (log pi - log pi_ref), plus the score at the last
token; a value head on the policy's trunk; GAE advantages (whitened); clipped policy and value
losses. GRPO (Shao et al. 2024): the advantage of a response is its score normalized within
its prompt's group, no value head; KL to the reference is a loss term (k3), weighted kl_coef.

Every step reports where its time went (rollout_seconds vs update_seconds): RL is bound by
generation, and a run that hides that is hard to speed up.
"""

import dataclasses

import torch

from protos import trainer_config_pb2
from protos.config_yaml import ConfigError
from protos.exit_codes import ExitCode
from trainer.rl import data, losses, policy
from trainer.rl import job as rljob


@dataclasses.dataclass
class Rollout:
    batch: policy.Batch
    scores: torch.Tensor  # (N,) one per response
    old_logps: torch.Tensor  # (N, T - 1)
    ref_logps: torch.Tensor
    old_values: torch.Tensor | None  # CLIPPED_PPO only
    advantages: torch.Tensor
    returns: torch.Tensor | None

    @property
    def kl(self) -> float:
        """Mean over responses of sum_t (log pi - log pi_ref)."""
        return float(((self.old_logps - self.ref_logps) * self.batch.mask).sum(1).mean())


@torch.no_grad()
def rollout(job, model: policy.WithHead | None, lm, ref, score, prompts, generator) -> Rollout:
    rl = job.cfg.rl
    G = rl.group_size
    out, starts, texts = job.sample(lm, prompts, G, generator)
    scores = score([prompts[i // G] for i in range(len(out))], texts, out, starts).float()
    batch = job.batch(list(zip(out, starts, strict=True)))
    hidden, old_logps = policy.hidden_and_logps(lm, batch)
    ref_logps = policy.token_logps(ref, batch)
    mask = batch.mask
    if model is None:  # GRPO
        advantages = losses.grpo_advantages(scores, G)[:, None] * mask
        return Rollout(batch, scores, old_logps, ref_logps, None, advantages, None)
    values = model.head(hidden[:, :-1]) * mask
    rewards = -rl.kl_coef * (old_logps - ref_logps) * mask
    rewards[torch.arange(len(out)), batch.last - 1] += scores
    advantages, returns = losses.gae(rewards, values, mask, rl.gamma, rl.gae_lambda)
    advantages = losses.whiten(advantages, mask)
    return Rollout(batch, scores, old_logps, ref_logps, values, advantages, returns)


def update(job, model: policy.WithHead | None, lm, r: Rollout, optimizer, scheduler, generator):
    """rl.ppo_epochs passes over the rollout; the mean of each reported quantity."""
    rl, t = job.cfg.rl, job.cfg.train
    n = r.batch.ids.shape[0]
    params = model if model is not None else lm
    sums = dict.fromkeys(("loss", "clip_fraction", "entropy", "value_loss", "grad_norm"), 0.0)
    count = 0
    for _ in range(rl.ppo_epochs):
        order = torch.randperm(n, generator=generator)
        for chunk in order.split(t.micro_batch):
            idx = chunk.to(r.batch.ids.device)
            sub = policy.rows(r.batch, idx)
            hidden, logps, entropy = policy.forward(lm, sub)
            mask = sub.mask
            pg, clipped = losses.clipped_policy_loss(
                logps, r.old_logps[idx], r.advantages[idx], mask, rl.clip_range
            )
            loss = pg
            if model is not None and r.old_values is not None and r.returns is not None:
                values = model.head(hidden[:, :-1])
                vloss = losses.clipped_value_loss(
                    values, r.old_values[idx], r.returns[idx], mask, rl.value_clip
                )
                loss = loss + rl.value_coef * vloss
                sums["value_loss"] += float(vloss.detach())
            else:
                loss = loss + rl.kl_coef * losses.masked_mean(
                    losses.k3_kl(logps, r.ref_logps[idx]), mask
                )
            loss.backward()
            sums["grad_norm"] += rljob.clip_and_step(
                params, optimizer, scheduler, job.cfg.optim.grad_clip
            )
            sums["loss"] += float(loss.detach())
            sums["clip_fraction"] += float(clipped)
            sums["entropy"] += float(losses.masked_mean(entropy.detach(), mask))
            count += 1
    return {k: v / count for k, v in sums.items()}


def run(cfg, attempt, env, log, client) -> ExitCode:
    job = rljob.start(cfg, attempt, env, log, client, rljob.stop_check(client))
    rl, t = cfg.rl, cfg.train
    ref = rljob.reference(job)
    score = rljob.scorer(job)
    prompts = data.read_prompts(rl.prompts)
    train, heldout = data.split(prompts, lambda p: p, rl.eval_fraction)
    log(f"{rl.prompts}: {len(prompts)} prompts ({len(train)} to train on, {len(heldout)} held out)")
    if not train:
        raise ConfigError(
            "trainer.rl.eval_fraction", f"{rl.eval_fraction} leaves no prompt to train on"
        )
    lm = job.actor.model
    grpo = rl.algorithm == trainer_config_pb2.GRPO
    model = None if grpo else policy.WithHead(lm, policy.ScalarHead(job.actor.meta.model))
    if model is not None:
        model.to(env.device)
    per_step = rl.ppo_epochs * -(-(rl.rollout_prompts * rl.group_size) // t.micro_batch)
    optimizer, scheduler = job.optimizer(model if model is not None else lm, t.steps * per_step)
    generator = torch.Generator(device=env.device).manual_seed(t.seed)
    shuffle = torch.Generator().manual_seed(t.seed)
    start = rljob.evaluate_policy(job, lm, ref, heldout)
    log(rljob.eval_line("before RL", start))
    job.emit(0, "eval", **start.fields())
    rollout_total = update_total = 0.0
    step = 0
    while step < t.steps and not job.stop_requested():
        picks = torch.randint(len(train), (rl.rollout_prompts,), generator=shuffle).tolist()
        r, rollout_s = rljob.timed(
            rollout, job, model, lm, ref, score, [train[i] for i in picks], generator
        )
        stats, update_s = rljob.timed(update, job, model, lm, r, optimizer, scheduler, shuffle)
        step += 1
        rollout_total += rollout_s
        update_total += update_s
        if step % t.log_every == 0 or step == t.steps:
            job.emit(
                step,
                loss=stats["loss"],
                grad_norm=stats["grad_norm"],
                lr=scheduler.get_last_lr()[0],
                reward_mean=float(r.scores.mean()),
                reward_std=float(r.scores.std()) if len(r.scores) > 1 else 0.0,
                kl=r.kl,
                entropy=stats["entropy"],
                clip_fraction=stats["clip_fraction"],
                **({} if grpo else {"value_loss": stats["value_loss"]}),  # GRPO: no value head
                response_length=sum(r.batch.response_lengths) / len(r.batch.response_lengths),
                rollout_seconds=rollout_s,
                update_seconds=update_s,
                step_time_seconds=rollout_s + update_s,
            )
        if t.eval_every and step % t.eval_every == 0 and step < t.steps:
            job.emit(step, "eval", **rljob.evaluate_policy(job, lm, ref, heldout).fields())
    end = rljob.evaluate_policy(job, lm, ref, heldout)
    name = "GRPO" if grpo else "PPO"
    log(rljob.eval_line(f"after {name} ({step} steps)", end))
    job.emit(step, "eval", **end.fields())
    share = rollout_total / max(rollout_total + update_total, 1e-9)
    log(
        f"time: rollouts {rollout_total:.1f} s, updates {update_total:.1f} s: "
        f"{share:.0%} of each step spent generating"
    )
    path = job.save(step, lm, optimizer)
    job.summary(
        checkpoint=str(path),
        algorithm=name,
        steps=step,
        heldout_prompts=len(heldout),
        pass_rate_before=start.pass_rate,
        pass_rate_after=end.pass_rate,
        kl_after=end.kl,
        response_length_after=end.mean_length,
        rollout_seconds=rollout_total,
        update_seconds=update_total,
        rollout_share=share,
    )
    return ExitCode.OK if step == t.steps else ExitCode.PREEMPTED
