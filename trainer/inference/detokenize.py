"""A request's text as its tokens come (engine.py's `_append`): incremental detokenization and
stop strings. Pure functions of the request's fields."""

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # engine.py imports this module
    from trainer.inference.engine import Request


def detokenize(r: "Request", decode: Callable[[list[int]], str], final: bool, end: int) -> None:
    """Extends r.text with its new tokens' text, decoding only the tokens since the last
    complete character plus the ones before them (vLLM's incremental detokenization):
    decoding the whole output every token costs O(length) per token. Text that ends in
    half a character (U+FFFD) waits for the next token, unless this is the last one."""
    window = r.output[r.decoded_from : end]
    before = decode(window[: r.decoded_to - r.decoded_from])
    text = decode(window)
    if len(text) > len(before) and (final or not text.endswith("\ufffd")):
        r.text += text[len(before) :]
        r.decoded_from, r.decoded_to = r.decoded_to, end


def stop_strings(
    r: "Request", stop: tuple[str, ...], searched: int, finishing: bool
) -> tuple[int, bool]:
    """Cuts r.text at the first stop string (it finishes the request), else holds back what
    may be the start of one, unless the request is `finishing` anyway: (characters of r.text
    ready to send, whether a stop string was found). `searched`: the length of r.text before
    this token; a stop string not found before must end after it."""
    found = (r.text.find(s, max(0, searched - len(s) + 1)) for s in stop)
    cut = min((i for i in found if i >= 0), default=-1)
    if cut >= 0:
        r.text = r.text[:cut]
        return cut, True
    ready = len(r.text)
    if not finishing:
        for s in stop:
            for k in range(min(len(s) - 1, ready), 0, -1):
                if r.text.endswith(s[:k]):
                    ready -= k
                    break
    return ready, False
