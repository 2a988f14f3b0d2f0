"""DPO jobs: Direct Preference Optimization (Rafailov et al. 2023) of the policy against a
frozen reference, on preference pairs. Sigmoid loss with beta, IPO and label smoothing as
options (TRL's DPOTrainer). Reports loss, implicit rewards of chosen and rejected, margin,
accuracy; before and after, the verifier's pass rate on held-out prompts and the KL to the
reference of the policy's own samples."""

import dataclasses

import torch

from protos import trainer_config_pb2
from protos.exit_codes import ExitCode
from trainer.rl import data, losses, policy
from trainer.rl import job as rljob
from trainer.rl.reward_model import split_pairs


@dataclasses.dataclass(frozen=True)
class DpoStats:
    loss: float
    chosen_reward: float
    rejected_reward: float
    accuracy: float

    @property
    def margin(self) -> float:
        return self.chosen_reward - self.rejected_reward

    def fields(self) -> dict:
        return {
            "chosen_reward": self.chosen_reward,
            "rejected_reward": self.rejected_reward,
            "margin": self.margin,
            "preference_accuracy": self.accuracy,
        }


def sequence_logps(model, batch: policy.Batch, mean: bool) -> torch.Tensor:
    """Each response's summed (or, for IPO, mean) token log-probability."""
    total = (policy.token_logps(model, batch) * batch.mask).sum(1)
    return total / batch.mask.sum(1).clamp(min=1) if mean else total


def pair_loss(job: rljob.RlJob, model, ref, pairs: list[data.PreferencePair]):
    rl = job.cfg.rl
    seqs = [job.pair_sequence(p.prompt, p.chosen) for p in pairs]
    seqs += [job.pair_sequence(p.prompt, p.rejected) for p in pairs]
    batch = job.batch(seqs)
    mean = rl.dpo_loss == trainer_config_pb2.IPO_LOSS
    pi = sequence_logps(model, batch, mean)
    with torch.no_grad():
        ref_logps = sequence_logps(ref, batch, mean)
    n = len(pairs)
    out, chosen, rejected = losses.dpo_loss(
        pi[:n], pi[n:], ref_logps[:n], ref_logps[n:], rl.beta,
        loss=rl.dpo_loss, label_smoothing=rl.label_smoothing,
    )  # fmt: skip
    stats = DpoStats(
        float(out.mean().detach()),
        float(chosen.mean()),
        float(rejected.mean()),
        float((chosen > rejected).float().mean()),
    )
    return out.mean(), stats


@torch.no_grad()
def evaluate(job, model, ref, pairs, batch_size: int) -> DpoStats:
    parts = [
        pair_loss(job, model, ref, pairs[i : i + batch_size])[1]
        for i in range(0, len(pairs), batch_size)
    ]
    return DpoStats(
        *(sum(getattr(p, f.name) for p in parts) / len(parts) for f in dataclasses.fields(DpoStats))
    )


def run(cfg, attempt, env, log, client) -> ExitCode:
    job = rljob.start(cfg, attempt, env, log, client, rljob.stop_check(client))
    ref = rljob.reference(job)
    train, heldout = split_pairs(job)
    prompts = sorted({p.prompt for p in heldout})
    model = job.actor.model.train()
    t = cfg.train
    optimizer, scheduler = job.optimizer(model, t.steps)
    generator = torch.Generator().manual_seed(t.seed)
    start = rljob.evaluate_policy(job, model, ref, prompts)
    log(rljob.eval_line("before DPO", start))
    job.emit(0, "eval", **start.fields())
    window: list[DpoStats] = []
    step = 0
    while step < t.steps and not job.stop_requested():
        step += 1
        model.train()
        picks = torch.randint(len(train), (t.micro_batch,), generator=generator).tolist()
        loss, stats = pair_loss(job, model, ref, [train[i] for i in picks])
        loss.backward()
        grad_norm = rljob.clip_and_step(model, optimizer, scheduler, cfg.optim.grad_clip)
        window.append(stats)
        if step % t.log_every == 0 or step == t.steps:
            mean = DpoStats(
                *(
                    sum(getattr(w, f.name) for w in window) / len(window)
                    for f in dataclasses.fields(DpoStats)
                )
            )
            job.emit(
                step,
                loss=mean.loss,
                grad_norm=grad_norm,
                lr=scheduler.get_last_lr()[0],
                **mean.fields(),
            )
            window = []
        if t.eval_every and step % t.eval_every == 0 and step < t.steps:
            e = rljob.evaluate_policy(job, model, ref, prompts)
            job.emit(step, "eval", **e.fields())
    held = evaluate(job, model, ref, heldout, t.micro_batch)
    end = rljob.evaluate_policy(job, model, ref, prompts)
    log(rljob.eval_line(f"after DPO ({step} steps)", end))
    job.emit(step, "eval", eval_loss=held.loss, **end.fields(), **held.fields())
    path = job.save(step, model, optimizer)
    job.summary(
        checkpoint=str(path),
        steps=step,
        heldout_prompts=len(prompts),
        pass_rate_before=start.pass_rate,
        pass_rate_after=end.pass_rate,
        kl_after=end.kl,
        heldout_preference_accuracy=held.accuracy,
        heldout_margin=held.margin,
    )
    return ExitCode.OK if step == t.steps else ExitCode.PREEMPTED
