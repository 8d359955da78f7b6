"""The Jinja sandbox chat templates run in, with bounded render time, value size and output.

A chat template is code from a model file. ``ImmutableSandboxedEnvironment`` already
blocks attribute escapes and mutation of lists and dicts; :class:`BoundedSandbox` also
bounds what one render may cost (:class:`RenderLimits`):

* **time**: a deadline (``timeout_s``, default 2 s) checked at every loop iteration,
  call (macros, ``loop()``, methods), filter, operator, attribute lookup and output, so
  nested loops and recursive or exponential macros stop within a step of it;
* **size**: no value a template makes (an operator's, call's or filter's result, an
  output expression) may exceed ``max_chars`` characters, nor may the rendered text.
  Steps that could build a larger value at once are refused *before* they run, from
  their operands: ``*``, ``**``, ``+``, ``%`` and ``~``; ``str.format``; the width and
  count arguments of ``center``/``ljust``/``rjust``/``zfill``/``expandtabs``/``indent``/
  ``wordwrap``/``batch``/``slice``/``tojson``/``lipsum``; ``replace``, ``join``, ``sum``;
  integers beyond :data:`MAX_INT_BITS` bits. Everything written, inside macros and
  ``{% set %}`` blocks included, is limited to :data:`WRITE_FACTOR` × ``max_chars``;
* **nesting**: calls nest at most ``max_depth`` deep.

A breach raises :class:`ChatTemplateTimeoutError`, :class:`ChatTemplateTooLargeError`
(also a :class:`~edgeinfer.errors.ContextOverflowError`: a render larger than the limit
cannot fit the context) or, for nesting, :class:`ChatTemplateError`. Templates render
only through :func:`bounded_render`; the hooks refuse to run outside one (so Jinja's
compile-time constant folding never runs a filter).

The hooks are Jinja's sandbox extension points (``call``, ``call_binop`` with
``intercepted_binops``, ``getattr``/``getitem``, ``wrap_str_format``, ``finalize``) and a
``code_generator_class`` that routes ``for`` iterables, ``~`` and constant template text
through the budget (it overrides ``CodeGenerator._output_const_repr``, a private method
of Jinja 3.1's compiler; ``tests/test_template_limits.py`` fails if that changes).
"""
from __future__ import annotations

import contextvars
import functools
import re
import string
import time
import types
from collections.abc import ItemsView, KeysView, Mapping, ValuesView
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg, generate_lorem_ipsum

from edgeinfer.errors import ContextOverflowError, EdgeInferError

__all__ = ["BoundedSandbox", "ChatTemplateError", "ChatTemplateTimeoutError",
           "ChatTemplateTooLargeError", "RenderLimits", "bounded_render"]

#: Render time limit, seconds.
DEFAULT_TIMEOUT_S = 2.0
#: Size limit (characters) of a render and of any value in it, when the caller gives none
#: (``edgeinfer.api.Model`` gives :data:`CHARS_PER_CONTEXT_TOKEN` × its context).
DEFAULT_MAX_CHARS = 1 << 22
#: Characters of rendered text allowed per context token (a render longer than this many
#: characters per token of the context could not fit it).
CHARS_PER_CONTEXT_TOKEN = 8
#: Calls (macros, ``loop()``) nested deeper than this are refused.
DEFAULT_MAX_DEPTH = 64
#: Everything written during a render (macro bodies, ``{% set %}`` blocks and the output)
#: is limited to this many times ``max_chars``.
WRITE_FACTOR = 8
#: Integers in template arithmetic are limited to this many bits.
MAX_INT_BITS = 1 << 16
_LOOP_FILTER = "_edgeinfer_bounded_loop"


class ChatTemplateError(EdgeInferError, jinja2.TemplateError, ValueError):
    """A chat template failed to compile or render, or called ``raise_exception``.

    For ``raise_exception(msg)`` the message is exactly the template's ``msg`` (e.g.
    "Conversation roles must alternate user/assistant/user/assistant/..."). It is a
    ``jinja2.TemplateError`` (what HF raises) and a ``ValueError`` (what edgeinfer's
    tokenizer documents), so callers may catch either.
    """


class ChatTemplateTimeoutError(ChatTemplateError):
    """The render ran past ``RenderLimits.timeout_s``."""


class ChatTemplateTooLargeError(ChatTemplateError, ContextOverflowError):
    """The render (or a value built in it) would exceed ``RenderLimits.max_chars``."""


@dataclass(frozen=True)
class RenderLimits:
    """Bounds of one render.

    Attributes:
        max_chars: most characters in the rendered text and in any value built during
            the render (default :data:`DEFAULT_MAX_CHARS`).
        timeout_s: seconds the render may take (default :data:`DEFAULT_TIMEOUT_S`).
        max_depth: most nested calls (default :data:`DEFAULT_MAX_DEPTH`).
    """

    max_chars: int = DEFAULT_MAX_CHARS
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_depth: int = DEFAULT_MAX_DEPTH

    @classmethod
    def for_context(cls, n_ctx: int, **kw: Any) -> RenderLimits:
        """Limits for a model whose context holds ``n_ctx`` tokens:
        ``max_chars = CHARS_PER_CONTEXT_TOKEN * n_ctx``."""
        return cls(max_chars=CHARS_PER_CONTEXT_TOKEN * max(int(n_ctx), 1), **kw)


class _Budget:
    """What one render has left; lives in :data:`_BUDGET` while the render runs."""

    __slots__ = ("limits", "deadline", "written", "ticks", "depth")

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.written = 0
        self.ticks = 0
        self.depth = 0

    def tick(self) -> None:
        self.ticks += 1
        if not self.ticks & 15 and time.monotonic() > self.deadline:
            raise ChatTemplateTimeoutError(
                f"chat template ran past its {self.limits.timeout_s:g} s limit (a loop or "
                f"recursion that does not end?)")

    def check(self, n: int, what: str) -> None:
        if n > self.limits.max_chars:
            raise ChatTemplateTooLargeError(
                f"chat template: {what} would exceed {self.limits.max_chars} characters "
                f"(the size limit for this context)")

    def check_int(self, v: Any, what: str) -> None:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > self.limits.max_chars:
            raise ChatTemplateTooLargeError(
                f"chat template: {what} got the integer {v}, more than the size limit "
                f"{self.limits.max_chars} for this context")

    def check_bits(self, bits: int, what: str) -> None:
        if bits > MAX_INT_BITS:
            raise ChatTemplateTooLargeError(
                f"chat template: {what} would be an integer of about {bits} bits "
                f"(at most {MAX_INT_BITS})")

    def value(self, v: Any, what: str) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            self.check_bits(v.bit_length(), what)
        self.check(_size(v, self.limits.max_chars), what)
        return v

    def write(self, n: int) -> None:
        self.written += n
        if self.written > WRITE_FACTOR * self.limits.max_chars:
            raise ChatTemplateTooLargeError(
                f"chat template: what it writes (macros and set blocks included) would "
                f"exceed {WRITE_FACTOR} x {self.limits.max_chars} characters")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "edgeinfer_template_budget", default=None)


class _OutsideRender(Exception):
    """A hook ran outside :func:`bounded_render` (e.g. Jinja's compile-time folding)."""


def _budget() -> _Budget:
    b = _BUDGET.get()
    if b is None:
        raise _OutsideRender("chat templates render only through bounded_render()")
    return b


def _size(v: Any, limit: int) -> int:
    """Characters ``str(v)``/``tojson(v)`` may take, roughly (containers: the sum of their
    items, each counted as often as it appears); stops counting past ``limit``."""
    total, stack = 0, [v]
    while stack and total <= limit:
        x = stack.pop()
        if isinstance(x, (str, bytes)):
            total += len(x) + 2
        elif isinstance(x, bool) or x is None or isinstance(x, float):
            total += 6
        elif isinstance(x, int):
            total += x.bit_length() // 3 + 2
        elif isinstance(x, Mapping):
            total += 2
            for k, val in x.items():
                stack.append(k)
                stack.append(val)
        elif isinstance(x, (list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)):
            total += 2
            stack.extend(x)
        elif isinstance(x, Namespace):
            stack.append(object.__getattribute__(x, "_Namespace__attrs"))
        else:
            total += 16
    return total


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")
_NUMBER = re.compile(r"\d+")


def _values(args: Any) -> list[Any]:
    if isinstance(args, Mapping):
        return list(args.values())
    return list(args) if isinstance(args, tuple) else [args]


def _percent_size(b: _Budget, fmt: str, args: Any) -> int:
    """Characters of ``fmt % args`` at most; refuses ``*`` widths and huge widths."""
    vals = _values(args)
    biggest = max((_size(v, b.limits.max_chars) for v in vals), default=0)
    n = len(fmt)
    for m in _PERCENT_SPEC.finditer(fmt):
        width, prec = m.group(1), m.group(2)
        if "*" in (width, prec):
            raise ChatTemplateError("chat template uses a '*' width in %-formatting, which "
                                    "is not supported")
        for num in (width, prec):
            if num:
                b.check(int(num), "a %-format field")
                n += int(num)
        n += biggest
    return n


def _format_size(b: _Budget, fmt: str, vals: list[Any]) -> int:
    """Characters of ``fmt.format(*vals)`` at most (each field: its widths + the largest
    argument)."""
    for v in vals:
        b.check_int(v, "a str.format argument")
    biggest = max((_size(v, b.limits.max_chars) for v in vals), default=0)
    n = len(fmt)
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is None:
            continue
        nums = [int(x) for x in _NUMBER.findall(spec or "")]
        for num in nums:
            b.check(num, "a str.format field")
        n += sum(nums) + biggest
    return n


def _replace_size(s: str, old: str, new: str, count: Any) -> int:
    hits = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _json_size(b: _Budget, x: Any, indent: Any) -> int:
    """Characters of ``json.dumps(x, indent=indent)`` at most."""
    ind = indent if isinstance(indent, int) and not isinstance(indent, bool) else \
        len(indent) if isinstance(indent, str) else 0
    b.check_int(ind, "tojson")
    items, depth, stack = 0, 0, [(x, 1)]
    while stack and items <= b.limits.max_chars:
        v, d = stack.pop()
        if isinstance(v, Mapping):
            items += len(v)
            depth = max(depth, d)
            stack.extend((w, d + 1) for w in v.values())
        elif isinstance(v, (list, tuple)):
            items += len(v)
            depth = max(depth, d)
            stack.extend((w, d + 1) for w in v)
    return _size(x, b.limits.max_chars) + items * (1 + depth * ind)


# ---- filters -------------------------------------------------------------------------
def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _check_filter(b: _Budget, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Refuse a filter call whose result would be too large; ``args`` start at the value.
    Returns the arguments to call it with (iterables that must be measured are listed)."""
    cap = b.limits.max_chars
    for v in list(args[1:]) + list(kwargs.values()):
        b.check_int(v, f"the {name} filter")
    value = args[0] if args else None
    if name == "replace":
        s, old, new = (str(x) for x in (value, _arg(args, kwargs, 1, "old", ""),
                                        _arg(args, kwargs, 2, "new", "")))
        b.check(_replace_size(s, old, new, _arg(args, kwargs, 3, "count")), "a replace result")
    elif name in ("join", "sum"):
        items = list(value)
        extra = _arg(args, kwargs, 1, "d", "") if name == "join" else _arg(args, kwargs, 2, "start", 0)
        b.check(sum(_size(v, cap) for v in items) + _size(extra, cap) * max(len(items), 1),
                f"a {name} result")
        args = (items, *args[1:])
    elif name == "indent":
        width = _arg(args, kwargs, 1, "width", 4)
        w = len(width) if isinstance(width, str) else int(width) if isinstance(width, int) else 0
        s = str(value)
        b.check(len(s) + (s.count("\n") + 1) * w, "an indent result")
    elif name == "wordwrap":
        s = str(value)
        width = _arg(args, kwargs, 1, "width", 79)
        wrap = _arg(args, kwargs, 3, "wrapstring", "\n") or "\n"
        lines = len(s) // max(int(width), 1) + s.count("\n") + 1 if isinstance(width, int) else 1
        b.check(len(s) + lines * len(str(wrap)), "a wordwrap result")
    elif name in ("batch", "slice"):
        count = _arg(args, kwargs, 1, "linecount" if name == "batch" else "slices", 1)
        fill = _arg(args, kwargs, 2, "fill_with")
        if isinstance(count, int):
            b.check(_size(value, cap) + count * (_size(fill, cap) + 2), f"a {name} result")
    elif name == "format":
        b.check(_percent_size(b, str(value), kwargs or tuple(args[1:])), "a format result")
    elif name == "tojson":
        b.check(_json_size(b, value, _arg(args, kwargs, 2, "indent")), "a tojson result")
    elif name == "pprint":
        b.check(2 * _json_size(b, value, 1), "a pprint result")
    elif name == "urlize":
        for key, i in (("target", 3), ("rel", 4)):
            b.check(len(str(_arg(args, kwargs, i, key, "") or "")) * max(len(str(value)), 1),
                    "an urlize result")
    return args, kwargs


def _bounded_filter(name: str, f: Any) -> Any:
    """``f`` with the budget's checks around it (Jinja's pass_* marker is kept)."""
    lead = 1 if _PassArg.from_obj(f) is not None else 0

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.tick()
        checked, kwargs = _check_filter(b, name, args[lead:], kwargs)
        return b.value(f(*args[:lead], *checked, **kwargs), f"the {name} filter's result")

    return bounded


def _bounded_loop(iterable: Any) -> Any:
    """Every ``for`` loop iterates through this: one budget tick per iteration."""
    b = _budget()
    for item in iterable:
        b.tick()
        yield item


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    b = _budget()
    for v in (n, min, max):
        b.check_int(v, "lipsum")
    b.check(int(n) * int(max) * 12, "a lipsum text")
    return generate_lorem_ipsum(n=n, html=html, min=min, max=max)


# ---- methods -------------------------------------------------------------------------
def _check_method(b: _Budget, obj: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Refuse a builtin method call (``'x'.ljust(n)``, ``','.join(xs)``) whose result would
    be too large; returns the arguments to call it with."""
    for v in list(args) + list(kwargs.values()):
        b.check_int(v, f"{obj.__name__}()")
    owner, name, cap = getattr(obj, "__self__", None), obj.__name__, b.limits.max_chars
    if not isinstance(owner, (str, bytes)):
        return args, kwargs
    if name == "join" and args:
        items = list(args[0])
        b.check(sum(_size(v, cap) for v in items) + len(owner) * len(items), "a join result")
        args = (items, *args[1:])
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], type(owner)):
        b.check(_replace_size(owner, args[0], args[1], _arg(args, kwargs, 2, "count", -1)),
                "a replace result")
    elif name == "expandtabs":
        tab = _arg(args, kwargs, 0, "tabsize", 8)
        b.check(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") *
                (tab if isinstance(tab, int) else 0), "an expandtabs result")
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
        b.check(len(owner) * longest, "a translate result")
    return args, kwargs


# ---- the environment -----------------------------------------------------------------
def _finalize(value: Any) -> Any:
    """Every ``{{ expression }}`` output passes here before ``str()``."""
    b = _budget()
    b.tick()
    # a string is written as itself (``_size`` adds 2 for the quotes of ``tojson``)
    n = len(value) if isinstance(value, str) else _size(value, b.limits.max_chars)
    b.check(n, "an output value")
    b.write(n)
    return value


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with ``for`` iterables, ``~`` and constant template text
    routed through the budget."""

    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        for loop in list(node.find_all(nodes.For)):
            loop.iter = nodes.Filter(loop.iter, _LOOP_FILTER, [], [], None, None,
                                     lineno=loop.lineno)
        super().visit_Template(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _output_const_repr(self, group: Any) -> str:
        return f"environment.bounded_text({super()._output_const_repr(group)})"


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` whose renders are bounded by a :class:`_Budget`.

    Args:
        filters, globals: added to Jinja's defaults (filters are wrapped like the built-in ones).
        **kw: ``jinja2.Environment`` options (``trim_blocks``, ``extensions``, ...).
    """

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(("+", "-", "*", "/", "//", "%", "**"))

    def __init__(self, *, filters: Mapping[str, Any] | None = None,
                 globals: Mapping[str, Any] | None = None, **kw: Any) -> None:
        super().__init__(finalize=_finalize, **kw)
        self.filters.update(filters or {})
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters[_LOOP_FILTER] = _bounded_loop
        self.globals.update(globals or {})
        self.globals["lipsum"] = _bounded_lipsum

    def bounded_text(self, text: str) -> str:
        """Constant template text being written (see ``_BoundedCodeGenerator``)."""
        b = _budget()
        b.tick()
        b.write(len(text))
        return text

    def bounded_concat(self, parts: tuple) -> str:
        """The ``~`` operator: ``str`` of each part, joined, after checking the total."""
        b = _budget()
        b.tick()
        b.check(sum(_size(p, b.limits.max_chars) for p in parts), "a '~' result")
        return "".join(str(p) for p in parts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        b.tick()
        cap = b.limits.max_chars
        ints = [v for v in (left, right) if isinstance(v, int) and not isinstance(v, bool)]
        for v in ints:
            b.check_bits(v.bit_length(), f"a {operator!r} operand")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes)) and isinstance(n, int):
                    b.check(len(seq) * max(n, 0), "a '*' result")
                elif isinstance(seq, (list, tuple)) and isinstance(n, int):
                    b.check(_size(seq, cap) * max(n, 0), "a '*' result")
            if len(ints) == 2:
                b.check_bits(left.bit_length() + right.bit_length(), "a '*' result")
        elif operator == "**" and len(ints) == 2 and right > 0 and abs(left) > 1:
            b.check_bits(left.bit_length() * right, "a '**' result")
        elif operator == "+" and isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
            b.check(len(left) + len(right), "a '+' result")
        elif operator == "+" and isinstance(left, (list, tuple)):
            b.check(_size(left, cap) + _size(right, cap), "a '+' result")
        elif operator == "%" and isinstance(left, str):
            b.check(_percent_size(b, left, right), "a '%' result")
        return b.value(super().call_binop(context, operator, left, right),
                       f"a {operator!r} result")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Any:
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        template, is_map = value.__self__, value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            b = _budget()
            vals = _values(args[0]) if is_map and args else [*args, *kwargs.values()]
            b.check(_format_size(b, template, vals), "a str.format result")
            return fmt(*args, **kwargs)

        return functools.update_wrapper(bounded, fmt)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.tick()
        if isinstance(obj, types.BuiltinFunctionType):
            args, kwargs = _check_method(b, obj, args, kwargs)
        b.depth += 1
        try:
            if b.depth > b.limits.max_depth:
                raise ChatTemplateError(
                    f"chat template: calls nest deeper than {b.limits.max_depth} levels "
                    f"(a recursive macro?)")
            result = super().call(context, obj, *args, **kwargs)
        finally:
            b.depth -= 1
        return b.value(result, "a call's result")


def bounded_render(template: jinja2.Template, limits: RenderLimits, variables: dict) -> str:
    """Render a template compiled by a :class:`BoundedSandbox` within ``limits``.

    Raises:
        ChatTemplateTimeoutError, ChatTemplateTooLargeError: a limit was reached.
        Whatever else the template raises (the caller wraps it).
    """
    b = _Budget(limits)
    token = _BUDGET.set(b)
    try:
        parts, n = [], 0
        for chunk in template.generate(**variables):
            n += len(chunk)
            b.check(n, "a rendered prompt")
            parts.append(chunk)
        return "".join(parts)
    finally:
        _BUDGET.reset(token)
