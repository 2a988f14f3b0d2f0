"""DPO: Direct Preference Optimization (Rafailov et al. 2023) of the policy against a frozen
reference, on preference pairs, on the one training core. Sigmoid loss with beta, IPO and label
smoothing as options (TRL's DPOTrainer). A micro-batch is `train.micro_batch` pairs; the loss is
the mean over the global batch's pairs. Reports loss, implicit rewards of chosen and rejected,
margin, accuracy; held out, the verifier's pass rate and the KL to the reference of the policy's
own samples, before and after."""

import dataclasses

import torch

from protos import trainer_config_pb2
from trainer.recipe import Evaluation
from trainer.rl import job as rljob
from trainer.rl import losses, policy
from trainer.rl.reward_model import PairRecipe, pair_batch


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


def mean_stats(parts: list[DpoStats]) -> DpoStats:
    return DpoStats(
        *(sum(getattr(p, f.name) for p in parts) / len(parts) for f in dataclasses.fields(DpoStats))
    )


def sequence_logps(model, batch: policy.Batch, mean: bool) -> torch.Tensor:
    """Each response's summed (or, for IPO, mean) token log-probability."""
    total = (policy.token_logps(model, batch) * batch.mask).sum(1)
    return total / batch.mask.sum(1).clamp(min=1) if mean else total


class DpoRecipe(PairRecipe):
    def prepare(self) -> None:
        super().prepare()
        self.prompts = sorted({p.prompt for p in self.heldout})
        self.ref = rljob.reference(self.cfg, self.policy, self.device, self.log)
        self.window: list[DpoStats] = []

    def build(self) -> torch.nn.Module:
        return self.build_policy()

    def start(self, model) -> str:
        started = self.start_policy(model)
        self.before = rljob.evaluate_policy(self.cfg, self.policy, model, self.ref, self.prompts)
        self.log(rljob.eval_line("before DPO", self.before))
        return started

    def pair_loss(self, model, batch: dict) -> tuple[torch.Tensor, DpoStats]:
        rl = self.cfg.rl
        mean = rl.dpo_loss == trainer_config_pb2.IPO_LOSS
        pi = sequence_logps(model, batch["batch"], mean)
        with torch.no_grad():
            ref_logps = sequence_logps(self.ref, batch["batch"], mean)
        n = batch["pairs"]
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
        return out.sum(), stats

    def loss(self, model, batch: dict) -> torch.Tensor:
        total, stats = self.pair_loss(model, batch)
        self.window.append(stats)
        return total

    def step_fields(self) -> dict:
        w, self.window = self.window, []
        return mean_stats(w).fields() if w else {}

    @torch.no_grad()
    def evaluate(self, model, step: int) -> Evaluation:
        was_training = model.training
        model.eval()
        size = self.cfg.train.micro_batch
        parts = [
            self.pair_loss(model, pair_batch(self.policy, self.heldout[i : i + size]))[1]
            for i in range(0, len(self.heldout), size)
        ]
        held = mean_stats(parts)
        model.train(was_training)
        e = rljob.evaluate_policy(self.cfg, self.policy, model, self.ref, self.prompts)
        self.last = held, e
        message = rljob.eval_line(f"eval at step {step}", e)
        fields = {"eval_loss": held.loss, **e.fields(), **held.fields()}
        return Evaluation(held.loss, message, fields)

    def finish(self, model, run_dir, step: int) -> None:
        held, end = self.last
        self.summary(
            run_dir,
            steps=step,
            heldout_prompts=len(self.prompts),
            pass_rate_before=self.before.pass_rate,
            pass_rate_after=end.pass_rate,
            kl_after=end.kl,
            heldout_preference_accuracy=held.accuracy,
            heldout_margin=held.margin,
        )
