"""What every RLHF job shares: the policy and its tokenizer, the frozen reference, the
verifier or reward model, progress records, held-out pass rate, and saving the result as an
ordinary checkpoint (eval, generate and another RL job load it like any other)."""

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from protos import attempt_pb2, job_pb2, trainer_config_pb2
from protos.config_yaml import ConfigError
from protos.enums import enum_name
from protos.files import write_json_atomic
from trainer import checkpoint
from trainer.config import train_dtype
from trainer.data.tokenizer import Tokenizer, load_tokenizer
from trainer.distributed import DistEnv
from trainer.loop import install_sigterm_handler
from trainer.metrics import MetricsLogger
from trainer.model_setup import seed_everything
from trainer.optim import build_optimizer, build_scheduler
from trainer.rl import policy, verifiers
from trainer.sizing import flops

Scorer = Callable[[list[str], list[str], list[list[int]], list[int]], torch.Tensor]


@dataclasses.dataclass
class RlJob:
    """A started REWARD, DPO or PPO job: its config, where it writes, its policy."""

    cfg: trainer_config_pb2.TrainerConfig
    kind: job_pb2.JobKind
    run_dir: Path
    env: DistEnv
    log: Callable[[str], None]
    metrics: MetricsLogger
    tokenizer: Tokenizer
    actor: policy.Loaded  # the policy being trained, from trainer.checkpoint.path
    stop_requested: Callable[[], bool]

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
        return policy.make_batch(sequences, self.tokenizer.pad_id, self.env.device)

    def sample(
        self, lm, prompts: list[str], per_prompt: int, generator: torch.Generator
    ) -> tuple[list[list[int]], list[int], list[str]]:
        """`per_prompt` responses to each prompt from `lm`, sampled by the inference engine
        from its live weights (trainer.rl's length and temperature; policy.sample): (sequences,
        where each response starts, each response's text). Response i answers
        prompts[i // per_prompt]."""
        rl = self.cfg.rl
        ids = [self.prompt_ids(p) for p in prompts]
        out = policy.sample(
            lm,
            ids,
            per_prompt,
            rl.max_new_tokens,
            temperature=rl.temperature,
            eos_id=self.tokenizer.eos_id,
            generator=generator,
            max_len=self.max_len,
        ).sequences
        starts = [len(ids[i // per_prompt]) for i in range(len(out))]
        texts = [self.tokenizer.decode(o[s:]) for o, s in zip(out, starts, strict=True)]
        return out, starts, texts

    def optimizer(self, model: torch.nn.Module, steps: int):
        opt = build_optimizer(model, self.cfg.optim, self.env.device)
        return opt, build_scheduler(opt, self.cfg.optim, steps)

    def emit(self, step: int, phase: str = "train", **fields) -> None:
        """One progress record of `fields`, and its log line (every field given, zeros too)."""
        self.metrics.emit(step=step, phase=phase, **fields)
        shown = ", ".join(
            f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}"
            for name, value in fields.items()
        )
        self.log(f"{phase} step {step}/{self.cfg.train.steps}: {shown}")

    def save(self, step: int, model, optimizer, extra: dict | None = None) -> Path:
        run = checkpoint.TrainingRun(
            kind=job_pb2.JobKind.Name(self.kind),
            model=self.actor.meta.model,
            vocab_size=self.actor.meta.vocab_size,
            dataset=self.actor.meta.dataset,
            world_size=1,
        )
        saver = checkpoint.Checkpointer(
            self.run_dir / "checkpoints", self.cfg.checkpoint.keep_last, self.env.is_main
        )
        path = saver.save(step, model, optimizer, {}, {}, run, extra=extra)
        self.log(f"saved {path}")
        return path

    def summary(self, **facts) -> None:
        """rl.json: the run's measured outcome, for people and tests."""
        if self.env.is_main:
            write_json_atomic(str(self.run_dir / "rl.json"), facts)
        self.log("summary: " + json.dumps(facts))


def start(
    cfg, attempt: attempt_pb2.Attempt, env: DistEnv, log, client, stop=lambda: False
) -> RlJob:
    """Load the policy (trainer.checkpoint.path) and its tokenizer; set up progress records."""
    seed_everything(cfg.train.seed)
    loaded = policy.load(
        cfg.checkpoint.path, "trainer.checkpoint.path", env.device, cfg.model.use_kernels
    )
    dataset = loaded.meta.dataset
    if not Path(dataset).exists():
        raise ConfigError(
            "trainer.checkpoint.path",
            f"{loaded.path} was trained on {dataset}, which is gone: its tokenizer is needed "
            "(precook that run's data again)",
        )
    tokenizer = load_tokenizer(dataset)
    dtype = train_dtype(cfg, env.device)
    metrics = MetricsLogger(
        attempt.run_dir,
        is_main=env.is_main,
        model_flops_per_token=0,
        peak=flops.peak_flops_per_second(env.device, dtype),
        world_size=1,
        log=log,
    )
    metrics.identity.update(
        job_id=attempt.job_id, attempt=attempt.number, total_steps=cfg.train.steps
    )
    if client is not None:
        metrics.sinks.append(client.send)
    params = sum(p.numel() for p in loaded.model.parameters())
    log(
        f"policy {loaded.path} ({loaded.meta.kind} step {loaded.meta.step}, "
        f"{params / 1e6:.2f} M parameters, vocabulary {loaded.meta.vocab_size})"
    )
    return RlJob(
        cfg, attempt.spec.kind, Path(attempt.run_dir), env, log, metrics, tokenizer, loaded, stop
    )


def stop_check(client) -> Callable[[], bool]:
    """SIGTERM or the launcher's stop request. A job that sees it saves what it has and exits
    75; an RL job does not resume mid-run (its retry starts again from checkpoint.path)."""
    sigterm = install_sigterm_handler()
    launcher_stop = client.stop_requested.is_set if client is not None else (lambda: False)
    return lambda: sigterm() or launcher_stop()


def reference(job: RlJob) -> torch.nn.Module:
    """The frozen reference: rl.reference_path, or the policy's own starting checkpoint."""
    rl = job.cfg.rl
    field = "trainer.rl.reference_path" if rl.reference_path else "trainer.checkpoint.path"
    ref = policy.load(
        rl.reference_path or job.cfg.checkpoint.path,
        field,
        job.env.device,
        job.cfg.model.use_kernels,
    )
    policy.check_matches(job.actor, ref, field)
    job.log(f"reference {ref.path} ({ref.meta.kind} step {ref.meta.step}), frozen")
    return policy.frozen(ref.model)


def load_reward_model(job: RlJob, path: str) -> tuple[torch.nn.Module, policy.ScalarHead]:
    """A REWARD checkpoint's model and head, refused unless it reads the policy's tokens."""
    field = "trainer.rl.reward_path"
    files = ("model.pt", policy.HEAD_FILE)
    loaded = policy.load(path, field, job.env.device, job.cfg.model.use_kernels, files)
    if loaded.meta.kind != "REWARD":
        raise ConfigError(field, f"{path} is a {loaded.meta.kind} checkpoint, not a REWARD one")
    policy.check_matches(job.actor, loaded, field, shape=False)
    head = policy.ScalarHead(loaded.meta.model).to(job.env.device)
    head.load_state_dict(torch.load(loaded.path / policy.HEAD_FILE, map_location="cpu"))
    job.log(f"reward model {loaded.path} (step {loaded.meta.step})")
    return policy.frozen(loaded.model), policy.frozen(head)


def verifier_of(cfg) -> verifiers.Verifier | None:
    """The verifier that rewards rollouts (None: the reward model does)."""
    return verifiers.VERIFIERS.get(cfg.rl.reward)


def scorer(job: RlJob) -> Scorer:
    """Scores of (prompt, response) texts: the verifier of rl.reward, or the reward model."""
    verify = verifier_of(job.cfg)
    if verify is not None:
        job.log(f"rewards: verifier {enum_name(job.cfg.rl, 'reward')}")

        def by_verifier(prompts, responses, ids, starts):
            values = [verify(p, r) for p, r in zip(prompts, responses, strict=True)]
            return torch.tensor(values, device=job.env.device)

        return by_verifier
    model, head = load_reward_model(job, job.cfg.rl.reward_path)

    @torch.no_grad()
    def by_model(prompts, responses, ids, starts):
        batch = job.batch(list(zip(ids, starts, strict=True)))
        return policy.scores(model, head, batch).float()

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
    job: RlJob, model, ref, prompts: list[str], samples_per_prompt: int = 4
) -> PolicyEval:
    """Sample `samples_per_prompt` responses per prompt from `model` (a fixed seed: the same
    draw before and after training), score them with the verifier, measure KL to `ref`."""
    rl = job.cfg.rl
    generator = torch.Generator(device=job.env.device).manual_seed(job.cfg.train.seed + 1)
    out, starts, texts = job.sample(model, prompts, samples_per_prompt, generator)
    verify = verifiers.VERIFIERS.get(rl.pass_verifier)
    rate = float("nan")
    if verify is not None:
        passed = [verify(prompts[i // samples_per_prompt], t) for i, t in enumerate(texts)]
        rate = sum(passed) / len(passed)
    kl = float("nan")
    if ref is not None:
        batch = job.batch(list(zip(out, starts, strict=True)))
        diff = (policy.token_logps(model, batch) - policy.token_logps(ref, batch)) * batch.mask
        kl = float(diff.sum(1).mean())
    lengths = [len(o) - s for o, s in zip(out, starts, strict=True)]
    return PolicyEval(rate, kl, len(out), sum(lengths) / len(lengths), texts[0])


def eval_line(name: str, e: PolicyEval) -> str:
    return (
        f"{name}: verifier pass rate {e.pass_rate:.1%} of {e.samples} sampled responses, "
        f"KL to the reference {e.kl:.3f} nats, {e.mean_length:.1f} tokens, e.g. {e.example!r}"
    )


def clip_and_step(model: torch.nn.Module, optimizer, scheduler, grad_clip: float) -> float:
    """Clip (when grad_clip > 0), step, zero the gradients; the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    else:
        norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def timed(fn, *args, **kwargs):
    """(fn's result, seconds it took)."""
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start
