"""The files RLHF jobs read: preference pairs and prompts (JSONL, one object per line).

    {"prompt": "...", "chosen": "...", "rejected": "..."}   rl.preferences (REWARD, DPO)
    {"prompt": "..."}                                     rl.prompts (PPO)

A line that is not a JSON object or lacks a field is a DataError naming the file and line; a
pair whose chosen and rejected are the same text teaches nothing and is counted and skipped.
Held out by prompt (a hash of its text), so no prompt is in both splits however many pairs it has.
"""

import dataclasses
import json
import zlib
from collections.abc import Callable, Iterator
from typing import TypeVar

from protos.config_yaml import ConfigError

PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")


class DataError(ConfigError):
    """A bad line of an RL input file: the config field that named it, file and line."""


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


@dataclasses.dataclass(frozen=True)
class Preferences:
    pairs: list[PreferencePair]
    identical: int  # pairs skipped: chosen == rejected


def _objects(path: str, field: str, needs: tuple[str, ...]) -> Iterator[dict[str, str]]:
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115 (closed below)
    except OSError as e:
        raise DataError(field, f"{path}: {e.strerror}") from e
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(field, f"{path}:{number}: not JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise DataError(field, f"{path}:{number}: not a JSON object")
            for name in needs:
                if not isinstance(obj.get(name), str):
                    problem = "missing" if name not in obj else "not a string"
                    raise DataError(field, f'{path}:{number}: field "{name}" {problem}')
            yield obj


def read_preferences(path: str, field: str = "trainer.rl.preferences") -> Preferences:
    pairs, identical = [], 0
    for obj in _objects(path, field, PREFERENCE_FIELDS):
        if obj["chosen"] == obj["rejected"]:
            identical += 1
            continue
        pairs.append(PreferencePair(obj["prompt"], obj["chosen"], obj["rejected"]))
    if not pairs:
        raise DataError(field, f"{path}: no usable preference pairs ({identical} identical)")
    return Preferences(pairs, identical)


def read_prompts(path: str, field: str = "trainer.rl.prompts") -> list[str]:
    prompts = [obj["prompt"] for obj in _objects(path, field, ("prompt",))]
    if not prompts:
        raise DataError(field, f"{path}: no prompts")
    return prompts


def is_heldout(prompt: str, fraction: float) -> bool:
    """Whether `prompt` belongs to the held-out split (stable across runs and files)."""
    return zlib.crc32(prompt.encode("utf-8")) % 10_000 < fraction * 10_000


T = TypeVar("T")


def split(
    items: list[T], prompt_of: Callable[[T], str], fraction: float
) -> tuple[list[T], list[T]]:
    """(train, held out) by each item's prompt."""
    train = [x for x in items if not is_heldout(prompt_of(x), fraction)]
    heldout = [x for x in items if is_heldout(prompt_of(x), fraction)]
    return train, heldout
