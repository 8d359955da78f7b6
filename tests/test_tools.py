"""edgeinfer.tools: the ``<tool_call>`` parser fed as text streams (any chunking gives the
same calls), the bare-object and fenced forms small models write, and the checks of
OpenAI tool definitions and ``tool_choice``."""
from __future__ import annotations

import json

import pytest

from edgeinfer.tools import (
    ToolCallParser,
    ToolError,
    call_grammar,
    normalize_tool_choice,
    normalize_tools,
    parse_tool_calls,
    template_messages,
)

TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "opts": {"unit": "celsius"}}}\n</tool_call>\n<tool_call>\n'
             '{"arguments": {"tz": "CET"}, "name": "get_time"}\n</tool_call>')


def _run(text: str, step: int, names=()):
    p = ToolCallParser(names=frozenset(names))
    events = []
    for i in range(0, len(text), step):
        events += p.feed(text[i:i + step])
    return events + p.finish(), p.calls


@pytest.mark.parametrize("step", [1, 2, 5, 13, 10_000])
def test_any_chunking_gives_the_same_calls_and_streams_the_arguments(step):
    events, calls = _run(TWO_CALLS, step)
    assert [(c.index, c.name, c.arguments) for c in calls] == [
        (0, "get_weather", '{"city": "Paris", "opts": {"unit": "celsius"}}'),
        (1, "get_time", '{"tz": "CET"}')]
    content = "".join(e[1] for e in events if e[0] == "content")
    assert content.strip() == "Let me check."
    streamed = {}
    for e in events:
        if e[0] == "arguments":
            streamed[e[1]] = streamed.get(e[1], "") + e[2]
    assert streamed == {0: calls[0].arguments, 1: calls[1].arguments}
    assert json.loads(streamed[0]) == {"city": "Paris", "opts": {"unit": "celsius"}}
    # each call is announced (name, empty arguments) before its arguments arrive
    kinds = [(e[0], e[1].index if e[0] == "call" else e[1]) for e in events if e[0] != "content"]
    assert kinds[0] == ("call", 0) and kinds.index(("call", 1)) > kinds.index(("arguments", 0))
    if step == 1:  # streamed in pieces, not at the end
        assert sum(e[0] == "arguments" and e[1] == 0 for e in events) > 5


def test_text_that_is_not_a_call_stays_content():
    assert parse_tool_calls("no <tool_ tag here") == ("no <tool_ tag here", [])
    assert parse_tool_calls("<tool_call>\nnot json\n</tool_call>") == \
        ("<tool_call>\nnot json\n</tool_call>", [])
    # an unfinished call at the end: its arguments so far
    events, calls = _run('<tool_call>\n{"name": "f", "arguments": {"a": 1', 4)
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1')]


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```',
])
def test_bare_and_fenced_call_objects_of_known_tools(text):
    content, calls = parse_tool_calls(text, {"get_weather"})
    assert content == "" and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    # the same text without tools, or naming another function, is content
    assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls(text, {"other"}) == (text, [])
    assert parse_tool_calls('{"a": 1}', {"get_weather"}) == ('{"a": 1}', [])


def test_tool_definitions_and_choice_are_checked():
    tools = normalize_tools([{"type": "function", "function": {"name": "f"}}])
    assert tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    with pytest.raises(ToolError, match="only function tools") as e:
        normalize_tools([{"type": "code_interpreter"}])
    assert e.value.param == "tools[0]"
    with pytest.raises(ToolError, match="defined twice"):
        normalize_tools([{"type": "function", "function": {"name": "f"}}] * 2)
    with pytest.raises(ToolError, match="letters, digits"):
        normalize_tools([{"type": "function", "function": {"name": "bad name"}}])
    assert normalize_tool_choice(None, tools) == "auto"
    assert normalize_tool_choice(None, None) == "none"
    assert normalize_tool_choice({"type": "function", "function": {"name": "f"}}, tools) == "f"
    with pytest.raises(ToolError, match="not in 'tools'"):
        normalize_tool_choice({"type": "function", "function": {"name": "g"}}, tools)
    with pytest.raises(ToolError, match="needs 'tools'"):
        normalize_tool_choice("required", None)
    assert call_grammar(tools, "auto") is None and call_grammar(tools, "none") is None
    assert call_grammar(tools, "f").kind == "lark"


def test_template_messages_turn_argument_text_into_objects():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "d", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}]
    out = template_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[0]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not modified
