"""A local HTTP server speaking the OpenAI API (``edgeinfer serve``).

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/chat/completions``,
``POST /v1/completions``, plus an unauthenticated ``GET /health``. Streaming answers are
server-sent events (``data: {json}\\n\\n`` chunks, then ``data: [DONE]``), as the
official clients expect. Built on Starlette + uvicorn (no pydantic models: requests
are small and validated by hand so every rejection is an OpenAI-style error body).
Three modules by concern: :mod:`.server_requests` (error bodies, validation, auth),
:mod:`.server_stream` (worker thread per request, SSE, disconnects) and this one (the
routes, the FIFO gate, the app and :func:`serve`).

Policy (documented for users):

* Binds 127.0.0.1 unless told otherwise; with ``api_key`` set every ``/v1`` route
  needs ``Authorization: Bearer <key>`` (401 otherwise).
* One model; ``parallel`` requests generate at once (a model built with
  ``parallel=N``, ``edgeinfer serve --parallel N``: continuous batching,
  :mod:`edgeinfer.batching`, one KV cache per sequence), else one at a time. More wait
  in arrival order (FIFO) without holding a thread; past ``queue_limit`` waiting
  requests a new one gets 503 + ``Retry-After`` (:mod:`.server_limits`). Generation
  runs on a worker thread, never on the event loop.
* A client that disconnects (mid-stream, while queued, or while waiting for a
  non-streamed answer) cancels its generation: the model is free again within one
  decode step. The finish reason "cancelled" therefore never reaches a client.
* Sampling fields a request omits (``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``repetition_penalty``) take the model's defaults, as llama.cpp's server and ollama
  do: its generation config (a catalog model's ``.eif`` carries the model card's, e.g.
  SmolLM2: temperature 0.2, top_p 0.9), else llama.cpp's (temperature 0.8, top_p 0.95,
  top_k 40, min_p 0.05) -- OpenAI's temperature 1 makes a small model ramble.
  A request without ``max_tokens`` runs up to the end of the context (OpenAI's
  semantics), or up to the server's ``default_max_tokens`` (``edgeinfer serve
  --max-tokens N``) when one is set; ``presence_penalty`` and
  ``frequency_penalty`` in [-2, 2] are applied; ``top_k``, ``min_p`` and
  ``repetition_penalty`` are accepted as extensions (as llama.cpp's server does).
* ``response_format`` (json_object / json_schema) constrains the output
  (:mod:`edgeinfer.constrained`); chat ``tools`` / ``tool_choice`` are rendered by the
  model's template and calls parsed into ``tool_calls`` (:mod:`edgeinfer.tools`; a
  template without tool support is a 400 saying why). A known OpenAI parameter that
  would change the result and is not supported is a 400 naming it; an unknown field is
  accepted and logged once (:mod:`edgeinfer.server_fields`).
* A chat that outgrows the context drops its oldest turns (room for ``max_tokens``, 256
  when unset, at most half the context) and says how many in ``usage.dropped_turns``.
* ``created`` is the time the request arrived (seconds since the epoch), as OpenAI's.
* One log line per request on the ``edgeinfer.server.access`` logger (INFO): method,
  path, status, prompt+completion tokens, seconds (:func:`serve` prints them on stderr
  unless ``access_log=False``; ``edgeinfer serve --quiet``).
* Bad requests get a 4xx with ``{"error": {"message", "type", "param", "code"}}``;
  unexpected failures a 500 with the same shape and no traceback (it goes to the log).
* Hostile clients are bounded (:mod:`.server_limits`): request bodies at most 4 MiB
  (``--max-body``; 413), the request head within 10 s (``--header-timeout``) and the body
  within 30 s (``--body-timeout``) or 408, JSON at most 64 levels deep. ``max_tokens``
  beyond the context is cut to the context.
* SIGTERM or Ctrl-C stops the server within about 2 s plus one decode step: open requests
  get 2 s to finish, then are cancelled (their generations stop between decode steps).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .errors import ContextOverflowError, EdgeInferError
from .server_limits import (  # noqa: F401  (RETRY_AFTER_S re-exported)
    DEFAULT_QUEUE_LIMIT,
    RETRY_AFTER_S,
    BodyLimit,
    ServerLimits,
    admit,
    bounded_h11_protocol,
)
from .server_requests import (
    APIError,
    GenRequest,
    check_auth,
    get_messages,
    get_prompt,
    invalid,
    parse_common,
    read_json,
)
from .server_fields import LogOnce, check_fields, get_response_format, get_tools
from .server_stream import (
    EventStream,
    Generation,
    ServerCounters,
    openai_finish_reason,
    sse,
    usage_of,
    wait_disconnect,
)
from .speculative import check_mode

__all__ = ["APIError", "ServeError", "ServerCounters", "ServerLimits", "create_app",
           "default_model_name", "serve", "uvicorn_config"]

log = logging.getLogger("edgeinfer.server")
access_log = logging.getLogger("edgeinfer.server.access")


class _AccessLog:
    """ASGI middleware: one ``access_log`` line per HTTP request once its response ends.

    ``METHOD PATH STATUS P+C tokens S s``: P and C are the usage counts a generation
    route leaves in ``request.state.usage`` ("-" for other routes); a streamed answer is
    logged when its last event is sent, a client that left as status 499.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        scope.setdefault("state", {})
        status: list[int] = []

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            usage = scope["state"].get("usage") if isinstance(scope["state"], dict) else None
            tokens = (f"{usage['prompt_tokens']}+{usage['completion_tokens']} tokens" if usage
                      else "- tokens")
            access_log.info("%s %s %s %s %.2f s", scope.get("method"), scope.get("path"),
                            status[0] if status else 500, tokens, time.perf_counter() - t0)


class _Server:
    """The state behind one app: the model, its FIFO gate, counters."""

    def __init__(self, model, model_name: str, api_key: str | None,
                 default_max_tokens: int | None = None, limits: ServerLimits | None = None,
                 queue_limit: int = DEFAULT_QUEUE_LIMIT, speculate: str = "auto"):
        self.model = model
        self.speculate = speculate
        pool = getattr(model, "pool", None)
        self.parallel = pool.n if pool is not None else 1
        self.queue_limit = int(queue_limit)
        self.limits = limits or ServerLimits()
        self.live: set[Generation] = set()  # started, not finished (cancelled at shutdown)
        self.default_max_tokens = default_max_tokens
        self.model_name = model_name
        self.api_key = api_key
        # sampling for fields a request omits: the model's generation config (over
        # llama.cpp's defaults), not OpenAI's temperature 1, which small models garble
        defaults = getattr(model, "sampling_defaults", None)
        self.sampling_defaults = defaults() if callable(defaults) else None
        if self.sampling_defaults:
            log.info("default sampling for requests that omit it: %s", self.sampling_defaults)
        self.created = int(time.time())
        # FIFO admission: held from the start of a worker to its end (released by the
        # worker thread), so queued requests cost no thread and are served in order.
        self.gate = asyncio.Semaphore(self.parallel)
        self.counters = ServerCounters()
        self.log_once = LogOnce()  # unknown request fields, logged once each

    # ---- plumbing --------------------------------------------------------------------
    def _on_done(self, loop: asyncio.AbstractEventLoop, gen: Generation,
                 finish: str | None) -> None:
        with self.counters.lock:
            self.live.discard(gen)
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

    async def _start(self, gen: Generation) -> None:
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
            self.live.add(gen)
        try:
            gen.start()  # no await between acquire and start: the gate cannot leak
        except BaseException:
            with self.counters.lock:
                self.counters.active -= 1
                self.live.discard(gen)
            self.gate.release()
            raise

    def _admit(self) -> None:
        with self.counters.lock:
            waiting = self.counters.queued
        admit(self.gate.locked(), waiting, self.parallel, self.queue_limit)

    def _new_generation(self, ids: list[int], req: GenRequest, param: str) -> Generation:
        self._admit()
        if len(ids) >= self.model.n_ctx:
            raise APIError(400, f"The prompt has {len(ids)} tokens but the context holds "
                           f"{self.model.n_ctx} (and at least one must be generated); shorten "
                           f"the prompt or start the server with a larger --ctx",
                           param=param, code="context_length_exceeded")
        if req.max_tokens is None and self.default_max_tokens is not None:
            req.max_tokens = self.default_max_tokens  # else: up to the end of the context
        if req.max_tokens is not None:  # the context ends generation anyway ("length")
            req.max_tokens = min(req.max_tokens, self.model.n_ctx - len(ids))
        loop = asyncio.get_running_loop()
        gen = Generation(self.model, ids, req, loop,
                         on_done=lambda finish: self._on_done(loop, gen, finish),
                         speculate=self.speculate)
        return gen

    def cancel_all(self) -> None:
        """Cancel every running generation (server shutdown): each stops within a decode step."""
        with self.counters.lock:
            running = list(self.live)
        for gen in running:
            gen.cancel.set()

    async def _encode(self, fn: Callable[[], list[int]], param: str) -> list[int]:
        try:
            ids = await run_in_threadpool(fn)
        except ContextOverflowError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except (ValueError, TypeError) as e:  # chat template errors, bad token ids
            raise APIError(400, str(e), param=getattr(e, "param", None) or param) from None
        if not ids:
            raise invalid(param, f"'{param}' encodes to no tokens")
        return ids

    # ---- endpoints -------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "edgeinfer"}

    async def models(self, request: Request) -> Response:
        check_auth(request, self.api_key)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def retrieve_model(self, request: Request) -> Response:
        check_auth(request, self.api_key)
        if request.path_params["model_id"] != self.model_name:
            raise APIError(404, f"The model '{request.path_params['model_id']}' does not exist",
                           param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def chat_completions(self, request: Request) -> Response:
        created = int(time.time())  # when the request arrived, not when it is answered
        check_auth(request, self.api_key)
        body = await read_json(request, self.limits.max_json_depth)
        check_fields(body, True, self.log_once)
        req = parse_common(body, self.model_name, self.sampling_defaults)
        messages = get_messages(body)
        req.chat = True
        req.grammar = get_response_format(body)
        tools = get_tools(body)
        if tools.active:
            reason = self.model.tool_support()
            if reason:
                raise invalid("tools", f"this model cannot call tools: {reason}")
            if req.grammar is not None:
                raise invalid("response_format", "'response_format' with 'tools' is not "
                              "supported; give one or the other (or tool_choice 'none')")
            from .errors import GrammarError
            from .tools import call_grammar
            try:
                req.grammar = call_grammar(tools.tools, tools.choice, self.model.tokenizer,
                                           parallel=tools.parallel)
            except GrammarError as e:
                raise invalid("tools", f"a tool's parameters cannot be used: {e}") from None
            req.tools = tools
        # room for the reply: max_tokens (256 when unset), at most half the context
        reserve = min(req.max_tokens or self.default_max_tokens or 256, self.model.n_ctx // 2)

        def encode() -> list[int]:
            ids, req.dropped_turns = self.model.chat_ids(
                messages, tools=tools.tools if tools.active else None, reserve=reserve)
            return ids

        ids = await self._encode(encode, "messages")
        return await self._respond(request, ids, req, chat=True, created=created)

    async def completions(self, request: Request) -> Response:
        created = int(time.time())
        check_auth(request, self.api_key)
        body = await read_json(request, self.limits.max_json_depth)
        check_fields(body, False, self.log_once)
        req = parse_common(body, self.model_name, self.sampling_defaults)
        req.grammar = get_response_format(body)
        prompt = get_prompt(body)
        if isinstance(prompt, str):
            ids = await self._encode(lambda: self.model.encode_prompt(
                prompt, parse_special=req.parse_special), "prompt")
        else:
            vocab = self.model.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise invalid("prompt", f"token ids must be in [0, {vocab})")
            ids = list(prompt)
        return await self._respond(request, ids, req, chat=False, created=created)

    # ---- responses -------------------------------------------------------------------
    async def _respond(self, request: Request, ids: list[int], req: GenRequest,
                       chat: bool, created: int) -> Response:
        gen = self._new_generation(ids, req, "messages" if chat else "prompt")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return EventStream(self._stream(request, gen, rid, chat, created), gen.cancel)
        return await self._complete(request, gen, rid, chat, created)

    async def _complete(self, request: Request, gen: Generation, rid: str,
                        chat: bool, created: int) -> Response:
        async def run() -> tuple[str, Any]:
            await self._start(gen)
            parts, final = [], None
            async for ev in gen.events():
                parts.append(ev.text)
                if ev.finish_reason is not None:
                    final = ev
            return "".join(parts), final

        work = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # uvicorn cancels what outlives the shutdown grace period: answer, not a traceback
            return APIError(503, "the server is shutting down; retry the request later",
                            type="server_error", code="server_shutting_down").response()
        finally:
            if not work.done():  # the client left (or this task was cancelled)
                gen.cancel.set()
                work.cancel()
            watch.cancel()
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # nobody is listening
        text, final = self._result_or_error(work)
        calls = []
        if gen.req.tools is not None:
            from .tools import parse_tool_calls
            text, calls = parse_tool_calls(text, gen.req.tools.names)
        reason = openai_finish_reason(final.finish_reason if final else None, bool(calls))
        usage = usage_of(final.stats if final else None,
                         gen.req.dropped_turns if chat else None)
        request.state.usage = usage  # for the access log
        if chat:
            message = {"role": "assistant", "content": text}
            if calls:
                message["content"] = text or None
                message["tool_calls"] = [c.as_openai() for c in calls]
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created,
                             "model": self.model_name, "choices": [choice],
                             "usage": usage, "system_fingerprint": None})

    @staticmethod
    def _result_or_error(work: asyncio.Future):
        try:
            return work.result()
        except ContextOverflowError as e:
            raise APIError(400, str(e), code="context_length_exceeded") from None
        except EdgeInferError as e:
            raise APIError(400, str(e)) from None

    async def _stream(self, request: Request, gen: Generation, rid: str, chat: bool,
                      created: int) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, reason: str | None, role: bool = False,
                  delta: dict | None = None) -> str:
            if chat:
                if delta is None:
                    delta = {"role": "assistant", "content": ""} if role else \
                        ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            return sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                         "system_fingerprint": None, "choices": [choice]})

        parser = None
        if gen.req.tools is not None:
            from .tools import ToolCallParser
            parser = ToolCallParser(names=gen.req.tools.names)

        def tool_chunks(events: list[tuple]):
            for e in events:
                if e[0] == "content":
                    if e[1] and not (parser.calls and not e[1].strip()):
                        yield chunk(e[1], None)
                elif e[0] == "call":
                    c = e[1]
                    yield chunk(None, None, delta={"tool_calls": [
                        {"index": c.index, "id": c.id, "type": "function",
                         "function": {"name": c.name, "arguments": ""}}]})
                elif e[2]:
                    yield chunk(None, None, delta={"tool_calls": [
                        {"index": e[1], "function": {"arguments": e[2]}}]})

        if chat:
            yield chunk(None, None, role=True)
        await self._start(gen)
        final = None
        try:
            async for ev in gen.events():
                if ev.text:
                    if parser is None:
                        yield chunk(ev.text, None)
                    else:
                        for c in tool_chunks(parser.feed(ev.text)):
                            yield c
                if ev.finish_reason is not None:
                    final = ev
            if parser is not None:
                for c in tool_chunks(parser.finish()):
                    yield c
        except Exception as e:  # noqa: BLE001  headers are sent: report in-band, as OpenAI does
            err = e if isinstance(e, APIError) else APIError(
                400 if isinstance(e, EdgeInferError) else 500,
                str(e) if isinstance(e, EdgeInferError) else "generation failed (see the server log)",
                type="invalid_request_error" if isinstance(e, EdgeInferError) else "server_error")
            yield sse({"error": {"message": err.message, "type": err.type, "param": err.param,
                                  "code": err.code}})
            yield "data: [DONE]\n\n"
            return
        usage = usage_of(final.stats if final else None, gen.req.dropped_turns if chat else None)
        request.state.usage = usage  # for the access log
        yield chunk(None, openai_finish_reason(final.finish_reason if final else None,
                                               bool(parser is not None and parser.calls)))
        if gen.req.include_usage:
            yield sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                        "system_fingerprint": None, "choices": [], "usage": usage})
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


def create_app(model, model_name: str, api_key: str | None = None,
               default_max_tokens: int | None = None,
               limits: ServerLimits | None = None,
               queue_limit: int = DEFAULT_QUEUE_LIMIT, speculate: str = "auto") -> Starlette:
    """Build the ASGI app serving ``model`` under the OpenAI API.

    Args:
        model: an :class:`edgeinfer.api.Model` (its lock and KV cache are used as they are).
        model_name: the id clients pass as ``model`` and ``/v1/models`` lists.
        api_key: when set, every ``/v1`` route requires ``Authorization: Bearer <api_key>``.
        default_max_tokens: tokens generated at most for a request that gives no
            ``max_tokens`` (None: up to the end of the context, OpenAI's semantics).
        limits: request bounds (:class:`ServerLimits`; default: its defaults). The body
            size and time are enforced by the app; the head timeout needs the protocol of
            :func:`uvicorn_config`.
        queue_limit: requests that may wait for a free slot; past it, 503 + Retry-After.
        speculate: every request's speculative decoding mode ("auto", "ngram", "off":
            :mod:`edgeinfer.speculative`; the same tokens either way).

    Returns:
        A Starlette app; ``app.state.counters`` (:class:`ServerCounters`) counts finished
        generations by outcome (``cancelled`` = the client disconnected).

    Raises:
        ValueError: an empty ``model_name`` or ``api_key``, ``default_max_tokens`` < 1,
            or an unknown ``speculate``.
    """
    check_mode(speculate)
    if default_max_tokens is not None and default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be None or >= 1, got {default_max_tokens}")
    if not model_name:
        raise ValueError("model_name must be a non-empty string")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be None (no authentication) or a non-empty string")
    if queue_limit < 0:
        raise ValueError(f"queue_limit must be >= 0, got {queue_limit}")
    srv = _Server(model, model_name, api_key, default_max_tokens, limits, queue_limit,
                  speculate)
    routes = [
        Route("/health", srv.health, methods=["GET"]),
        Route("/v1/models", srv.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", srv.retrieve_model, methods=["GET"]),
        Route("/v1/chat/completions", srv.chat_completions, methods=["POST"]),
        Route("/v1/completions", srv.completions, methods=["POST"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        srv.cancel_all()  # shutdown: requests still running were cancelled or are cut now

    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(_AccessLog), Middleware(BodyLimit, limits=srv.limits)],
                    exception_handlers={APIError: _api_error, HTTPException: _http_error,
                                        Exception: _server_error})
    app.state.counters = srv.counters
    app.state.limits = srv.limits
    app.state.cancel_all = srv.cancel_all
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


def _setup_access_log(enabled: bool) -> None:
    """Route ``access_log`` lines to stderr (``HH:MM:SS METHOD PATH ...``), or silence it."""
    access_log.propagate = False
    if not enabled:
        access_log.setLevel(logging.WARNING)
        return
    access_log.setLevel(logging.INFO)
    if not access_log.handlers:
        handler = logging.StreamHandler()  # stderr
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        access_log.addHandler(handler)


#: Seconds open requests get to finish at shutdown (SIGTERM, Ctrl-C) before they are cancelled.
GRACEFUL_SHUTDOWN_S = 2


def uvicorn_config(app: Starlette, limits: ServerLimits | None = None, log_level: str = "info"):
    """The ``uvicorn.Config`` :func:`serve` runs ``app`` with: the h11 protocol bounded by
    ``limits`` (request-head deadline, discarding refused bodies), idle keep-alive 5 s, and
    :data:`GRACEFUL_SHUTDOWN_S` for open requests at shutdown (then cancelled, so a
    stream's generation stops instead of running on to ``max_tokens``)."""
    import uvicorn

    limits = limits or getattr(app.state, "limits", None) or ServerLimits()
    return uvicorn.Config(app, log_level=log_level, http=bounded_h11_protocol(limits),
                          timeout_keep_alive=5, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


def serve(model, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          model_name: str | None = None, log_level: str = "info",
          on_listening: Callable[[str], None] | None = None,
          default_max_tokens: int | None = None, access_log: bool = True,
          limits: ServerLimits | None = None, queue_limit: int = DEFAULT_QUEUE_LIMIT,
          speculate: str = "auto") -> None:
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
        default_max_tokens: cap for requests without ``max_tokens`` (None: the context).
        access_log: print one line per request on stderr (see the module policy).
        limits: request bounds (:class:`ServerLimits`: body size, head/body timeouts,
            JSON depth); default: its defaults.
        queue_limit: requests that may wait for a free slot (see the module policy).
        speculate: speculative decoding mode of every request (:func:`create_app`).

    Raises:
        ValueError: a port out of range, an empty ``model_name``/``api_key``, an
            unknown ``speculate``.
        ServeError: the address cannot be bound (port in use, unknown host).
    """
    import uvicorn

    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an integer in 1..65535, got {port!r}")
    name = model_name or default_model_name(model)
    limits = limits or ServerLimits()
    app = create_app(model, name, api_key, default_max_tokens, limits, queue_limit, speculate)
    _setup_access_log(access_log)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach this port can use "
                    "the model", host)
    sock = _bind(host, port)
    if on_listening is not None:
        shown = f"[{host}]" if ":" in host else host
        on_listening(f"http://{shown}:{sock.getsockname()[1]}/v1")
    try:
        uvicorn.Server(uvicorn_config(app, limits, log_level)).run(sockets=[sock])
    finally:
        app.state.cancel_all()
        sock.close()
