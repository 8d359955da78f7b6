"""Hostile HTTP clients against ``edgeinfer serve``: bodies over the limit (413 before
they are read), slow request heads and bodies and a lying Content-Length (408), bad JSON
bodies (4xx naming the field, no traceback in the log), SIGTERM mid-generation with stuck
clients (the real CLI exits within seconds)."""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from edgeinfer.server import ServerLimits, create_app  # noqa: E402
from edgeinfer.server_limits import parse_size  # noqa: E402
from test_server import NAME, PROMPT, ServerThread, assert_error, post, wait_for  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = ServerLimits(max_body=64 * 1024, header_timeout=0.6, body_timeout=0.6,
                      drain_timeout=1.0)
MSGS = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def model(stories_dir):
    from edgeinfer import api
    from edgeinfer.readers import read_model

    return api.Model(read_model(str(stories_dir)), backend="reference", n_ctx=512)


@pytest.fixture(scope="module")
def server(model):
    """Small limits and short timeouts, for fast tests."""
    with ServerThread(create_app(model, NAME, limits=LIMITS)) as s:
        yield s


@pytest.fixture(scope="module")
def default_server(model):
    """The default limits (4 MiB bodies)."""
    with ServerThread(create_app(model, NAME)) as s:
        yield s


@pytest.fixture
def server_log():
    """Records every log record of uvicorn and edgeinfer (uvicorn's do not reach caplog)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "edgeinfer")]
    for lg in loggers:
        lg.addHandler(handler)
    yield records
    for lg in loggers:
        lg.removeHandler(handler)


def no_errors_logged(records) -> None:
    bad = [x for x in records if x.exc_info or x.levelno >= logging.ERROR]
    assert not bad, [x.getMessage() for x in bad]


def raw(server, data: bytes = b"", wait: float = 5.0) -> tuple[bytes, float]:
    """Send ``data`` on a fresh connection, then read until the server closes it (or
    ``wait`` s pass). Returns (everything received, seconds from sending to the end)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as c:
        t0 = time.monotonic()
        c.sendall(data)
        got = b""
        try:
            while chunk := c.recv(65536):
                got += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return got, time.monotonic() - t0


def read_response(c: socket.socket) -> bytes:
    """One whole response (head and Content-Length body) from a kept-alive connection."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = c.recv(65536)
        assert chunk, got
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += c.recv(65536)
    return head + b"\r\n\r\n" + body


def status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def head(path="/v1/chat/completions", length: int | None = None, extra=b"") -> bytes:
    cl = b"" if length is None else b"Content-Length: %d\r\n" % length
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s%s\r\n"
            % (path.encode(), cl, extra))


# ---- request bodies -------------------------------------------------------------------------
def test_content_length_over_the_limit_is_413_before_the_body_is_sent(server, server_log):
    got, took = raw(server, head(length=50 * 2**20) + b'{"messages": [', wait=5)
    status, err = status_and_error(got)
    assert status == 413 and err["code"] == "request_too_large", got
    assert "65536 bytes" in err["message"] and "--max-body" in err["message"]
    assert took < LIMITS.drain_timeout + 1.5  # answered, then closed after the drain deadline
    no_errors_logged(server_log)


def test_a_large_body_gets_413_not_a_reset(server, server_log):
    """httpx uploads 8 MB; the server answers 413 and discards the rest (bounded), so the
    client reads the answer instead of a connection reset."""
    r = post(server, "/v1/chat/completions", b'{"messages": "' + b"x" * (8 << 20) + b'"}')
    assert_error(r, 413, code="request_too_large")
    # chunked (no Content-Length): counted as it arrives
    r = server.http.post("/v1/chat/completions", content=iter([b'{"user": "', b"y" * (200 << 10),
                                                               b'"}']),
                         headers={"Authorization": "Bearer sk-edgeinfer-test"})
    assert_error(r, 413, code="request_too_large")
    # positive control: a body just under the limit is served
    pad = "z" * (LIMITS.max_body - 200)
    r = post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "user": pad},
             key=None)
    assert r.status_code == 200, r.text
    no_errors_logged(server_log)


# ---- slow clients ---------------------------------------------------------------------------
def test_a_slow_request_head_is_408(server, server_log):
    got, took = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
    status, err = status_and_error(got)
    assert status == 408 and err["code"] == "request_timeout", got
    assert LIMITS.header_timeout - 0.1 < took < LIMITS.header_timeout + 1.5, took
    # dripping a byte at a time does not reset the clock: the deadline is for the whole head
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as c:
        t0 = time.monotonic()
        for b in head(length=2):
            try:
                c.send(bytes([b]))
            except OSError:
                break
            time.sleep(0.05)
        c.settimeout(5)
        got = c.recv(65536)
    assert got.startswith(b"HTTP/1.1 408"), got
    assert time.monotonic() - t0 < LIMITS.header_timeout + 1.5
    # an incomplete head over h11's 16 KiB is refused at once (400), not buffered
    got, took = raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000)
    assert got.startswith(b"HTTP/1.1 400") and took < 1.0, got
    no_errors_logged(server_log)


def test_a_slow_body_and_a_lying_content_length_are_408(server, server_log):
    got, took = raw(server, head(length=1000) + b'{"messages": [')  # 14 of 1000 bytes, then silence
    status, err = status_and_error(got)
    assert status == 408 and err["code"] == "request_timeout", got
    assert "14 of 1000 bytes" in err["message"]
    assert LIMITS.body_timeout - 0.1 < took < LIMITS.body_timeout + 1.5, took
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as c:  # a dripping body
        c.sendall(head(length=100))
        t0 = time.monotonic()
        for _ in range(40):
            try:
                c.send(b" ")
            except OSError:
                break
            time.sleep(0.05)
        c.settimeout(5)
        got = c.recv(65536)
    assert got.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < LIMITS.body_timeout + 1.5
    no_errors_logged(server_log)


def test_the_timeouts_do_not_cut_a_slow_answer_or_a_kept_alive_connection(server, model):
    """Control: an answer that takes longer than both timeouts (the model is held busy for
    1.5 s) is served whole, streamed or not, and the connection then serves another request."""
    import threading

    for stream in (False, True):
        model._lock.acquire()
        threading.Timer(1.5, model._lock.release).start()
        t0 = time.monotonic()
        r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                             "stream": stream}, key=None)
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 > LIMITS.header_timeout + LIMITS.body_timeout
        assert r.text.endswith("data: [DONE]\n\n") if stream else \
            r.json()["usage"]["completion_tokens"] == 8
        time.sleep(0.3)  # idle on the kept-alive connection, shorter than uvicorn's 5 s
        r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, key=None)
        assert r.status_code == 200, r.text
    # a kept-alive connection idle for longer than the head timeout (but under uvicorn's
    # 5 s keep-alive) is not sent a 408: the head clock starts at the next request's first byte
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as c:
        c.sendall(get)
        assert read_response(c).startswith(b"HTTP/1.1 200")
        time.sleep(LIMITS.header_timeout + 0.4)
        c.sendall(get)
        assert read_response(c).startswith(b"HTTP/1.1 200")


# ---- bad JSON: one bounded parse, one schema check -------------------------------------------------
M = b'[{"role": "user", "content": "hi"}]'
BAD_BODIES = [  # (id, path, body, status, param, code)
    ("nested 10^5 deep", "c", b"[" * 100_000 + b"]" * 100_000, 400, None, "invalid_json"),
    ("nested inside a field", "c", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None,
     "invalid_json"),
    ("5000-digit integer", "c", b'{"messages": %s, "max_tokens": %s}' % (M, b"9" * 5000), 400, None,
     "invalid_json"),
    ("30-digit seed", "c", b'{"messages": %s, "seed": %s}' % (M, b"9" * 30), 400, "seed", None),
    ("30-digit top_k", "c", b'{"messages": %s, "top_k": %s}' % (M, b"9" * 30), 400, "top_k", None),
    ("huge max_tokens", "p", b'{"prompt": "hi", "max_tokens": %s}' % (b"9" * 25), 400, "max_tokens",
     None),
    ("negative max_tokens", "c", b'{"messages": %s, "max_tokens": -5}' % M, 400, "max_tokens", None),
    ("negative top_k", "c", b'{"messages": %s, "top_k": -1}' % M, 400, "top_k", None),
    ("NaN literal", "c", b'{"messages": %s, "temperature": NaN}' % M, 400, None, "invalid_json"),
    ("Infinity literal", "c", b'{"messages": %s, "top_p": -Infinity}' % M, 400, None, "invalid_json"),
    ("1e999", "c", b'{"messages": %s, "temperature": 1e999}' % M, 400, "temperature", None),
    ("invalid UTF-8", "c", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None,
     "invalid_json"),
    ("lone surrogate in content", "c", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
     400, "messages[0].content", None),
    ("lone surrogate in a text part", "c",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', 400,
     "messages[0].content[0].text", None),
    ("lone surrogate in prompt", "p", b'{"prompt": "\\udc00"}', 400, "prompt", None),
    ("lone surrogate in stop", "c", b'{"messages": %s, "stop": ["\\ud83d"]}' % M, 400, "stop", None),
    ("duplicate key", "c", b'{"messages": %s, "max_tokens": 2, "max_tokens": 3}' % M, 400, None,
     "invalid_json"),
    ("array body", "c", b"[1, 2]", 400, None, "invalid_json"),
    ("string body", "c", b'"hello"', 400, None, "invalid_json"),
    ("number body", "p", b"42", 400, None, "invalid_json"),
    ("null body", "c", b"null", 400, None, "invalid_json"),
    ("empty body", "c", b"", 400, None, "invalid_json"),
    ("truncated JSON", "c", b'{"messages": [{"role": "us', 400, None, "invalid_json"),
    ("messages not a list", "c", b'{"messages": {"role": "user"}}', 400, "messages", None),
    ("message not an object", "c", b'{"messages": ["hi"]}', 400, "messages[0]", None),
    ("role a list", "c", b'{"messages": [{"role": ["user"], "content": "x"}]}', 400,
     "messages[0].role", None),
    ("content a number", "c", b'{"messages": [{"role": "user", "content": 5}]}', 400,
     "messages[0].content", None),
    ("max_tokens a string", "c", b'{"messages": %s, "max_tokens": "8"}' % M, 400, "max_tokens", None),
    ("max_tokens a float", "c", b'{"messages": %s, "max_tokens": 8.0}' % M, 400, "max_tokens", None),
    ("stream a number", "c", b'{"messages": %s, "stream": 1}' % M, 400, "stream", None),
    ("stream_options a list", "c", b'{"messages": %s, "stream": true, "stream_options": []}' % M,
     400, "stream_options", None),
    ("include_usage a string", "c",
     b'{"messages": %s, "stream": true, "stream_options": {"include_usage": "yes"}}' % M, 400,
     "stream_options.include_usage", None),
    ("model a number", "c", b'{"messages": %s, "model": 7}' % M, 400, "model", None),
    ("prompt token id too large", "p", b'{"prompt": [1, %s]}' % (b"9" * 30), 400, "prompt", None),
    ("prompt token id negative", "p", b'{"prompt": [1, -4]}', 400, "prompt", None),
    ("prompt of floats", "p", b'{"prompt": [1.5]}', 400, "prompt", None),
    ("stop a dict", "c", b'{"messages": %s, "stop": {"a": 1}}' % M, 400, "stop", None),
]


@pytest.mark.parametrize("case", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_json_body_is_a_4xx_naming_the_field(default_server, server_log, case):
    _, path, body, status, param, code = case
    r = post(default_server, {"c": "/v1/chat/completions", "p": "/v1/completions"}[path], body,
             key=None, timeout=10)
    assert_error(r, status, param=param, code=code)
    no_errors_logged(server_log)


def test_bad_bodies_are_parsed_in_bounded_time(default_server):
    """The deepest, longest-number and most-escaped bodies the 4 MiB limit allows are
    answered in bounded time (seconds on a loaded machine; linear-time checks)."""
    n = 2 * 2**20 - 10
    for body in (b"[" * n + b"]" * n, b'{"max_tokens": ' + b"1" * (4 * 2**20 - 40) + b"}",
                 b'{"messages": "' + b"[\\\"" * (2**20 - 10) + b'"}'):
        t0 = time.monotonic()
        r = post(default_server, "/v1/chat/completions", body, key=None)
        assert r.status_code == 400 and time.monotonic() - t0 < 5.0, r.text


def test_max_tokens_beyond_the_context_is_cut_to_it(stories_dir):
    from edgeinfer import api
    from edgeinfer.readers import read_model

    small = api.Model(read_model(str(stories_dir)), backend="reference", n_ctx=32)
    with ServerThread(create_app(small, NAME)) as s:
        r = post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10**12, "temperature": 0},
                 key=None)
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 27, "total_tokens": 32}
    assert r.json()["choices"][0]["finish_reason"] == "length"


# ---- shutdown -------------------------------------------------------------------------------
def test_shutdown_cancels_a_running_stream(model, monkeypatch):
    """uvicorn's exit (what SIGTERM triggers) cancels the generation within about the
    grace period: the worker thread notices between decode steps. Each step is held 5 ms
    so that the 500 tokens outlast the 1 s grace period on any machine (stories260K
    alone can decode them in under a second on a fast one, and then completes)."""
    forward = model.transformer.forward

    def slow_forward(*a, **k):
        time.sleep(0.005)
        return forward(*a, **k)

    monkeypatch.setattr(model.transformer, "forward", slow_forward)
    s = ServerThread(create_app(model, NAME, limits=LIMITS)).__enter__()
    counters = s.app.state.counters
    with socket.create_connection(("127.0.0.1", s.port)) as c:  # a stuck client: never reads
        body = json.dumps({"prompt": PROMPT, "max_tokens": 500, "stream": True}).encode()
        c.sendall(head("/v1/completions", len(body)) + body)
        assert wait_for(lambda: counters.active == 1)
        t0 = time.monotonic()
        s.__exit__(None, None, None)
        assert not s.thread.is_alive()
        assert wait_for(lambda: counters.active == 0, timeout=5)
        assert counters.cancelled == 1 and time.monotonic() - t0 < 4


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def test_sigterm_ends_the_real_server_mid_generation_with_stuck_clients(stories_dir, tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EDGEINFER_HOME": str(tmp_path)}
    p = subprocess.Popen([sys.executable, "-m", "cli", "serve", "-m", str(stories_dir),
                          "--backend", "reference", "--port", str(port), "--ctx", "2048"],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    conns = []
    try:
        def up():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return True
            except OSError:
                return p.poll() is not None

        assert wait_for(up, timeout=60) and p.poll() is None, p.stderr.read()

        def connect(data: bytes) -> socket.socket:
            c = socket.create_connection(("127.0.0.1", port), timeout=10)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.sendall(data)
            conns.append(c)
            return c

        body = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "stream": True}).encode()
        reader = connect(head("/v1/completions", len(body)) + body)  # ~2000 tokens: seconds
        assert b"200 OK" in reader.recv(4096)
        connect(head("/v1/completions", len(body)) + body)  # queued behind it, never reads
        comp = json.dumps({"prompt": PROMPT, "max_tokens": 2000}).encode()
        connect(head("/v1/completions", len(comp)) + comp)  # queued, non-streamed
        connect(head("/v1/completions", 500) + b"{")  # a body that never comes
        connect(b"POST /v1/completions HTTP/1.1\r\n")  # a head that never ends
        time.sleep(0.3)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(15)
        took = time.monotonic() - t0
    finally:
        for c in conns:
            c.close()
        if p.poll() is None:
            p.kill()
            p.wait()
    err = p.stderr.read().decode()
    assert rc == -signal.SIGTERM, (rc, err)  # uvicorn re-raises the signal once it has shut down
    assert took < 5, (took, err)
    assert (tmp_path / "run").is_dir() and not list((tmp_path / "run").glob("serve-*.json"))
    assert "Traceback" not in err, err
    print(f"SIGTERM to exit: {took:.2f} s; stderr:\n{err}")


# ---- configuration --------------------------------------------------------------------------
def test_limits_parse_and_validate():
    assert parse_size("4M") == 4 * 2**20 and parse_size("512k") == 512 * 1024
    assert parse_size("1.5MiB") == 3 * 2**19 and parse_size("65536") == 65536
    for bad in ("", "-1", "4X", "0", "1e3"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError, match="max_body"):
        ServerLimits(max_body=0)
    with pytest.raises(ValueError, match="body_timeout"):
        ServerLimits(body_timeout=-1)


def test_serve_help_documents_the_limits():
    r = subprocess.run([sys.executable, "-m", "cli", "serve", "--help"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    text = " ".join(r.stdout.split())
    assert "--max-body SIZE largest request body accepted, e.g. 4M, 512K (default 4M); larger: 413" \
        in text, text
    assert "--header-timeout S seconds a client has to send the request line and headers " \
           "(default 10); slower: 408" in text
    assert "--body-timeout S seconds a client has to send the request body after its headers " \
           "(default 30); slower: 408" in text
