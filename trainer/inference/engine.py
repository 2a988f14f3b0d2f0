"""Kitchen's one inference engine: continuous batching over a paged KV cache. Pure: no HTTP,
no threads, no processes. Every decode path runs on it: the serve job (trainer/serve/ around
it), and through the offline batch API (offline.py) the GENERATE job, VLM generation, eval's
generation tasks and RL rollouts. It reads the model's live parameters: nothing is copied.

`step()` is one iteration of the model over the running batch. Between steps requests join
and leave (finished, aborted): the batch never waits for its slowest member, unlike a static
batch. Which requests run in a step, with how many tokens, and which is preempted when blocks
run out is the scheduler's (scheduler.py); the engine runs what it schedules, samples and
verifies drafts. Each feature is explained in its own module; what the engine does for it:

- serve.prefix_caching (kv_cache.py, scheduler.py): a request reads the cached blocks of its
  longest shared prefix; their keys and values are the ones it would compute (the same model
  on the same tokens, up to float rounding), so its output is the same; a recompute after a
  preemption reuses its own blocks while they are cached. `cached_tokens` counts the prompt
  tokens it read at its first admission (usage.prompt_tokens_details.cached_tokens).
- serve.speculative_tokens (speculative.py): a decoding request's draft runs with its last
  token in one step; greedy keeps plain greedy decoding's tokens, sampled the rejection rule's
  (plain sampling's distribution). `accepted` / `drafted`: the engine's and each request's.
- a request's `constraint` (grammar.py): its logits are masked to what its grammar allows; a
  greedy one's drafts are cut and verified under the mask, a sampled one does not speculate.
- a VLM's image (#16, paged_model.py): the step that first schedules it runs the encoder over
  every new image in one batch; the projected vectors fill the request's first positions as
  it prefills, chunked and cached in blocks like text, kept across a preemption.

One rule for every path: a request stops at the model's end of text (`eos_id`) or one of its
`stop_token_ids`, and that token is part of its generated ids (an RL sequence is `<bos> prompt
response <eos>`) but never of its text; sampling and `logprobs` are sampling.py's. Only ids of
the tokenizer (`vocab`) are ever sampled: a checkpoint whose embedding has more rows than its
tokenizer has ids (vocabularies padded to a multiple of 64 or 128, as published checkpoints
often are) has logits for ids that decode to nothing, cut off before sampling and before a
draft is verified. The log-probabilities stay those of the model's full softmax (what the RL
trainer recomputes from the logits).
"""

import enum
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from protos import trainer_config_pb2
from trainer.inference.admission import check_fits
from trainer.inference.detokenize import detokenize, stop_strings
from trainer.inference.grammar import Constraint, Grammars, Matcher, Vocabulary, masked
from trainer.inference.kv_cache import PagedKVCache
from trainer.inference.paged_model import Run, forward_step
from trainer.inference.sampling import (
    TopLogprobs,
    argmax_rows,
    probabilities,
    sample,
    token_logprobs,
)
from trainer.inference.scheduler import Scheduler
from trainer.inference.speculative import DraftModel, verify_sampled
from trainer.model import Transformer

# The token id at an image's positions of a request's token list: any valid id, its embedding
# is replaced by the image's (paged_model.py).
IMAGE_PLACEHOLDER = 0


class FinishReason(enum.Enum):
    STOP = "stop"  # end of text, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the model's context is full
    ABORT = "abort"  # the client went away


@dataclass(frozen=True)
class SamplingParams:
    """Per request: temperature 0 is greedy; top_k 0 and top_p 1 disable those filters; a
    seed makes the draws reproducible; `stop_token_ids` end it as the model's end of text
    does; `logprobs` keeps each sampled token's log-probability (sampling.py), and with
    `top_logprobs` those of that many most likely tokens at its position."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs
    constraint: Constraint | None = None  # structured output (grammar.py)


@dataclass(eq=False)  # compared by identity: the queues look requests up often
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    arrived: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each output token, when asked
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # per output token, too
    text: str = ""  # decoded output, up to a stop string
    sent: int = 0  # characters of `text` already handed out
    decoded_from: int = 0  # incremental detokenization: output[decoded_from:decoded_to] is
    decoded_to: int = 0  # the last complete text, decoded again as the next token's context
    computed: int = 0  # positions whose keys and values are in the cache
    table: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    generator: torch.Generator | None = None
    preemptions: int = 0
    cached_tokens: int | None = None  # prompt tokens read from the prefix cache, once admitted
    block_names: list[bytes] = field(default_factory=list)  # hashes of its full blocks
    named: int = 0  # blocks of `table` registered under their name
    root: bytes = b""  # its image's digest: the first block's name depends on the image
    draft: list[int] = field(default_factory=list)  # this step's speculative tokens
    matcher: Matcher | None = None  # its place in params.constraint's grammar, once added
    drafted: int = 0  # speculative tokens proposed for it, and of those kept: its acceptance
    accepted: int = 0
    # A VLM's image, (S, S, 3) uint8, read at the first positions of `prompt` (their ids are
    # IMAGE_PLACEHOLDER), and its projected tokens once encoded: kept
    # across a preemption, so a recompute prefills the same vectors without the encoder.
    image: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    # len(prompt) + len(output), kept as the output grows: the scheduler reads it for every
    # running request on every step.
    length: int = field(init=False)

    def __post_init__(self):
        self.length = len(self.prompt) + len(self.output)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Output(NamedTuple):
    """What one step produced for one request: new text (may be empty while a multi-byte
    character or a possible stop string is incomplete), and the reason when it finished. A
    NamedTuple: every step pickles one per request to the server's process (engine_process.py),
    and a tuple pickles in half the time of a dataclass."""

    request_id: str
    text: str
    token_ids: list[int]
    finish: FinishReason | None
    cached_tokens: int = 0  # the request's prompt tokens read from the prefix cache
    # With params.logprobs: the token's log-probability and its top_logprobs alternatives.
    logprobs: tuple[float, TopLogprobs] | None = None


class Engine:
    def __init__(
        self,
        model: Transformer,
        cfg: trainer_config_pb2.ServeConfig,
        *,
        decode: Callable[[list[int]], str],
        eos_id: int,
        max_len: int,
        embed_images: Callable[[torch.Tensor], torch.Tensor] | None = None,
        vocab: int | None = None,
        grammar: Vocabulary | None = None,
        draft: Transformer | None = None,
    ):
        """`cfg` is a ServeConfig with defaults applied; `max_len` the model's positions;
        `embed_images` a VLM's encoder and projector, (B, S, S, 3) uint8 -> (B, image tokens,
        dim) (None: a text model); `vocab` the tokenizer's ids (None: every row of the model's
        output), the only ones sampled; `grammar` the tokenizer's vocabulary for structured
        output (grammar.py; None: a constrained request is refused); `draft` speculative
        decoding's draft model (None: prompt lookup), with the model's vocabulary and at least
        its positions."""
        self.model = model  # its live parameters: the engine copies no weights
        self.embed_images = embed_images
        self.cfg, self.decode, self.eos_id, self.max_len = cfg, decode, eos_id, max_len
        self.vocab = vocab
        p = next(model.parameters())
        attn = model.layers[0].attention
        self.cache = PagedKVCache(
            len(model.layers),
            attn.n_kv_heads,
            attn.head_dim,
            cfg.num_blocks,
            cfg.block_size,
            p.device,
            p.dtype,
            caching=cfg.prefix_caching,
        )
        self.device = p.device
        self.finished = 0
        self.drafted = 0  # speculative tokens proposed since the start, and of those accepted
        self.accepted = 0
        self._pending: list[Output] = []  # outputs of requests ended between steps (aborts)
        self.grammars = Grammars(grammar) if grammar is not None else None
        self.drafter = None if draft is None else DraftModel(draft, model, max_len, cfg, vocab)
        self.scheduler = Scheduler(cfg, self.cache, max_len, self.drafter)
        self._draft_dists: dict[Request, torch.Tensor | None] = {}

    def add(self, request: Request) -> None:
        """Queues a request; RequestTooLarge (check_fits) if it could never finish."""
        check_fits(len(request.prompt), request.params.max_tokens, self.max_len, self.cfg)
        if request.image is not None and self.embed_images is None:
            raise ValueError("an image for a text model")
        if request.params.constraint is not None:
            if self.grammars is None:
                raise ValueError("structured output needs the engine's grammar vocabulary")
            request.matcher = self.grammars.matcher(request.params.constraint)
        if request.image is not None:
            request.root = hashlib.sha256(request.image.cpu().numpy().tobytes()).digest()
        seed = request.params.seed
        gen = torch.Generator(device=self.device)
        request.generator = gen.manual_seed(seed) if seed is not None else gen
        if seed is None:
            gen.seed()
        self.scheduler.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Ends a request wherever it is, freeing its blocks. False when it is unknown."""
        for queue in (self.scheduler.running, self.scheduler.waiting):
            for r in queue:
                if r.id == request_id:
                    queue.remove(r)
                    self._end(r, FinishReason.ABORT)
                    self._pending.append(Output(r.id, "", [], FinishReason.ABORT))
                    return True
        return False

    def has_work(self) -> bool:
        q = self.scheduler
        return bool(q.running or q.waiting or self._pending)

    def step(self) -> list[Output]:
        """One model iteration over the scheduled requests; their outputs."""
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return outputs
        proposing, self.scheduler.proposing = self.scheduler.proposing, []
        if proposing:  # the draft model's drafts for the requests scheduled with one
            assert self.drafter is not None
            dists = self.drafter.propose(proposing)
            self._draft_dists = {r: d for (r, _), d in zip(proposing, dists, strict=True)}
            for r, _ in proposing:
                if r.matcher is not None:  # greedy (scheduler.draft): forbidden is never kept
                    r.draft = r.matcher.valid_prefix(r.draft)
            # a draft cut by its grammar runs fewer tokens than were scheduled
            scheduled = [
                (r, 1 + len(r.draft) if r in self._draft_dists else n) for r, n in scheduled
            ]
        self._encode_images([r for r, _ in scheduled])
        runs = [
            Run(self._new_tokens(r, n), r.computed, r.table, _image_run(r, n), 1 + len(r.draft))
            for r, n in scheduled
        ]
        logits = forward_step(self.model, runs, self.cache)
        ready = []  # (row of logits, request) of the requests whose whole context is read
        drafted = []  # (first row, request) of the requests with a draft to verify
        row = 0
        for r, n in scheduled:
            if r.draft:
                drafted.append((row, r))
                row += n
                continue
            r.computed += n
            self.scheduler.name_blocks(r)
            if r.computed == r.length:  # else a prefill chunk: the prompt is not all read yet
                ready.append((row, r))
            row += 1
        rows = logits[:, : self.vocab]
        constrained = [(i, r.matcher) for i, r in ready if r.matcher is not None]
        tokens = self._sample(masked(rows, constrained) if constrained else rows, ready)
        scored = [k for k, (_, r) in enumerate(ready) if r.params.logprobs]
        if scored:
            rows = logits[[ready[k][0] for k in scored]]
            top = [ready[k][1].params.top_logprobs for k in scored]
            logps, tops = token_logprobs(rows, [tokens[k] for k in scored], top)
            for k, lp, alternatives in zip(scored, logps, tops, strict=True):
                ready[k][1].logprobs.append(lp)
                ready[k][1].top_logprobs.append(alternatives)
        for (_, r), token in zip(ready, tokens, strict=True):
            outputs.append(self._append(r, token))
        for row, r in drafted:
            outputs += self._verify(r, logits[row : row + 1 + len(r.draft), : self.vocab])
        q = self.scheduler
        if any(r.finish is not None for r in q.running):
            q.running = [r for r in q.running if r.finish is None]
        return outputs

    @staticmethod
    def _new_tokens(r: Request, n: int) -> list[int]:
        if n == 1 and r.output and r.computed == r.length - 1:  # decoding: its last token
            return r.output[-1:]
        if r.draft:
            return r.tokens[r.computed : r.computed + 1] + r.draft
        return r.tokens[r.computed : r.computed + n]

    def _verify(self, r: Request, rows: torch.Tensor) -> list[Output]:
        """Greedy: keeps r's draft up to its first token that is not the model's greedy
        choice, and that choice: the tokens plain greedy decoding would give. Sampled: the
        rejection rule's tokens (speculative.verify_sampled). One output each."""
        draft, r.draft = r.draft, []
        p, q = r.params, self._draft_dists.pop(r, None)
        if p.temperature == 0:
            if r.matcher is not None:  # masked at each position, the grammar rolled back after
                targets = r.matcher.greedy_targets(rows, draft)
            else:
                targets = rows.argmax(dim=-1).tolist()
            m = 0
            while m < len(draft) and draft[m] == targets[m]:
                m += 1
        else:
            dist = probabilities(rows, p.temperature, p.top_k, p.top_p)
            assert r.generator is not None
            targets = verify_sampled(dist, draft, q, r.generator)
            m = len(targets) - 1
        self.drafted, self.accepted = self.drafted + len(draft), self.accepted + m
        r.drafted, r.accepted = r.drafted + len(draft), r.accepted + m
        r.computed += 1 + m  # the rejected drafts' keys and values are overwritten later
        outputs = []
        for j, token in enumerate(targets[: m + 1]):
            if r.params.logprobs:
                lp, top = token_logprobs(rows[j : j + 1], [token], [r.params.top_logprobs])
                r.logprobs.append(lp[0])
                r.top_logprobs.append(top[0])
            outputs.append(self._append(r, token))
            if r.finish is not None:
                return outputs
        self.scheduler.name_blocks(r)  # now that its tokens hold the accepted ones
        return outputs

    @staticmethod
    def _sample(logits: torch.Tensor, ready: list[tuple[int, Request]]) -> list[int]:
        """The next token of each ready request, each with its own params and generator."""
        if len(ready) == len(logits) and all(r.params.temperature == 0 for _, r in ready):
            return argmax_rows(logits).tolist()  # all greedy: one argmax over every row
        rows = logits[[i for i, _ in ready]]
        params = [r.params for _, r in ready]
        return sample(
            rows,
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [r.generator for _, r in ready],
        )

    @torch.no_grad()
    def _encode_images(self, requests: list[Request]) -> None:
        """The images of newly admitted requests through the encoder, in one batch."""
        new = [r for r in requests if r.image is not None and r.image_embeds is None]
        if new and self.embed_images is not None:
            embeds = self.embed_images(torch.stack([r.image for r in new]).to(self.device))
            for r, e in zip(new, embeds, strict=True):
                r.image_embeds = e

    def _append(self, r: Request, token: int) -> Output:
        p = r.params
        r.output.append(token)
        r.length += 1
        if r.matcher is not None:
            r.matcher.accept(token)
        stopped = token == self.eos_id or token in p.stop_token_ids
        finish = FinishReason.STOP if stopped else None
        if not stopped and (len(r.output) >= p.max_tokens or r.length >= self.max_len):
            finish = FinishReason.LENGTH
        searched = len(r.text)
        # The stop token ends the ids; it never shows in the text.
        detokenize(r, self.decode, final=finish is not None, end=len(r.output) - stopped)
        ready = len(r.text)
        if p.stop:
            ready, found = stop_strings(r, p.stop, searched, finish is not None)
            finish = FinishReason.STOP if found else finish
        delta, r.sent = r.text[r.sent : max(ready, r.sent)], max(ready, r.sent)
        if finish is not None:
            self._end(r, finish)
        scored = (r.logprobs[-1], r.top_logprobs[-1]) if p.logprobs else None
        return Output(r.id, delta, [token], finish, r.cached_tokens or 0, scored)

    def _end(self, r: Request, finish: FinishReason) -> None:
        r.finish = finish
        r.image_embeds = r.matcher = None
        self.scheduler.release(r)
        self.finished += 1


def _image_run(r: Request, n: int) -> torch.Tensor | None:
    """The image vectors of r's next n positions (they lead the run: the image comes first)."""
    if r.image_embeds is None or r.computed >= len(r.image_embeds):
        return None
    return r.image_embeds[r.computed : r.computed + n]
