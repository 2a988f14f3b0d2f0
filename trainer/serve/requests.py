"""What a request to the API may say: OpenAI's request bodies as pydantic models, and how a
body the models refuse becomes OpenAI's error object naming the field.

Every field of OpenAI's requests is either implemented here or refused by name: an unknown
field is a 400 (as OpenAI answers), and so is a field in NOT_SUPPORTED set to anything but a
value that asks for nothing (clients that send every field send those). Numbers must be finite:
JSON's NaN is a number to Python, and NaN compares false with every bound. `check_limits`:
what a request may ask beyond the schema (ServeConfig's limits on prompt and stop strings).
"""

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protos import trainer_config_pb2
from trainer.inference.grammar import Constraint, Format, problem

# Fields of OpenAI's completion and chat requests this server does not implement, each with
# the values that ask for nothing (null always does). To implement one, delete its row and give
# the request models the field.
NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "metadata": ({},),
}
# The same for a chat message's fields: an answer passed back as it came
# (`choices[0].message`) carries them empty.
MESSAGE_NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "tool_calls": ([],),
    "tool_call_id": (),
    "function_call": (),
    "refusal": (),
    "audio": (),
    "annotations": ([],),
}


class ApiError(Exception):
    """An answer in OpenAI's error shape: `kind` is its `type`, `code` its `code`."""

    def __init__(
        self, status: int, message: str, param: str | None, kind: str = "", code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or "invalid_request_error"

    def body(self) -> dict:
        error = {"message": self.message, "type": self.kind, "param": self.param}
        return {"error": {**error, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    not_supported: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _drop_what_asks_for_nothing(cls, data: Any) -> Any:
        """A field of `not_supported` set to nothing is dropped; set to more, it stays, and
        extra="forbid" refuses it (`validation_refusal` says it is not supported)."""
        if not isinstance(data, dict):
            return data
        table = cls.not_supported
        return {
            k: v for k, v in data.items() if k not in table or (v is not None and v not in table[k])
        }


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with token counts and no choices


class JsonSchema(_Strict):
    """OpenAI's `response_format.json_schema`. Answers always follow the schema: `strict` is
    accepted either way (a grammar has no looser mode)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for the name
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # `schema` is a BaseModel method
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format` (text, json_object, json_schema), and Kitchen's `regex`: a
    type of the same field, so an answer has one format, never two asked at once."""

    type: Literal["text", "json_object", "json_schema", "regex"]
    json_schema: JsonSchema | None = None  # with type json_schema
    regex: str | None = None  # with type regex: the whole answer matches it

    @model_validator(mode="after")
    def _one_format(self) -> "ResponseFormat":
        for name in ("json_schema", "regex"):
            if (getattr(self, name) is not None) != (self.type == name):
                raise ValueError(f"{name}: given exactly when type is {name!r}")
        return self

    def constraint(self) -> Constraint | None:
        """The engine's constraint (None: free text); a 400 naming the field when no answer
        could satisfy it (an unsatisfiable or unsupported schema, an invalid pattern)."""
        if self.type == "text":
            return None
        if self.json_schema is not None:
            c = Constraint(Format.JSON_SCHEMA, json.dumps(self.json_schema.schema_))
            field = "response_format.json_schema.schema"
        elif self.regex is not None:
            c, field = Constraint(Format.REGEX, self.regex), "response_format.regex"
        else:
            c, field = Constraint(Format.JSON_OBJECT), "response_format"
        why = problem(c)
        if why:
            raise ApiError(400, f"{field}: {why}", field)
        return c


class Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None  # count and length: ServeConfig.max_stop, max_stop_chars
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1  # one choice per request
    user: str | None = None  # the caller's end user, for their own records: accepted, unused
    response_format: ResponseFormat | None = None  # structured output (grammar.py)
    not_supported = NOT_SUPPORTED


class CompletionRequest(Sampling):
    prompt: str
    logprobs: int | None = Field(default=None, ge=0, le=5)  # that many alternatives (logprobs.py)


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]  # a string, or OpenAI's content parts (text, image_url)
    name: str | None = None  # a participant's name: accepted, not part of the prompt format
    not_supported = MESSAGE_NOT_SUPPORTED


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # with logprobs (logprobs.py)


def validation_refusal(errors: list[dict]) -> ApiError:
    """The 400 of a body the models refused (FastAPI's RequestValidationError.errors())."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type")
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}", None)
    param = ".".join(loc) or None
    unsupported = (len(loc) == 1 and loc[0] in NOT_SUPPORTED) or (
        len(loc) == 3 and loc[0] == "messages" and loc[2] in MESSAGE_NOT_SUPPORTED
    )
    if kind == "extra_forbidden" and unsupported:
        return ApiError(400, f"{param}: not supported by this server", param)
    if kind == "extra_forbidden":
        return ApiError(400, f"{param}: unrecognized request argument", param)
    return ApiError(400, f"{param}: {first.get('msg')}", param)


def check_limits(
    text: str, field: str, stop: tuple[str, ...], limits: trainer_config_pb2.ServeConfig
) -> None:
    """What one request may ask beyond the schema (ServeConfig's limits), checked before the
    prompt is tokenized: a 400 naming the field."""
    if len(text) > limits.max_prompt_chars:
        message = (
            f"{field}: {len(text):,} characters; this server takes at most "
            f"{limits.max_prompt_chars:,} (serve.max_prompt_chars)"
        )
        raise ApiError(400, message, field)
    if len(stop) > limits.max_stop:
        message = f"stop: {len(stop):,} stop strings; at most {limits.max_stop} (serve.max_stop)"
        raise ApiError(400, message, "stop")
    for i, s in enumerate(stop):
        if len(s) > limits.max_stop_chars:
            message = (
                f"stop[{i}]: {len(s):,} characters; at most {limits.max_stop_chars} "
                "(serve.max_stop_chars)"
            )
            raise ApiError(400, message, "stop")
