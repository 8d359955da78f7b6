"""The OpenAI-compatible server on a real tiny model, through the official client.

A real uvicorn server runs on a free loopback port in a background thread, serving
stories260K on the reference backend. Golden values: greedy "Once upon a time" goes on
", there was a little girl named Lily"; the prompt is 5 tokens (BOS included); a chat
of one user message falls back to the message text verbatim (no chat template).
"""
from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="pip install -e '.[serve,test]'")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from edgeinfer.server import create_app, uvicorn_config  # noqa: E402  (after the skips)

KEY = "sk-edgeinfer-test"
NAME = "stories260K"
PROMPT = "Once upon a time"
GOLDEN_START = ", there was a little girl"
STOP_TEXT = ", there was a little girl named "  # greedy text up to the stop string "Lily"


@pytest.fixture(scope="module")
def model(stories_dir):
    from edgeinfer import api
    from edgeinfer.readers import read_model

    return api.Model(read_model(str(stories_dir)), backend="reference", n_ctx=512)


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(app, log_level="warning")  # serve()'s: the bounded protocol
        config.timeout_graceful_shutdown = 1
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self):
        # one client, so that each request does not build its own connection pool/SSL context
        self.http = httpx.Client(base_url=self.url, timeout=30)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start in 10 s"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.http.close()
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(create_app(model, NAME, api_key=KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def post(server, path, body, key=KEY, **kw):
    """POST raw JSON (or bytes) with an optional bearer key; returns the httpx response."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return server.http.post(path, content=data,
                            headers={"Content-Type": "application/json", **headers}, **kw)


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---- the official client ------------------------------------------------------------------
def test_models_list(client, server):
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.models.retrieve(NAME).id == NAME


def test_completion_greedy_stream_equals_non_stream(client):
    res = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0)
    text = res.choices[0].text
    assert text.startswith(GOLDEN_START), text
    assert res.choices[0].finish_reason == "length"
    assert res.object == "text_completion" and res.model == NAME
    assert (res.usage.prompt_tokens, res.usage.completion_tokens, res.usage.total_tokens) == (5, 20, 25)

    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_greedy_stream_equals_non_stream_with_usage(client):
    messages = [{"role": "user", "content": PROMPT}]
    res = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16,
                                         temperature=0)
    msg = res.choices[0].message
    assert msg.role == "assistant" and msg.content.startswith(GOLDEN_START), msg.content
    assert res.choices[0].finish_reason == "length"
    assert (res.usage.prompt_tokens, res.usage.completion_tokens, res.usage.total_tokens) == (5, 16, 21)

    chunks = list(client.chat.completions.create(
        model=NAME, messages=messages, max_completion_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 21


def test_stop_string_and_list(client):
    res = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0,
                                    stop="Lily")
    assert res.choices[0].text == STOP_TEXT
    assert res.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=40,
        temperature=0, stop=["zebra", "Lily"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == STOP_TEXT
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=0.9, seed=7)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b and len(a) > 0


# ---- errors (raw HTTP) -----------------------------------------------------------------------
def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    assert "Traceback" not in r.text


def test_bad_requests_get_openai_error_bodies(server):
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    assert_error(post(server, chat, b"{not json"), 400, code="invalid_json")
    assert_error(post(server, chat, b"[1, 2]"), 400, code="invalid_json")
    assert_error(post(server, chat, {"model": NAME}), 400, param="messages")
    assert_error(post(server, chat, {"model": NAME, "messages": []}), 400, param="messages")
    assert_error(post(server, chat, {"model": NAME, "messages": [{"role": "robot", "content": "x"}]}),
                 400, param="messages[0].role")
    assert_error(post(server, chat, {"model": "gpt-9", "messages": msgs}), 404, code="model_not_found")
    for field, value in [("temperature", 5), ("temperature", -0.1), ("temperature", "hot"),
                         ("top_p", 0), ("top_p", 1.5), ("max_tokens", 0), ("max_tokens", -3),
                         ("max_tokens", 2.5), ("max_tokens", "10"), ("max_completion_tokens", 0),
                         ("seed", -1), ("stop", 3), ("stop", ["a", 1]), ("stream", "yes"),
                         ("n", 2), ("presence_penalty", 3), ("logprobs", True), ("echo", True)]:
        assert_error(post(server, chat, {"model": NAME, "messages": msgs, field: value}), 400,
                     param=field)
    assert_error(post(server, "/v1/completions", {"model": NAME}), 400, param="prompt")
    assert_error(post(server, "/v1/completions", {"model": NAME, "prompt": [1, 10**9]}), 400,
                 param="prompt")
    too_long = {"model": NAME, "prompt": [1] * 600}  # the context holds 512
    assert_error(post(server, "/v1/completions", too_long), 400, code="context_length_exceeded")
    assert_error(server.http.get("/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}),
                 404)
    assert_error(server.http.get(chat), 405)


def test_api_key_enforced(server, model):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_error(post(server, "/v1/chat/completions", body, key=None), 401, code="invalid_api_key")
    assert_error(post(server, "/v1/chat/completions", body, key="sk-wrong"), 401,
                 code="invalid_api_key")
    assert_error(server.http.get("/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert post(server, "/v1/chat/completions", body).status_code == 200
    # a server started without a key needs none
    with ServerThread(create_app(model, NAME, api_key=None)) as open_server:
        r = post(open_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0},
                 key=None)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]


# ---- cancellation and queueing ---------------------------------------------------------------
LONG = 480  # tokens; the context (512) minus the 5-token prompt leaves room for them


def test_disconnect_mid_stream_cancels_generation(server, client, model):
    counters = server.app.state.counters
    assert wait_for(lambda: counters.active == 0)
    before = counters.cancelled
    t_full = time.perf_counter()
    model.generate(PROMPT, max_tokens=LONG)  # the uncancelled cost
    t_full = time.perf_counter() - t_full

    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=LONG,
                                       temperature=0.8, seed=1, stream=True)
    first = next(iter(stream))
    assert first.choices[0].text
    stream.close()  # the client hangs up after one chunk
    t0 = time.perf_counter()
    res = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    waited = time.perf_counter() - t0
    assert res.choices[0].text.startswith(", there")
    assert wait_for(lambda: counters.cancelled == before + 1), "the generation was not cancelled"
    # the follow-up did not wait for the abandoned LONG-token generation to finish
    assert waited < max(0.5 * t_full, 0.25) or t_full < 0.2, (waited, t_full)


def test_disconnect_while_waiting_for_non_streamed_answer_cancels(server):
    counters = server.app.state.counters
    assert wait_for(lambda: counters.active == 0)
    before = counters.cancelled
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0.8, "seed": 2}
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=0.05)
    assert wait_for(lambda: counters.cancelled == before + 1), "the generation was not cancelled"
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200


def test_concurrent_requests_are_queued_not_interleaved(server, client):
    """Two streams at once each get exactly what they get alone; the loop stays responsive."""
    prompts = [PROMPT, "Lily and Ben went to the"]
    solo = [client.completions.create(model=NAME, prompt=p, max_tokens=40, temperature=0)
            .choices[0].text for p in prompts]
    results: dict[int, str] = {}

    def run(i):
        chunks = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=40,
                                           temperature=0, stream=True)
        results[i] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    health = server.http.get("/health", timeout=5)  # not blocked by generation
    health_s = time.perf_counter() - t0
    for t in threads:
        t.join(30)
    assert health.status_code == 200 and health_s < 1.0
    assert [results.get(0), results.get(1)] == solo


def test_request_abandoned_while_queued_never_runs(server, client):
    """B waits behind A; B's client leaves; B never reaches the model."""
    counters = server.app.state.counters
    assert wait_for(lambda: counters.active == 0)  # earlier tests' workers have wound down
    started = counters.started
    a = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=LONG, temperature=0,
                                  stream=True)
    assert next(iter(a)).choices[0].text  # A holds the model
    with server.http.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                            json={"prompt": "Lily", "max_tokens": 5, "stream": True}) as b:
        assert b.status_code == 200
        assert wait_for(lambda: counters.queued == 1), "B was not queued"
    # B left the queue when its client did, while A still held the model
    assert wait_for(lambda: counters.queued == 0)
    assert counters.started == started + 1 and counters.active == 1
    a.close()
    assert wait_for(lambda: counters.active == 0), "A was not cancelled"
    time.sleep(0.1)
    assert counters.started == started + 1  # B never started


# ---- sampling defaults: the model's, not OpenAI's temperature 1 --------------------------------
def test_a_request_without_model_defaults_gets_the_sampler_defaults():
    """parse_common with no model defaults fills omitted fields from
    edgeinfer.sampling.DEFAULTS (llama.cpp's), not OpenAI's temperature 1; given model
    defaults win over them, and a request's own value over both."""
    from edgeinfer.sampling import DEFAULTS
    from edgeinfer.server_requests import parse_common

    fields = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
              "presence_penalty", "frequency_penalty", "seed")
    assert parse_common({}, NAME).sampling == {f: getattr(DEFAULTS, f) for f in fields}
    got = parse_common({"top_p": 0.5}, NAME, {"temperature": 0.2, "top_p": 0.9}).sampling
    assert (got["temperature"], got["top_p"], got["top_k"]) == (0.2, 0.5, DEFAULTS.top_k)


def test_omitted_temperature_uses_the_fallback_defaults(client):
    # stories260K's generation config has no sampling keys: llama.cpp's defaults apply
    base = dict(model=NAME, prompt=PROMPT, max_tokens=24, seed=3)
    implicit = client.completions.create(**base).choices[0].text
    explicit = client.completions.create(
        **base, temperature=0.8, top_p=0.95, extra_body={"top_k": 40, "min_p": 0.05}
    ).choices[0].text
    assert implicit == explicit and implicit


def test_omitted_temperature_uses_the_models_generation_config(stories_dir):
    import dataclasses

    from edgeinfer import api
    from edgeinfer.readers import read_model

    src = read_model(str(stories_dir))
    greedy = api.Model(dataclasses.replace(src, generation={**src.generation, "temperature": 0.0}),
                       backend="reference", n_ctx=128)
    assert greedy.sampling_defaults()["temperature"] == 0.0
    with ServerThread(create_app(greedy, NAME)) as s:
        r = post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12}, key=None)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith(GOLDEN_START)  # greedy: the golden text
        # an explicit request value still wins
        r = post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.5,
                                        "seed": 5}, key=None)
        assert r.status_code == 200 and not r.json()["choices"][0]["text"].startswith(GOLDEN_START)


# ---- created, the per-request log line, the server's default max_tokens -------------------------
def test_created_is_stamped_when_the_request_arrives(server, model):
    """The model is held busy for 2 s: ``created`` must still be the arrival second."""
    for stream in (False, True):
        model._lock.acquire()
        released = threading.Timer(2.0, model._lock.release)
        t_sent = time.time()
        released.start()
        try:
            body = {"model": NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                    "stream": stream}
            r = post(server, "/v1/completions", body)
        finally:
            released.join()
        t_done = time.time()
        assert r.status_code == 200, r.text
        first = json.loads(r.text.split("\n")[0][len("data: "):]) if stream else r.json()
        assert t_done - t_sent >= 2.0
        # int(arrival) <= t_sent + 0.5; a finish-time stamp would be >= int(t_sent + 2)
        assert t_sent - 1 < first["created"] <= t_sent + 0.5, (stream, t_sent, first["created"])


def test_one_log_line_per_request(server, caplog):
    with caplog.at_level(logging.INFO, logger="edgeinfer.server.access"):
        r = post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 7,
                                             "temperature": 0})
        assert r.status_code == 200
        s = post(server, "/v1/chat/completions", {"model": NAME, "max_tokens": 4, "stream": True,
                                                  "messages": [{"role": "user", "content": PROMPT}]})
        assert s.status_code == 200 and s.text.endswith("data: [DONE]\n\n")
        bad = post(server, "/v1/completions", {"model": "nope", "prompt": PROMPT})
        assert bad.status_code == 404
        patterns = [r"POST /v1/completions 200 5\+7 tokens \d+\.\d\d s",
                    r"POST /v1/chat/completions 200 5\+4 tokens \d+\.\d\d s",
                    r"POST /v1/completions 404 - tokens \d+\.\d\d s"]

        def lines():
            return [x.getMessage() for x in caplog.records if x.name == "edgeinfer.server.access"]

        # a streamed answer is logged when its response ends, just after the client saw it
        assert wait_for(lambda: all(any(re.fullmatch(p, ln) for ln in lines())
                                    for p in patterns)), lines()


def test_serve_max_tokens_caps_requests_without_max_tokens(model):
    with ServerThread(create_app(model, NAME, default_max_tokens=6)) as s:
        r = post(s, "/v1/completions", {"prompt": PROMPT, "temperature": 0}, key=None)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = post(s, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 9},
                 key=None)
        assert r.json()["usage"]["completion_tokens"] == 9  # the request's own wins
    with pytest.raises(ValueError, match="default_max_tokens"):
        create_app(model, NAME, default_max_tokens=0)


def test_serve_help_documents_max_tokens_and_quiet():
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "cli", "serve", "--help"], check=False,
                       capture_output=True,
                       text=True, cwd=os.path.dirname(os.path.dirname(__file__)), timeout=60)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "--max-tokens N, -n N most tokens to generate for a request that sets no max_tokens " \
           "(default: unlimited, i.e. up to the end of the context" in text, text
    assert "--quiet, -q no log line per request" in text
