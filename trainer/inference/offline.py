"""The offline batch API on the engine (vLLM's `LLM.generate`): prompts in, completions out.

    completions = generate(model, [Prompt(ids), Prompt(ids, image)], SamplingParams(...),
                           eos_id=tok.eos_id, decode=tok.decode)

Every prompt is one engine request; the engine batches them continuously (a finished sequence's
place goes to the next at once, prompts of any length share a step), over a KV-cache pool sized
for the whole batch, so nothing waits for a block. The model is read in place: its live
parameters, as they are at the call (an RL policy mid-training), never a copy. A VLM passes its
language model, `embed_images` and `image_tokens`; a prompt's image is read in front of its ids,
as the VLM trained (`[image tokens] <bos> text`).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from protos import defaults, trainer_config_pb2
from trainer.inference.engine import (
    IMAGE_PLACEHOLDER,
    Engine,
    FinishReason,
    Request,
    SamplingParams,
)
from trainer.model import Transformer


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # token ids, <bos> first as the model's documents start
    image: torch.Tensor | None = None  # a VLM's (S, S, 3) uint8 image, read before `ids`


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # generated ids, the stop token included when one ended it
    text: str  # their text ("" without a `decode`), never the stop token's
    finish: FinishReason
    # log_softmax of the fp32 logits at temperature 1 at each token (sampling.py): the log
    # pi(token) the RL trainer recomputes, whatever temperature drew it
    logprobs: list[float]


def _no_text(ids: list[int]) -> str:
    return ""


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: Sequence[Prompt],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    eos_id: int,
    max_len: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
    embed_images: Callable[[torch.Tensor], torch.Tensor] | None = None,
    image_tokens: int = 0,
    block_size: int = 16,
    vocab: int | None = None,
) -> list[Completion]:
    """One completion per prompt, in order. `params`: one for all prompts, or one each (each
    request's own seed: give distinct seeds for distinct draws of one prompt). `max_len`: the
    positions the model has (default: its rotary table's). `decode`: ids -> text. `vocab`: the
    tokenizer's ids, the only ones sampled (None: every row of the model's output; engine.py)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    if not prompts:
        return []
    max_len = max_len or model.rope.cos.shape[0]
    requests = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        if prompt.image is not None and not image_tokens:
            raise ValueError(f"prompts[{i}].image: the model reads no images (image_tokens 0)")
        ids = list(prompt.ids)
        if prompt.image is not None:
            ids = [IMAGE_PLACEHOLDER] * image_tokens + ids
        requests.append(Request(str(i), ids, p, image=prompt.image))
    # No room to generate (no new tokens asked, or the prompt fills the context): an empty
    # completion, never a request.
    runs = [r for r in requests if r.params.max_tokens > 0 and len(r.prompt) < max_len]
    if not runs:
        return [Completion([], "", FinishReason.LENGTH, []) for _ in requests]
    cfg = _pool_config(runs, max_len, block_size)
    engine = Engine(
        model, cfg, decode=decode or _no_text, eos_id=eos_id, max_len=max_len,
        embed_images=embed_images, vocab=vocab,
    )  # fmt: skip
    for r in runs:
        engine.add(r)
    while engine.has_work():
        engine.step()
    return [
        Completion(r.output, r.text, r.finish or FinishReason.LENGTH, r.logprobs) for r in requests
    ]


def _pool_config(requests: list[Request], max_len: int, block_size: int):
    """A ServeConfig whose KV-cache pool holds every request at its longest: all run at once
    and none is ever preempted."""
    cfg = trainer_config_pb2.TrainerConfig()
    blocks = sum(
        -(-min(len(r.prompt) + r.params.max_tokens, max_len) // block_size) for r in requests
    )
    cfg.serve.block_size, cfg.serve.num_blocks = block_size, blocks
    cfg.serve.max_running = len(requests)
    return defaults.with_defaults(cfg).serve
