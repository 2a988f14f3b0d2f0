"""The GENERATE job's sampling: one prompt (a VLM's with its image in front) through the
inference engine's offline API (trainer/inference/offline.py), with the job's temperature,
top-k, top-p and seed."""

import time
from collections.abc import Callable

import torch

from trainer.inference.engine import SamplingParams
from trainer.inference.offline import Prompt
from trainer.inference.offline import generate as generate_batch


def generate(
    model,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 0.95,
    seed: int = 0,
    stop_id: int | None = None,
    max_len: int,
    vocab: int | None = None,
    image: torch.Tensor | None = None,
    embed_images: Callable[[torch.Tensor], torch.Tensor] | None = None,
    image_tokens: int = 0,
) -> tuple[list[int], float]:
    """New token ids after `prompt` (the stop token last when it ended them) and tokens/s.
    Stops at `stop_id` (None: never), after `max_new_tokens`, or when `max_len` positions are
    used. Only ids below `vocab` (the tokenizer's) are sampled (None: any row of the model's).
    A VLM's `image` (S, S, 3 uint8) is read before the prompt: `model` is then its language
    model, with its `embed_images` and `image_tokens` (offline.py)."""
    params = SamplingParams(
        max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
    )
    start = time.perf_counter()
    [done] = generate_batch(
        model,
        [Prompt(prompt, image)],
        params,
        eos_id=-1 if stop_id is None else stop_id,
        max_len=max_len,
        vocab=vocab,
        embed_images=embed_images,
        image_tokens=image_tokens,
    )
    elapsed = time.perf_counter() - start
    return done.token_ids, len(done.token_ids) / max(elapsed, 1e-9)
