"""Sampling with an image in front of the prompt: the image and prompt fill the KV cache in one
forward, then one cached forward per new token (trainer/generate.py's sampler)."""

import time

import torch

from protos.trainer_config_pb2 import GenerateConfig
from trainer.generate import sample_next
from trainer.model import KVCache


@torch.no_grad()
def generate(model, image: torch.Tensor, prompt: list[int], g: GenerateConfig, stop_id: int):
    """(new token ids, tokens/s) after `image` (S, S, 3 uint8) and `prompt`."""
    device = next(model.parameters()).device
    lm = model.lm
    room = lm.rope.cos.shape[0] - model.image_tokens - len(prompt)
    steps = min(g.max_new_tokens, room)
    if steps <= 0:
        return [], 0.0
    cache = KVCache(lm, 1, model.image_tokens + len(prompt) + steps, device, lm.output.weight.dtype)
    generator = torch.Generator(device=device).manual_seed(g.seed)
    ids = torch.tensor([prompt], device=device)
    embeds = torch.cat([model.embed_images(image[None].to(device)), lm.tok_embeddings(ids)], 1)
    start = time.perf_counter()
    h = model.hidden(embeds, 0, cache)
    out: list[int] = []
    for _ in range(steps):
        logits = torch.nn.functional.linear(h[:, -1], lm.output.weight).float()
        token = int(sample_next(logits, g.temperature, g.top_k, g.top_p, generator))
        if token == stop_id:
            break
        out.append(token)
        h = model.hidden(
            lm.tok_embeddings(torch.tensor([[token]], device=device)), cache.pos, cache
        )
    return out, len(out) / max(time.perf_counter() - start, 1e-9)
