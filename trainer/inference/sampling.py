"""The next token from a row of fp32 logits, the same way on every decode path.

Temperature 0 is greedy (the first index of the largest logit); otherwise the logits are
divided by the temperature, filtered by top-k (0: off) and top-p (1: off), and one token is
drawn with the request's own generator, so a seeded request draws the same tokens whatever
else shares its batch.

The log-probability reported for a sampled token is log_softmax of the unscaled logits the
token was drawn from (temperature 1, no top-k/top-p filter): the number the RL trainer
recomputes as log pi(token) from the model's logits (trainer/rl/policy.py `token_logps`), so
the two are comparable (equal up to float rounding), whatever temperature sampled it.
"""

import torch

ARGMAX_BLOCK = 64


def sample(
    logits: torch.Tensor,
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    generators: list[torch.Generator],
) -> list[int]:
    """One token id per row of `logits` (B, vocab), each row with its own temperature (0:
    greedy), top_k (0: off), top_p (1: off) and generator.

    The filters run on all rows at once; the draw is inverse-CDF sampling, as torch.multinomial
    does it: one uniform number from the row's own generator, placed in the cumulative
    distribution of the row. One random number per row, not one per token (exponential or
    Gumbel races), and not one multinomial call per row (~150 us for a 4096-token row here). A
    row's draw depends on its logits and its generator only, never on the other rows."""
    tokens: dict[int, int] = {}
    greedy = [i for i, t in enumerate(temperature) if t == 0]
    if greedy:
        tokens = dict(zip(greedy, argmax_rows(logits[greedy]).tolist(), strict=True))
    drawn = [i for i, t in enumerate(temperature) if t != 0]
    if drawn:
        device = logits.device
        x = (
            logits[drawn].float()
            / torch.tensor([temperature[i] for i in drawn], device=device)[:, None]
        )
        ks, ps = [top_k[i] for i in drawn], [top_p[i] for i in drawn]
        if any(0 < k < x.shape[-1] for k in ks) or any(p < 1 for p in ps):
            x = _filtered(x, ks, ps)
        cdf = x.softmax(dim=-1).cumsum(dim=-1)
        total = cdf[:, -1:]
        u = torch.cat([torch.rand(1, generator=generators[i], device=device) for i in drawn])
        picked = torch.searchsorted(cdf, u[:, None] * total, right=True)[:, 0]
        # u * total may round up to total: the last token with probability is the highest pick.
        last = (cdf >= total).int().argmax(dim=-1)
        tokens.update(zip(drawn, torch.minimum(picked, last).tolist(), strict=True))
    return [tokens[i] for i in range(len(temperature))]


def _filtered(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """x (B, vocab) with -inf outside each row's top_k (ties with the k-th kept) and, among
    the rest, outside its top_p nucleus: a token is dropped when the tokens ranked above it
    already reach top_p (the first always stays)."""
    vocab = x.shape[-1]
    ordered, order = x.sort(dim=-1, descending=True)
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=x.device)
    kth = ordered.gather(1, (k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    p = torch.tensor(top_p, device=x.device)[:, None]
    probs = ordered.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs >= p) & (p < 1)
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, ordered)


def probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The distribution `sample` draws a row from (B, vocab) at temperature > 0: softmax of
    the logits over the temperature, outside top_k and the top_p nucleus 0. Speculative
    decoding's rejection rule compares the target's and the draft's (speculative.py)."""
    x = logits.float() / temperature
    rows = x.shape[0]
    if 0 < top_k < x.shape[-1] or top_p < 1:
        x = _filtered(x, [top_k] * rows, [top_p] * rows)
    return x.softmax(dim=-1)


TopLogprobs = tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], top: list[int]
) -> tuple[list[float], list[TopLogprobs]]:
    """log_softmax(logits[i])[tokens[i]] for each row, from the fp32 logits at temperature 1,
    and the row's `top[i]` most likely tokens with theirs (the API's top_logprobs; ties: the
    lower id first)."""
    logp = logits.float().log_softmax(-1)
    index = torch.tensor(tokens, device=logits.device)[:, None]
    chosen = logp.gather(1, index)[:, 0].tolist()
    k = max(top, default=0)
    if not k:
        return chosen, [() for _ in tokens]
    values, ids = logp.topk(k, dim=-1, sorted=True)
    values, ids = values.tolist(), ids.tolist()
    tops = [tuple(zip(ids[i][:n], values[i][:n], strict=True)) for i, n in enumerate(top)]
    return chosen, tops


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), the same index (the first of ties), faster for many rows.

    PyTorch's CPU argmax walks a row one element at a time (~150 us for 32 rows of 4096 here),
    while max reductions are vectorized. So: the max of each block of 64 logits, the first
    block holding the row's max (argmax over 64x fewer values), then the first max inside that
    block: the first index of the row's max, as argmax gives. About 5x faster at 32 rows; one
    row, or a vocabulary not in whole blocks, takes plain argmax."""
    rows, vocab = logits.shape
    if rows < 8 or vocab % ARGMAX_BLOCK:
        return logits.argmax(dim=-1)
    blocks = logits.view(rows, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)
    block = blocks.amax(dim=-1).argmax(dim=-1)
    inner = blocks[torch.arange(rows, device=logits.device), block].argmax(dim=-1)
    return block * ARGMAX_BLOCK + inner
