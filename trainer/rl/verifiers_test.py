"""Each verifier on responses that pass and that fail, and the table covering every source."""

import pytest

from protos import trainer_config_pb2
from trainer.rl import verifiers


@pytest.mark.parametrize(
    "verifier, prompt, response, expected",
    [
        (verifiers.python_syntax, "", "x = [1, 2]\nprint(x)\n", 1.0),
        (verifiers.python_syntax, "", "def f(:\n", 0.0),
        (verifiers.python_syntax, "", "   \n", 0.0),
        (verifiers.arithmetic, "What is 12 plus 30?", "12 plus 30 is 42.", 1.0),
        (verifiers.arithmetic, "What is 12 plus 30?", "It is 41.", 0.0),
        (verifiers.arithmetic, "What is 2 + -5?", "-3", 1.0),
        (verifiers.arithmetic, "Name a colour.", "42", 0.0),
        (verifiers.sentence, "", "Return the encoded string.", 1.0),
        (verifiers.sentence, "", "Return the\nencoded string.", 0.0),
        (verifiers.sentence, "", "no full stop", 0.0),
        (verifiers.sentence, "", " 3.", 0.0),
        (verifiers.has_number, "", "port 25", 1.0),
        (verifiers.has_number, "", "no digits", 0.0),
    ],
)
def test_verifier(verifier, prompt, response, expected):
    assert verifier(prompt, response) == expected


def test_every_reward_source_but_the_reward_model_has_a_verifier():
    sources = trainer_config_pb2.RewardSource.values()
    expected = {s for s in sources if s not in (0, trainer_config_pb2.REWARD_MODEL)}
    assert set(verifiers.VERIFIERS) == expected
