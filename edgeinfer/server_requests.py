"""Request side of the OpenAI-compatible server: error bodies, validation, auth.

Every rejection is an :class:`APIError` rendered as an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}`` (no pydantic: requests are small and
checked by hand so each message names the offending field). :func:`parse_common` turns
the fields both endpoints share into a :class:`GenRequest`, filling omitted sampling
fields from the served model's defaults (:func:`edgeinfer.sampling.sampling_defaults`).

Hostile bodies: :func:`parse_json` is the one parse (strict UTF-8, nesting and number
length bounded before ``json`` sees the text, no NaN/Infinity, no duplicate keys); the
getters are the one schema check (types, ranges: integers fit in 64 bits, text is valid
Unicode). Every refusal is a 400 naming the field; nothing reaches the engine unchecked.
"""
from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass

import numpy as np

from starlette.requests import Request
from starlette.responses import JSONResponse

from .sampling import SamplingParams, sampling_defaults

MAX_STOP_STRINGS = 16
MAX_JSON_DEPTH = 64
MAX_NUMBER_DIGITS = 100
INT64_MAX = 2**63 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# ---- errors ----------------------------------------------------------------------------
class APIError(Exception):
    """A request the server refuses, rendered as an OpenAI-style error body.

    Args:
        status: HTTP status code (4xx, or 5xx for server faults).
        message: what is wrong and how to fix it.
        type: OpenAI error type ("invalid_request_error", "authentication_error", ...).
        param: the offending request field, if any.
        code: a machine-readable code ("model_not_found", "invalid_api_key", ...).
        headers: extra response headers (e.g. ``Retry-After`` on a 503).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.headers = dict(headers or {})
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        headers.update(self.headers)
        return JSONResponse({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status, headers=headers)


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- request validation -------------------------------------------------------------------
def get_number(body: dict, name: str, default: float, lo: float, hi: float,
                lo_open: bool = False) -> float:
    """``body[name]`` as a float in [lo, hi] (or (lo, hi] with ``lo_open``); null = default."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(name, f"'{name}' must be a number, got {type(v).__name__}", "invalid_type")
    if not (lo < v <= hi if lo_open else lo <= v <= hi):
        rng = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise invalid(name, f"'{name}' must be in {rng}, got {v!r}")
    return float(v)


def get_int(body: dict, name: str, default: int | None, lo: int | None = None,
            hi: int = INT64_MAX, param: str | None = None) -> int | None:
    """``body[name]`` as an int in [lo, hi]; null or absent = default. Floats are refused."""
    param = param or name
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(param, f"'{param}' must be an integer, got {type(v).__name__}", "invalid_type")
    if lo is not None and v < lo:
        raise invalid(param, f"'{param}' must be >= {lo}, got {v}")
    if v > hi:
        raise invalid(param, f"'{param}' must be <= {hi}, got a {len(str(v))}-digit number")
    return v


def get_bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    param = param or name
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(param, f"'{param}' must be a boolean, got {type(v).__name__}", "invalid_type")
    return v


def check_text(text: str, param: str) -> str:
    """``text`` itself, refused when it holds an unpaired UTF-16 surrogate (a JSON
    ``\\ud800`` escape alone): not Unicode text, which no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(param, f"{param} holds an unpaired UTF-16 surrogate "
                      f"(\\u{ord(text[e.start]):04x} at character {e.start}); send valid "
                      f"Unicode text") from None
    return text


def get_stop(body: dict) -> list[str]:
    """``stop``: null, a string, or a list of up to 16 strings (empty strings ignored)."""
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid("stop", "'stop' must be a string or a list of strings", "invalid_type")
    if len(v) > MAX_STOP_STRINGS:
        raise invalid("stop", f"'stop' holds at most {MAX_STOP_STRINGS} strings, got {len(v)}")
    return [check_text(s, "stop") for s in v if s]


def get_messages(body: dict) -> list[dict]:
    """``messages`` as ``[{"role", "content": str}]``; text parts of list contents joined."""
    msgs = body.get("messages")
    if msgs is None:
        raise APIError(400, "'messages' is required: a list of {role, content} objects",
                       param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", "'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(p, f"{p} must be an object with 'role' and 'content'", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"{p}.role", f"{p}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise invalid(f"{p}.content[{j}]", f"{p}.content[{j}]: only text parts "
                                   "({'type': 'text', 'text': ...}) are supported")
                texts.append(check_text(part["text"], f"{p}.content[{j}].text"))
            content = "".join(texts)
        elif not isinstance(content, str):
            raise invalid(f"{p}.content", f"{p}.content must be a string or a list of text parts",
                           "invalid_type")
        else:
            check_text(content, f"{p}.content")
        # OpenAI's "developer" role is the system prompt of newer models; templates know "system"
        msg = {"role": "system" if role == "developer" else role, "content": content}
        msg.update(_tool_fields(m, role, p))
        out.append(msg)
    return out


def _tool_fields(m: dict, role: str, p: str) -> dict:
    """An assistant's ``tool_calls`` and a tool result's ``tool_call_id`` / ``name``,
    checked, for the chat template to render."""
    out = {}
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise invalid(f"{p}.tool_calls", f"{p}.tool_calls must be a list", "invalid_type")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments", ""), (str, dict)):
                raise invalid(f"{p}.tool_calls[{j}]", f"{p}.tool_calls[{j}] must be "
                              "{'id', 'type': 'function', 'function': {'name', 'arguments'}}")
        out["tool_calls"] = calls
    if role == "tool":
        for key in ("tool_call_id", "name"):
            v = m.get(key)
            if v is not None and not isinstance(v, str):
                raise invalid(f"{p}.{key}", f"{p}.{key} must be a string", "invalid_type")
            if v is not None:
                out[key] = v
    return out


def get_prompt(body: dict) -> str | list[int]:
    """``prompt`` of /v1/completions: a string or token ids (one prompt only)."""
    v = body.get("prompt")
    if v is None:
        raise APIError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        return check_text(v, "prompt")
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return v  # the ids are checked against the vocabulary by the server
    raise invalid("prompt", "'prompt' must be a string or a list of token ids "
                   "(batches of several prompts are not supported)")


@dataclass
class GenRequest:
    """A validated generation request (either endpoint).

    ``parse_special`` (request field, default true; /v1/completions only): special-token
    strings in a string ``prompt`` become control tokens, as llama.cpp's server does;
    false encodes them as plain text. Chat messages are always text.
    """

    stream: bool
    max_tokens: int | None
    stop: list[str]
    sampling: dict
    include_usage: bool = False
    grammar: object = None  # an edgeinfer.constrained.Grammar the output must match
    tools: object = None  # an active edgeinfer.server_fields.ToolRequest (chat only)
    dropped_turns: int = 0  # oldest chat turns dropped to fit the context
    chat: bool = False  # a chat reply (no SentencePiece leading space restored)
    parse_special: bool = True


def parse_common(body: dict, model_name: str, defaults: dict | None = None) -> GenRequest:
    """The parameters both endpoints share.

    Args:
        body: the JSON request.
        model_name: the served model id (``model`` may be omitted or must equal it).
        defaults: values for omitted ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
            ``repetition_penalty`` (the model's generation config, as llama.cpp's server
            and ollama do); missing keys fall back to :data:`edgeinfer.sampling.DEFAULTS`.

    Raises:
        APIError: 404 for a model other than the served one, 400 for anything malformed.
    """
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise invalid("model", "'model' must be a string", "invalid_type")
        if model != model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{model_name}'", param="model", code="model_not_found")
    n = get_int(body, "n", 1, lo=1)
    if n != 1:
        raise invalid("n", "only n=1 is supported (one model, one KV cache)")
    for name, off in (("logprobs", (None, False)), ("top_logprobs", (None, 0)),
                      ("echo", (None, False)), ("best_of", (None, 1))):
        if body.get(name) not in off:
            raise APIError(400, f"'{name}' is not supported by this server", param=name,
                           code="unsupported_parameter")
    max_tokens = get_int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, lo=1)
    stream = get_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("stream_options", "'stream_options' must be an object", "invalid_type")
    include_usage = bool(opts and get_bool(opts, "include_usage", False,
                                            param="stream_options.include_usage") and stream)
    d = {**sampling_defaults(None), **(defaults or {})}
    sampling = dict(
        temperature=get_number(body, "temperature", d["temperature"], 0.0, 2.0),
        top_p=get_number(body, "top_p", d["top_p"], 0.0, 1.0, lo_open=True),
        # extensions (llama.cpp / vLLM servers); OpenAI itself applies neither filter
        top_k=get_int(body, "top_k", d["top_k"], lo=0),
        min_p=get_number(body, "min_p", d["min_p"], 0.0, 1.0),
        repetition_penalty=get_number(body, "repetition_penalty", d["repetition_penalty"],
                                      0.0, 10.0, lo_open=True),
        presence_penalty=get_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=get_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        seed=get_int(body, "seed", None, lo=0, hi=2**64 - 1),
    )
    try:  # the sampler's own checks, so that nothing fails later on the worker thread
        SamplingParams(**sampling)
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_value") from None
    # the other fields: edgeinfer.server_fields.check_fields
    return GenRequest(stream=stream, max_tokens=max_tokens, stop=get_stop(body),
                      sampling=sampling, include_usage=include_usage,
                      parse_special=get_bool(body, "parse_special", True))


def check_auth(request: Request, api_key: str | None) -> None:
    """Raises APIError 401 unless ``Authorization: Bearer <api_key>`` is present (when set)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "No API key provided: send 'Authorization: Bearer <key>' (the key "
                       "given to edgeinfer serve --api-key)", type="authentication_error",
                       code="invalid_api_key")
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "Incorrect API key provided", type="authentication_error",
                       code="invalid_api_key")


# ---- the body ------------------------------------------------------------------------------
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_LONG_NUMBER = re.compile(rb"\d{%d,}" % (MAX_NUMBER_DIGITS + 1))
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _json_depth(skeleton: bytes) -> int:
    """Deepest bracket nesting of JSON text whose strings were removed (O(n), no recursion)."""
    brackets = np.frombuffer(skeleton.translate(None, _NOT_BRACKETS), np.uint8)
    if not brackets.size:
        return 0
    step = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(step).max())


class _Refused(ValueError):
    pass


def _no_constant(name: str):
    raise _Refused(f"{name} is not valid JSON (numbers must be finite)")


def _no_duplicates(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Refused(f"the key {dup!r} appears twice in one object")
    return obj


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """A request body (bytes) as a JSON object, in time and memory linear in its size.

    Refused (APIError 400, code ``invalid_json``): bytes that are not UTF-8, nesting deeper
    than ``max_depth``, a number of more than :data:`MAX_NUMBER_DIGITS` digits, ``NaN`` /
    ``Infinity`` literals, a key twice in one object, invalid JSON, a non-object.
    """
    def refuse(why: str) -> APIError:
        return APIError(400, f"The request body {why}", code="invalid_json")

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise refuse(f"is not valid UTF-8 (byte {e.start}); send JSON encoded as UTF-8") from None
    skeleton = _JSON_STRING.sub(b'""', raw)  # strings out: their brackets and digits are text
    depth = _json_depth(skeleton)
    if depth > max_depth:
        raise refuse(f"nests {depth} levels deep; at most {max_depth} are accepted")
    if _LONG_NUMBER.search(skeleton):
        raise refuse(f"holds a number of more than {MAX_NUMBER_DIGITS} digits")
    try:
        body = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except _Refused as e:
        raise refuse(f"is refused: {e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise refuse(f"is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise refuse(f"must be a JSON object, got {type(body).__name__ if body is not None else 'null'}")
    return body


async def read_json(request: Request, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """The request's JSON object (the body's size and arrival time are bounded upstream,
    :class:`edgeinfer.server_limits.BodyLimit`); see :func:`parse_json`."""
    return parse_json(await request.body(), max_depth)
