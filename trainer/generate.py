"""Sampling with a KV cache: temperature, top-k, top-p (nucleus)."""

import time

import torch

from trainer.model import KVCache


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator):
    """One token id per row of `logits` (B, vocab). temperature 0 is greedy; top_k 0 and top_p
    1 disable those filters."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first stays).
        drop = cumulative - sorted_logits.softmax(dim=-1) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
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
) -> tuple[list[int], float]:
    """New token ids after `prompt` (one KV-cached forward per token) and tokens/s.
    Stops at `stop_id`, after `max_new_tokens`, or when `max_len` positions are used."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    new_tokens = min(max_new_tokens, max_len - len(prompt))
    if new_tokens <= 0:
        return [], 0.0
    cache = KVCache(model, 1, len(prompt) + new_tokens, device, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    model.eval()
    ids = torch.tensor([prompt], device=device)
    start = time.perf_counter()
    out: list[int] = []
    for _ in range(new_tokens):
        positions = torch.arange(cache.pos, cache.pos + ids.shape[1], device=device)[None]
        logits = model(ids, positions, cache=cache)[:, -1]
        token = sample_next(logits, temperature, top_k, top_p, generator)
        out.append(int(token))
        if stop_id is not None and out[-1] == stop_id:
            break
        ids = token[:, None]
    elapsed = time.perf_counter() - start
    return out, len(out) / max(elapsed, 1e-9)
