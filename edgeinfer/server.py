"""A local HTTP server speaking the OpenAI API (``edgeinfer serve``).

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/chat/completions``,
``POST /v1/completions``, plus an unauthenticated ``GET /health``. Streaming answers are
server-sent events (``data: {json}\\n\\n`` chunks, then ``data: [DONE]``), as the
official clients expect. Built on Starlette + uvicorn (no pydantic models: requests
are small and validated by hand so every rejection is an OpenAI-style error body).

Policy (documented for users):

* Binds 127.0.0.1 unless told otherwise; with ``api_key`` set every ``/v1`` route
  needs ``Authorization: Bearer <key>`` (401 otherwise).
* One model, one KV cache: requests are served one at a time in arrival order (FIFO);
  the others wait in the queue without holding a thread. Generation runs on a worker
  thread, never on the event loop.
* A client that disconnects (mid-stream, while queued, or while waiting for a
  non-streamed answer) cancels its generation: the model is free again within one
  decode step. The finish reason "cancelled" therefore never reaches a client.
* Defaults follow OpenAI: ``temperature`` 1, ``top_p`` 1, no top-k/min-p filtering,
  ``max_tokens`` up to the end of the context; ``presence_penalty`` and
  ``frequency_penalty`` in [-2, 2] are applied; ``top_k``, ``min_p`` and
  ``repetition_penalty`` are accepted as extensions (as llama.cpp's server does).
* Bad requests get a 4xx with ``{"error": {"message", "type", "param", "code"}}``;
  unexpected failures a 500 with the same shape and no traceback (it goes to the log).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .errors import ContextOverflowError, EdgeInferError
from .sampling import SamplingParams

log = logging.getLogger("edgeinfer.server")

MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---- errors ----------------------------------------------------------------------------
class APIError(Exception):
    """A request the server refuses, rendered as an OpenAI-style error body.

    Args:
        status: HTTP status code (4xx, or 5xx for server faults).
        message: what is wrong and how to fix it.
        type: OpenAI error type ("invalid_request_error", "authentication_error", ...).
        param: the offending request field, if any.
        code: a machine-readable code ("model_not_found", "invalid_api_key", ...).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status, headers=headers)


def _invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- request validation -------------------------------------------------------------------
def _get_number(body: dict, name: str, default: float, lo: float, hi: float,
                lo_open: bool = False) -> float:
    """``body[name]`` as a float in [lo, hi] (or (lo, hi] with ``lo_open``); null = default."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _invalid(name, f"'{name}' must be a number, got {type(v).__name__}", "invalid_type")
    if not (lo < v <= hi if lo_open else lo <= v <= hi):
        rng = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise _invalid(name, f"'{name}' must be in {rng}, got {v!r}")
    return float(v)


def _get_int(body: dict, name: str, default: int | None, lo: int | None = None) -> int | None:
    """``body[name]`` as an int >= ``lo``; null or absent = default. Floats are refused."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _invalid(name, f"'{name}' must be an integer, got {type(v).__name__}", "invalid_type")
    if lo is not None and v < lo:
        raise _invalid(name, f"'{name}' must be >= {lo}, got {v}")
    return v


def _get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _invalid(name, f"'{name}' must be a boolean, got {type(v).__name__}", "invalid_type")
    return v


def _get_stop(body: dict) -> list[str]:
    """``stop``: null, a string, or a list of up to 16 strings (empty strings ignored)."""
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _invalid("stop", "'stop' must be a string or a list of strings", "invalid_type")
    if len(v) > MAX_STOP_STRINGS:
        raise _invalid("stop", f"'stop' holds at most {MAX_STOP_STRINGS} strings, got {len(v)}")
    return [s for s in v if s]


def _get_messages(body: dict) -> list[dict]:
    """``messages`` as ``[{"role", "content": str}]``; text parts of list contents joined."""
    msgs = body.get("messages")
    if msgs is None:
        raise APIError(400, "'messages' is required: a list of {role, content} objects",
                       param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise _invalid("messages", "'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _invalid(p, f"{p} must be an object with 'role' and 'content'", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise _invalid(f"{p}.role", f"{p}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise _invalid(f"{p}.content[{j}]", f"{p}.content[{j}]: only text parts "
                                   "({'type': 'text', 'text': ...}) are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise _invalid(f"{p}.content", f"{p}.content must be a string or a list of text parts",
                           "invalid_type")
        # OpenAI's "developer" role is the system prompt of newer models; templates know "system"
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _get_prompt(body: dict) -> str | list[int]:
    """``prompt`` of /v1/completions: a string or token ids (one prompt only)."""
    v = body.get("prompt")
    if v is None:
        raise APIError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return v
    raise _invalid("prompt", "'prompt' must be a string or a list of token ids "
                   "(batches of several prompts are not supported)")


@dataclass
class GenRequest:
    """A validated generation request (either endpoint)."""

    stream: bool
    max_tokens: int | None
    stop: list[str]
    sampling: dict
    include_usage: bool = False


def _parse_common(body: dict, model_name: str) -> GenRequest:
    """The parameters both endpoints share.

    Raises:
        APIError: 404 for a model other than the served one, 400 for anything malformed.
    """
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise _invalid("model", "'model' must be a string", "invalid_type")
        if model != model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{model_name}'", param="model", code="model_not_found")
    n = _get_int(body, "n", 1, lo=1)
    if n != 1:
        raise _invalid("n", "only n=1 is supported (one model, one KV cache)")
    for name, off in (("logprobs", (None, False)), ("top_logprobs", (None, 0)),
                      ("echo", (None, False)), ("best_of", (None, 1))):
        if body.get(name) not in off:
            raise APIError(400, f"'{name}' is not supported by this server", param=name,
                           code="unsupported_parameter")
    max_tokens = _get_int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = _get_int(body, "max_tokens", None, lo=1)
    stream = _get_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _invalid("stream_options", "'stream_options' must be an object", "invalid_type")
    include_usage = bool(stream and opts and _get_bool(opts, "include_usage", False))
    sampling = dict(
        temperature=_get_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_get_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        # extensions (llama.cpp / vLLM servers); OpenAI itself applies neither filter
        top_k=_get_int(body, "top_k", 0, lo=0),
        min_p=_get_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_get_number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        presence_penalty=_get_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_get_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        seed=_get_int(body, "seed", None, lo=0),
    )
    try:  # the sampler's own checks, so that nothing fails later on the worker thread
        SamplingParams(**sampling)
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_value") from None
    # logit_bias, user, metadata, tools, ... are accepted and ignored
    return GenRequest(stream=stream, max_tokens=max_tokens, stop=_get_stop(body),
                      sampling=sampling, include_usage=include_usage)


def _check_auth(request: Request, api_key: str | None) -> None:
    """Raises APIError 401 unless ``Authorization: Bearer <api_key>`` is present (when set)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "No API key provided: send 'Authorization: Bearer <key>' (the key "
                       "given to edgeinfer serve --api-key)", type="authentication_error",
                       code="invalid_api_key")
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "Incorrect API key provided", type="authentication_error",
                       code="invalid_api_key")


async def _read_json(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    return body


# ---- generation on a worker thread --------------------------------------------------------
_DONE = object()


class _Generation:
    """One request's generation on its own worker thread.

    Events (text deltas, then the final event; or an exception) are handed to the event
    loop through an asyncio queue; ``cancel`` stops the engine between decode steps.
    ``on_done`` runs on the worker thread when it finishes, whatever the outcome.
    """

    def __init__(self, model, ids: list[int], req: GenRequest, loop: asyncio.AbstractEventLoop,
                 on_done: Callable[[str | None], None]):
        self.model = model
        self.ids = ids
        self.req = req
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
                                            cancel=self.cancel, **self.req.sampling):
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
    started and not yet finished (0 or 1); finished ones by outcome: ``completed``
    ("stop"/"length"), ``cancelled`` (the client left), ``failed`` (an exception).
    """

    queued: int = 0
    started: int = 0
    active: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def _finish_reason(reason: str | None) -> str:
    # "stop" and "length" are OpenAI's; "cancelled" only happens for clients that left.
    return reason if reason in ("stop", "length") else "stop"


def _usage(stats) -> dict:
    p = stats.prompt_tokens if stats else 0
    c = stats.generated_tokens if stats else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _EventStream(StreamingResponse):
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


async def _wait_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the request body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Server:
    """The state behind one app: the model, its FIFO gate, counters."""

    def __init__(self, model, model_name: str, api_key: str | None):
        self.model = model
        self.model_name = model_name
        self.api_key = api_key
        self.created = int(time.time())
        # FIFO admission: held from the start of a worker to its end (released by the
        # worker thread), so queued requests cost no thread and are served in order.
        self.gate = asyncio.Lock()
        self.counters = ServerCounters()

    # ---- plumbing --------------------------------------------------------------------
    def _on_done(self, loop: asyncio.AbstractEventLoop, finish: str | None) -> None:
        with self.counters.lock:
            self.counters.active -= 1
            if finish == "cancelled":
                self.counters.cancelled += 1
                log.info("generation cancelled (client disconnected)")
            elif finish is None:
                self.counters.failed += 1
            else:
                self.counters.completed += 1
        try:
            loop.call_soon_threadsafe(self.gate.release)
        except RuntimeError:  # event loop closed
            pass

    async def _start(self, gen: _Generation) -> None:
        """Wait for this request's turn (FIFO), then start its worker thread."""
        with self.counters.lock:
            self.counters.queued += 1
        try:
            await self.gate.acquire()
        finally:
            with self.counters.lock:
                self.counters.queued -= 1
        with self.counters.lock:  # before the thread exists: its on_done may run at once
            self.counters.started += 1
            self.counters.active += 1
        try:
            gen.start()  # no await between acquire and start: the gate cannot leak
        except BaseException:
            with self.counters.lock:
                self.counters.active -= 1
            self.gate.release()
            raise

    def _new_generation(self, ids: list[int], req: GenRequest, param: str) -> _Generation:
        if len(ids) >= self.model.n_ctx:
            raise APIError(400, f"The prompt has {len(ids)} tokens but the context holds "
                           f"{self.model.n_ctx} (and at least one must be generated); shorten "
                           f"the prompt or start the server with a larger --ctx",
                           param=param, code="context_length_exceeded")
        loop = asyncio.get_running_loop()
        return _Generation(self.model, ids, req, loop,
                           on_done=lambda finish: self._on_done(loop, finish))

    async def _encode(self, fn: Callable[[], list[int]], param: str) -> list[int]:
        try:
            ids = await run_in_threadpool(fn)
        except (ValueError, TypeError) as e:  # chat template errors, bad token ids
            raise APIError(400, str(e), param=param) from None
        if not ids:
            raise _invalid(param, f"'{param}' encodes to no tokens")
        return ids

    # ---- endpoints -------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "edgeinfer"}

    async def models(self, request: Request) -> Response:
        _check_auth(request, self.api_key)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def retrieve_model(self, request: Request) -> Response:
        _check_auth(request, self.api_key)
        if request.path_params["model_id"] != self.model_name:
            raise APIError(404, f"The model '{request.path_params['model_id']}' does not exist",
                           param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def chat_completions(self, request: Request) -> Response:
        _check_auth(request, self.api_key)
        body = await _read_json(request)
        req = _parse_common(body, self.model_name)
        messages = _get_messages(body)
        ids = await self._encode(lambda: self.model.encode_chat(messages), "messages")
        return await self._respond(request, ids, req, chat=True)

    async def completions(self, request: Request) -> Response:
        _check_auth(request, self.api_key)
        body = await _read_json(request)
        req = _parse_common(body, self.model_name)
        prompt = _get_prompt(body)
        if isinstance(prompt, str):
            ids = await self._encode(lambda: self.model.encode_prompt(prompt), "prompt")
        else:
            vocab = self.model.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise _invalid("prompt", f"token ids must be in [0, {vocab})")
            ids = list(prompt)
        return await self._respond(request, ids, req, chat=False)

    # ---- responses -------------------------------------------------------------------
    async def _respond(self, request: Request, ids: list[int], req: GenRequest,
                       chat: bool) -> Response:
        gen = self._new_generation(ids, req, "messages" if chat else "prompt")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return _EventStream(self._stream(gen, rid, chat), gen.cancel)
        return await self._complete(request, gen, rid, chat)

    async def _complete(self, request: Request, gen: _Generation, rid: str,
                        chat: bool) -> Response:
        async def run() -> tuple[str, Any]:
            await self._start(gen)
            parts, final = [], None
            async for ev in gen.events():
                parts.append(ev.text)
                if ev.finish_reason is not None:
                    final = ev
            return "".join(parts), final

        work = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():  # the client left (or this task was cancelled)
                gen.cancel.set()
                work.cancel()
            watch.cancel()
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # nobody is listening
        text, final = self._result_or_error(work)
        reason = _finish_reason(final.finish_reason if final else None)
        created = int(time.time())
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created,
                             "model": self.model_name, "choices": [choice],
                             "usage": _usage(final.stats if final else None),
                             "system_fingerprint": None})

    @staticmethod
    def _result_or_error(work: asyncio.Future):
        try:
            return work.result()
        except ContextOverflowError as e:
            raise APIError(400, str(e), code="context_length_exceeded") from None
        except EdgeInferError as e:
            raise APIError(400, str(e)) from None

    async def _stream(self, gen: _Generation, rid: str, chat: bool) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, reason: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else \
                    ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            return _sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                         "system_fingerprint": None, "choices": [choice]})

        if chat:
            yield chunk(None, None, role=True)
        await self._start(gen)
        final = None
        try:
            async for ev in gen.events():
                if ev.text:
                    yield chunk(ev.text, None)
                if ev.finish_reason is not None:
                    final = ev
        except Exception as e:  # noqa: BLE001  headers are sent: report in-band, as OpenAI does
            err = e if isinstance(e, APIError) else APIError(
                400 if isinstance(e, EdgeInferError) else 500,
                str(e) if isinstance(e, EdgeInferError) else "generation failed (see the server log)",
                type="invalid_request_error" if isinstance(e, EdgeInferError) else "server_error")
            yield _sse({"error": {"message": err.message, "type": err.type, "param": err.param,
                                  "code": err.code}})
            yield "data: [DONE]\n\n"
            return
        yield chunk(None, _finish_reason(final.finish_reason if final else None))
        if gen.req.include_usage:
            yield _sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                        "system_fingerprint": None, "choices": [],
                        "usage": _usage(final.stats if final else None)})
        yield "data: [DONE]\n\n"


# ---- app and entry point --------------------------------------------------------------------
async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                    code=code).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    # Starlette still logs the traceback; the client gets no internals.
    return APIError(500, "internal server error (see the server log)", type="server_error").response()


def create_app(model, model_name: str, api_key: str | None = None) -> Starlette:
    """Build the ASGI app serving ``model`` under the OpenAI API.

    Args:
        model: an :class:`edgeinfer.api.Model` (its lock and KV cache are used as they are).
        model_name: the id clients pass as ``model`` and ``/v1/models`` lists.
        api_key: when set, every ``/v1`` route requires ``Authorization: Bearer <api_key>``.

    Returns:
        A Starlette app; ``app.state.counters`` (:class:`ServerCounters`) counts finished
        generations by outcome (``cancelled`` = the client disconnected).

    Raises:
        ValueError: an empty ``model_name`` or ``api_key``.
    """
    if not model_name:
        raise ValueError("model_name must be a non-empty string")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be None (no authentication) or a non-empty string")
    srv = _Server(model, model_name, api_key)
    routes = [
        Route("/health", srv.health, methods=["GET"]),
        Route("/v1/models", srv.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", srv.retrieve_model, methods=["GET"]),
        Route("/v1/chat/completions", srv.chat_completions, methods=["POST"]),
        Route("/v1/completions", srv.completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, Exception: _server_error})
    app.state.counters = srv.counters
    app.state.model_name = model_name
    return app


def default_model_name(model) -> str:
    """The id a model is served under by default: its file or folder name without suffix."""
    path = Path(str(getattr(model.source, "path", "") or "model"))
    return path.stem if path.suffix in (".gguf", ".eif") else path.name


class ServeError(EdgeInferError, OSError):
    """The server cannot listen on the requested address (port in use, unknown host)."""


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), IPv4 or IPv6 as ``host`` resolves.

    Raises:
        ServeError: the host does not resolve or the address cannot be bound.
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ServeError(f"cannot listen on {host}:{port}: {e}; check --host") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}; "
                         f"pick another --port or stop the program using it") from e
    return sock


def serve(model, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          model_name: str | None = None, log_level: str = "info",
          on_listening: Callable[[str], None] | None = None) -> None:
    """Serve ``model`` over HTTP until interrupted (blocks; Ctrl-C stops it).

    Args:
        model: an :class:`edgeinfer.api.Model`.
        host: interface to bind; the default 127.0.0.1 is reachable from this machine only.
        port: TCP port (1-65535).
        api_key: require ``Authorization: Bearer <api_key>`` on every ``/v1`` route.
        model_name: the served model id (default: :func:`default_model_name`).
        log_level: uvicorn's log level ("critical", "error", "warning", "info", "debug").
        on_listening: called with the base URL (``http://host:port/v1``) once the port
            is bound, before the first request is accepted (the CLI prints it).

    Raises:
        ValueError: a port out of range, or an empty ``model_name``/``api_key``.
        ServeError: the address cannot be bound (port in use, unknown host).
    """
    import uvicorn

    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an integer in 1..65535, got {port!r}")
    name = model_name or default_model_name(model)
    app = create_app(model, name, api_key)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach this port can use "
                    "the model", host)
    sock = _bind(host, port)
    if on_listening is not None:
        shown = f"[{host}]" if ":" in host else host
        on_listening(f"http://{shown}:{sock.getsockname()[1]}/v1")
    # A short graceful-shutdown timeout: on Ctrl-C open streams are cut (and so their
    # generations cancelled) instead of running on to max_tokens.
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
