"""A progress line for long precook stages: documents/s and tokens/s, redrawn in place on a
terminal, a plain line every few seconds in a log file; and `reporter`, the stages' one-line
messages."""

import sys
import time
from collections.abc import Callable

Say = Callable[[str], None]  # where a stage's one-line messages go (`reporter`)


def reporter(enabled: bool) -> Say:
    """A `say(message)` for stage messages on stderr (silent when not enabled)."""

    def say(message: str) -> None:
        if enabled:
            print(f"precook: {message}", file=sys.stderr, flush=True)

    return say


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23 M' (with `unit` appended): short numbers for progress lines."""
    for scale, suffix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f} {unit}".rstrip() if unit else f"{n:.0f}"


class Progress:
    def __init__(self, label: str, total_docs: int, enabled: bool = True, stream=None):
        self.label, self.total = label, total_docs
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.enabled and self.stream.isatty()
        self.docs = self.tokens = 0
        self.start = self._last = time.perf_counter()

    def update(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        now = time.perf_counter()
        if self.enabled and now - self._last >= (0.1 if self.tty else 5.0):
            self._last = now
            self._draw(final=False)

    def _draw(self, final: bool) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        frac = self.docs / self.total if self.total else 1.0
        clock = f"{elapsed:.1f} s" if final else f"eta {elapsed / max(frac, 1e-9) - elapsed:.0f} s"
        line = (
            f"  {self.label}  {self.docs:,}/{self.total:,} records ({100 * frac:3.0f}%)  "
            f"{human(self.docs / elapsed, 'docs/s')}  {human(self.tokens / elapsed, 'tokens/s')}  "
            f"{clock}"
        )
        if self.tty:
            print("\r" + line.ljust(100), end="\n" if final else "", file=self.stream, flush=True)
        elif final or self.docs:
            print(line, file=self.stream, flush=True)

    def close(self) -> float:
        """Print the final line; return the seconds elapsed."""
        if self.enabled:
            self._draw(final=True)
        return time.perf_counter() - self.start
