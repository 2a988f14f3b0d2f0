"""Every decode path gives the same output on the same prompts: the offline API, the GENERATE
job's function, VLM generation, RL sampling, eval's generate_until, the VLM eval's answers and
the serve job over HTTP, greedy and seeded sampling, text prompts and an image.

The models are inference/testing.py's tiny text model and a tiny VLM built the same way: random
weights spread wide, so that greedy choices are decided by the model (not float rounding) and
the next token depends on the context. The test checks that it does (different prompts and
different images give different answers), else a path that ignored its prompt or its image
could pass. The greedy text answers also equal a full forward per token with no cache."""

import http.client
import io
import json
from types import SimpleNamespace
from urllib.parse import urlparse

import numpy as np
import pytest
import torch
from PIL import Image

from protos import defaults, trainer_config_pb2
from trainer.data.images import load_image
from trainer.generate import generate as generate_job_sampling
from trainer.inference import offline
from trainer.inference.engine import SamplingParams
from trainer.inference.testing import (
    BOS,
    EOS,
    VOCAB,
    decode,
    encode,
    greedy_full_forward,
    tiny_model,
)
from trainer.interop.lm_eval_adapter import KitchenLM
from trainer.rl import policy
from trainer.serve.api import ServedModel
from trainer.serve.images import PromptImages
from trainer.serve.server import Server
from trainer.serve.testing import start_server
from trainer.vlm.ask import image_message
from trainer.vlm.evaluate import answer
from trainer.vlm.model import VisionLanguageModel

torch.set_num_threads(1)

MAX_LEN = 64
NEW = 12
TEXTS = ["abc", "hello", "zzzz", "kitchen"]
QUESTION = "what"
# Seeded sampling: RL draws each response's engine seed from its job's generator; the other
# paths are given that seed, so all draw with the same one.
RL_GENERATOR_SEED = 5
SAMPLING = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}


def rl_seed() -> int:
    [seed] = policy.response_seeds(torch.Generator().manual_seed(RL_GENERATOR_SEED), 1)
    return seed


def ids(text: str) -> list[int]:
    return [BOS, *encode(text)]


def tiny_vlm() -> VisionLanguageModel:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads = 32, 2, 4, 2
    cfg.model.max_seq_len, cfg.model.use_kernels = MAX_LEN, False
    cfg.data.seq_len = 24
    v = cfg.vision
    v.image_size, v.patch_size, v.pixel_shuffle, v.dim, v.n_layers = 16, 4, 2, 32, 1
    torch.manual_seed(1)
    model = VisionLanguageModel(defaults.with_defaults(cfg), VOCAB, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model.eval()


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def pixels(data: bytes) -> torch.Tensor:
    """The image as every path reads it: load_image (the serve job's decoding too)."""
    return torch.from_numpy(load_image(io.BytesIO(data), 16).copy())


@pytest.fixture(scope="module")
def text_model():
    return tiny_model(MAX_LEN)


@pytest.fixture(scope="module")
def vlm():
    return tiny_vlm()


@pytest.fixture(scope="module")
def text_server(text_model):
    server = start_server(text_model)
    yield server
    assert server.stop()


@pytest.fixture(scope="module")
def vlm_server(vlm):
    reads = PromptImages(16, vlm.image_tokens, vlm.embed_images)
    served = ServedModel("vlm", encode, BOS, MAX_LEN, created=0, images=reads)
    cfg = defaults.with_defaults(trainer_config_pb2.TrainerConfig()).serve
    server = Server(vlm.lm, cfg, served, decode=decode, eos_id=EOS).start()
    yield server
    assert server.stop()


def post(server, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection(urlparse(server.endpoint).netloc, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = json.loads(response.read())
    conn.close()
    assert response.status == 200, data
    return data


def text_of(token_ids: list[int]) -> str:
    """What every path's text must be: the ids' text, a stop token never shown."""
    return decode([t for t in token_ids if t != EOS])


def text_paths(model, server, text: str, knobs: dict, seed: int) -> dict[str, list[int] | str]:
    """Each text path's answer to `text`: token ids where the path gives them, else text."""
    params = SamplingParams(max_tokens=NEW, seed=seed, **knobs)
    [done] = offline.generate(model, [offline.Prompt(ids(text))], params, eos_id=EOS, decode=decode)
    job, _ = generate_job_sampling(
        model, ids(text), NEW, seed=seed, stop_id=EOS, max_len=MAX_LEN, **knobs
    )
    rollout = policy.sample(
        model, [ids(text)], 1, NEW, temperature=knobs["temperature"], eos_id=EOS,
        generator=torch.Generator().manual_seed(RL_GENERATOR_SEED), max_len=MAX_LEN,
        top_k=knobs["top_k"], top_p=knobs["top_p"],
    )  # fmt: skip
    served = post(
        server, "/v1/completions",
        {"model": "tiny", "prompt": text, "max_tokens": NEW, "seed": seed, **knobs},
    )  # fmt: skip
    out: dict[str, list[int] | str] = {
        "offline": done.token_ids,
        "generate job": job,
        "rl sample": rollout.sequences[0][len(ids(text)) :],
        "offline text": done.text,
        "serve (HTTP)": served["choices"][0]["text"],
    }
    if knobs["temperature"] == 0:  # eval's generation tasks decode greedily
        tokenizer = SimpleNamespace(
            encode=encode, decode=decode, bos_id=BOS, eos_id=EOS, vocab_size=VOCAB
        )
        harness = KitchenLM(model, tokenizer, MAX_LEN, batch_size=1)  # type: ignore[arg-type]
        request = SimpleNamespace(args=(text, {"until": [], "max_gen_toks": NEW}))
        out["eval generate_until"] = harness.generate_until([request])[0]
    return out


def assert_all_agree(answers: dict[str, list[int] | str]) -> list[int]:
    token_ids = answers["offline"]
    assert isinstance(token_ids, list)
    for name, got in answers.items():
        want = token_ids if isinstance(got, list) else text_of(token_ids)
        assert got == want, f"{name}: {got!r}, the offline API's {want!r}"
    return token_ids


@pytest.mark.parametrize("knobs", [GREEDY, SAMPLING], ids=["greedy", "seeded sampling"])
def test_every_text_path_gives_the_same_answer(text_model, text_server, knobs):
    seed = rl_seed()
    answers = [assert_all_agree(text_paths(text_model, text_server, t, knobs, seed)) for t in TEXTS]
    assert len({tuple(a) for a in answers}) == len(TEXTS)  # the context decides the answer
    if knobs is GREEDY:
        for text, got in zip(TEXTS, answers, strict=True):
            assert got == greedy_full_forward(text_model, ids(text), NEW, stop=EOS)
    else:  # another seed draws another answer
        other = offline.generate(
            text_model, [offline.Prompt(ids(TEXTS[0]))],
            SamplingParams(max_tokens=NEW, seed=seed + 1, **knobs), eos_id=EOS,
        )  # fmt: skip
        assert other[0].token_ids != answers[0]


@pytest.mark.parametrize("knobs", [GREEDY, SAMPLING], ids=["greedy", "seeded sampling"])
def test_every_image_path_gives_the_same_answer(vlm, vlm_server, knobs):
    seed = rl_seed()
    answers = []
    for image_seed in (0, 1, 2):
        data = png(image_seed)
        image = pixels(data)
        params = SamplingParams(max_tokens=NEW, seed=seed, **knobs)
        [done] = offline.generate(
            vlm.lm, [offline.Prompt(ids(QUESTION), image)], params, eos_id=EOS,
            embed_images=vlm.embed_images, image_tokens=vlm.image_tokens, decode=decode,
        )  # fmt: skip
        job, _ = generate_job_sampling(
            vlm.lm, ids(QUESTION), NEW, seed=seed, stop_id=EOS, max_len=vlm.lm.rope.cos.shape[0],
            image=image, embed_images=vlm.embed_images, image_tokens=vlm.image_tokens, **knobs,
        )  # fmt: skip
        served = post(
            vlm_server, "/v1/chat/completions",
            {"model": "vlm", "messages": [image_message(data, QUESTION)], "max_tokens": NEW,
             "seed": seed, **knobs},
        )  # fmt: skip
        got = {
            "offline": done.token_ids,
            "vlm generate job": job,
            "offline text": done.text,
            "serve (HTTP chat)": served["choices"][0]["message"]["content"],
        }
        if knobs is GREEDY:  # the VLM eval's answers: greedy, <eos> left out
            [evaluated] = answer(vlm, image[None], torch.tensor([ids(QUESTION)]), NEW, EOS)
            got["vlm eval answer"] = decode(evaluated)
            assert evaluated == [t for t in done.token_ids if t != EOS]
        answers.append(assert_all_agree(got))
    assert len({tuple(a) for a in answers}) == 3  # the image decides the answer
