"""The server's request fields on stories260K through the official client: constrained
``response_format`` output that parses and validates; unsupported result-changing
parameters are 400s naming them; unknown vendor fields are accepted and logged once;
dropped chat turns are returned; tools on a model without a template are refused."""
from __future__ import annotations

import json
import logging

import pytest

openai = pytest.importorskip("openai", reason="pip install -e '.[serve,test]'")
jsonschema = pytest.importorskip("jsonschema", reason="pip install -e '.[test]'")
pytest.importorskip("uvicorn")

from test_server import KEY, NAME, ServerThread, post  # noqa: E402

from edgeinfer.server import create_app  # noqa: E402

STORY = {"type": "object", "properties": {
    "hero": {"type": "string", "maxLength": 16},
    "friends": {"type": "integer", "minimum": 0, "maximum": 9},
    "happy": {"type": "boolean"}},
    "required": ["hero", "friends", "happy"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(stories_dir):
    from edgeinfer import api
    from edgeinfer.readers import read_model

    return api.Model(read_model(str(stories_dir)), backend="reference", n_ctx=256)


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(create_app(model, NAME, api_key=KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_response_format_json_schema_parses_and_validates(client, seed):
    rf = {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY,
                                                  "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content":
                                       "Once upon a time"}], response_format=rf,
                                       temperature=1.0, seed=seed, max_tokens=120)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), STORY)
    # completions take it too, streamed
    parts = [c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="Once upon a time", extra_body={"response_format": rf},
        temperature=1.0, seed=seed, max_tokens=120, stream=True) if c.choices]
    jsonschema.validate(json.loads("".join(parts)), STORY)


def test_response_format_json_object_and_text(client):
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Once upon a time"}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8,
                                  temperature=0, extra_body={"response_format": {"type": "text"}})
    assert r.choices[0].text.startswith(", there was")


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"42": 5}), ("functions", [{"name": "f"}]), ("function_call", "f"),
    ("audio", {"voice": "alloy"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("reasoning_effort", "high"),
    ("response_format", {"type": "xml"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                                                 {"type": "nonsense"}}}),
])
def test_unsupported_parameters_are_400s_naming_them(server, field, value):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == field and field in err["message"]


def test_neutral_values_and_neutral_fields_are_accepted(server):
    r = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logit_bias": {},
        "user": "u1", "metadata": {"k": "v"}, "store": False, "modalities": ["text"],
        "tools": []})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "suffix": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "tools": []})
    assert r.status_code == 400 and "chat parameter" in r.json()["error"]["message"]


def test_unknown_vendor_fields_are_accepted_and_logged_once(server, caplog):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "ignore_eos": True, "cache_prompt": True}
    with caplog.at_level(logging.INFO, logger="edgeinfer.server"):
        for _ in range(3):
            assert post(server, "/v1/chat/completions", body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "ignoring the request field" in r.getMessage()]
    assert sorted(x.split("'")[1] for x in lines) == ["cache_prompt", "ignore_eos"]


def test_tools_on_a_model_without_tool_support_are_a_400_naming_why(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "tools": [tool]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tools" and "no chat template" in err["message"]
    # tool_choice "none" renders no tools: accepted
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "tools": [tool], "tool_choice": "none",
                                              "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_chat_that_outgrows_the_context_returns_its_dropped_turns(client, model):
    long = "Once upon a time there was a little girl. " * 6
    convo = []
    for i in range(6):
        convo += [{"role": "user", "content": f"{i} {long}"},
                  {"role": "assistant", "content": long}]
    convo.append({"role": "user", "content": "The end."})
    assert len(model.encode_chat(convo)) > model.n_ctx  # it cannot fit whole
    r = client.chat.completions.create(model=NAME, messages=convo, max_tokens=16, temperature=0)
    dropped = r.usage.dropped_turns
    ids, want = model.chat_ids(convo, reserve=16)
    assert dropped == want and dropped >= 3
    assert r.usage.prompt_tokens == len(ids) <= model.n_ctx - 16
    small = client.chat.completions.create(model=NAME, max_tokens=2, messages=convo[-1:])
    assert small.usage.dropped_turns == 0
    # the API says the same on its final event
    final = list(model.chat_stream(convo, max_tokens=16))[-1]
    assert final.stats.dropped_turns == want
