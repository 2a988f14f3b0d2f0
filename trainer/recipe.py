"""A recipe: what one kind of training job adds to the one training core (trainer/loop.py).

The core (`Trainer`) owns everything every kind is promised: the seeded model, its DDP/FSDP
wrapping (and tensor/pipeline/context parallel where the recipe allows them), gradient
accumulation, the loss guard with rollback, health (stragglers, replica and replay checks, hang
dumps), the gradient noise scale, fp16/bf16/fp8, metrics, goodput, checkpoints with exact
resume, stop and preemption. A recipe supplies only what differs (torchtitan's `Trainer`
hooks; TRL's one trainer per algorithm on one base):

- `build()`: the module it trains, every parameter the optimizer steps (a Transformer; one with
  a scalar head; a vision-language model). The core seeds the RNG first.
- `start(model)`: the weights to start from when the run does not resume (SFT, RL and distill
  start from `checkpoint.path`), before the model is wrapped.
- `batches(rank, ranks)`: an iterator of micro-batches for one data-parallel rank, resumable
  (`Batches`). A rollout phase (PPO, GRPO) lives here: it runs when the iterator needs data.
- `loss(model, batch)`: the batch's loss summed over its `units` (labelled tokens, preference
  pairs, response tokens). The core divides by the global batch's units, so one process with
  accumulation and N processes compute the same mean. `model` is the wrapped module: the loss
  goes through its forward (`head=`, trainer/model.py), so DDP and FSDP see the whole pass.
- `evaluate(model)`: the held-out evaluation, or None.
- `state_dict()`/`load_state_dict()`: what else a resume needs (checkpointed per rank).
- `step_fields()`: the kind's own metrics of the last step, in its progress record.
"""

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

import torch

from protos import job_pb2, trainer_config_pb2
from trainer.distributed import DistEnv

if TYPE_CHECKING:
    from trainer.jobs.context import JobContext
    from trainer.parallel.engine import Engine


class Batches(Protocol):
    """A resumable iterator of micro-batches (dicts of CPU tensors) for one data rank."""

    def __next__(self) -> dict: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def resume_state(self, saved: list[dict]) -> dict:
        """This rank's position from every writer rank's saved `state_dict()` (the writers
        may have been more or fewer ranks); ValueError when the order cannot continue."""
        ...


@dataclasses.dataclass(frozen=True)
class BatchCounts:
    """What a micro-batch holds, counted before its compute."""

    units: float  # what `loss` is summed over: labelled tokens, pairs, response tokens
    tokens: int  # token positions holding data (throughput and MFU count these)
    positions: int  # token positions computed, padding included


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """A held-out evaluation: its loss (NaN: none), the log line, the progress fields."""

    loss: float
    message: str
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    scores: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class Recipe:
    """The base every training kind subclasses (trainer/recipes/)."""

    model_parallel: ClassVar[bool] = False  # whether TP/PP/CP layouts may run it
    expert_parallel: ClassVar[bool] = False
    # Whether a loss far above its recent median means trouble (trainer/loss_guard.py): true of
    # a distance to a target (cross entropy, a preference loss), not of a policy gradient.
    loss_spikes_matter: ClassVar[bool] = True

    def __init__(
        self,
        cfg: trainer_config_pb2.TrainerConfig,
        kind: job_pb2.JobKind,
        env: DistEnv,
        dataset: str,
        vocab_size: int,
        dtype: torch.dtype,
        log,
    ):
        self.cfg, self.kind, self.env, self.log = cfg, kind, env, log
        self.dataset, self.vocab_size, self.dtype = dataset, vocab_size, dtype
        self.device = env.device
        # The architecture its checkpoints record (an RL recipe's is its policy checkpoint's).
        self.model_config: trainer_config_pb2.ModelConfig = cfg.model
        # The model-parallel engine (trainer/parallel/engine.py) when the layout has one: set
        # by the core once the model is wrapped.
        self.engine: Engine | None = None

    @classmethod
    def for_job(cls, ctx: "JobContext") -> Self:
        """The recipe of a job: its data precooked (the default) or found, its dtype."""
        from trainer.config import train_dtype
        from trainer.jobs.context import precook, vocab_size_of

        ds = precook(ctx)
        dtype = train_dtype(ctx.cfg, ctx.env.device)
        return cls(ctx.cfg, ctx.kind, ctx.env, ds.path, vocab_size_of(ds), dtype, ctx.log)

    # ---------------------------------------------------------------- the model

    def build(self) -> torch.nn.Module:
        raise NotImplementedError

    def start(self, model: torch.nn.Module) -> str:
        """Load starting weights into the bare `model`; what was loaded, for the log ("" when
        the run starts from the seeded initialization)."""
        return ""

    def shard_units(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The modules FSDP shards one by one before the root (their weights are gathered just
        before each runs)."""
        return list(model.layers)

    def language_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The Transformer inside the bare `model` (what eval, generate and serve load from
        this run's checkpoints)."""
        return model

    def flops_per_token(self, model: torch.nn.Module) -> float:
        raise NotImplementedError

    def describe(self, model: torch.nn.Module) -> str:
        """A log line on what this kind trains beyond a plain language model ("": nothing)."""
        return ""

    # ---------------------------------------------------------------- the data and the loss

    def batches(self, rank: int, ranks: int, model: torch.nn.Module) -> Batches:
        raise NotImplementedError

    def counts(self, batch: dict) -> BatchCounts:
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    # ---------------------------------------------------------------- around the steps

    def evaluate(self, model: torch.nn.Module, step: int) -> Evaluation | None:
        return None

    def step_fields(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def finish(self, model: torch.nn.Module, run_dir, step: int) -> None:
        """After the last step and the final evaluation, on every rank: a summary. `model` is
        the recipe's module (not a DDP wrapper; under FSDP its forwards are collective)."""


class ListBatches:
    """`Batches` over items drawn at random, with replacement, from an in-memory list: every
    data rank draws the same global sequence of micro-batches from one seeded generator and
    keeps micro-batch g where g % ranks == rank (as PackedRowLoader deals global batches), so
    the global batch of a step is the same for any number of ranks."""

    def __init__(self, items: list, batch_size: int, seed: int, rank: int, ranks: int, make):
        self.items, self.batch_size, self.seed = items, batch_size, seed
        self.rank, self.ranks, self.make = rank, ranks, make
        self.drawn = 0  # global micro-batches drawn so far

    def _draw(self, g: int) -> list:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + g)
        picks = torch.randint(len(self.items), (self.batch_size,), generator=gen).tolist()
        return [self.items[i] for i in picks]

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        g = self.drawn + self.rank
        self.drawn += self.ranks
        return self.make(self._draw(g))

    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "seed": self.seed, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        for name in ("seed", "batch_size"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"loader state was saved with {name}={state[name]!r}, this run has "
                    f"{getattr(self, name)!r}: the batch order would differ"
                )
        self.drawn = int(state["drawn"])

    def resume_state(self, saved: list[dict]) -> dict:
        return dict(saved[0])  # every rank's `drawn` counts global micro-batches
