"""Length and quality filters: per-document features measured while tokenizing, thresholds
applied when the dataset is packed.

The features are cheap and stored beside the tokens (doc_alpha.npy, doc_line_repeat.npy), so
changing a threshold repacks without re-reading or re-tokenizing the corpus:

- tokens: the document's length (<bos> text <eos>), against min_doc_tokens / max_doc_tokens
- alpha: letters / characters (Gopher-style: code, tables and binary junk score low)
- line_repeat: lines that repeat an earlier line of the same document / non-blank lines
  (boilerplate, logs, generated lists score high)
"""

from dataclasses import dataclass

import numpy as np

from protos.trainer_config_pb2 import DataConfig

# Code points counted as letters: ASCII A-Z a-z, and everything from U+00C0 on (accented Latin,
# Greek, Cyrillic, CJK, ...): coarse, but fast on a whole text at once.
_FIRST_NON_ASCII_LETTER = 0xC0


def alpha_fraction(text: str) -> float:
    if not text:
        return 0.0
    code = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ascii_letter = ((code | 0x20) - ord("a")) < 26
    return float((ascii_letter | (code >= _FIRST_NON_ASCII_LETTER)).sum()) / len(code)


def line_repeat_fraction(text: str) -> float:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return 0.0
    return 1.0 - len(set(lines)) / len(lines)


def text_features(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(alpha fraction, repeated-line fraction) of each text, float32."""
    alpha = np.fromiter((alpha_fraction(t) for t in texts), np.float32, count=len(texts))
    repeat = np.fromiter((line_repeat_fraction(t) for t in texts), np.float32, count=len(texts))
    return alpha, repeat


@dataclass(frozen=True)
class FilterCounts:
    """Documents dropped by each filter (a document counts under the first that drops it)."""

    too_short: int
    too_long: int
    low_alpha: int
    repeated_lines: int


def apply(
    cfg: DataConfig, lengths: np.ndarray, alpha: np.ndarray, repeat: np.ndarray
) -> tuple[np.ndarray, FilterCounts]:
    """(keep mask, counts) of a defaulted DataConfig's filters over every document."""
    keep = np.ones(len(lengths), dtype=bool)
    dropped = []
    for drop in (
        lengths < cfg.min_doc_tokens,
        (lengths > cfg.max_doc_tokens) if cfg.max_doc_tokens else np.zeros_like(keep),
        alpha < np.float32(cfg.min_alpha_fraction),
        repeat > np.float32(cfg.max_repeated_line_fraction),
    ):
        dropped.append(int((keep & drop).sum()))
        keep &= ~drop
    return keep, FilterCounts(*dropped)
