"""Generation side of the OpenAI-compatible server: a worker thread per request,
its events handed to the event loop, server-sent events, disconnect detection.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from .server_requests import GenRequest

log = logging.getLogger("edgeinfer.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---- generation on a worker thread --------------------------------------------------------
_DONE = object()


class Generation:
    """One request's generation on its own worker thread.

    Events (text deltas, then the final event; or an exception) are handed to the event
    loop through an asyncio queue; ``cancel`` stops the engine between decode steps.
    ``on_done`` runs on the worker thread when it finishes, whatever the outcome.
    """

    def __init__(self, model, ids: list[int], req: GenRequest, loop: asyncio.AbstractEventLoop,
                 on_done: Callable[[str | None], None], speculate: str = "auto"):
        self.model = model
        self.ids = ids
        self.req = req
        self.speculate = speculate
        self.loop = loop
        self.on_done = on_done
        self.cancel = threading.Event()
        self.queue: asyncio.Queue = asyncio.Queue()

    def start(self) -> None:
        threading.Thread(target=self._run, name="edgeinfer-generate", daemon=True).start()

    def _put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is gone, stop here
            self.cancel.set()

    def _run(self) -> None:
        finish = None
        try:
            if self.cancel.is_set():  # the client left before its turn came
                finish = "cancelled"
                return
            max_tokens = self.req.max_tokens or max(1, self.model.n_ctx - len(self.ids))
            for ev in self.model.stream_ids(self.ids, max_tokens=max_tokens, stop=self.req.stop,
                                            cancel=self.cancel, grammar=self.req.grammar,
                                            leading_space=not self.req.chat,
                                            speculate=self.speculate,
                                            **self.req.sampling):
                if ev.finish_reason is not None:
                    finish = ev.finish_reason
                if ev.text or ev.finish_reason is not None:
                    self._put(ev)
        except Exception as e:  # handed to the request, which answers with an error body
            log.exception("generation failed")
            self._put(e)
        finally:
            self._put(_DONE)
            self.on_done(finish)

    async def events(self) -> AsyncIterator:
        """Text-carrying events then the final one; re-raises the worker's exception."""
        while True:
            item = await self.queue.get()
            if item is _DONE:
                return
            if isinstance(item, Exception):
                raise item
            yield item


@dataclass
class ServerCounters:
    """Per-app generation counters (``app.state.counters``), for logs and tests.

    ``queued``: waiting for their turn; ``started``: worker threads started; ``active``:
    started and not yet finished (at most the server's parallel); finished ones by
    outcome: ``completed`` ("stop"/"length"), ``cancelled`` (the client left),
    ``failed`` (an exception).
    """

    queued: int = 0
    started: int = 0
    active: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def openai_finish_reason(reason: str | None, tool_calls: bool = False) -> str:
    # "stop" and "length" are OpenAI's; "cancelled" only happens for clients that left.
    # A reply that ended by itself after tool calls finishes with "tool_calls".
    if tool_calls and reason == "stop":
        return "tool_calls"
    return reason if reason in ("stop", "length") else "stop"


def usage_of(stats, dropped_turns: int | None = None) -> dict:
    """OpenAI's usage counts; a chat also gets ``dropped_turns`` (edgeinfer's: the oldest
    turns dropped to fit the context)."""
    p = stats.prompt_tokens if stats else 0
    c = stats.generated_tokens if stats else 0
    usage = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if dropped_turns is not None:
        usage["dropped_turns"] = dropped_turns
    return usage


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """An SSE response that cancels its generation however the response ends.

    Starlette cancels the sending task when the client disconnects; the body generator
    may then be suspended at a ``yield`` and only finalized later, so the cancel event is
    set here rather than in the generator.
    """

    def __init__(self, content: AsyncIterator[str], cancel: threading.Event):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._cancel = cancel

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cancel.set()


async def wait_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the request body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
