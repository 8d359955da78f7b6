"""Tool calling (OpenAI ``tools`` / ``tool_choice``) through the model's own chat template.

The tools are rendered by the model's template (its ``tools`` variable, as HF's
``apply_chat_template(..., tools=...)``); the model answers with calls in the format its
template teaches. The one format parsed here is the ``<tool_call>`` JSON block that
Qwen2.5 (and Hermes-style templates) use::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:func:`tool_support` says whether a template can take tools (it reads ``tools`` and
teaches ``<tool_call>``); :func:`call_grammar` builds the Lark grammar that forces a call
(``tool_choice`` "required" or a named function, :mod:`edgeinfer.constrained`);
:class:`ToolCallParser` turns the generated text, fed as it streams, into content and
tool-call events (a call's name as soon as it is known, then its arguments in pieces, as
OpenAI streams ``delta.tool_calls``); :func:`template_messages` turns OpenAI history
(assistant ``tool_calls`` with JSON-string arguments, ``tool`` results) into what the
templates expect.
"""
from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .constrained import JSON_LAYOUT, Grammar
from .errors import EdgeInferError

__all__ = ["OPEN_TAG", "CLOSE_TAG", "ToolCall", "ToolCallParser", "ToolError", "call_grammar",
           "normalize_tool_choice", "normalize_tools", "parse_tool_calls", "template_messages",
           "tool_support"]

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_NAME_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_FUNC_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ToolError(EdgeInferError, ValueError):
    """Tools that cannot be used: malformed definitions, an unknown ``tool_choice``, or a
    model whose chat template has no tool support. ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def tool_support(template: str | None) -> str | None:
    """Why ``template`` cannot take tools, or None when it can.

    A template can when it reads the ``tools`` variable and teaches the ``<tool_call>``
    JSON format (Qwen2.5, Hermes); the reason names what is missing.
    """
    if not template:
        return "the model has no chat template, so it cannot be given tools"
    import jinja2
    from jinja2 import meta

    try:
        names = meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError as e:
        return f"the model's chat template does not parse ({e})"
    if "tools" not in names:
        return "the model's chat template has no tool support (it never reads `tools`)"
    if OPEN_TAG not in template:
        return (f"the model's chat template uses a tool-call format edgeinfer does not parse "
                f"(only {OPEN_TAG} JSON blocks, as Qwen2.5's)")
    return None


def normalize_tools(tools: Any, param: str = "tools") -> list[dict]:
    """OpenAI ``tools`` checked: ``[{"type": "function", "function": {"name",
    "description"?, "parameters"?}}]``; returns deep copies with ``parameters``
    defaulting to ``{"type": "object", "properties": {}}``.

    Raises:
        ToolError: not a non-empty list of function tools, a bad or repeated name, or
            parameters that are not a JSON schema object.
    """
    if not isinstance(tools, list) or not tools:
        raise ToolError(f"'{param}' must be a non-empty list of tools", param)
    out, seen = [], set()
    for i, t in enumerate(tools):
        p = f"{param}[{i}]"
        if not isinstance(t, Mapping) or t.get("type") != "function" \
                or not isinstance(t.get("function"), Mapping):
            raise ToolError(f"{p} must be {{'type': 'function', 'function': {{...}}}} (only "
                            f"function tools are supported)", p)
        f = dict(copy.deepcopy(t["function"]))
        name = f.get("name")
        if not isinstance(name, str) or not _FUNC_NAME_RE.match(name):
            raise ToolError(f"{p}.function.name must be 1-64 letters, digits, '_', '.' or '-', "
                            f"got {name!r}", f"{p}.function.name")
        if name in seen:
            raise ToolError(f"{p}.function.name {name!r} is defined twice", f"{p}.function.name")
        seen.add(name)
        params = f.get("parameters")
        if params is None:
            f["parameters"] = {"type": "object", "properties": {}}
        elif not isinstance(params, Mapping):
            raise ToolError(f"{p}.function.parameters must be a JSON schema object",
                            f"{p}.function.parameters")
        if "description" in f and not isinstance(f["description"], str):
            raise ToolError(f"{p}.function.description must be a string",
                            f"{p}.function.description")
        out.append({"type": "function", "function": f})
    return out


def normalize_tool_choice(choice: Any, tools: Sequence[dict] | None) -> str:
    """``tool_choice`` as "auto", "none", "required" or a function name.

    Default: "auto" with tools, "none" without (OpenAI's rule).

    Raises:
        ToolError: an unknown value, a name that is not among ``tools``, or a choice
            that needs tools when there are none.
    """
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ToolError(f"'tool_choice' must be 'auto', 'none', 'required' or "
                            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
                            "tool_choice")
        if choice == "required" and not tools:
            raise ToolError("'tool_choice' 'required' needs 'tools'", "tool_choice")
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), Mapping) \
            and isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
        names = [t["function"]["name"] for t in tools or ()]
        if name not in names:
            raise ToolError(f"'tool_choice' names the function {name!r}, which is not in "
                            f"'tools' ({', '.join(names) or 'none given'})", "tool_choice")
        return name
    raise ToolError("'tool_choice' must be 'auto', 'none', 'required' or "
                    "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


def _lark_literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal is a JSON string


def _tag(tokenizer, tag: str) -> str:
    """The grammar item of a tag: the token itself where the vocabulary has one (an
    added token, which llguidance matches by id), else its text."""
    i = tokenizer.token_to_id(tag) if tokenizer is not None else None
    return f"<[{i}]>" if i is not None else _lark_literal(tag)


def call_grammar(tools: Sequence[dict], choice: str, tokenizer=None,
                 parallel: bool = False) -> Grammar | None:
    """The grammar that forces tool calls for ``choice`` ("required": any of ``tools``,
    or a function name), None for "auto" / "none".

    Each call is ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`` with
    ARGS valid under the function's ``parameters`` schema. One call, then the end of the
    reply; ``parallel`` (a "required" choice with ``parallel_tool_calls: true``) allows
    more calls after the first, separated by a newline (a small model may then repeat
    its call up to ``max_tokens``).

    Raises:
        GrammarError: a parameters schema llguidance cannot compile.
    """
    if choice in ("auto", "none"):
        return None
    chosen = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    alts, rules = [], []
    for i, f in enumerate(chosen):
        schema = {**f["parameters"], "x-guidance": JSON_LAYOUT}
        head = _lark_literal(f'{f["name"]}", "arguments": ')
        alts.append(f"{head} args{i}")
        rules.append(f"args{i}: %json {json.dumps(schema)}")
    head, tail = _lark_literal('\n{"name": "'), _lark_literal("}\n")
    call = (f"call: {_tag(tokenizer, OPEN_TAG)} {head} ({' | '.join(alts)}) {tail} "
            f"{_tag(tokenizer, CLOSE_TAG)}")
    start = 'start: call ("\\n" call)*' if parallel and choice == "required" else "start: call"
    return Grammar.from_lark("\n".join([start, call, *rules]))


def template_messages(messages: Sequence[Mapping]) -> list[dict]:
    """OpenAI messages as chat templates expect them: an assistant's ``tool_calls``
    arguments (JSON text in OpenAI's API) become objects (templates ``tojson`` them),
    falling back to the text where it is not JSON."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                c = copy.deepcopy(dict(c))
                fn = c.get("function")
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out


@dataclass
class ToolCall:
    """One parsed call: OpenAI's ``{"id", "type": "function", "function": {"name",
    "arguments"}}`` (``arguments`` is JSON text)."""

    index: int
    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallParser:
    """Incremental ``<tool_call>`` parser over streamed text.

    :meth:`feed` takes each text delta and returns events, :meth:`finish` the rest:

    * ``("content", text)``: text outside calls (a possible start of ``<tool_call>`` is
      held back until it is decided);
    * ``("call", ToolCall)``: a call whose name is known (``arguments`` still "");
    * ``("arguments", index, text)``: the next piece of that call's arguments JSON.

    The arguments are streamed as generated, holding back from the last ``}`` (it may be
    the call object's own closing brace). A block whose JSON does not start with
    ``"name"`` is parsed whole at ``</tool_call>``; one that is not a call at all comes
    out as content, as written.

    Small models often drop the tags and answer with the bare call object
    (``{"name": "get_weather", "arguments": {...}}``), or that object in a Markdown code
    fence: a reply that begins with ``{`` or a fence is held to its end, and is a call
    when it is exactly such an object naming one of ``names``; otherwise it is content.

    Attributes:
        names: the tools' function names (for the bare-object rule; empty: never).
        calls: the calls parsed so far.
    """

    names: frozenset = frozenset()
    calls: list[ToolCall] = field(default_factory=list)
    _mode: str = "start"  # "start", "content", "head" (after <tool_call>), "args", "bare"
    _buf: str = ""
    _sent: int = 0  # chars of the current call's arguments already sent

    def feed(self, text: str) -> list[tuple]:
        self._buf += text
        events: list[tuple] = []
        while True:
            if self._mode == "start":  # nothing emitted yet: a bare call object?
                lead = self._buf.lstrip()
                if not lead:
                    return events
                if self.names and (lead[0] == "{" or lead.startswith("```")):
                    self._mode = "bare"
                elif self.names and "```".startswith(lead):
                    return events  # maybe a fence: wait for more
                else:
                    self._mode = "content"
            elif self._mode == "bare":
                return events
            elif self._mode == "content":
                i = self._buf.find(OPEN_TAG)
                if i < 0:
                    keep = _partial_suffix(self._buf, OPEN_TAG)
                    cut = len(self._buf) - keep
                    if cut:
                        events.append(("content", self._buf[:cut]))
                    self._buf = self._buf[cut:]
                    return events
                if i:
                    events.append(("content", self._buf[:i]))
                self._buf = self._buf[i + len(OPEN_TAG):]
                self._mode = "head"
            elif self._mode == "head":
                m = _NAME_RE.match(self._buf)
                end = self._buf.find(CLOSE_TAG)
                # (a match must be followed by a character: the spaces may go on)
                if m and m.end() < len(self._buf) and (end < 0 or m.end() <= end):
                    call = ToolCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}",
                                    json.loads(f'"{m.group(1)}"'))
                    self.calls.append(call)
                    events.append(("call", call))
                    self._buf = self._buf[m.end():]
                    self._sent = 0
                    self._mode = "args"
                    continue
                if end < 0:
                    return events
                events.extend(self._whole_block(self._buf[:end]))
                self._buf = self._buf[end + len(CLOSE_TAG):]
                self._mode = "content"
            else:  # args
                end = self._buf.find(CLOSE_TAG)
                body = self._buf if end < 0 else self._buf[:end]
                if end < 0:
                    # hold from the last "}" (maybe the call's own) and a partial close tag
                    stop = body.rfind("}")
                    stop = len(body) - _partial_suffix(body, CLOSE_TAG) if stop < 0 else stop
                else:
                    stop = _args_end(body)
                if stop > self._sent:
                    piece = body[self._sent:stop]
                    self.calls[-1].arguments += piece
                    events.append(("arguments", self.calls[-1].index, piece))
                    self._sent = stop
                if end < 0:
                    return events
                self._buf = self._buf[end + len(CLOSE_TAG):]
                self._mode = "content"

    def finish(self) -> list[tuple]:
        """End of the text: what is still held (an unclosed call's arguments, or the
        text of an unfinished block as content)."""
        events: list[tuple] = []
        if self._mode in ("bare", "start") and self._buf:
            obj = _json_or_none(_unfenced(self._buf))
            if isinstance(obj, dict) and set(obj) == {"name", "arguments"} \
                    and obj["name"] in self.names and isinstance(obj["arguments"], dict):
                events.extend(self._call_events(obj))
            else:
                events.append(("content", self._buf))
        elif self._mode == "args":
            stop = _args_end(self._buf)
            if stop > self._sent:
                piece = self._buf[self._sent:stop]
                self.calls[-1].arguments += piece
                events.append(("arguments", self.calls[-1].index, piece))
        elif self._mode == "head":
            events.append(("content", OPEN_TAG + self._buf))
        elif self._buf:
            events.append(("content", self._buf))
        self._buf, self._mode = "", "content"
        return events

    def _call_events(self, obj: dict) -> list[tuple]:
        args = obj["arguments"]
        call = ToolCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", obj["name"],
                        args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        return [("call", ToolCall(call.index, call.id, call.name)),
                ("arguments", call.index, call.arguments)]

    def _whole_block(self, block: str) -> list[tuple]:
        """A block whose head did not match: a call if it parses as one, else content."""
        obj = _json_or_none(block)
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and "arguments" in obj:
            return self._call_events(obj)
        return [("content", OPEN_TAG + block + CLOSE_TAG)]


def _unfenced(text: str) -> str:
    """The body of a Markdown code fence (```json ... ```) filling ``text``, else ``text``."""
    m = re.fullmatch(r"\s*```[A-Za-z]*\s*\n(.*?)\n?\s*```\s*", text, re.S)
    return m.group(1) if m else text


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _args_end(body: str) -> int:
    """Where a call's arguments end in ``body`` (the text before ``</tool_call>``): before
    the call object's closing brace and the whitespace around it."""
    s = body.rstrip()
    if s.endswith("}"):
        s = s[:-1].rstrip()
    return len(s)


def parse_tool_calls(text: str, names=()) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole generated text: :class:`ToolCallParser` in one go
    (``names``: the tools' function names, for a bare call object). Content is the text
    outside the calls, stripped."""
    p = ToolCallParser(names=frozenset(names))
    events = p.feed(text) + p.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    return content.strip(), p.calls
