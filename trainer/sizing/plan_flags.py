"""What the plan's modules share about their flags: the error that names one, and counts."""

import argparse
import re

_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


class PlanError(ValueError):
    """Bad flags; the message starts with the flag's name."""


def count(text: str) -> float:
    """A positive count such as 7e9, 7B, 300M, 1.5T, 4096."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([KMBGT]?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 7e9, 7B, 300M, 1.5T)")
    value = float(m.group(1)) * _SUFFIX.get(m.group(2).upper(), 1.0)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value
