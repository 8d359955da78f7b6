"""Which request fields the server takes, refuses or ignores, and the ones that shape the
output: ``response_format`` (constrained JSON) and ``tools`` / ``tool_choice``.

The rule (never ignore a parameter silently):

* a known OpenAI parameter that would change the result and is not supported is a 400
  naming it (:data:`UNSUPPORTED`; a neutral value such as ``n: 1`` or ``logprobs: false``
  passes);
* known OpenAI parameters that do not change the text (``user``, ``metadata``,
  ``store``, ...) are accepted (:data:`NEUTRAL`);
* any other field is a vendor extension: accepted and logged once per field name per
  server (vLLM's habit), since OpenAI clients send extras (``extra_body``).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from .constrained import Grammar
from .errors import GrammarError
from .server_requests import APIError, invalid

log = logging.getLogger("edgeinfer.server")

#: fields both endpoints read (server_requests.parse_common and the routes)
COMMON = frozenset({
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "stop",
    "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
    "top_k", "min_p", "repetition_penalty",  # extensions (llama.cpp / vLLM)
    "n", "logprobs", "top_logprobs", "echo", "best_of",  # refused unless neutral
})
CHAT = COMMON | {"messages", "response_format", "tools", "tool_choice", "parallel_tool_calls"}
COMPLETIONS = COMMON | {"prompt", "response_format", "parse_special"}

#: OpenAI parameters that do not change the generated text
NEUTRAL = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                     "safety_identifier", "stream_options"})

#: OpenAI parameters that would change the result and are not supported, with the value(s)
#: that leave it unchanged (accepted) and the hint of the 400
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "logit_bias": ((None, {}), "token biases are not supported"),
    "functions": ((None, []), "the deprecated 'functions' API is not supported; use 'tools'"),
    "function_call": ((None, "none", "auto"),
                      "the deprecated 'function_call' is not supported; use 'tool_choice'"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "reasoning_effort": ((None,), "this model has no reasoning effort setting"),
    "verbosity": ((None,), "a verbosity setting is not supported"),
    "suffix": ((None, ""), "insertion (a completion 'suffix') is not supported"),
}


class LogOnce:
    """Names already logged (one set per app)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, name: str, route: str) -> None:
        with self.lock:
            if name in self.seen:
                return
            self.seen.add(name)
        log.info("ignoring the request field %r (not an OpenAI parameter this server knows; "
                 "logged once) on %s", name, route)


def check_fields(body: dict, chat: bool, log_once: LogOnce) -> None:
    """Refuse the unsupported result-changing fields of ``body``; log unknown ones once.

    Raises:
        APIError: 400 ``unsupported_parameter`` naming the first offending field.
    """
    known = CHAT if chat else COMPLETIONS
    route = "/v1/chat/completions" if chat else "/v1/completions"
    for name, value in body.items():
        if name in known or name in NEUTRAL:
            continue
        if name in UNSUPPORTED:
            neutral, why = UNSUPPORTED[name]
            if value in neutral:
                continue
            raise APIError(400, f"'{name}' is not supported by this server: {why}",
                           param=name, code="unsupported_parameter")
        if not chat and name in CHAT:
            raise APIError(400, f"'{name}' is a chat parameter; use /v1/chat/completions",
                           param=name, code="unsupported_parameter")
        log_once(name, route)


def get_response_format(body: dict) -> Grammar | None:
    """``response_format``: ``{"type": "text"}`` (None), ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}``.

    Raises:
        APIError: 400 naming the field for anything else, or a schema that does not compile.
    """
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise invalid("response_format", "'response_format' must be an object with a 'type'",
                      "invalid_type")
    kind = rf["type"]
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return Grammar.json_object()
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise invalid("response_format.json_schema",
                              "'response_format.json_schema' must be an object with a "
                              "'name' and a 'schema' object")
            return Grammar.from_json_schema(spec.get("schema") or {})
    except GrammarError as e:
        raise invalid("response_format", f"response_format: {e}") from None
    raise invalid("response_format.type", f"'response_format.type' must be 'text', "
                  f"'json_object' or 'json_schema', got {kind!r}")


@dataclass
class ToolRequest:
    """The validated ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat."""

    tools: list[dict] | None
    choice: str  # "auto", "none", "required" or a function name
    parallel: bool = False  # a forced ("required") reply may hold several calls

    @property
    def names(self) -> frozenset:
        return frozenset(t["function"]["name"] for t in self.tools or ())

    @property
    def active(self) -> bool:
        """Tools are rendered and calls parsed."""
        return bool(self.tools) and self.choice != "none"


def get_tools(body: dict) -> ToolRequest:
    """The chat's tool fields, checked (:func:`edgeinfer.tools.normalize_tools`).

    Raises:
        APIError: 400 naming the offending field.
    """
    from .tools import ToolError, normalize_tool_choice, normalize_tools

    raw = body.get("tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "'parallel_tool_calls' must be a boolean",
                      "invalid_type")
    try:
        tools = None if raw is None or raw == [] else normalize_tools(raw)
        choice = normalize_tool_choice(body.get("tool_choice"), tools)
    except ToolError as e:
        raise invalid(e.param or "tools", str(e)) from None
    return ToolRequest(tools, choice, parallel is True)
