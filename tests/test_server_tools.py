"""Tool calling through the official openai client against the real server, on
Qwen2.5-Coder-0.5B-Instruct (its template renders tools and teaches ``<tool_call>``).

The model runs as the catalog's INT4 file (made once in the models cache). Greedy, so
a streamed answer must equal the non-streamed one; arguments must validate against the
tool's schema (jsonschema)."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="pip install -e '.[serve,test]'")
jsonschema = pytest.importorskip("jsonschema", reason="pip install -e '.[test]'")
pytest.importorskip("uvicorn")

from test_server import ServerThread, post  # noqa: E402

from edgeinfer.server import create_app  # noqa: E402

NAME = "qwen-tools"
KEY = "sk-edgeinfer-test"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen(qwen_gguf):
    from edgeinfer import api, catalog
    from edgeinfer.quant.convert import convert
    from edgeinfer.readers import read_model

    path = catalog.prepare("qwen2.5-coder-0.5b-instruct", convert, progress=False)
    model = api.Model(read_model(str(path)), backend="cpu", n_ctx=1024)
    model.warm_up()
    return model


@pytest.fixture(scope="module")
def server(qwen):
    with ServerThread(create_app(qwen, NAME, api_key=KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _args_ok(arguments: str, tool: dict) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_named_tool_choice_streamed_as_openai_streams_it(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice=choice, temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    assert _args_ok(call.function.arguments, WEATHER)["city"] == "Paris"

    stream = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice=choice, temperature=0, max_tokens=60,
                                            stream=True)
    chunks = list(stream)
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    pieces = [d.tool_calls[0] for d in deltas if d.tool_calls]
    first, rest = pieces[0], pieces[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert rest and all(p.index == 0 and p.id is None and p.function.name is None for p in rest)
    assert len(rest) > 1  # the arguments come in pieces, as they are generated
    assert "".join(p.function.arguments for p in rest) == call.function.arguments
    assert not any(d.content for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_are_rendered_back_through_the_template(qwen):
    """An assistant's OpenAI tool_calls (arguments as JSON text) and the tool's result
    render as Qwen's template spells them: arguments as an object, not a quoted string."""
    convo = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 22}'},
    ]
    text = qwen.tokenizer.decode(qwen.encode_chat(convo, tools=[WEATHER]), skip_special=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature_c": 22}\n</tool_response>' in text
    assert "\"name\": \"get_weather\"" in text.split("<tools>\n")[1].split("</tools>")[0]
    # tool_choice "none": the tools are not rendered at all
    plain = qwen.tokenizer.decode(qwen.encode_chat(ASK), skip_special=False)
    assert "<tools>" not in plain and "<tools>" in text


def test_a_model_without_tool_support_gets_a_400_naming_why(qwen, smollm2_gguf):
    from edgeinfer.readers import read_model
    from edgeinfer.tools import tool_support

    assert qwen.tool_support() is None
    why = tool_support(read_model(str(smollm2_gguf)).chat_template)
    assert why == "the model's chat template has no tool support (it never reads `tools`)"
    assert "no chat template" in tool_support(None)


def test_bad_tool_fields_are_400s(server):
    for body, param in (
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                              "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ):
        r = post(server, "/v1/chat/completions", {"messages": ASK, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.slow
def test_auto_and_required_tool_calls_and_an_answer_from_the_result(client):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], temperature=0,
                                       max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert _args_ok(c.message.tool_calls[0].function.arguments, WEATHER)["city"] == "Paris"

    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    _args_ok(call.function.arguments, tool)

    convo = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 22}'}]
    r = client.chat.completions.create(model=NAME, messages=convo, tools=[WEATHER],
                                       temperature=0, max_tokens=40)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.tool_calls is None
    assert "22" in c.message.content
