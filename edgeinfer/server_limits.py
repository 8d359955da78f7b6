"""What an HTTP client can make the server hold, and for how long (``edgeinfer serve``).

* **Request body**: at most ``max_body`` bytes (default 4 MiB, ``--max-body``). A larger
  ``Content-Length`` is refused with 413 before any of the body is read; a chunked body is
  counted as it arrives and refused with 413 once past the limit. The rest of a refused
  body is read and discarded for at most ``drain_timeout`` seconds (so the client sees the
  413 rather than a reset connection), then the connection is closed.
* **Slow clients**: the request head (request line and headers; an incomplete head
  over 16 KiB is refused, h11's limit) must arrive within ``header_timeout`` seconds
  (default 10, ``--header-timeout``) of the connection opening, or on a kept-alive
  connection of its first byte; the body within
  ``body_timeout`` seconds (default 30, ``--body-timeout``) of the head. Otherwise: 408 and
  the connection is closed. A ``Content-Length`` larger than what is sent is such a case.
  An idle keep-alive connection is closed after 5 s (uvicorn's ``timeout_keep_alive``).
* **Waiting requests**: at most ``queue_limit`` (default 16, ``--queue-limit``) wait for a
  free generation slot; past it a new request is answered 503 with ``Retry-After``
  (:func:`admit`).
* **JSON**: nesting at most ``max_json_depth`` levels (64), numbers at most 100 digits;
  see :func:`edgeinfer.server_requests.parse_json`.

The body limit and body timeout are an ASGI middleware (:class:`BodyLimit`, part of
:func:`edgeinfer.server.create_app`); the head timeout and the drain deadline live in the
HTTP protocol (:func:`bounded_h11_protocol`, a subclass of uvicorn's h11 protocol that
:func:`edgeinfer.server.serve` runs).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass

log = logging.getLogger("edgeinfer.server")

MIB = 2**20


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on one HTTP request (see the module docstring).

    Args:
        max_body: request body bytes at most (413 beyond).
        header_timeout: seconds for the request head to arrive (408 after).
        body_timeout: seconds for the body to arrive once the head has (408 after).
        drain_timeout: seconds a refused body is still read (and discarded) before closing.
        max_json_depth: JSON nesting levels at most (400 beyond).

    Raises:
        ValueError: a limit that is not positive.
    """

    max_body: int = 4 * MIB
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    drain_timeout: float = 2.0
    max_json_depth: int = 64

    def __post_init__(self):
        for name in ("max_body", "header_timeout", "body_timeout", "drain_timeout",
                     "max_json_depth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)i?b?\s*", re.I)


def parse_size(text: str) -> int:
    """``"4M"``, ``"512k"``, ``"1.5MiB"``, ``"65536"`` -> bytes (K/M/G are powers of 1024).

    Raises:
        ValueError: not a size, or zero.
    """
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4M, 512K, 65536)")
    n = int(float(m.group(1)) * 1024 ** " kmg".index(m.group(2).lower() or " "))
    if n < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return n


def error_body(message: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": param, "code": code}}).encode()


async def _respond(send, status: int, message: str, code: str, close: bool) -> None:
    body = error_body(message, code)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyLimit:
    """ASGI middleware: reads each HTTP request body whole, bounded in size and time, then
    hands the app a ``receive`` that returns it in one message (and afterwards the
    server's own, for disconnects). Answers 413 / 408 itself, as OpenAI-style errors."""

    def __init__(self, app, limits: ServerLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lim = self.limits
        too_large = (f"The request body is larger than this server accepts ({lim.max_body} "
                     f"bytes; edgeinfer serve --max-body); send a shorter request")
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and declared.strip().isdigit() and int(declared) > lim.max_body:
            await _respond(send, 413, too_large, "request_too_large", close=False)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + lim.body_timeout
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.CancelledError:
                # the server is shutting down (uvicorn cancels what outlives its grace
                # period): end this request quietly rather than as a logged traceback
                return
            except asyncio.TimeoutError:
                got = f"{len(body)} of {int(declared)}" if declared and declared.strip().isdigit() \
                    else f"{len(body)}"
                await _respond(send, 408, f"The request body did not arrive within "
                               f"{lim.body_timeout:g} s ({got} bytes received); send the whole "
                               f"body at once, with a correct Content-Length",
                               "request_timeout", close=True)
                return
            if message["type"] == "http.disconnect":
                return  # the client left before sending it all: nobody to answer
            body += message.get("body", b"")
            if len(body) > lim.max_body:
                await _respond(send, 413, too_large, "request_too_large", close=False)
                return
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": bytes(body), "more_body": False}
        del body
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return whole
            return await receive()

        await self.app(scope, replay, send)


def bounded_h11_protocol(limits: ServerLimits):
    """A uvicorn HTTP protocol class (``uvicorn.Config(http=...)``): uvicorn's h11 protocol
    with a deadline for the request head (408, then close) and one for discarding the rest
    of a body the app refused early (close)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._deadline = None  # (kind, asyncio.TimerHandle) or None
            self._first_head = True  # no request head complete yet on this connection

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._update_deadline()

        def connection_lost(self, exc) -> None:
            self._cancel_deadline()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            self._update_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._update_deadline()

        # ---- the deadlines ------------------------------------------------------------
        def _cancel_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline[1].cancel()
                self._deadline = None

        def _arm(self, kind: str, seconds: float, callback) -> None:
            if self._deadline is not None and self._deadline[0] == kind:
                return  # already running: a total deadline, not one per read
            self._cancel_deadline()
            self._deadline = (kind, self.loop.call_later(seconds, callback))

        def _update_deadline(self) -> None:
            if self.transport is None or self.transport.is_closing():
                self._cancel_deadline()
            elif self.conn.their_state is h11.IDLE:  # waiting for a request head
                # from the connection's start, or from a kept-alive connection's first byte
                # (an idle kept-alive connection is uvicorn's timeout_keep_alive's business)
                if self._first_head or self.conn.trailing_data[0]:
                    self._arm("head", limits.header_timeout, self._head_timed_out)
                else:
                    self._cancel_deadline()
            elif (self.conn.their_state is h11.SEND_BODY and self.cycle is not None
                  and self.cycle.response_complete):  # answered early: discarding the body
                self._first_head = False
                self._arm("drain", limits.drain_timeout, self._close)
            else:
                self._first_head = False
                self._cancel_deadline()

        def _close(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def _head_timed_out(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            body = error_body(f"The request head (request line and headers) did not arrive "
                              f"within {limits.header_timeout:g} s; send it at once",
                              "request_timeout")
            # h11 cannot send a response before a request: written as bytes, then closed
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json"
                                 b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(body), body))
            self.transport.close()
            log.info("closed a connection that sent no complete request head in %g s (408)",
                     limits.header_timeout)

    return BoundedH11Protocol


#: requests that may wait for a free slot before new ones get a 503
DEFAULT_QUEUE_LIMIT = 16
#: seconds a 503's ``Retry-After`` asks a client to wait
RETRY_AFTER_S = 2


def admit(slots_full: bool, waiting: int, parallel: int, queue_limit: int) -> None:
    """Raise a 503 APIError with ``Retry-After`` when every slot is taken
    (``slots_full``) and ``waiting`` >= ``queue_limit`` requests already wait."""
    if slots_full and waiting >= queue_limit:
        from .server_requests import APIError
        raise APIError(503, f"the server is busy: {parallel} requests are generating and "
                       f"{waiting} are waiting (queue limit {queue_limit}); retry after "
                       f"{RETRY_AFTER_S} s", type="server_error", code="server_busy",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
