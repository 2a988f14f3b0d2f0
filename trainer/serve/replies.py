"""How an answer goes back to its client: a request's outputs handed from the runner's
receiving thread to its event loop (Mailbox, once per step's worth, not per token; Outputs),
OpenAI's reply shapes (Reply: completion or chat, whole or as chunks, with usage and logprobs),
and the two ways out: `whole` (a client that disconnects aborts its request at once) and
`stream` (server-sent events; a client that goes away cancels the generator and its request).
"""

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from trainer.inference.engine import FinishReason, Output
from trainer.serve.logprobs import Logprobs
from trainer.serve.runner import EngineRunner


class Outputs:
    """One request's outputs on its event loop: the handler takes everything that arrived since
    it last looked (a client that fell behind catches up in one write)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: list[Output] = []
        self._waiter: asyncio.Future | None = None

    def put(self, out: Output) -> None:  # on the loop
        self._items.append(out)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[Output]:
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class Mailbox:
    """Hands outputs from the runner's receiving thread to one event loop's requests, waking
    the loop once for all the outputs that arrive before it runs (a step's worth), not once per
    token: each wake-up is a write to the loop's self-pipe and a turn of the loop. No lock:
    deque's append and popleft are atomic, and `_flush` clears the flag before it empties the
    deque, so an output put after it has looked finds the flag clear and wakes the loop again."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: deque[tuple[Outputs, Output]] = deque()
        self._scheduled = False

    def put(self, outputs: Outputs, out: Output) -> None:  # on the receiving thread
        self._items.append((outputs, out))
        if not self._scheduled:
            self._scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop is closed: the server stopped, its clients are gone
                self._scheduled = False
                self._items.clear()

    def _flush(self) -> None:  # on the loop
        self._scheduled = False
        items = self._items
        while items:
            outputs, out = items.popleft()
            outputs.put(out)


@dataclass
class Reply:
    id: str
    model: str
    chat: bool
    prompt_tokens: int
    created: int = 0
    logprobs: Logprobs | None = None  # when the request asked for them

    def __post_init__(self):
        self.created = int(time.time())
        # A token's chunk (its text, no finish) is built per token: its JSON around the text is
        # made once. JSON writes the marker as "\u0000", which nothing else in a chunk holds.
        marker = "\x00"
        self._head, self._tail = json.dumps(self.chunk(marker, None)).split(json.dumps(marker))

    def text_event(self, text: str) -> str:
        """The server-sent event of a chunk with `text` and no finish reason."""
        return f"data: {self._head}{json.dumps(text)}{self._tail}\n\n"

    def chunk(
        self, text: str, finish: str | None, first: bool = False, logprobs: dict | None = None
    ) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta if text or first else {}, "finish_reason": finish}
            kind = "chat.completion.chunk"
            if logprobs is not None:
                choice["logprobs"] = logprobs
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [choice]}  # fmt: skip

    def usage(self, completion_tokens: int, cached_tokens: int) -> dict:
        """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens the
        engine's prefix cache held (read, not computed)."""
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens}
        details = {"prompt_tokens_details": {"cached_tokens": cached_tokens}}
        return {**usage, "total_tokens": self.prompt_tokens + completion_tokens, **details}

    def whole(self, text: str, finish: str, completion_tokens: int, cached: int) -> dict:
        logprobs = self.logprobs.whole() if self.logprobs is not None else None
        out = self.chunk(text, finish, logprobs=logprobs)
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": finish}
            out["choices"] = [{**choice, "logprobs": logprobs}]
            out["object"] = "chat.completion"
        out["usage"] = self.usage(completion_tokens, cached)
        return out


async def stream(
    reply: Reply, outputs: Outputs, runner: EngineRunner, usage: bool
) -> AsyncIterator[str]:
    """Server-sent events; a client that goes away cancels this generator, and so its
    request (finally: abort frees its KV blocks). `usage`: a last chunk with token counts."""
    finished, tokens, cached = False, 0, 0
    try:
        if reply.chat:
            yield f"data: {json.dumps(reply.chunk('', None, first=True))}\n\n"
        while not finished:
            # Every output already there goes out in one write (one chunk of the HTTP body),
            # each still its own event; the last write also carries the usage and [DONE].
            events = []
            for out in await outputs.take():
                finished, tokens = out.finish is not None, tokens + len(out.token_ids)
                # Each token's logprobs in the chunk of its output, even one with no text yet.
                scored = reply.logprobs.of(out) if reply.logprobs is not None else None
                if out.finish is not None or scored is not None:
                    finish = out.finish.value if out.finish is not None else None
                    chunk = reply.chunk(out.text, finish, logprobs=scored)
                    events.append(f"data: {json.dumps(chunk)}\n\n")
                    cached = out.cached_tokens
                elif out.text:
                    events.append(reply.text_event(out.text))
            if finished:
                if usage:
                    last = {
                        **reply.chunk("", None),
                        "choices": [],
                        "usage": reply.usage(tokens, cached),
                    }
                    events.append(f"data: {json.dumps(last)}\n\n")
                events.append("data: [DONE]\n\n")
            if events:
                yield "".join(events)
    finally:
        if not finished:
            runner.abort(reply.id)


async def whole(reply: Reply, outputs: Outputs, runner: EngineRunner, request: Request):
    """The whole answer. A client that disconnects while it waits aborts its request at once
    (its KV blocks are freed): the watcher waits on the connection itself, not on a pause in
    the tokens."""
    watcher = asyncio.create_task(_abort_when_gone(request, runner, reply.id))
    text, tokens = "", 0
    try:
        while True:
            for out in await outputs.take():
                text, tokens = text + out.text, tokens + len(out.token_ids)
                if out.finish is FinishReason.ABORT and watcher.done():
                    return Response(status_code=499)  # nobody reads it: the client is gone
                if reply.logprobs is not None:
                    reply.logprobs.of(out)
                if out.finish is not None:
                    return reply.whole(text, out.finish.value, tokens, out.cached_tokens)
    finally:
        watcher.cancel()


async def _abort_when_gone(request: Request, runner: EngineRunner, request_id: str) -> None:
    """Returns once the client has gone, after aborting its request. The body is read by now,
    so the next message the server has for this request is its disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    runner.abort(request_id)
