"""Sampling with an image in front of the prompt: one request with an image through the
inference engine's offline API (trainer/inference/offline.py), as the text GENERATE job."""

import time

import torch

from protos.trainer_config_pb2 import GenerateConfig
from trainer.inference.engine import SamplingParams
from trainer.inference.offline import Prompt
from trainer.inference.offline import generate as generate_batch


def generate(model, image: torch.Tensor, prompt: list[int], g: GenerateConfig, stop_id: int):
    """(new token ids, the stop token last when it ended them; tokens/s) after `image`
    (S, S, 3 uint8) and `prompt`."""
    max_len = model.lm.rope.cos.shape[0]
    params = SamplingParams(
        max_tokens=g.max_new_tokens, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
        seed=g.seed,
    )  # fmt: skip
    start = time.perf_counter()
    [done] = generate_batch(
        model.lm, [Prompt(prompt, image)], params, eos_id=stop_id, max_len=max_len,
        embed_images=model.embed_images, image_tokens=model.image_tokens,
    )  # fmt: skip
    return done.token_ids, len(done.token_ids) / max(time.perf_counter() - start, 1e-9)
