"""What the engine admits (#36): a request it could never finish is refused when it arrives,
by the serve API (a 400 naming the field) and again by the engine's `add`."""

from protos import trainer_config_pb2


class RequestTooLarge(ValueError):
    """A request the engine could never finish; `field` names the request's field that is too
    large (the serve API's 400 names it)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_fits(
    prompt_tokens: int,
    max_tokens: int,
    max_len: int,
    cfg: trainer_config_pb2.ServeConfig,
    prompt_field: str = "prompt",
) -> None:
    """Raises RequestTooLarge unless a request fits the model's context and, at its longest
    (prompt + max_tokens, or the context), the KV-cache pool. One that does not fit the pool
    would take every block, be preempted, be recomputed, and never finish, holding back every
    other request (#36): it is refused at admission instead."""
    if prompt_tokens >= max_len:
        problem = f"{prompt_tokens} tokens; the model's context is {max_len}: no room to generate"
        raise RequestTooLarge(prompt_field, f"{prompt_field}: {problem}")
    pool = cfg.num_blocks * cfg.block_size
    if min(prompt_tokens + max_tokens, max_len) > pool:
        field = prompt_field if prompt_tokens >= pool else "max_tokens"
        raise RequestTooLarge(
            field,
            f"{field}: max_tokens {max_tokens} plus the {prompt_field}'s {prompt_tokens} tokens "
            f"exceed the KV-cache pool of {pool} positions (serve.num_blocks {cfg.num_blocks} x "
            f"serve.block_size {cfg.block_size})",
        )
