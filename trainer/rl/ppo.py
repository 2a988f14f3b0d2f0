"""PPO and GRPO: on-policy RL from a verifier or a reward model (InstructGPT; TRL's PPOTrainer
and GRPOTrainer), on the one training core.

The rollout phase is the recipe's batches (`Rollouts`): when a step starts and the current
rollout is used up, the policy samples `rl.group_size` responses to each of `rl.rollout_prompts`
prompts with its current weights, they are scored, and their old log-probabilities, the
reference's and the advantages are computed once. The rollout's responses are then dealt out,
`rl.ppo_epochs` shuffled passes cut into micro-batches of `train.micro_batch` responses, each
optimizer step taking `train.grad_accum` micro-batches on every data-parallel rank. A step whose
micro-batches run past the rollout's last takes its first ones again (a partial extra pass), so
every step of any layout sees the same global batch: one process with 2 accumulation steps and 2
processes with 1 train alike. The loss is the mean over the global batch's response tokens.

CLIPPED_PPO: per-token reward -kl_coef * (log pi - log pi_ref), plus the score at the last
token; a value head on the policy's trunk; GAE advantages (whitened over the rollout); clipped
policy and value losses. GRPO (Shao et al. 2024): the advantage of a response is its score
normalized within its prompt's group, no value head; KL to the reference is a loss term (k3),
weighted kl_coef.

Every step reports where its time went (rollout_seconds): RL is bound by generation, and a run
that hides that is hard to speed up. The rollout is part of the checkpoint (every rank's), so a
resumed run continues mid-rollout exactly.
"""

import time

import torch
import torch.nn.functional as F

from protos import trainer_config_pb2
from protos.config_yaml import ConfigError
from trainer.recipe import BatchCounts, Evaluation
from trainer.rl import data, losses, policy
from trainer.rl import job as rljob

# What a rollout holds per response, sliced into micro-batches (tensors with a response axis).
FIELDS = ("ids", "mask", "last", "old_logps", "ref_logps", "advantages", "old_values", "returns")


def logprob_diff(engine: list[list[float]], trainer: torch.Tensor, starts: list[int]) -> float:
    """The largest |engine - trainer| log pi over the response tokens (response i starts at
    starts[i]; trainer[i, t] is log pi of token t + 1): what the engine reported when it
    sampled them against what the trainer recomputes from the same weights."""
    worst = 0.0
    for row, (reported, start) in enumerate(zip(engine, starts, strict=True)):
        if reported:
            recomputed = trainer[row, start - 1 : start - 1 + len(reported)]
            got = torch.tensor(reported, dtype=recomputed.dtype, device=recomputed.device)
            worst = max(worst, float((got - recomputed).abs().max()))
    return worst


class Rollouts:
    """`Batches` of a PPO run: micro-batches of the current rollout, a new one when it is used
    up at a step's start (see the module docstring)."""

    def __init__(self, recipe: "PpoRecipe", rank: int, ranks: int, model: torch.nn.Module):
        self.recipe, self.rank, self.ranks, self.model = recipe, rank, ranks, model
        self.accum = recipe.cfg.train.grad_accum
        self.rollouts = 0  # rollouts made so far
        self.cursor = 0  # the global micro-batch the current step started at
        self.taken = 0  # micro-batches taken in the current step
        self.data: dict[str, torch.Tensor] = {}
        self.chunks: list[torch.Tensor] = []

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.taken == 0 and self.cursor >= len(self.chunks):
            seconds = self._rollout()
            self.recipe.rollout_s += seconds
            self.recipe.rollout_total += seconds
            self.cursor = 0
        g = self.cursor + self.taken * self.ranks + self.rank
        idx = self.chunks[g % len(self.chunks)]
        self.taken += 1
        if self.taken == self.accum:
            self.taken, self.cursor = 0, self.cursor + self.accum * self.ranks
        return {k: v[idx] for k, v in self.data.items()}

    def _rollout(self) -> float:
        start = time.perf_counter()
        r = self.recipe
        r.started = r.started or start  # training starts with the first rollout
        rl, t = r.cfg.rl, r.cfg.train
        gen = torch.Generator().manual_seed(t.seed * 1_000_003 + self.rollouts)
        picks = torch.randint(len(r.train_prompts), (rl.rollout_prompts,), generator=gen)
        prompts = [r.train_prompts[i] for i in picks.tolist()]
        was_training = self.model.training
        self.model.eval()
        self.data = r.make_rollout(self.model, prompts, gen)
        self.model.train(was_training)
        n = len(self.data["ids"])
        self.chunks = [
            chunk
            for _ in range(rl.ppo_epochs)
            for chunk in torch.randperm(n, generator=gen).split(t.micro_batch)
        ]
        self.rollouts += 1
        return time.perf_counter() - start

    def state_dict(self) -> dict:
        """The position (meta.json); the rollout itself is the recipe's state (train.pt)."""
        return {"rollouts": self.rollouts, "cursor": self.cursor, "taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        self.rollouts, self.cursor, self.taken = state["rollouts"], state["cursor"], state["taken"]

    def rollout_state(self) -> dict:
        return {"data": {k: v.cpu() for k, v in self.data.items()}, "chunks": self.chunks}

    def load_rollout_state(self, state: dict) -> None:
        self.data = {k: v.to(self.recipe.device) for k, v in state["data"].items()}
        self.chunks = state["chunks"]

    def resume_state(self, saved: list[dict]) -> dict:
        return saved[0]  # every rank holds the same global rollout


class PpoRecipe(rljob.RlRecipe):
    loss_spikes_matter = False  # a clipped policy gradient sits around 0 and changes sign

    def prepare(self) -> None:
        rl = self.cfg.rl
        prompts = data.read_prompts(rl.prompts)
        self.train_prompts, self.heldout = data.split(prompts, lambda p: p, rl.eval_fraction)
        self.log(
            f"{rl.prompts}: {len(prompts)} prompts ({len(self.train_prompts)} to train on, "
            f"{len(self.heldout)} held out)"
        )
        if not self.train_prompts:
            raise ConfigError(
                "trainer.rl.eval_fraction", f"{rl.eval_fraction} leaves no prompt to train on"
            )
        self.grpo = rl.algorithm == trainer_config_pb2.GRPO
        self.ref = rljob.reference(self.cfg, self.policy, self.device, self.log)
        self.score = rljob.scorer(self.cfg, self.policy, self.device, self.log)
        # Seconds spent in rollouts since the last logged step, and in this process.
        self.rollout_s, self.rollout_total = 0.0, 0.0
        self.started = 0.0  # perf_counter() at this process's first rollout
        self.window: dict[str, list[float]] = {}
        self.last: dict[str, float] = {}

    def build(self) -> torch.nn.Module:
        lm = self.build_policy()
        if self.grpo:
            return lm
        return policy.WithHead(lm, policy.ScalarHead(self.model_config)).to(self.device)

    def start(self, model) -> str:
        started = self.start_policy(policy.language_model(model))
        self.before = rljob.evaluate_policy(self.cfg, self.policy, model, self.ref, self.heldout)
        self.log(rljob.eval_line(f"before {self.name}", self.before))
        return started

    @property
    def name(self) -> str:
        return "GRPO" if self.grpo else "PPO"

    def shard_units(self, model) -> list[torch.nn.Module]:
        return list(policy.language_model(model).layers)

    def language_model(self, model) -> torch.nn.Module:
        return policy.language_model(model)

    def batches(self, rank: int, ranks: int, model) -> Rollouts:
        self.rollouts = Rollouts(self, rank, ranks, model)
        return self.rollouts

    def state_dict(self) -> dict:
        return self.rollouts.rollout_state()

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.rollouts.load_rollout_state(state)

    def forward(self, model, ids: torch.Tensor, entropy: bool = True):
        """(log pi of each next token (B, T - 1), the entropy of each next-token distribution
        or None, the value head's values or None for GRPO) from one pass through `model`'s
        forward: the root module, so DDP and FSDP see it whole."""
        grpo = self.grpo

        def head(m, hidden):
            lm = policy.language_model(m)
            logits = F.linear(hidden[:, :-1], lm.output.weight).float()
            logp_all = logits.log_softmax(-1)
            logps = torch.gather(logp_all, 2, ids[:, 1:, None]).squeeze(-1)
            ent = -(logp_all.exp() * logp_all).sum(-1) if entropy else None
            values = None if grpo else m.head(hidden[:, :-1])
            return logps, ent, values

        positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
        return model(ids, positions, None, head=head)

    @torch.no_grad()
    def make_rollout(self, model, prompts: list[str], gen: torch.Generator) -> dict:
        """Sample, score and evaluate one rollout with `model`'s current weights (every rank
        the same: the core's module, which the sampler and the forward pass each see whole)."""
        rl, G = self.cfg.rl, self.cfg.rl.group_size
        sampled, starts, texts = self.policy.sample(model, prompts, G, rl, gen)
        out = sampled.sequences
        scores = self.score([prompts[i // G] for i in range(len(out))], texts, out, starts)
        scores = scores.float()
        batch = self.policy.batch(list(zip(out, starts, strict=True)))
        old_logps, _, values = self.forward(model, batch.ids, entropy=False)
        ref_logps = policy.token_logps(self.ref, batch)
        mask = batch.mask
        zeros = torch.zeros_like(mask)
        if self.grpo:
            advantages = losses.grpo_advantages(scores, G)[:, None] * mask
            values, returns = zeros, zeros
        else:
            values = values * mask
            rewards = -rl.kl_coef * (old_logps - ref_logps) * mask
            rewards[torch.arange(len(out)), batch.last - 1] += scores
            advantages, returns = losses.gae(rewards, values, mask, rl.gamma, rl.gae_lambda)
            advantages = losses.whiten(advantages, mask)
        self.last = {
            "reward_mean": float(scores.mean()),
            "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
            "kl": float(((old_logps - ref_logps) * mask).sum(1).mean()),
            "response_length": sum(batch.response_lengths) / len(batch.response_lengths),
            "rollout_logprob_diff": logprob_diff(sampled.logprobs, old_logps, starts),
        }
        return {
            "ids": batch.ids,
            "mask": mask,
            "last": batch.last,
            "old_logps": old_logps,
            "ref_logps": ref_logps,
            "advantages": advantages,
            "old_values": values,
            "returns": returns,
        }

    def counts(self, batch: dict) -> BatchCounts:
        ids = batch["ids"]
        return BatchCounts(
            float(batch["mask"].sum()),
            int((ids != self.policy.tokenizer.pad_id).sum()),
            ids.numel(),
        )

    def loss(self, model, batch: dict) -> torch.Tensor:
        rl = self.cfg.rl
        mask = batch["mask"]
        logps, entropy, values = self.forward(model, batch["ids"])
        n = mask.sum()
        pg, clipped = losses.clipped_policy_loss(
            logps, batch["old_logps"], batch["advantages"], mask, rl.clip_range
        )
        total = pg * n  # the losses are means over the micro-batch's tokens: back to sums
        if values is not None:
            vloss = losses.clipped_value_loss(
                values, batch["old_values"], batch["returns"], mask, rl.value_clip
            )
            total = total + rl.value_coef * vloss * n
            self._note("value_loss", float(vloss.detach()))
        else:
            kl = losses.masked_mean(losses.k3_kl(logps, batch["ref_logps"]), mask)
            total = total + rl.kl_coef * kl * n
        self._note("clip_fraction", float(clipped))
        self._note("entropy", float(losses.masked_mean(entropy.detach(), mask)))
        return total

    def _note(self, name: str, value: float) -> None:
        self.window.setdefault(name, []).append(value)

    def step_fields(self) -> dict:
        fields = {k: sum(v) / len(v) for k, v in self.window.items()}
        self.window = {}
        fields.update(self.last, rollout_seconds=self.rollout_s)
        self.rollout_s = 0.0
        return fields

    def evaluate(self, model, step: int) -> Evaluation:
        e = rljob.evaluate_policy(self.cfg, self.policy, model, self.ref, self.heldout)
        self.end = e
        message = rljob.eval_line(f"eval at step {step}", e)
        return Evaluation(float("nan"), message, e.fields())

    def finish(self, model, run_dir, step: int) -> None:
        end = self.end
        self.log(rljob.eval_line(f"after {self.name} ({step} steps)", end))
        trained = time.perf_counter() - (self.started or time.perf_counter())
        share = self.rollout_total / max(trained, 1e-9)
        self.log(
            f"time: rollouts {self.rollout_total:.1f} s of {trained:.1f} s of training in this "
            f"process: {share:.0%} of each step spent generating (the rest: updates, reports, "
            "evaluation)"
        )
        self.summary(
            run_dir,
            algorithm=self.name,
            steps=step,
            heldout_prompts=len(self.heldout),
            pass_rate_before=self.before.pass_rate,
            pass_rate_after=end.pass_rate,
            kl_after=end.kl,
            response_length_after=end.mean_length,
            rollout_seconds=self.rollout_total,
            rollout_share=share,
        )
