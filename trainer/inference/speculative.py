"""Speculative decoding: a draft proposes k tokens, the target model verifies them in one step.

Two drafts (serve.speculative_tokens = k, 0: off):
- Prompt lookup (n-grams), needing no second model: the k tokens that followed the most recent
  earlier occurrence of the sequence's last n tokens (the longest n <= 3 that occurs; vLLM's
  ngram proposer, Saxena's prompt lookup decoding). Its draft distribution is a point mass.
- A draft model (serve.draft_path): a smaller checkpoint with the target's tokenizer samples k
  tokens, one at a time, from its own distribution under the request's temperature, top-k and
  top-p (`DraftModel`).

The engine runs the request's last token and the draft through the target in one step: the
target's distributions p_1..p_{k+1} at the draft's positions. `verify_sampled` applies the
standard rejection rule (Leviathan et al. 2023, Chen et al. 2023): draft token x_j is kept with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token is drawn from
max(0, p_j - q_j) normalized, and the rest of the draft is dropped; when all k are kept, a bonus
token is drawn from p_{k+1}. Every token so emitted is distributed as plain sampling from p
(whatever q is): the answer's distribution is the plain engine's, its tokens per step higher
when the draft agrees with the target. A seeded request's draws come from its own generator,
so it is reproducible, but it consumes the generator differently from plain sampling: the same
seed gives another (equally distributed) answer. Greedy requests (temperature 0, p a point mass
on the argmax) keep the draft up to its first token that is not the target's argmax, plus the
argmax there: exactly plain greedy decoding's tokens (engine.py `_verify`).

The draft model keeps its own paged KV cache (kv_cache.py, no prefix caching, the target's
block size and block count), one table per request, rather than recomputing the context each
step: recomputing costs the draft a forward over the whole context k times a step, which for a
1K-token context is more than the target's own step and would eat the speedup. With a cache a
step costs the draft one catch-up run (the tokens verified since its last proposal, usually
1 + accepted) and k - 1 single-token runs, batched over every drafting request like the target's
decode. Rejected draft positions are not erased: they are overwritten, as the target's are,
because only the verified prefix counts as computed (`_State`). When the draft's pool has no
room, a request does not speculate that step (always correct, never waits).
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from protos import trainer_config_pb2
from trainer.inference.kv_cache import PagedKVCache
from trainer.inference.paged_model import Run, forward_step
from trainer.inference.sampling import probabilities
from trainer.model import Transformer

if TYPE_CHECKING:  # engine.py imports this module
    from trainer.inference.engine import Request

MAX_NGRAM = 3


def ngram_draft(tokens: list[int], k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens."""
    end = len(tokens)
    for n in range(min(MAX_NGRAM, end - 1), 0, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a row of probabilities (not necessarily normalized), by inverse CDF with
    one uniform number from `generator`: sampling.py's draw."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(1, generator=generator, device=probs.device).double()
    picked = int(torch.searchsorted(cdf, u * cdf[-1:], right=True)[0])
    last = int((cdf >= cdf[-1]).int().argmax())  # u * total may round up to total
    return min(picked, last)


def verify_sampled(
    p: torch.Tensor, draft: list[int], q: torch.Tensor | None, generator: torch.Generator
) -> list[int]:
    """The rejection rule over a draft of k tokens: p (k + 1, vocab) the target's sampling
    distributions at the draft's positions and one past; q (k, vocab) the draft's (None: prompt
    lookup, a point mass on each draft token). The kept draft tokens, then the resampled or
    bonus token: 1..k + 1 tokens, distributed as sampling from p token by token."""
    for j, x in enumerate(draft):
        px = float(p[j, x])
        qx = 1.0 if q is None else float(q[j, x])
        u = float(torch.rand(1, generator=generator, device=p.device))
        if u * qx < px:  # u < p/q without dividing: q(x) > 0, x was drawn from it
            continue
        if q is None:
            residual = p[j].clone()
            residual[x] = 0
        else:
            residual = (p[j] - q[j]).clamp(min=0)
        if float(residual.sum()) <= 0:  # rounding only: a rejection means p(x) < q(x)
            residual = p[j]
        return draft[:j] + [draw(residual, generator)]
    return draft + [draw(p[len(draft)], generator)]


@dataclass
class _State:
    """A request's draft-model cache: `table` its blocks, `verified` the positions whose keys
    and values are the request's tokens', `base` and `proposed` the last proposal (positions
    base.. hold the proposal's tokens but its first k - 1 only, until verified)."""

    table: list[int] = field(default_factory=list)
    verified: int = 0
    base: int = 0
    proposed: list[int] = field(default_factory=list)


class DraftModel:
    """A smaller model with the target's vocabulary proposing k tokens per request and step."""

    def __init__(
        self,
        model: Transformer,
        target: Transformer,
        max_len: int,
        cfg: trainer_config_pb2.ServeConfig,
        vocab: int | None,
    ):
        """`model` drafts for `target` (of `max_len` positions, `vocab` ids sampled), with a
        pool of cfg's blocks; ValueError naming serve.draft_path when it cannot: another
        vocabulary, or fewer positions."""
        theirs, ours = model.output.weight.shape[0], target.output.weight.shape[0]
        if theirs != ours:
            raise ValueError(
                f"serve.draft_path: the draft model has a {theirs}-token vocabulary, the served "
                f"model {ours}: a draft must share the target's tokenizer"
            )
        if model.rope.cos.shape[0] < max_len:
            raise ValueError(
                f"serve.draft_path: the draft model has {model.rope.cos.shape[0]} positions, "
                f"the served model {max_len}: the draft must read every position"
            )
        self.model, self.vocab = model, vocab
        num_blocks, block_size = cfg.num_blocks, cfg.block_size
        p = next(model.parameters())
        attn = model.layers[0].attention
        self.cache = PagedKVCache(
            len(model.layers), attn.n_kv_heads, attn.head_dim, num_blocks, block_size,
            p.device, p.dtype, caching=False,
        )  # fmt: skip
        self.states: dict[Request, _State] = {}  # by request (compared by identity)

    def reserve(self, r: "Request", k: int) -> bool:
        """Takes the blocks for r's next proposal of k tokens (its context and k - 1 drafts
        are written); False when the pool has no room (r does not speculate this step)."""
        state = self.states.setdefault(r, _State())
        self._settle(r, state)
        need = self.cache.blocks_for(r.length + k - 1) - len(state.table)
        if need > self.cache.allocator.free:
            return False
        self.cache.grow(state.table, r.length + k - 1)
        return True

    def release(self, r: "Request") -> None:
        state = self.states.pop(r, None)
        if state is not None:
            self.cache.release(state.table)

    def _settle(self, r: "Request", state: _State) -> None:
        """Counts as verified the proposal's written tokens that r's tokens now hold."""
        tokens = r.tokens
        for j, x in enumerate(state.proposed[:-1]):
            if state.base + j >= len(tokens) or tokens[state.base + j] != x:
                break
            state.verified = state.base + j + 1
        state.proposed = []
        state.verified = min(state.verified, len(tokens) - 1)

    @torch.no_grad()
    def propose(self, requests: list[tuple["Request", int]]) -> list[torch.Tensor | None]:
        """Fills each request's `draft` with k tokens (blocks reserved); returns each one's
        draft distributions (k, vocab), None for a greedy request (argmax: a point mass)."""
        states = [self.states[r] for r, _ in requests]
        runs = []
        for (r, _), state in zip(requests, states, strict=True):
            runs.append(Run(r.tokens[state.verified :], state.verified, state.table))
            state.base, state.verified = r.length, r.length
        drafts: list[list[int]] = [[] for _ in requests]
        dists: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        while active:
            logits = forward_step(self.model, runs, self.cache)[:, : self.vocab]
            for row, i in enumerate(active):
                r = requests[i][0]
                p = r.params
                if p.temperature == 0:
                    drafts[i].append(int(logits[row].argmax()))
                else:
                    dist = probabilities(logits[row : row + 1], p.temperature, p.top_k, p.top_p)
                    dists[i].append(dist[0])
                    drafts[i].append(draw(dist[0], r.generator))
            active = [i for i in active if len(drafts[i]) < requests[i][1]]
            runs = [
                Run(drafts[i][-1:], requests[i][0].length + len(drafts[i]) - 1, states[i].table)
                for i in active
            ]
        out: list[torch.Tensor | None] = []
        for (r, _), state, draft, dist in zip(requests, states, drafts, dists, strict=True):
            r.draft, state.proposed = draft, draft
            out.append(torch.stack(dist) if dist else None)
        return out
