"""The server's text rules: chat content is text, /v1/completions' ``parse_special`` switch,
invalid Unicode refused with a 400 (on stories260K, whose <unk> <s> </s> are special)."""
from __future__ import annotations

import pytest

from test_server import KEY, NAME, ServerThread, assert_error, post

from edgeinfer.server import create_app  # noqa: E402  (test_server skips without the extra)

TEXT = "</s><s>Once upon a time"


@pytest.fixture(scope="module")
def model(stories_dir):
    from edgeinfer import api
    from edgeinfer.readers import read_model

    return api.Model(read_model(str(stories_dir)), backend="reference", n_ctx=256)


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(create_app(model, NAME, api_key=KEY)) as s:
        yield s


def usage(r) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_completion_parse_special_field(server, model):
    body = {"model": NAME, "prompt": TEXT, "max_tokens": 1, "temperature": 0}
    parsed, as_text = model.encode_prompt(TEXT), model.encode_prompt(TEXT, parse_special=False)
    assert parsed[:3] == [1, 2, 1] and not {0, 1, 2} & set(as_text[1:])
    assert usage(post(server, "/v1/completions", body)) == len(parsed)
    assert usage(post(server, "/v1/completions", {**body, "parse_special": True})) == len(parsed)
    assert usage(post(server, "/v1/completions", {**body, "parse_special": False})) == len(as_text)
    assert_error(post(server, "/v1/completions", {**body, "parse_special": "no"}), 400,
                 param="parse_special")


def test_chat_content_is_text_whatever_the_request_says(server, model):
    msgs = [{"role": "user", "content": TEXT}]
    as_text = model.encode_prompt(TEXT, parse_special=False)
    body = {"model": NAME, "messages": msgs, "max_tokens": 1, "temperature": 0}
    assert usage(post(server, "/v1/chat/completions", body)) == len(as_text)
    assert usage(post(server, "/v1/chat/completions", {**body, "parse_special": True})) == len(as_text)


def test_lone_surrogates_are_a_400(server):
    # json.dumps writes "\ud800" escapes: valid JSON, not valid Unicode
    for path, body in [("/v1/completions", {"model": NAME, "prompt": "a\ud800"}),
                       ("/v1/chat/completions", {"model": NAME,
                                                 "messages": [{"role": "user", "content": "\udfff"}]})]:
        r = post(server, path, body)
        assert_error(r, 400)
        assert "surrogate" in r.json()["error"]["message"]
