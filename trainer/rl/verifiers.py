"""Rewards that need no human: each is a pure function (prompt, response) -> 0.0 or 1.0.

Chosen by `trainer.rl.reward` (the RewardSource enum); REWARD_MODEL is not here (it is a
checkpoint, trainer/rl/policy.py). They are small on purpose: a 1 M-parameter model trained
for a minute on this machine can learn to satisfy SENTENCE and HAS_NUMBER; PYTHON_SYNTAX and
ARITHMETIC are the real-world kind, for bigger models.
"""

import ast
import re
import warnings
from collections.abc import Callable

from protos import trainer_config_pb2

Verifier = Callable[[str, str], float]

_SUM = re.compile(r"(-?\d+)\s*(?:plus|\+)\s*(-?\d+)")
_NUMBER = re.compile(r"-?\d+")


def python_syntax(prompt: str, response: str) -> float:
    """The response parses as Python and is not blank."""
    if not response.strip():
        return 0.0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences warn, they still parse
            ast.parse(response)
    except (SyntaxError, ValueError):
        return 0.0
    return 1.0


def arithmetic(prompt: str, response: str) -> float:
    """The prompt asks "A plus B" and the response's last number is A + B."""
    question = _SUM.search(prompt)
    numbers = _NUMBER.findall(response)
    if question is None or not numbers:
        return 0.0
    return float(int(numbers[-1]) == int(question.group(1)) + int(question.group(2)))


def sentence(prompt: str, response: str) -> float:
    """The response is one line with a letter in it that ends with a full stop (the format of
    the guides' SFT answers, a docstring's first sentence)."""
    text = response.strip()
    ok = text.endswith(".") and "\n" not in text and any(c.isalpha() for c in text)
    return float(ok)


def has_number(prompt: str, response: str) -> float:
    """The response contains a digit."""
    return float(any(c.isdigit() for c in response))


VERIFIERS: dict[int, Verifier] = {
    trainer_config_pb2.PYTHON_SYNTAX: python_syntax,
    trainer_config_pb2.ARITHMETIC: arithmetic,
    trainer_config_pb2.SENTENCE: sentence,
    trainer_config_pb2.HAS_NUMBER: has_number,
}
