"""REWARD: the policy's network with a scalar head, trained on preference pairs with the
Bradley-Terry loss (InstructGPT's reward model; TRL's RewardTrainer), on the one training core.
A micro-batch is `train.micro_batch` pairs; the loss is the mean over the global batch's pairs.
Reports loss, accuracy (chosen scored above rejected; a tie counts half) and the mean margin,
on the step's pairs and on the held-out ones."""

import dataclasses

import torch

from protos.config_yaml import ConfigError
from trainer.recipe import BatchCounts, Evaluation, ListBatches
from trainer.rl import data, losses, policy
from trainer.rl.job import Policy, RlRecipe


@dataclasses.dataclass(frozen=True)
class PairStats:
    loss: float
    accuracy: float
    margin: float


def stats(chosen: torch.Tensor, rejected: torch.Tensor) -> PairStats:
    diff = (chosen - rejected).detach()
    accuracy = float(((diff > 0).float() + 0.5 * (diff == 0).float()).mean())
    loss = float(losses.reward_loss(chosen, rejected).mean().detach())
    return PairStats(loss, accuracy, float(diff.mean()))


def split_pairs(cfg, log) -> tuple[list, list]:
    rl = cfg.rl
    prefs = data.read_preferences(rl.preferences)
    train, heldout = data.split(prefs.pairs, lambda p: p.prompt, rl.eval_fraction)
    log(
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


def pair_batch(pol: Policy, pairs: list[data.PreferencePair]) -> dict:
    """The chosen responses, then the rejected ones, as one right-padded batch."""
    seqs = [pol.pair_sequence(p.prompt, p.chosen) for p in pairs]
    seqs += [pol.pair_sequence(p.prompt, p.rejected) for p in pairs]
    return {"batch": pol.batch(seqs), "pairs": len(pairs)}


class PairRecipe(RlRecipe):
    """A recipe on preference pairs (REWARD, DPO): `train.micro_batch` pairs a micro-batch,
    drawn at random from the training pairs; the loss is summed over pairs."""

    # A step's loss is over a handful of pairs: a batch of hard pairs sits several times above
    # the median with nothing wrong (the guides' reward model tripped the spike rule 3 times in
    # a row at step 47). The loss guard checks finiteness only.
    loss_spikes_matter = False

    def prepare(self) -> None:
        self.train_pairs, self.heldout = split_pairs(self.cfg, self.log)

    def batches(self, rank: int, ranks: int, model) -> ListBatches:
        t = self.cfg.train
        make = lambda pairs: pair_batch(self.policy, pairs)  # noqa: E731
        return ListBatches(self.train_pairs, t.micro_batch, t.seed, rank, ranks, make)

    def counts(self, batch: dict) -> BatchCounts:
        ids = batch["batch"].ids
        pad_id = self.policy.tokenizer.pad_id
        return BatchCounts(float(batch["pairs"]), int((ids != pad_id).sum()), ids.numel())


class RewardRecipe(PairRecipe):
    def prepare(self) -> None:
        super().prepare()
        self.window: list[PairStats] = []

    def build(self) -> torch.nn.Module:
        return policy.WithHead(self.build_policy(), policy.ScalarHead(self.model_config)).to(
            self.device
        )

    def start(self, model: policy.WithHead) -> str:
        return self.start_policy(model.lm)

    def shard_units(self, model) -> list[torch.nn.Module]:
        return list(model.lm.layers)

    def language_model(self, model) -> torch.nn.Module:
        return model.lm

    def loss(self, model, batch: dict) -> torch.Tensor:
        n = batch["pairs"]
        s = policy.scores(model, batch["batch"])
        self.window.append(stats(s[:n], s[n:]))
        return losses.reward_loss(s[:n], s[n:]).sum()

    def step_fields(self) -> dict:
        w, self.window = self.window, []
        if not w:
            return {}
        return {
            "preference_accuracy": sum(x.accuracy for x in w) / len(w),
            "margin": sum(x.margin for x in w) / len(w),
        }

    @torch.no_grad()
    def heldout_stats(self, model) -> PairStats:
        chosen, rejected = [], []
        size = self.cfg.train.micro_batch
        for i in range(0, len(self.heldout), size):
            batch = pair_batch(self.policy, self.heldout[i : i + size])
            s = policy.scores(model, batch["batch"])
            chosen.append(s[: batch["pairs"]])
            rejected.append(s[batch["pairs"] :])
        return stats(torch.cat(chosen), torch.cat(rejected))

    def evaluate(self, model, step: int) -> Evaluation:
        was_training = model.training
        model.eval()
        e = self.heldout_stats(model)
        model.train(was_training)
        self.last_eval = e
        message = (
            f"eval at step {step}: held-out accuracy {e.accuracy:.1%} on {len(self.heldout)} "
            f"pairs (chance 50%), mean margin {e.margin:.3f}, loss {e.loss:.4f}"
        )
        fields = {"eval_loss": e.loss, "preference_accuracy": e.accuracy, "margin": e.margin}
        return Evaluation(e.loss, message, fields)

    def finish(self, model, run_dir, step: int) -> None:
        e = self.last_eval
        self.summary(
            run_dir,
            steps=step,
            heldout_pairs=len(self.heldout),
            heldout_accuracy=e.accuracy,
            heldout_margin=e.margin,
            heldout_loss_after=e.loss,
        )
