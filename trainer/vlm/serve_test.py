"""A VLM checkpoint served: the real `serve` job (a trainer process on 127.0.0.1) answers a
chat request holding an image, called with the official `openai` client, exactly as the
`generate` path answers the same image and question (greedy), alone and among text-only
requests; the engine batches image and text requests, through preemption, without changing an
answer; bad images are HTTP 400 naming the field."""

import http.client
import io
import json
import random
import signal
import threading
from urllib.parse import urlparse

import openai
import pytest
import torch

from protos import attempt_pb2
from protos.config_yaml import load_job_spec
from protos.exit_codes import ExitCode
from protos.validation import validate_job_spec
from trainer import distributed, main
from trainer.data.images import load_image
from trainer.data.tokenizer import load_tokenizer
from trainer.generate import generate
from trainer.inference.engine import IMAGE_PLACEHOLDER, Engine, Request, SamplingParams
from trainer.inference.testing import serve_config
from trainer.jobs.context import JobContext
from trainer.serve.testing import wait_for_endpoint
from trainer.testing import start_trainer, write_job
from trainer.vlm import scenes
from trainer.vlm.ask import data_url, image_message
from trainer.vlm.checkpoints import load_vlm
from trainer.vlm.testing import vlm_job, write_scenes

torch.set_num_threads(1)
STEPS = 80  # enough for answers that are words, not only <eos>
QUESTION = f"question: {scenes.QUESTIONS[scenes.QuestionType.COLOR]} answer:"
MAX_TOKENS = 4
NAME = "scenes-vlm"


def scene_png(seed: int) -> bytes:
    """A fresh scene, rendered 4x larger than the model's images: the server resizes it."""
    scene = scenes.random_scene(random.Random(seed), 64)
    return scenes.png_bytes(scenes.render(scene, 64))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_serve")
    write_scenes(root, count=100)
    job = write_job(root / "train.yaml", vlm_job(root, steps=STEPS))
    assert main.main(["--config", str(job), "--run-dir", str(root / "run")]) == ExitCode.OK
    return root


@pytest.fixture(scope="module")
def reference(trained):
    """The checkpoint loaded as the GENERATE and EVAL jobs load it, and its tokenizer."""
    job = write_job(trained / "gen.yaml", vlm_job(trained, kind="GENERATE"))
    cfg = validate_job_spec(load_job_spec(str(job)))
    attempt = attempt_pb2.Attempt(run_dir=str(trained / "run"), cache_dir=str(trained / "cache"))
    ctx = JobContext(cfg, attempt, distributed.init(), lambda m: None, None)
    model, dataset = load_vlm(ctx)
    return model, load_tokenizer(dataset)


def greedy(reference, png: bytes, text: str = QUESTION) -> str:
    """The `generate` job's answer (trainer/generate.py) to `text` about the image."""
    model, tok = reference
    image = torch.from_numpy(load_image(io.BytesIO(png), model.cfg.vision.image_size).copy())
    new, _ = generate(
        model.lm, [tok.bos_id, *tok.encode(text)], MAX_TOKENS, temperature=0,
        stop_id=tok.eos_id, max_len=model.lm.rope.cos.shape[0], vocab=tok.vocab_size,
        image=image, embed_images=model.embed_images, image_tokens=model.image_tokens,
    )  # fmt: skip
    return tok.decode(new)


@pytest.fixture(scope="module")
def server(trained):
    """The serve job of the checkpoint, as the launcher starts it: `train --config`."""
    job = vlm_job(trained, kind="SERVE", serve={"heartbeat_seconds": 0.5})
    job["name"] = NAME
    config = write_job(trained / "serve.yaml", job)
    log = trained / "serve.log"
    process = start_trainer("--config", config, "--run-dir", trained / "run", log_path=log)
    try:
        yield wait_for_endpoint(log, process, timeout=120)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == ExitCode.PREEMPTED
    finally:
        if process.poll() is None:
            process.kill()
    assert "with 4 tokens per image" in log.read_text()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def test_served_answer_about_an_image_is_generates(client, reference):
    png = scene_png(1)
    want = greedy(reference, png)
    assert want.strip(), "the model answers words: the comparison below means something"
    got = client.chat.completions.create(
        model=NAME, messages=[image_message(png, QUESTION)], max_tokens=MAX_TOKENS, temperature=0
    )
    assert got.choices[0].message.content == want
    _, tok = reference
    assert got.usage.prompt_tokens == 4 + 1 + len(tok.encode(QUESTION))  # image, <bos>, text


def test_among_text_requests_the_answers_stay_the_same(client, reference):
    pngs = [scene_png(seed) for seed in range(2, 5)]
    want = [greedy(reference, png) for png in pngs]
    answers: dict[int, str] = {}
    text_message = {"role": "user", "content": QUESTION}

    def ask(i: int) -> None:  # even: an image and the question; odd: the question alone
        message = image_message(pngs[i // 2], QUESTION) if i % 2 == 0 else text_message
        got = client.chat.completions.create(
            model=NAME, messages=[message], max_tokens=MAX_TOKENS, temperature=0
        )
        answers[i] = got.choices[0].message.content or ""

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [answers[i] for i in (0, 2, 4)] == want


def test_the_engine_batches_image_and_text_requests_through_preemption(reference):
    """In-process: 3 image requests and 3 text ones in one engine, whose KV cache is too small
    for all of them at once, so some are preempted and recomputed (their image vectors
    prefilled again); each image answer is still the generate path's."""
    model, tok = reference
    size, k = model.cfg.vision.image_size, model.image_tokens
    pngs = [scene_png(seed) for seed in range(5, 8)]
    prompt = [tok.bos_id, *tok.encode(QUESTION)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    # Blocks exactly as long as an image request's prompt, three of them: the three image
    # requests are admitted first and fill the cache, their first decoded token needs a block
    # more, so the newest are preempted (and recomputed later); text requests join as blocks
    # free up, batched with the image requests still decoding.
    engine = Engine(
        model.lm,
        serve_config(block_size=k + len(prompt), num_blocks=3, max_batch_tokens=512),
        decode=tok.decode,
        eos_id=tok.eos_id,
        max_len=model.lm.rope.cos.shape[0],
        embed_images=model.embed_images,
    )
    requests = []
    for i, png in enumerate(pngs):
        image = torch.from_numpy(load_image(io.BytesIO(png), size).copy())
        requests.append(Request(f"i{i}", [IMAGE_PLACEHOLDER] * k + prompt, params, image=image))
    requests += [Request(f"t{i}", list(prompt), params) for i in range(3)]
    for r in requests:
        engine.add(r)
    kinds = []  # per step: whether it ran text requests (True), image requests (False)
    schedule = engine.scheduler.schedule

    def watched_schedule():
        scheduled = schedule()
        kinds.append({r.image is None for r, _ in scheduled})
        return scheduled

    engine.scheduler.schedule = watched_schedule  # type: ignore[method-assign]
    while engine.has_work():
        engine.step()
    assert engine.scheduler.preemptions > 0 and {True, False} in kinds
    assert all(r.finish is not None for r in requests)
    got = [tok.decode([t for t in r.output if t != tok.eos_id]) for r in requests[:3]]
    assert got == [greedy(reference, png) for png in pngs]


def post_chat(server: str, messages: list[dict], model: str = NAME):
    conn = http.client.HTTPConnection(urlparse(server).netloc, timeout=30)
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 2})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(
    ("content", "param", "says"),
    [
        ([image_part("https://example.com/a.png")], "[0].image_url.url", "network"),
        (
            [{"type": "text", "text": "a"}, image_part(data_url(b"hello", "text/plain"))],
            "[1].image_url.url",
            "not an image",
        ),
        ([image_part(data_url(b"not a png"))], "[0].image_url.url", "not a readable image"),
        ([image_part("data:image/png;base64,@@@")], "[0].image_url.url", "base64"),
        ([image_part(data_url(scene_png(0)))] * 2, "[1].image_url.url", "at most 1"),
        ([{"type": "input_audio", "input_audio": {}}], "[0].type", "expected"),
    ],
)
def test_bad_images_are_400_naming_the_field(server, content, param, says):
    status, body = post_chat(server, [{"role": "user", "content": content}])
    param = "messages[0].content" + param
    assert status == 400, body
    assert body["error"]["param"] == param
    assert says in body["error"]["message"] and param in body["error"]["message"]
