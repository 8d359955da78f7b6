"""A local HTTP server speaking the OpenAI API (``edgeinfer serve``).

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/chat/completions``,
``POST /v1/completions``, plus an unauthenticated ``GET /health``. Streaming answers are
server-sent events (``data: {json}\\n\\n`` chunks, then ``data: [DONE]``), as the
official clients expect. Built on Starlette + uvicorn (no pydantic models: requests
are small and validated by hand so every rejection is an OpenAI-style error body).
Modules by concern: :mod:`.server_requests` (error bodies, validation, auth),
:mod:`.server_stream` (worker thread per request, SSE, disconnects),
:mod:`.server_handlers` (the endpoints, the FIFO gate, the answers) and this one (the
routes, the app and :func:`serve`).

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

import contextlib
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .errors import EdgeInferError
from .server_handlers import _Server
from .server_limits import (  # noqa: F401  (RETRY_AFTER_S re-exported)
    DEFAULT_QUEUE_LIMIT,
    RETRY_AFTER_S,
    BodyLimit,
    ServerLimits,
    bounded_h11_protocol,
)
from .server_requests import APIError
from .server_stream import ServerCounters
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
