"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (both with
`stream: true` as server-sent events), /v1/models, /health, /metrics. `logprobs` (and chat's
`top_logprobs`): logprobs.py; usage carries `prompt_tokens_details.cached_tokens`, the prompt
tokens the prefix cache held; `response_format` (json_schema, json_object, Kitchen's regex)
constrains the answer (requests.py, trainer/inference/grammar.py). How an answer goes back,
whole or streamed: replies.py.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with `param`
naming the field: 400 for bad input (malformed JSON included: FastAPI's 422 is turned into
400; unknown and unimplemented fields: requests.py; a request over ServeConfig's limits; an
image the model cannot take: trainer/serve/images.py), 401 without the API key (guard.py), 404
for an unknown model or route, 429 when the queue is full, 503 while draining.
"""

import asyncio
import dataclasses
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from trainer.inference.admission import RequestTooLarge, check_fits
from trainer.inference.engine import IMAGE_PLACEHOLDER, Output, SamplingParams
from trainer.inference.engine import Request as EngineRequest
from trainer.inference.grammar import Vocabulary
from trainer.serve.guard import Guard
from trainer.serve.images import (
    ImageInputError,
    ImagePart,
    PromptImages,
    content_parts,
    request_image,
)
from trainer.serve.logprobs import Logprobs
from trainer.serve.replies import Mailbox, Outputs, Reply, stream, whole
from trainer.serve.requests import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Message,
    Sampling,
    check_limits,
    validation_refusal,
)
from trainer.serve.runner import Draining, EngineRunner, Overloaded

# A prompt longer than this is tokenized on a worker thread: a long one would hold the event
# loop (every client's stream) for as long as it takes; a short one takes microseconds, less
# than the hop to a thread and back.
INLINE_TOKENIZE_CHARS = 4096


def chat_prompt(messages: list[Message]) -> tuple[str, list[ImagePart]]:
    """The SFT chat format (trainer/data/tokenized.py lays a record out as `<bos> prompt
    response <eos>`, no separator, no role tags): the turns' texts joined in order. The last
    turn must be the user's; the model's answer follows it, ended by <eos>. With the text, the
    image parts of every turn, in order."""
    if messages[-1].role != "user":
        raise ApiError(400, "the last message must be the user's", "messages")
    texts, images = [], []
    for i, m in enumerate(messages):
        try:
            text, parts = content_parts(m.content, f"messages[{i}].content")
        except ImageInputError as e:
            raise ApiError(400, str(e), e.param) from None
        texts.append(text)
        images += parts
    return "".join(texts), images


@dataclass(frozen=True)
class ServedModel:
    """What the API needs of the model: its name, tokenizer functions and context length."""

    name: str
    encode: Callable[[str], list[int]]
    bos_id: int
    max_len: int
    created: int
    images: PromptImages | None = None  # a VLM's; None: a text model
    grammar: Vocabulary | None = None  # the tokenizer's, for structured output (None: off)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(model: ServedModel, runner: EngineRunner, api_key: str = "") -> FastAPI:
    """The API of `model` on `runner`'s engine; `api_key` (""; none) is asked of /v1 routes.
    Limits are runner.cfg's (ServeConfig, defaults applied)."""
    app = FastAPI(title="kitchen serve")
    limits = runner.cfg
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes)
    registry = runner.metrics.registry
    mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = (
        weakref.WeakKeyDictionary()
    )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(validation_refusal(list(exc.errors())))

    @app.exception_handler(HTTPException)  # an unknown route or method, a body FastAPI refused
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(ApiError(exc.status_code, str(exc.detail), None))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **dataclasses.asdict(runner.load())}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model.name,
            "object": "model",
            "created": model.created,
            "owned_by": "kitchen",
        }
        card["max_model_len"] = model.max_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        top = body.logprobs
        return await _serve(body, body.prompt, "prompt", request, False, [], top)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs true", "top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        text, images = chat_prompt(body.messages)
        return await _serve(body, text, "messages", request, True, images, top)

    async def _serve(
        body: Sampling,
        text: str,
        field: str,
        request: Request,
        chat: bool,
        images: list[ImagePart],
        top_logprobs: int | None,  # None: no logprobs
    ) -> Any:
        if body.model != model.name:
            problem = f"model {body.model!r} does not exist: this server serves {model.name!r}"
            raise ApiError(404, problem, "model", "model_not_found")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        check_limits(text, field, stop, limits)
        constraint, asked = None, body.response_format
        if asked is not None and asked.type != "text":
            if model.grammar is None:
                problem = "response_format: structured output is off (no grammar vocabulary)"
                raise ApiError(400, problem, "response_format")
            constraint = await asyncio.to_thread(asked.constraint)  # a big schema takes ms
        pixels = None
        if images:  # decoding is Pillow's work: off the event loop. Only with an image: the
            # hop to a worker thread and back cost every text request milliseconds under load
            try:
                pixels = await asyncio.to_thread(request_image, images, model.images)
            except ImageInputError as e:
                raise ApiError(400, str(e), e.param) from None
        # Documents start with BOS; a VLM's image goes before it (its training rows' layout).
        if len(text) > INLINE_TOKENIZE_CHARS:
            tokens = await asyncio.to_thread(model.encode, text)
        else:
            tokens = model.encode(text)
        prompt = [model.bos_id, *tokens]
        image = None
        if pixels is not None and model.images is not None:
            image = torch.from_numpy(pixels.copy())
            prompt = [IMAGE_PLACEHOLDER] * model.images.tokens + prompt
        room = model.max_len - len(prompt)
        if room < 1:
            problem = f"{field}: {len(prompt)} tokens; the model's context is {model.max_len}"
            raise ApiError(400, problem, field)
        # OpenAI's default: 16 tokens for a completion, the rest of the context for a chat.
        max_tokens = body.max_tokens or (room if chat else min(16, room))
        if max_tokens > room:
            problem = (
                f"max_tokens: {max_tokens} plus the {field}'s {len(prompt)} tokens exceed "
                f"the model's context of {model.max_len}"
            )
            raise ApiError(400, problem, "max_tokens")
        try:  # the KV-cache pool, too: a request it cannot hold would never finish (#36)
            check_fits(len(prompt), max_tokens, model.max_len, runner.cfg, field)
        except RequestTooLarge as e:
            raise ApiError(400, str(e), e.field) from None
        params = SamplingParams(
            max_tokens, body.temperature, body.top_p, body.top_k, body.seed, stop,
            logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0,
            constraint=constraint,
        )  # fmt: skip
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        loop = asyncio.get_running_loop()
        outputs = Outputs(loop)
        mailbox = mailboxes.get(loop) or mailboxes.setdefault(loop, Mailbox(loop))

        def deliver(out: Output) -> None:  # on the runner's receiving thread
            mailbox.put(outputs, out)

        try:
            runner.submit(EngineRequest(rid, prompt, params, image=image), deliver)
        except Overloaded as e:
            raise ApiError(429, str(e), None, "rate_limit_exceeded") from e
        except Draining as e:
            raise ApiError(503, str(e), None, "server_shutting_down") from e
        reply = Reply(rid, model.name, chat, len(prompt))
        if top_logprobs is not None:
            reply.logprobs = Logprobs(runner.decode, chat)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                stream(reply, outputs, runner, usage), media_type="text/event-stream"
            )
        return await whole(reply, outputs, runner, request)

    return app
