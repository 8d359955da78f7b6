"""Chat templates: render a list of messages to prompt text with a model's Jinja template.

The environment matches what Hugging Face transformers uses for ``apply_chat_template``
(``transformers/utils/chat_template_utils.py``), so that a template taken from a model's
``tokenizer_config.json`` / ``chat_template.jinja`` renders the same text here:

- ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks=True`` and
  ``lstrip_blocks=True`` (templates are untrusted code from the Hub; the sandbox blocks
  attribute escapes and the immutable variant blocks ``list.append`` and friends).
  ``keep_trailing_newline`` is left at Jinja's default (False), as in HF.
- the ``loopcontrols`` extension (``{% break %}`` / ``{% continue %}``) and a
  ``{% generation %}...{% endgeneration %}`` tag that just renders its body (HF uses it
  to track assistant tokens for training masks; inference only needs it to parse).
- globals ``raise_exception(msg)`` and ``strftime_now(fmt)``; filter ``tojson`` with
  ``ensure_ascii=False`` (Jinja's built-in one HTML-escapes ``<>&'``, HF's does not).
- the template sees ``messages``, ``add_generation_prompt``, ``tools`` (None unless
  given), the special-token strings (``bos_token``, ``eos_token``, ...) and any extra
  keyword (e.g. ``date_string``, ``enable_thinking``). Messages are copied to plain JSON
  types and keys whose value is None are dropped (HF does the same: many templates
  render a literal "None" for ``content=None`` but handle a missing key).

The rendered text already contains every control token the model expects (BOS
included, where the template writes ``{{ bos_token }}``); it must be tokenized WITHOUT
adding special tokens again (https://github.com/abetlen/llama-cpp-python/pull/1439,
https://github.com/huggingface/transformers/issues/37686).

Rendering is bounded (:mod:`edgeinfer.template_sandbox`): a deadline (2 s by default),
a size limit on the text and on every value the template builds (``RenderLimits``), and
a limit on nested calls. Every failure, whatever the template raised, becomes a
:class:`ChatTemplateError` with a one-line message.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes

from edgeinfer.template_sandbox import (
    BoundedSandbox,
    ChatTemplateError,
    ChatTemplateTimeoutError,
    ChatTemplateTooLargeError,
    RenderLimits,
    bounded_render,
)

__all__ = ["MAX_TEMPLATE_CHARS", "ChatTemplateError", "ChatTemplateTimeoutError",
           "ChatTemplateTooLargeError", "RenderLimits", "compile_chat_template", "plain_prompt",
           "render_chat_template"]

#: Longest chat template source accepted, characters (real ones are under 20 000).
MAX_TEMPLATE_CHARS = 1 << 20
#: Deepest nesting of lists/dicts accepted in messages and tools.
MAX_MESSAGE_DEPTH = 64


def _one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` of an exception on one line, at most ``limit`` characters."""
    text = " ".join(str(e).split())
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _raise_exception(message: str) -> None:
    """Template global: abort rendering with the template's own message."""
    raise ChatTemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    """Template global: local time formatted with ``fmt`` (Llama-3.x writes today's date)."""
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Template filter ``tojson``, same signature and output as HF's override."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}body{% endgeneration %}`` renders ``body`` unchanged.

    HF's ``AssistantTracker`` records where assistant text lies for training masks; a
    template using the tag must still parse here, and inference needs only the text.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template once; later calls with the same string hit the cache.

    Args:
        template: the Jinja source (``chat_template`` of a tokenizer config), at most
            :data:`MAX_TEMPLATE_CHARS` characters.

    Returns:
        A compiled ``jinja2.Template`` bound to the bounded sandbox described in the module
        docstring; render it with :func:`render_chat_template` (its hooks refuse to run
        outside a bounded render).

    Raises:
        ChatTemplateError: the template has a syntax error (the message names the line),
            is too long, nests too deeply to compile, or is not a string.
    """
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be a string, got {type(template).__name__}")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"chat template is {len(template)} characters long; at most "
                                f"{MAX_TEMPLATE_CHARS} are accepted")
    env = BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        filters={"tojson": _tojson},
        globals={"raise_exception": _raise_exception, "strftime_now": _strftime_now},
    )
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"chat template does not compile (line {e.lineno}): {e.message}") from e
    except Exception as e:  # noqa: BLE001  RecursionError, MemoryError, SyntaxError of deep nesting
        raise ChatTemplateError(f"chat template does not compile: {_one_line(e)}") from e


def _plain(value: Any, depth: int = 0) -> Any:
    """Copy ``value`` to plain JSON-like types (str/int/float/bool/None/dict/list/tuple).

    Objects the sandbox cannot vouch for become the placeholder "<TypeName>", as in HF's
    ``_plain_template_data``; numpy scalars become Python scalars.

    Raises:
        ChatTemplateError: lists/dicts nest deeper than :data:`MAX_MESSAGE_DEPTH`.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if depth > MAX_MESSAGE_DEPTH:
        raise ChatTemplateError(f"chat messages nest lists/objects deeper than "
                                f"{MAX_MESSAGE_DEPTH} levels")
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v, depth + 1) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item(), depth + 1)  # numpy scalar
    return f"<{type(value).__name__}>"


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    render_limits: RenderLimits | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` with a chat template, as HF ``apply_chat_template(tokenize=False)``.

    Args:
        template: Jinja source of the chat template.
        messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...]``.
            Each must be a mapping; keys whose value is None are dropped.
        add_generation_prompt: append the header that opens the assistant's turn.
        bos_token, eos_token: the special-token strings; omitted from the template
            variables when None (so ``{{ bos_token }}`` renders "" rather than "None").
        tools: JSON-schema dicts of callable tools, for templates that support them.
        render_limits: time and size bounds (default ``RenderLimits()``: 2 s,
            ``DEFAULT_MAX_CHARS`` characters).
        **extra: more template variables (``pad_token``, ``date_string``,
            ``enable_thinking``, ...). They override the special tokens if both are given.

    Returns:
        The prompt text, control tokens included.

    Raises:
        ChatTemplateTimeoutError, ChatTemplateTooLargeError: a render limit was reached.
        ChatTemplateError: the template calls ``raise_exception`` (message passed through
            unchanged), fails to compile, or fails while rendering: any exception the
            template raises (a sandbox violation, a TypeError, ZeroDivisionError,
            OverflowError, RecursionError, MemoryError...) becomes one, on one line.
        TypeError: a message is not a mapping.
    """
    plain_messages = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"chat message {i} must be a mapping with 'role' and 'content', "
                            f"got {type(message).__name__}")
        plain_messages.append({k: _plain(v) for k, v in message.items() if v is not None})
    variables: dict[str, Any] = {}
    if bos_token is not None:
        variables["bos_token"] = bos_token
    if eos_token is not None:
        variables["eos_token"] = eos_token
    variables.update({k: _plain(v) for k, v in extra.items()})
    variables.update(messages=plain_messages, add_generation_prompt=bool(add_generation_prompt),
                     tools=_plain(list(tools)) if tools is not None else None)
    compiled = compile_chat_template(template)
    try:
        return bounded_render(compiled, render_limits or RenderLimits(), variables)
    except ChatTemplateError:
        raise
    except RecursionError as e:
        raise ChatTemplateError("chat template failed to render: it recursed too deeply "
                                "(a macro that calls itself without end?)") from e
    except MemoryError as e:
        raise ChatTemplateError("chat template failed to render: out of memory") from e
    except jinja2.TemplateError as e:  # sandbox violations, undefined-attribute errors
        raise ChatTemplateError(f"chat template failed to render: {_one_line(e)}") from e
    except Exception as e:  # noqa: BLE001  whatever else the template's code raised
        raise ChatTemplateError(f"chat template failed to render: {_one_line(e)}") from e


def plain_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """Fallback prompt for models without a chat template (base models).

    The message contents joined by a blank line ("\\n\\n"), in order, without role
    labels: a single user message becomes its text verbatim, which is what a base model
    should continue. List contents (multimodal parts) contribute their "text" parts.
    Encode the result with ``Tokenizer.encode(text, add_special=True)`` so that the model's
    ``add_bos_token`` setting still applies exactly once.

    Raises:
        TypeError: a message is not a mapping, or its content is neither str nor list.
    """
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"chat message {i} must be a mapping, got {type(m).__name__}")
        content = m.get("content")
        if content is None:
            continue
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.append("".join(p.get("text", "") for p in content
                                 if isinstance(p, Mapping) and p.get("type", "text") == "text"))
        else:
            raise TypeError(f"chat message {i} content must be str or list, got {type(content).__name__}")
    return "\n\n".join(parts)
