"""Models of an RLHF job: checkpoints checked against each other, sequences laid out the way
SFT trained them (`<bos> prompt response <eos>`, trainer/data/tokenized.py), their per-token
log-probabilities, a scalar head (reward model, value function) and rollouts sampled by the
inference engine (trainer/inference/offline.py) from the policy's live weights.
"""

import dataclasses
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from google.protobuf import json_format

from protos import trainer_config_pb2
from protos.config_yaml import ConfigError
from trainer import checkpoint
from trainer.inference import offline
from trainer.inference.engine import SamplingParams
from trainer.model import Transformer


@dataclasses.dataclass
class Loaded:
    model: Transformer
    meta: checkpoint.CheckpointMeta
    path: Path


def load(path: str, field: str, device, use_kernels: bool, files=("model.pt",)) -> Loaded:
    """The model of checkpoint `path`, or a ConfigError naming `field`."""
    try:
        model, meta = checkpoint.load_model(Path(path), device, use_kernels)  # verifies model.pt
        if set(files) != {"model.pt"}:
            checkpoint.verify(Path(path), files)
    except (checkpoint.CheckpointError, OSError) as e:
        raise ConfigError(field, str(e)) from e
    return Loaded(model, meta, Path(path))


def check_matches(policy: Loaded, other: Loaded, field: str, shape: bool = True) -> None:
    """A ConfigError naming `field` unless `other` reads the policy's token ids (the same
    vocabulary) and, with `shape`, has the same architecture (a reference must)."""
    if other.meta.vocab_size != policy.meta.vocab_size:
        raise ConfigError(
            field,
            f"{other.path} has a {other.meta.vocab_size}-token vocabulary, the policy "
            f"{policy.path} {policy.meta.vocab_size}: they must share the tokenizer",
        )
    ours = json_format.MessageToDict(policy.meta.model, preserving_proto_field_name=True)
    theirs = json_format.MessageToDict(other.meta.model, preserving_proto_field_name=True)
    for name in sorted(set(ours) | set(theirs)) if shape else ():
        if name != "use_kernels" and ours.get(name) != theirs.get(name):
            raise ConfigError(
                field,
                f"{other.path} has model.{name} {theirs.get(name)}, the policy "
                f"{policy.path} {ours.get(name)}",
            )


def frozen(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


class ScalarHead(nn.Module):
    """One number per position from the final hidden state: a reward or a value. Starts at 0."""

    def __init__(self, cfg: trainer_config_pb2.ModelConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.dim, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.float()).squeeze(-1)


class WithHead(nn.Module):
    """A Transformer and a ScalarHead trained together (one optimizer over both); its
    checkpoints hold both (model.pt's lm.* and head.*: trainer/checkpoint.py reads the lm.*)."""

    def __init__(self, lm: Transformer, head: ScalarHead):
        super().__init__()
        self.lm, self.head = lm, head

    def forward(self, input_ids, position_ids, layout=None, head=None):
        """The Transformer's forward; `head(self, hidden)` sees the scalar head too."""
        if head is None:
            return self.lm(input_ids, position_ids, layout)
        return self.lm(input_ids, position_ids, layout, head=lambda lm, h: head(self, h))


def language_model(model: nn.Module) -> Transformer:
    """The Transformer of a policy, with or without a scalar head."""
    return getattr(model, "lm", model)


@dataclasses.dataclass
class Batch:
    """Right-padded sequences. `mask[b, t]` is 1 where ids[b, t + 1] is a response token (the
    targets of the logits at t); `last[b]` indexes each sequence's last token."""

    ids: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T - 1) float
    last: torch.Tensor  # (B,)
    response_lengths: list[int]


def layout(bos_id: int, prompt: list[int], response: list[int], max_len: int) -> tuple:
    """(ids, response start) of `<bos> prompt response`, cut to `max_len`: the prompt keeps
    its end (at least one response token fits), then the response is cut."""
    prompt = prompt[-(max_len - 2) :] if len(prompt) > max_len - 2 else prompt
    ids = ([bos_id] + prompt + response)[:max_len]
    return ids, 1 + len(prompt)


def make_batch(sequences: list[tuple[list[int], int]], pad_id: int, device: torch.device) -> Batch:
    """A Batch of (ids, response start) pairs from `layout`."""
    T = max(len(ids) for ids, _ in sequences)
    ids = torch.full((len(sequences), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), T - 1)
    for b, (seq, start) in enumerate(sequences):
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, start - 1 : len(seq) - 1] = 1
    last = torch.tensor([len(seq) - 1 for seq, _ in sequences])
    lengths = [len(seq) - start for seq, start in sequences]
    return Batch(ids.to(device), mask.to(device), last.to(device), lengths)


def _positions(ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1], device=ids.device)
    return pos[None].expand(ids.shape[0], -1)


def hidden_and_logps(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states (B, T, dim), log-probabilities (B, T - 1) of each next token)."""
    hidden, logps, _ = forward(model, batch, with_entropy=False)
    return hidden, logps


def forward(model: nn.Module, batch: Batch, with_entropy: bool = True):
    """(hidden (B, T, dim), next-token log-probabilities (B, T - 1), the entropy of each
    next-token distribution (B, T - 1), or None) from one pass through `model`'s forward (a
    Transformer or WithHead, wrapped or not)."""

    def head(m, hidden):
        logits = F.linear(hidden[:, :-1], language_model(m).output.weight).float()
        logp_all = logits.log_softmax(-1)
        logps = torch.gather(logp_all, 2, batch.ids[:, 1:, None]).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
        return hidden, logps, ent

    return model(batch.ids, _positions(batch.ids), None, head=head)


def token_logps(model: nn.Module, batch: Batch) -> torch.Tensor:
    return hidden_and_logps(model, batch)[1]


def rows(batch: Batch, index: torch.Tensor) -> Batch:
    """The sub-batch of rows `index`."""
    i = index.tolist()
    return Batch(
        batch.ids[index],
        batch.mask[index],
        batch.last[index],
        [batch.response_lengths[k] for k in i],
    )


def scores(model: nn.Module, batch: Batch, head: ScalarHead | None = None) -> torch.Tensor:
    """A reward model's score of each sequence: its head at the sequence's last token.
    `model`: a WithHead (wrapped or not), or a Transformer with its `head` apart."""

    def at_last(m, hidden):
        last = hidden[torch.arange(len(batch.last)), batch.last]
        return (head or m.head)(last)

    return model(batch.ids, _positions(batch.ids), None, head=at_last)


@dataclasses.dataclass
class Rollouts:
    """Sampled sequences, row i * n + j prompt i's j-th: `<bos> prompt response`, the response
    ending in EOS when the policy ended it, and the engine's log pi(token) at temperature 1 of
    each response token: what `token_logps` recomputes from the same weights."""

    sequences: list[list[int]]
    logprobs: list[list[float]]


def response_seeds(generator: torch.Generator, count: int) -> list[int]:
    """The engine seeds of `count` responses, drawn from the job's generator."""
    return torch.randint(2**62, (count,), generator=generator, device=generator.device).tolist()


@torch.no_grad()
def sample(
    model: Transformer,
    prompts: list[list[int]],
    n: int,
    max_new_tokens: int,
    *,
    temperature: float,
    eos_id: int,
    generator: torch.Generator,
    max_len: int,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Rollouts:
    """`n` responses to each prompt (full token ids, BOS included) from the inference engine,
    reading `model`'s parameters in place (no copy). Each response is a request with its own
    seed drawn from `generator`: the same generator state draws the same responses whatever
    the batch. RlConfig has no top_k/top_p: RL samples the whole distribution (0 and 1)."""
    seeds = response_seeds(generator, len(prompts) * n)
    params = [
        SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            logprobs=True,
        )  # fmt: skip
        for seed in seeds
    ]
    asked = [offline.Prompt(prompts[i // n]) for i in range(len(seeds))]
    done = offline.generate(model, asked, params, eos_id=eos_id, max_len=max_len)
    return Rollouts(
        [prompts[i // n] + c.token_ids for i, c in enumerate(done)], [c.logprobs for c in done]
    )
