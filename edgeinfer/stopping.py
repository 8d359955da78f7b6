"""Stop conditions: end-of-sequence ids, stop strings, and the token budget.

Two channels, because they see different things (https://github.com/ggml-org/llama.cpp/issues/6772):

- **ids** (``on_token``): EOS and end-of-turn control tokens. They decode to "" when
  special tokens are skipped, so a stop *string* "<|eot_id|>" can never match the text;
  they must be caught by id. ``stop_strings_to_ids`` moves such strings to the id set.
- **text** (``feed``/``flush``): user stop strings on the detokenized stream. A stop
  string may arrive split across deltas ("\\nUs" + "er" + ":"), so any suffix that could
  still grow into a stop string is held back; text is released once it can no longer
  be part of a match, or at the end (``flush``). On a match the text is cut before the
  stop string, which is never emitted (OpenAI API behaviour).

Engine wiring, per generated token::

    reason = checker.on_token(tok)          # "stop" on an EOS id: do not detokenize tok
    if reason != "stop":
        safe, r = checker.feed(detok.add(tok))
        emit(safe); reason = reason or r
    if reason:
        if reason == "length": emit(checker.feed(detok.flush())[0])
        emit(checker.flush()); finish(reason)

Finish reasons: "stop" (an EOS id or a stop string) and "length" (``max_tokens``).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Protocol

__all__ = ["FinishReason", "StopChecker", "stop_strings_to_ids"]

FinishReason = Literal["stop", "length"]


class _KnowsSpecialTokens(Protocol):
    special_ids: frozenset[int]

    def token_to_id(self, token: str) -> int | None: ...


def stop_strings_to_ids(stop_strings: Iterable[str], tokenizer: _KnowsSpecialTokens
                        ) -> tuple[frozenset[int], tuple[str, ...]]:
    """Split user stop strings into special-token ids and plain text stops.

    A stop string that is exactly a special token ("<|eot_id|>", "<|im_end|>") would never
    match detokenized text (special tokens decode to ""), so it becomes an id stop.

    Returns:
        (ids to add to the EOS set, the remaining text stop strings in their order).
    """
    ids, texts = set(), []
    for s in stop_strings:
        i = tokenizer.token_to_id(s)
        if i is not None and i in tokenizer.special_ids:
            ids.add(i)
        else:
            texts.append(s)
    return frozenset(ids), tuple(texts)


class StopChecker:
    """Decides when generation ends, and holds back text that may start a stop string.

    One instance per generation; not thread-safe.
    """

    def __init__(self, eos_ids: Iterable[int], stop_strings: Iterable[str] = (),
                 max_tokens: int | None = None) -> None:
        """
        Args:
            eos_ids: ids that end generation (``Tokenizer.eos_ids``, plus any from
                ``stop_strings_to_ids``).
            stop_strings: text that ends generation; the match itself is not emitted.
            max_tokens: the most tokens to generate (EOS included in the count); None =
                no limit.

        Raises:
            ValueError: an empty or non-str stop string, or ``max_tokens < 1``.
        """
        self._eos = frozenset(int(i) for i in eos_ids)
        stops = tuple(stop_strings)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self._stops = stops
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {max_tokens!r}")
        self._max_tokens = max_tokens
        self._count = 0
        self._held = ""
        self._reason: FinishReason | None = None
        self._matched: str | None = None

    @property
    def finish_reason(self) -> FinishReason | None:
        """"stop", "length", or None while generation may continue."""
        return self._reason

    @property
    def matched_stop(self) -> str | None:
        """The stop string that matched, or None (EOS id, length, or not finished)."""
        return self._matched

    @property
    def stopped_by_string(self) -> bool:
        """True when a stop string (not an id or the length) ended generation."""
        return self._matched is not None

    @property
    def num_tokens(self) -> int:
        """How many tokens ``on_token`` has seen."""
        return self._count

    @property
    def held_text(self) -> str:
        """Text currently held back because it could begin a stop string."""
        return self._held

    def on_token(self, token_id: int) -> FinishReason | None:
        """Account for one generated id; return a finish reason if generation ends here.

        "stop" when the id is in ``eos_ids`` (the token is not part of the output: do not
        detokenize it). "length" when this token reaches ``max_tokens`` (the token IS
        part of the output). Once finished, returns the same reason again.
        """
        if self._reason is not None:
            return self._reason
        self._count += 1
        if int(token_id) in self._eos:
            self._reason = "stop"
        elif self._max_tokens is not None and self._count >= self._max_tokens:
            self._reason = "length"
        return self._reason

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, text_delta: str) -> tuple[str, FinishReason | None]:
        """Add detokenized text; return (text safe to emit now, finish reason or None).

        On a stop-string match the safe text ends just before the earliest match and the
        reason is "stop"; everything after is discarded. Otherwise the safe text is all
        but the longest tail that could still become a stop string. After "stop" by a stop
        string, further calls return ("", "stop"). A finish by id or length does not
        block ``feed`` (the engine feeds the last token's text, then calls ``flush``).
        """
        if self._matched is not None:
            return "", self._reason
        if not self._stops:
            return text_delta, None
        buf = self._held + text_delta
        first = -1
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (first == -1 or i < first):
                first, self._matched = i, s
        if first != -1:
            self._held = ""
            self._reason = "stop"
            return buf[:first], "stop"
        keep = self._holdback(buf)
        cut = len(buf) - keep
        self._held = buf[cut:]
        return buf[:cut], None

    def flush(self) -> str:
        """End of generation: release the held-back text (it never became a stop string).

        Returns "" after a stop-string match (the text after the match is dropped).
        """
        held, self._held = self._held, ""
        return "" if self._matched is not None else held
