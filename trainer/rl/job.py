"""What every RLHF recipe shares (REWARD, DPO, PPO/GRPO on the one training core): the policy
checkpoint and its tokenizer, sequences laid out as SFT trained them, the frozen reference, the
verifier or reward model, and the held-out evaluation of a policy's own samples."""

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Self

import torch

from protos import trainer_config_pb2
from protos.config_yaml import ConfigError
from protos.defaults import head_dim
from protos.enums import enum_name
from protos.files import write_json_atomic
from trainer import checkpoint, distributed
from trainer.data.tokenizer import Tokenizer, load_tokenizer
from trainer.model import Transformer, select_ops
from trainer.recipe import Recipe
from trainer.rl import policy, verifiers
from trainer.sizing import flops

Scorer = Callable[[list[str], list[str], list[list[int]], list[int]], torch.Tensor]


@dataclasses.dataclass
class Policy:
    """The checkpoint an RL job starts from (trainer.checkpoint.path) and its tokenizer."""

    actor: policy.Loaded
    tokenizer: Tokenizer
    device: torch.device

    @property
    def max_len(self) -> int:
        return self.actor.meta.model.max_seq_len

    def prompt_ids(self, prompt: str) -> list[int]:
        ids, _ = policy.layout(
            self.tokenizer.bos_id, self.tokenizer.encode(prompt), [], self.max_len
        )
        return ids

    def pair_sequence(self, prompt: str, response: str) -> tuple[list[int], int]:
        """`<bos> prompt response <eos>` as SFT laid it out, and where the response starts."""
        response_ids = self.tokenizer.encode(response) + [self.tokenizer.eos_id]
        return policy.layout(
            self.tokenizer.bos_id, self.tokenizer.encode(prompt), response_ids, self.max_len
        )

    def batch(self, sequences: list[tuple[list[int], int]]) -> policy.Batch:
        return policy.make_batch(sequences, self.tokenizer.pad_id, self.device)

    def sample(
        self,
        model,
        prompts: list[str],
        per_prompt: int,
        rl: trainer_config_pb2.RlConfig,
        generator: torch.Generator,
    ) -> tuple[policy.Rollouts, list[int], list[str]]:
        """`per_prompt` responses to each prompt from `model` (a policy, with or without a
        scalar head, wrapped or not), sampled by the inference engine
        from its live weights (trainer.rl's length and temperature; policy.sample): (the
        sequences and their log-probabilities, where each response starts, each response's
        text). Response i answers prompts[i // per_prompt]."""
        ids = [self.prompt_ids(p) for p in prompts]
        # The engine reads the weights in place, outside the model's forward: every rank
        # gathers them whole first (FSDP; a DDP wrapper is only unwrapped).
        with distributed.whole(model) as bare:
            out = policy.sample(
                policy.language_model(bare),
                ids,
                per_prompt,
                rl.max_new_tokens,
                temperature=rl.temperature,
                eos_id=self.tokenizer.eos_id,
                generator=generator,
                max_len=self.max_len,
            )
        starts = [len(ids[i // per_prompt]) for i in range(len(out.sequences))]
        texts = [self.tokenizer.decode(o[s:]) for o, s in zip(out.sequences, starts, strict=True)]
        return out, starts, texts


def load_policy(cfg: trainer_config_pb2.TrainerConfig, device, log) -> Policy:
    """The policy of trainer.checkpoint.path and the tokenizer of the data it was trained on."""
    loaded = policy.load(
        cfg.checkpoint.path, "trainer.checkpoint.path", device, cfg.model.use_kernels
    )
    dataset = loaded.meta.dataset
    if not Path(dataset).exists():
        raise ConfigError(
            "trainer.checkpoint.path",
            f"{loaded.path} was trained on {dataset}, which is gone: its tokenizer is needed "
            "(precook that run's data again)",
        )
    params = sum(p.numel() for p in loaded.model.parameters())
    log(
        f"policy {loaded.path} ({loaded.meta.kind} step {loaded.meta.step}, "
        f"{params / 1e6:.2f} M parameters, vocabulary {loaded.meta.vocab_size})"
    )
    return Policy(loaded, load_tokenizer(dataset), device)


class RlRecipe(Recipe):
    """The base of the RLHF recipes: the model is the policy checkpoint's architecture, its
    starting weights the checkpoint's, its tokenizer the one it was trained with."""

    policy: Policy

    @classmethod
    def for_job(cls, ctx) -> Self:
        from trainer.config import train_dtype

        pol = load_policy(ctx.cfg, ctx.env.device, ctx.log)
        meta = pol.actor.meta
        dtype = train_dtype(ctx.cfg, ctx.env.device)
        recipe = cls(ctx.cfg, ctx.kind, ctx.env, meta.dataset, meta.vocab_size, dtype, ctx.log)
        recipe.policy, recipe.model_config = pol, meta.model
        recipe.prepare()
        return recipe

    def prepare(self) -> None:
        """What the recipe reads before the model is built (its pairs, prompts, reference)."""

    def build_policy(self) -> Transformer:
        ops = select_ops(self.cfg.model.use_kernels, self.device)
        return Transformer(self.model_config, self.vocab_size, ops=ops).to(self.device)

    def start_policy(self, lm: torch.nn.Module) -> str:
        path = self.policy.actor.path
        # load_policy read and verified model.pt already: its weights, not a second read
        checkpoint.load_model_state(lm, self.policy.actor.model.state_dict())
        del self.policy.actor.model  # the trained copy is the core's from here on
        return f"starting from the policy {path}"

    def flops_per_token(self, model: torch.nn.Module) -> float:
        m = self.model_config
        lm = self.language_model(model)
        return flops.flops_per_token(
            lm.matmul_params(), m.n_layers, m.n_heads, head_dim(m), self.policy.max_len
        )

    def summary(self, run_dir, **facts) -> None:
        """rl.json: the run's measured outcome, for people and tests."""
        if self.env.is_main:
            write_json_atomic(str(Path(run_dir) / "rl.json"), facts)
        self.log("summary: " + json.dumps(facts))


def reference(cfg, pol: Policy, device, log) -> torch.nn.Module:
    """The frozen reference: rl.reference_path, or the policy's own starting checkpoint."""
    rl = cfg.rl
    field = "trainer.rl.reference_path" if rl.reference_path else "trainer.checkpoint.path"
    ref = policy.load(
        rl.reference_path or cfg.checkpoint.path, field, device, cfg.model.use_kernels
    )
    policy.check_matches(pol.actor, ref, field)
    log(f"reference {ref.path} ({ref.meta.kind} step {ref.meta.step}), frozen")
    return policy.frozen(ref.model)


def load_reward_model(cfg, pol: Policy, path: str, device, log):
    """A REWARD checkpoint's model and head, refused unless it reads the policy's tokens."""
    field = "trainer.rl.reward_path"
    loaded = policy.load(path, field, device, cfg.model.use_kernels)
    if loaded.meta.kind != "REWARD":
        raise ConfigError(field, f"{path} is a {loaded.meta.kind} checkpoint, not a REWARD one")
    policy.check_matches(pol.actor, loaded, field, shape=False)
    head = policy.ScalarHead(loaded.meta.model).to(device)
    state = torch.load(loaded.path / "model.pt", map_location="cpu", mmap=True, weights_only=True)
    head.load_state_dict({k[len("head.") :]: v for k, v in state.items() if k.startswith("head.")})
    log(f"reward model {loaded.path} (step {loaded.meta.step})")
    return policy.frozen(loaded.model), policy.frozen(head)


def scorer(cfg, pol: Policy, device, log) -> Scorer:
    """Scores of (prompt, response) texts: the verifier of rl.reward, or the reward model."""
    verify = verifiers.VERIFIERS.get(cfg.rl.reward)
    if verify is not None:
        log(f"rewards: verifier {enum_name(cfg.rl, 'reward')}")

        def by_verifier(prompts, responses, ids, starts):
            values = [verify(p, r) for p, r in zip(prompts, responses, strict=True)]
            return torch.tensor(values, device=device)

        return by_verifier
    model, head = load_reward_model(cfg, pol, cfg.rl.reward_path, device, log)

    @torch.no_grad()
    def by_model(prompts, responses, ids, starts):
        batch = pol.batch(list(zip(ids, starts, strict=True)))
        return policy.scores(model, batch, head).float()

    return by_model


@dataclasses.dataclass(frozen=True)
class PolicyEval:
    """The verifier's verdict on responses sampled from a policy for held-out prompts."""

    pass_rate: float  # NaN without a verifier
    kl: float  # mean over responses of sum_t log pi - log pi_ref (NaN without a reference)
    samples: int
    mean_length: float
    example: str  # one response, for the log

    def fields(self) -> dict:
        return {"pass_rate": self.pass_rate, "kl": self.kl, "response_length": self.mean_length}


@torch.no_grad()
def evaluate_policy(
    cfg, pol: Policy, model, ref, prompts: list[str], samples_per_prompt: int = 4
) -> PolicyEval:
    """Sample `samples_per_prompt` responses per prompt from `model` (a fixed seed: the same
    draw before and after training), score them with the verifier, measure KL to `ref`.
    `model`: the trained module as the core holds it (a DDP or FSDP one too; every rank calls
    this the same way)."""
    rl = cfg.rl
    was_training = model.training
    model.eval()
    generator = torch.Generator(device=pol.device).manual_seed(cfg.train.seed + 1)
    sampled, starts, texts = pol.sample(model, prompts, samples_per_prompt, rl, generator)
    out = sampled.sequences
    verify = verifiers.VERIFIERS.get(rl.pass_verifier)
    rate = float("nan")
    if verify is not None:
        passed = [verify(prompts[i // samples_per_prompt], t) for i, t in enumerate(texts)]
        rate = sum(passed) / len(passed)
    kl = float("nan")
    if ref is not None:
        batch = pol.batch(list(zip(out, starts, strict=True)))
        diff = (policy.token_logps(model, batch) - policy.token_logps(ref, batch)) * batch.mask
        kl = float(diff.sum(1).mean())
    model.train(was_training)
    lengths = [len(o) - s for o, s in zip(out, starts, strict=True)]
    return PolicyEval(rate, kl, len(out), sum(lengths) / len(lengths), texts[0])


def eval_line(name: str, e: PolicyEval) -> str:
    return (
        f"{name}: verifier pass rate {e.pass_rate:.1%} of {e.samples} sampled responses, "
        f"KL to the reference {e.kl:.3f} nats, {e.mean_length:.1f} tokens, e.g. {e.example!r}"
    )
