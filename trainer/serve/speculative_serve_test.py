"""A serve job with a draft model (serve.draft_path's, handed to the engine process): greedy
answers over HTTP stay the model's own, and the acceptance counters of /metrics and the
heartbeat are the engine's."""

import time

import openai
import pytest
import torch

from trainer.generate import generate
from trainer.inference.testing import BOS, EOS, decode, encode, perturbed, tiny_model
from trainer.serve.testing import start_server

torch.set_num_threads(1)

MAX_LEN = 96


def metric(server, name: str) -> float:
    from urllib.request import urlopen

    with urlopen(server.endpoint + "/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.split()[-1])
    raise AssertionError(f"no {name}")


@pytest.fixture(scope="module")
def model():
    return tiny_model(MAX_LEN)


@pytest.fixture(scope="module")
def server(model):
    draft = perturbed(model, 0.03, MAX_LEN)  # agrees with the model often, not always
    s = start_server(model, draft=draft, speculative_tokens=4)
    yield s
    assert s.stop()


def test_greedy_answers_with_a_draft_model_are_the_models_and_acceptance_is_reported(model, server):
    client = openai.OpenAI(base_url=server.endpoint + "/v1", api_key="unused", max_retries=0)
    for prompt in ["speculate", "a draft model proposes", "the target verifies"]:
        answer = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0
        )
        want, _ = generate(
            model, [BOS, *encode(prompt)], 24, temperature=0, stop_id=EOS, max_len=MAX_LEN
        )
        assert answer.choices[0].text == decode(want)
    sampled = client.completions.create(
        model="tiny", prompt="sampled", max_tokens=24, temperature=1.0, seed=3
    )
    assert sampled.usage.completion_tokens > 0
    deadline = time.monotonic() + 5  # the counters follow the step report after the answer

    def counts() -> tuple[tuple[float, float], tuple[int, int]]:
        beat = server.heartbeat("j1", 1)
        return (
            (
                metric(server, "kitchen_serve_spec_decode_draft_tokens_total"),
                metric(server, "kitchen_serve_spec_decode_accepted_tokens_total"),
            ),
            (beat.spec_draft_tokens, beat.spec_accepted_tokens),
        )

    metrics, beat = counts()
    while metrics != beat and time.monotonic() < deadline:
        time.sleep(0.05)
        metrics, beat = counts()
    assert metrics == beat
    drafted, accepted = beat
    assert 0 < accepted < drafted
