"""Hostile chat templates: bounded render time and size, one-line errors for whatever they raise."""
from __future__ import annotations

import time

import jinja2
import pytest

from edgeinfer.chat_template import (
    ChatTemplateError,
    ChatTemplateTimeoutError,
    ChatTemplateTooLargeError,
    RenderLimits,
    compile_chat_template,
    render_chat_template,
)
from edgeinfer.conversation import fit_messages
from edgeinfer.errors import ContextOverflowError
from edgeinfer.template_sandbox import CHARS_PER_CONTEXT_TOKEN, MAX_INT_BITS, WRITE_FACTOR
from edgeinfer.tokenizer import Tokenizer

from test_chat_template import CHATML_TEMPLATE, chatml_tokenizer_json

SMALL = RenderLimits(max_chars=10_000, timeout_s=0.5)


def render(template: str, limits: RenderLimits = SMALL, messages=()) -> str:
    return render_chat_template(template, list(messages), render_limits=limits)


def too_large(template: str, match: str, limits: RenderLimits = SMALL) -> ChatTemplateTooLargeError:
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateTooLargeError, match=match) as e:
        render(template, limits)
    assert time.perf_counter() - t0 < limits.timeout_s  # refused before the work, not timed out
    assert isinstance(e.value, ContextOverflowError) and "\n" not in str(e.value)
    return e.value


# ---------------------------------------------------------------- time
@pytest.mark.parametrize("name, template", [
    # 10^10 iterations of an empty body: no call, no output, only the loop itself
    ("nested loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
    # 2^40 calls, each writing nothing
    ("exponential macro", "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                          "{% endmacro %}{{ f(40) }}"),
    # a recursive loop over a 40-deep binary tree made of one shared list
    ("recursive loop", "{% set ns = namespace(t=[]) %}{% for i in range(40) %}{% set ns.t = [ns.t, ns.t] %}"
                       "{% endfor %}{% for x in [ns.t] recursive %}{{ loop(x) }}{% endfor %}"),
])
def test_endless_work_stops_at_the_deadline(name, template):
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateTimeoutError, match=r"ran past its 0\.5 s limit"):
        render(template)
    elapsed = time.perf_counter() - t0
    assert 0.5 <= elapsed < 0.5 + 2.0, (name, elapsed)  # a step past the deadline, not 25 s


def test_recursion_is_cut_at_the_nesting_limit():
    with pytest.raises(ChatTemplateError, match="calls nest deeper than 64 levels") as e:
        render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    assert not isinstance(e.value, ChatTemplateTooLargeError)  # not a context overflow
    # 60 levels are fine
    assert render("{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{% else %}{{ n }}{% endif %}"
                  "{% endmacro %}{{ f(0) }}") == "60"


# ---------------------------------------------------------------- size
def test_output_limit_is_exact():
    assert len(render("{% for i in range(1000) %}0123456789{% endfor %}")) == 10_000
    too_large("{% for i in range(1001) %}0123456789{% endfor %}", "a rendered prompt would exceed 10000")


@pytest.mark.parametrize("template, what", [
    ("{{ 'a' * 1000000000 }}", "a '\\*' result"),                     # 1 GB at once
    ("{{ ['a'] * 100000 }}", "a '\\*' result"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "a '~' result"),                                                 # doubling: 2^64 characters
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "a '\\+' result"),
    ("{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "a '\\+' result"),
    ("{% set d = {'a': 'x' * 9000} %}{{ [d, d] }}", "an output value"),  # str() of a container
    ("{{ 'x'|center(1000000000) }}", "center filter got the integer 1000000000"),
    ("{{ 'x'.ljust(1000000000) }}", "ljust\\(\\) got the integer"),
    ("{{ (1).to_bytes(1000000000, 'big') }}", "to_bytes\\(\\) got the integer"),
    ("{{ '{:>1000000000}'.format(1) }}", "a str.format field"),
    ("{{ '%1000000000d' % 1 }}", "a %-format field"),
    ("{{ '%1000000000d'|format(1) }}", "a %-format field"),
    ("{% set s = 'a' * 5000 %}{{ s|replace('a', s) }}", "a replace result"),  # 25 M from 10 k
    ("{% set s = 'a' * 5000 %}{{ s.replace('a', s) }}", "a replace result"),
    ("{% set s = 'a' * 5000 %}{{ [s, s, s]|join }}", "a join result"),
    ("{% set s = 'a' * 5000 %}{{ ' '.join([s, s, s]) }}", "a join result"),
    ("{{ ('\n' * 5000)|indent(100) }}", "an indent result"),
    ("{{ ('a' * 5000)|wordwrap(1, wrapstring='x' * 100) }}", "a wordwrap result"),
    ("{{ ('\t' * 5000).expandtabs(100) }}", "an expandtabs result"),
    ("{{ [1]|batch(9000, 'xxxxx')|list }}", "a batch result"),
    ("{{ ([[1, [2]]] * 1000)|tojson(indent=50) }}", "a tojson result"),
    ("{{ lipsum(1000) }}", "a lipsum text"),
])
def test_a_step_that_would_build_too_much_is_refused_before_it_runs(template, what):
    too_large(template, what)


def test_big_integers_are_refused():
    roomy = RenderLimits(max_chars=1_000_000, timeout_s=0.5)
    with pytest.raises(ChatTemplateTooLargeError, match=f"at most {MAX_INT_BITS}"):
        render("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
               "{% endfor %}", roomy)
    with pytest.raises(ChatTemplateTooLargeError, match=f"at most {MAX_INT_BITS}"):
        render("{{ (10 ** 100) ** 100000 }}", roomy)
    assert render("{{ 2 ** 64 }}") == "18446744073709551616"


def test_writing_inside_macros_and_set_blocks_is_counted():
    # 10^10 characters of constant text appended to a macro's buffer, never output: the
    # write budget stops it (this also checks the code generator hook on constant text)
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateTooLargeError, match=f"exceed {WRITE_FACTOR} x 10000"):
        render("{% macro f() %}{% for i in range(100000) %}{% for j in range(100000) %}"
               "0123456789{% endfor %}{% endfor %}{% endmacro %}{% set x = f() %}")
    assert time.perf_counter() - t0 < 0.5
    with pytest.raises(ChatTemplateTooLargeError, match="exceed"):
        render("{% set x %}{% for i in range(100000) %}{{ 'y' * 5000 }}{% endfor %}{% endset %}")
    with pytest.raises(ChatTemplateTooLargeError):
        render("{% filter upper %}{% for i in range(100000) %}abcdefghij{% endfor %}{% endfilter %}")


def test_message_content_larger_than_the_limit_is_refused():
    msgs = [{"role": "user", "content": "x" * 20_000}]
    with pytest.raises(ChatTemplateTooLargeError, match="an output value"):
        render("{% for m in messages %}{{ m.content }}{% endfor %}", messages=msgs)


def test_the_default_limits_stop_a_500_mb_render():
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateTooLargeError, match="a rendered prompt would exceed 4194304"):
        render_chat_template("{% for i in range(100000) %}{{ 'x' * 5000 }}{% endfor %}", [])
    assert time.perf_counter() - t0 < 2.0


def test_limits_for_a_context():
    assert RenderLimits.for_context(4096).max_chars == CHARS_PER_CONTEXT_TOKEN * 4096 == 32768
    assert RenderLimits.for_context(4096).timeout_s == 2.0


def test_real_templates_render_unchanged_within_the_limits():
    msgs = [{"role": "user", "content": "hello"}]
    limits = RenderLimits.for_context(64)  # 512 characters
    assert render_chat_template(CHATML_TEMPLATE, msgs, render_limits=limits) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")


def test_a_conversation_too_large_to_render_drops_old_turns():
    """A long chat outgrows the render limit long before the template is slow: the oldest
    turns are dropped (fit_messages counts a too-large render as not fitting)."""
    tok = Tokenizer.from_json_text(chatml_tokenizer_json(), eos_token="<|im_end|>",
                                   chat_template=CHATML_TEMPLATE)
    n_ctx = 400
    limits = RenderLimits.for_context(n_ctx)  # 3200 characters
    msgs = []
    for i in range(40):
        msgs += [{"role": "user", "content": f"hello world {i}"},
                 {"role": "assistant", "content": "a" * 100}]
    msgs.append({"role": "user", "content": "What is 2+2?"})

    def ids(m):
        return tok.apply_chat_template(m, render_limits=limits)

    with pytest.raises(ChatTemplateTooLargeError):
        ids(msgs)
    kept, dropped = fit_messages(msgs, ids, n_ctx, reserve=50)
    assert dropped > 0 and kept[-1] == msgs[-1] and len(ids(kept)) <= n_ctx - 50
    with pytest.raises(ContextOverflowError, match="renders to more than 400 tokens"):
        fit_messages([{"role": "user", "content": "z" * 5000}], ids, n_ctx, reserve=50)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("template, kind", [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ 2.0 ** 100000 }}", "OverflowError"),
    ("{{ 1 + 'a' }}", "TypeError"),
    ("{{ messages[5].content }}", "UndefinedError"),
    ("{{ none.x.y }}", "UndefinedError"),
    ("{{ 'abc'.index('z') }}", "ValueError"),
    ("{{ ''.join(1) }}", "TypeError"),
    ("{{ messages.__class__.__mro__ }}", "SecurityError"),
    ("{% include 'x' %}", "TypeError|TemplateNotFound"),
])
def test_any_exception_becomes_a_one_line_template_error(template, kind):
    with pytest.raises(ChatTemplateError) as e:
        render(template)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("chat template failed to render:"), msg
    assert any(k in msg for k in kind.split("|")), msg


def test_templates_that_cannot_compile_are_template_errors():
    with pytest.raises(ChatTemplateError, match=r"does not compile: RecursionError"):
        compile_chat_template("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")
    with pytest.raises(ChatTemplateError, match=r"does not compile \(line 1\)"):
        compile_chat_template("{% for %}")
    with pytest.raises(ChatTemplateError, match="at most 1048576"):
        compile_chat_template("x" * (1 << 20 + 1))


def test_deeply_nested_messages_are_refused():
    deep: list = []
    for _ in range(1000):
        deep = [deep]
    with pytest.raises(ChatTemplateError, match="deeper than 64 levels"):
        render("{{ messages }}", messages=[{"role": "user", "content": deep}])


def test_templates_render_only_through_the_bounded_renderer():
    with pytest.raises(Exception, match="bounded_render"):
        compile_chat_template("{{ 'a' ~ 'b' }}").render()
    assert isinstance(compile_chat_template("{{ 1 }}"), jinja2.Template)
