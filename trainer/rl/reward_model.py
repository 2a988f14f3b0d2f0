"""REWARD jobs: the policy's network with a scalar head, trained on preference pairs with the
Bradley-Terry loss (InstructGPT's reward model; TRL's RewardTrainer). Reports loss, held-out
accuracy (chosen scored above rejected; a tie counts half) and the mean margin."""

import dataclasses

import torch

from protos.config_yaml import ConfigError
from protos.exit_codes import ExitCode
from trainer.rl import data, losses, policy
from trainer.rl import job as rljob


@dataclasses.dataclass(frozen=True)
class PairStats:
    loss: float
    accuracy: float
    margin: float


def pair_scores(job: rljob.RlJob, model: policy.WithHead, pairs: list[data.PreferencePair]):
    seqs = [job.pair_sequence(p.prompt, p.chosen) for p in pairs]
    seqs += [job.pair_sequence(p.prompt, p.rejected) for p in pairs]
    s = policy.scores(model.lm, model.head, job.batch(seqs))
    return s[: len(pairs)], s[len(pairs) :]


def stats(chosen: torch.Tensor, rejected: torch.Tensor) -> PairStats:
    diff = (chosen - rejected).detach()
    accuracy = float(((diff > 0).float() + 0.5 * (diff == 0).float()).mean())
    loss = float(losses.reward_loss(chosen, rejected).mean().detach())
    return PairStats(loss, accuracy, float(diff.mean()))


@torch.no_grad()
def evaluate(job, model, pairs, batch_size: int) -> PairStats:
    chosen, rejected = [], []
    for i in range(0, len(pairs), batch_size):
        c, r = pair_scores(job, model, pairs[i : i + batch_size])
        chosen.append(c)
        rejected.append(r)
    return stats(torch.cat(chosen), torch.cat(rejected))


def split_pairs(job: rljob.RlJob) -> tuple[list, list]:
    rl = job.cfg.rl
    prefs = data.read_preferences(rl.preferences)
    train, heldout = data.split(prefs.pairs, lambda p: p.prompt, rl.eval_fraction)
    job.log(
        f"{rl.preferences}: {len(prefs.pairs)} pairs ({len(train)} to train on, "
        f"{len(heldout)} held out); {prefs.identical} skipped: chosen identical to rejected"
    )
    if not train or not heldout:
        raise ConfigError(
            "trainer.rl.eval_fraction",
            f"{rl.eval_fraction} leaves {len(train)} pairs to train on and {len(heldout)} "
            "held out: both need some",
        )
    return train, heldout


def run(cfg, attempt, env, log, client) -> ExitCode:
    job = rljob.start(cfg, attempt, env, log, client, rljob.stop_check(client))
    train, heldout = split_pairs(job)
    model = policy.WithHead(job.actor.model, policy.ScalarHead(job.actor.meta.model))
    model.to(env.device).train()
    t = cfg.train
    optimizer, scheduler = job.optimizer(model, t.steps)
    generator = torch.Generator().manual_seed(t.seed)
    before = evaluate(job, model, heldout, t.micro_batch)
    job.emit(0, "eval", eval_loss=before.loss, preference_accuracy=before.accuracy)
    window: list[PairStats] = []
    step = 0
    while step < t.steps and not job.stop_requested():
        step += 1
        picks = torch.randint(len(train), (t.micro_batch,), generator=generator).tolist()
        chosen, rejected = pair_scores(job, model, [train[i] for i in picks])
        losses.reward_loss(chosen, rejected).mean().backward()
        grad_norm = rljob.clip_and_step(model, optimizer, scheduler, cfg.optim.grad_clip)
        window.append(stats(chosen, rejected))
        if step % t.log_every == 0 or step == t.steps:
            job.emit(
                step,
                loss=sum(w.loss for w in window) / len(window),
                preference_accuracy=sum(w.accuracy for w in window) / len(window),
                margin=sum(w.margin for w in window) / len(window),
                grad_norm=grad_norm,
                lr=scheduler.get_last_lr()[0],
            )
            window = []
        if t.eval_every and step % t.eval_every == 0 and step < t.steps:
            e = evaluate(job, model, heldout, t.micro_batch)
            job.emit(
                step, "eval", eval_loss=e.loss, preference_accuracy=e.accuracy, margin=e.margin
            )
    after = evaluate(job, model, heldout, t.micro_batch)
    job.emit(
        step, "eval", eval_loss=after.loss, preference_accuracy=after.accuracy, margin=after.margin
    )
    path = job.save(step, model.lm, optimizer, extra={policy.HEAD_FILE: model.head.state_dict()})
    log(
        f"reward model: held-out accuracy {after.accuracy:.1%} on {len(heldout)} pairs "
        f"(chance 50%), mean margin {after.margin:.3f}, loss {before.loss:.4f} -> {after.loss:.4f}"
    )
    job.summary(
        checkpoint=str(path),
        steps=step,
        heldout_pairs=len(heldout),
        heldout_accuracy=after.accuracy,
        heldout_margin=after.margin,
        heldout_loss_before=before.loss,
        heldout_loss_after=after.loss,
    )
    return ExitCode.OK if step == t.steps else ExitCode.PREEMPTED
