"""Constrained decoding: a grammar decides which tokens a sequence may take next.

Built on llguidance (https://github.com/guidance-ai/llguidance, its numpy API): a
grammar (a JSON schema, "any JSON object", a Lark grammar, a regex) is compiled once
per request; per token, llguidance fills a bitmask of the allowed ids (int32
[ceil(V/32)], bit ``i % 32`` of word ``i // 32``), the sampler sets the others to -inf
(:meth:`edgeinfer.sampling.Sampler.sample`'s ``mask``), and the sampled id is fed back.
The model's EOS ids are allowed only where the grammar may end, and once it has ended
only they are, so a generation that stops by itself always parses.

Why llguidance: it takes our ``tokenizers`` JSON as it is, compiles a schema in about
a millisecond and fills a 151936-id mask in tens of microseconds; outlines-core builds
an index per schema in over a second at that vocabulary, and xgrammar needs torch,
triton and its own FFI package.

One :class:`Constraint` per sequence, each owning its mask row; a batch passes rows of
one [B, ceil(V/32)] array (``mask=`` of :class:`Constraint`), so a scheduler can fill
them all at once later (llguidance's ``fill_next_token_bitmask_par``).

The token table (llguidance's view of the vocabulary) costs about a second to build for
a 150k vocabulary; :func:`token_table` builds it once per tokenizer and keeps it.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import GrammarError

__all__ = ["JSON_LAYOUT", "Constraint", "Grammar", "allowed_ids", "as_grammar", "mask_words", "token_table"]

_INSTALL = "constrained output needs llguidance: pip install llguidance (edgeinfer's dependency)"


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a dependency; missing only in broken installs
        raise GrammarError(f"{_INSTALL} ({e})") from None
    return llguidance


#: llguidance's JSON layout options for generated JSON: ``json.dumps``'s separators.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def mask_words(vocab: int) -> int:
    """Words of int32 in one sequence's bitmask for ``vocab`` ids."""
    return (int(vocab) + 31) // 32


@dataclass(frozen=True)
class Grammar:
    """A compiled-to-text grammar (llguidance's grammar JSON), checked on creation.

    Attributes:
        source: the llguidance grammar (a JSON string).
        kind: "json_schema", "json_object", "lark" or "regex".
    """

    source: str
    kind: str

    def __post_init__(self) -> None:
        llg = _llg()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self.source)
        if is_error:
            raise GrammarError(f"invalid {self.kind.replace('_', ' ')}: {messages[0]}")

    @classmethod
    def from_json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        """Output that is one JSON value valid under ``schema``, spaced as ``json.dumps``
        spaces it (", " and ": ", no newlines: a small model cannot pad it forever, and
        it is the spelling chat templates and training data use).

        Raises:
            GrammarError: not a JSON object, or a schema llguidance cannot compile
                (an unsupported keyword is named).
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, Mapping):
            raise GrammarError(f"a JSON schema must be a JSON object, got "
                               f"{type(schema).__name__}")
        try:
            src = _llg().LLMatcher.grammar_from_json_schema(dict(schema), defaults=JSON_LAYOUT)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
        return cls(src, "json_schema")

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.from_json_schema({"type": "object"})

    @classmethod
    def from_lark(cls, text: str) -> Grammar:
        """A Lark grammar in llguidance's dialect (``start:`` rule; ``%json {...}``
        embeds a JSON schema; https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md).

        Raises:
            GrammarError: the grammar does not compile.
        """
        if not isinstance(text, str) or not text.strip():
            raise GrammarError("a Lark grammar must be a non-empty string")
        return cls(_llg().LLMatcher.grammar_from_lark(text), "lark")

    @classmethod
    def from_regex(cls, pattern: str) -> Grammar:
        """Output matching the regular expression ``pattern`` as a whole.

        Raises:
            GrammarError: the pattern does not compile.
        """
        return cls(_llg().LLMatcher.grammar_from_regex(pattern), "regex")


def as_grammar(json_schema: Mapping[str, Any] | str | None = None,
               grammar: Grammar | str | None = None) -> Grammar | None:
    """The API's ``json_schema=`` / ``grammar=`` arguments as one :class:`Grammar` (or None).

    ``grammar`` is a :class:`Grammar` or a Lark grammar string.

    Raises:
        GrammarError: both given, or either does not compile.
    """
    if json_schema is not None and grammar is not None:
        raise GrammarError("give json_schema= or grammar=, not both")
    if json_schema is not None:
        return Grammar.from_json_schema(json_schema)
    if grammar is None or isinstance(grammar, Grammar):
        return grammar
    if isinstance(grammar, str):
        return Grammar.from_lark(grammar)
    raise GrammarError(f"grammar= takes a Grammar or a Lark grammar string, got "
                       f"{type(grammar).__name__}")


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def token_table(tokenizer, vocab: int):
    """llguidance's token table for ``tokenizer`` (an :class:`edgeinfer.tokenizer.Tokenizer`)
    at the model's vocabulary size ``vocab`` (ids past the tokenizer's are never allowed);
    built on first use (about a second at 150k ids) and kept while the tokenizer lives.

    Raises:
        GrammarError: llguidance cannot read the tokenizer.
    """
    with _TABLES_LOCK:
        per = _TABLES.setdefault(tokenizer, {})
        table = per.get(vocab)
        if table is None:
            try:
                table = _llg().LLTokenizer(tokenizer.backend.to_str(), n_vocab=int(vocab),
                                           eos_token=sorted(tokenizer.eos_ids))
            except (ValueError, RuntimeError) as e:
                raise GrammarError(f"constrained output cannot use this tokenizer: {e}") from None
            per[vocab] = table
    return table


class Constraint:
    """One sequence's grammar state and its next-token mask.

    Per token: :meth:`fill` (the mask of allowed ids), sample with it, :meth:`accept`.

    Args:
        table: :func:`token_table` of the model's tokenizer.
        grammar: the :class:`Grammar` the output must match.
        vocab: the model's vocabulary size V (the logits' length).
        mask: where to keep the mask: an int32 C-contiguous [ceil(V/32)] array, e.g. one
            row of a batch's [B, ceil(V/32)] array; None allocates one.

    Attributes:
        mask: int32 [ceil(V/32)]: after :meth:`fill`, bit ``i % 32`` of word ``i // 32``
            is set when id ``i`` may come next.
        fill_s: seconds spent in :meth:`fill` and :meth:`accept` so far (the overhead).

    Raises:
        GrammarError: the grammar does not compile against this vocabulary.
    """

    def __init__(self, table, grammar: Grammar, vocab: int, mask: np.ndarray | None = None):
        import time

        self._clock = time.perf_counter
        llg = _llg()
        self.grammar = grammar
        self.vocab = int(vocab)
        w = mask_words(vocab)
        if mask is None:
            mask = np.full(w, -1, np.int32)
        if mask.dtype != np.int32 or mask.shape != (w,) or not mask.flags.c_contiguous:
            raise ValueError(f"mask must be a C-contiguous int32 [{w}] array, got "
                             f"{mask.dtype} {mask.shape}")
        self.mask = mask
        self._ptr = mask.ctypes.data
        self._nbytes = mask.nbytes
        self._m = llg.LLMatcher(table, grammar.source, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"the {grammar.kind.replace('_', ' ')} does not compile: "
                               f"{self._m.get_error()}")
        self.fill_s = 0.0

    def fill(self) -> np.ndarray:
        """Compute the mask of the ids allowed next into :attr:`mask` and return it.

        Raises:
            GrammarError: the matcher is in an error state (a token it did not allow
                was accepted, or a grammar limit was hit).
        """
        t0 = self._clock()
        self._m.unsafe_compute_mask_ptr(self._ptr, self._nbytes)
        self.fill_s += self._clock() - t0
        if self._m.is_error():
            raise GrammarError(f"constrained decoding failed: {self._m.get_error()}")
        return self.mask

    def accept(self, token: int) -> None:
        """Advance the grammar over a sampled id.

        Raises:
            GrammarError: ``token`` is not allowed here.
        """
        t0 = self._clock()
        ok = self._m.consume_token(int(token))
        self.fill_s += self._clock() - t0
        if not ok:
            raise GrammarError(f"token {int(token)} does not fit the grammar: "
                               f"{self._m.get_error()}")

    @property
    def done(self) -> bool:
        """True when the grammar has ended: only an EOS id may follow."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """True when the output so far is complete (the grammar may end here)."""
        return self._m.is_accepting()

    def reset(self) -> None:
        """Back to the grammar's start (a new sequence)."""
        self._m.reset()


def allowed_ids(mask: np.ndarray, vocab: int) -> np.ndarray:
    """The ids a bitmask allows, int64 [n] ascending (for tests and debugging)."""
    bits = np.unpackbits(np.asarray(mask, np.int32).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab])

