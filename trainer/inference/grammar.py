"""Structured output: a request's answer constrained to a JSON schema, any JSON object, or a
regular expression, through llguidance (guidance-ai's grammar engine, also a structured-output
backend of vLLM and SGLang: it installs here from a wheel, is maintained, and builds its token
trie from any tokenizer's vocabulary).

The engine asks a request's `Matcher` for the tokens the grammar allows next and sets every
other logit to -inf before sampling (greedy or seeded: the same sampler, on masked logits), and
tells it each token the request keeps. A speculative draft (prompt lookup) is verified with the
mask applied at every drafted position, the grammar advanced over the accepted tokens, then
rolled back: the engine then appends the kept tokens as plain decoding would, and the matcher
advances over them again. So a constrained answer is the plain engine's under the same
constraint, token for token, with or without speculation, prefix caching, chunked prefill or
preemption (the matcher lives in the request, which a preemption keeps).

The log-probabilities reported stay the model's own (unmasked) ones, as vLLM reports by
default: the number the RL trainer recomputes from the logits.
"""

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON, no free whitespace: a model may not pad an answer with spaces forever, and
# every answer of a schema has one spelling per value (the tokens decide only the values).
JSON_OPTIONS: "JsonCompileOptions" = {"whitespace_flexible": False}


class Format(enum.Enum):
    """The shapes an answer can be asked to take (the API's response_format types)."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"


@dataclass(frozen=True)
class Constraint:
    """What a request asks its answer to be (in SamplingParams, pickled to the engine's
    process): `source` is the schema's JSON text (JSON_SCHEMA) or the pattern (REGEX)."""

    format: Format
    source: str = ""

    def grammar(self) -> str:
        """llguidance's grammar for it; ValueError when `source` is not JSON."""
        if self.format is Format.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        schema = self.source if self.format is Format.JSON_SCHEMA else '{"type": "object"}'
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def problem(constraint: Constraint) -> str:
    """Why no answer could satisfy `constraint` ("": one can): an unsatisfiable or
    unsupported schema, an invalid pattern."""
    try:
        grammar = constraint.grammar()
    except ValueError as e:
        return str(e)
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if error else ""


@dataclass(frozen=True)
class Vocabulary:
    """What the engine's process builds llguidance's tokenizer from (picklable): a HF
    tokenizer's tokenizer.json text (Kitchen's `bpe` kind: llguidance reads its byte-level
    pre-tokenizer and byte fallback itself), or the bytes of every id with the tokenizer's
    encode (cl100k, the tests' toy tokenizers)."""

    size: int  # ids of the tokenizer: the mask's length
    eos_id: int
    hf_json: str = ""
    tokens: tuple[bytes, ...] = ()
    special_ids: tuple[int, ...] = ()
    encode: Callable[[str], list[int]] | None = None

    def lltokenizer(self) -> llguidance.LLTokenizer:
        if self.hf_json:
            return llguidance.LLTokenizer(self.hf_json, n_vocab=self.size, eos_token=self.eos_id)
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped(self)))


class _Wrapped:
    """The attributes and call llguidance's TokenizerWrapper reads."""

    def __init__(self, v: Vocabulary):
        self.eos_token_id, self.bos_token_id = v.eos_id, None
        self.tokens, self.special_token_ids = list(v.tokens), list(v.special_ids)
        self._encode = v.encode

    def __call__(self, text: str) -> list[int]:
        if self._encode is None:
            raise ValueError("this vocabulary has no encode")
        return self._encode(text)


class Grammars:
    """The engine's grammar compiler: one matcher per constrained request, and the time they
    took (`seconds` over `tokens` masked positions: the serve metrics' grammar time per
    token)."""

    def __init__(self, vocabulary: Vocabulary):
        self.vocabulary = vocabulary
        self.tokenizer = vocabulary.lltokenizer()
        self.seconds = 0.0
        self.tokens = 0

    def matcher(self, constraint: Constraint) -> "Matcher":
        """A fresh matcher; ValueError when the grammar cannot be built."""
        start = time.perf_counter()
        try:
            m = llguidance.LLMatcher(self.tokenizer, constraint.grammar(), log_level=0)
        finally:
            self.seconds += time.perf_counter() - start
        if m.is_error():
            raise ValueError(f"response_format: {m.get_error()}")
        return Matcher(m, self)


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, m: llguidance.LLMatcher, grammars: Grammars):
        self._m, self._grammars = m, grammars

    def allowed(self, width: int, device: torch.device) -> torch.Tensor:
        """(width,) bool: the ids the grammar allows next (ids past the tokenizer's: never).
        One that allows nothing (a grammar in error) ends the answer: end of text only."""
        start = time.perf_counter()
        bias = self._m.compute_logit_bias()  # a byte per id: 0 (forbidden) or 200
        self._grammars.seconds += time.perf_counter() - start
        self._grammars.tokens += 1
        allowed = torch.zeros(width, dtype=torch.bool)
        n = min(width, len(bias))
        allowed[:n] = torch.frombuffer(bytearray(bias[:n]), dtype=torch.uint8) != 0
        if not allowed.any():
            allowed[self._grammars.vocabulary.eos_id] = True
        return allowed.to(device)

    def accept(self, token: int) -> None:
        start = time.perf_counter()
        self._m.consume_token(token)
        self._grammars.seconds += time.perf_counter() - start

    def valid_prefix(self, draft: list[int]) -> list[int]:
        """The longest head of a speculative draft the grammar allows: no position is spent
        on a token that could not be kept."""
        start = time.perf_counter()
        n = self._m.validate_tokens(draft)
        self._grammars.seconds += time.perf_counter() - start
        return draft[:n]

    def greedy_targets(self, rows: torch.Tensor, draft: list[int]) -> list[int]:
        """The masked greedy choice at each verified position of a draft: row j is the
        logits after the draft's first j tokens; stops after the first choice that is not the
        draft's (or after the last row). The grammar is rolled back to where it was."""
        targets: list[int] = []
        for j in range(len(rows)):
            row = rows[j].masked_fill(~self.allowed(rows.shape[-1], rows.device), float("-inf"))
            targets.append(int(row.argmax()))
            if j == len(draft) or draft[j] != targets[-1]:
                break
            self.accept(draft[j])
        start = time.perf_counter()
        self._m.rollback(len(targets) - 1)
        self._grammars.seconds += time.perf_counter() - start
        return targets


def masked(logits: torch.Tensor, rows: Sequence[tuple[int, Matcher]]) -> torch.Tensor:
    """A copy of logits (B, vocab) with each listed row's forbidden ids at -inf."""
    out = logits.clone()
    for i, matcher in rows:
        out[i].masked_fill_(~matcher.allowed(out.shape[-1], out.device), float("-inf"))
    return out
