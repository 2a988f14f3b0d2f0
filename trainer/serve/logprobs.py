"""OpenAI's `logprobs` objects of both endpoints, from the engine's numbers: each generated
token's log-probability and its most likely alternatives', log_softmax of the model's fp32
logits at temperature 1 at that position (trainer/inference/sampling.py), whatever
temperature and filters drew the token (OpenAI's and vLLM's convention).

- /v1/completions, `logprobs: N` (0-5): `{"tokens", "token_logprobs", "top_logprobs":
  [{text: logprob}], "text_offset"}`;
- /v1/chat/completions, `logprobs: true` and `top_logprobs: N` (0-20): `{"content":
  [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.

A token's text is the tokenizer's decoding of that one token (a byte-level token that is half
a character decodes to U+FFFD, as vLLM shows it); the stop token that ended an answer is
listed too (its text is empty), as it is counted in usage.completion_tokens.
"""

from collections.abc import Callable
from typing import Any

from trainer.inference.engine import Output


class Logprobs:
    """The logprobs of one request's answer, one output at a time."""

    def __init__(self, decode: Callable[[list[int]], str], chat: bool):
        self.decode, self.chat = decode, chat
        self.offset = 0  # characters of the answer's token texts so far (text_offset)
        self._parts: list[dict[str, Any]] = []

    def of(self, out: Output) -> dict[str, Any] | None:
        """The logprobs object of `out`'s tokens (a streamed chunk's), kept for `whole`."""
        if out.logprobs is None:
            return None
        [token] = out.token_ids
        logprob, top = out.logprobs
        text = self.decode([token])
        alternatives = [(self.decode([i]), lp) for i, lp in top]
        if self.chat:

            def entry(t: str, lp: float) -> dict[str, Any]:
                return {"token": t, "logprob": lp, "bytes": list(t.encode())}

            content = {**entry(text, logprob), "top_logprobs": [entry(*a) for a in alternatives]}
            part: dict[str, Any] = {"content": [content]}
        else:
            part = {
                "tokens": [text],
                "token_logprobs": [logprob],
                "top_logprobs": [dict(alternatives)],
                "text_offset": [self.offset],
            }
        self.offset += len(text)
        self._parts.append(part)
        return part

    def whole(self) -> dict[str, Any]:
        """The logprobs object of every token `of` has seen, in order."""
        keys = (
            ("content",)
            if self.chat
            else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        )
        return {k: [x for part in self._parts for x in part[k]] for k in keys}
