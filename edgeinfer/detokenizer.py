"""Streaming detokenization: token ids in, complete text out, never half a character.

Why not ``decode([token_id])`` per token: a character can span several tokens. Byte-level
BPE (GPT-2, Qwen, SmolLM2) splits a 3-byte CJK character or a 4-byte emoji across ids,
and decoding one of those ids alone yields U+FFFD (https://github.com/vllm-project/vllm/issues/931). SentencePiece
byte fallback (Llama-2, Phi-3) spells rare characters as ``<0xE7><0xA7><0x81>``; treating
each as a code point gives mojibake like "ç§" (https://github.com/ml-explore/mlx-examples/issues/808). SentencePiece
decoders also strip the space of the first token ("▁Hello" → "Hello"), so a per-token
decode loses every word boundary.

Algorithm (the incremental detokenization of HF text-generation-inference and vLLM,
re-derived here): keep all ids and two offsets. ``read`` is the end of what has been
emitted; ``prefix`` is the start of the previous emission, one clean boundary further
back. For each new id decode the window ``ids[prefix:]`` and emit what lies beyond
``decode(ids[prefix:read])``. Because both decodes start at the same token, decoder
effects at the window start (the SentencePiece first-token space strip) cancel out, and
the emitted pieces concatenate to exactly ``tokenizer.decode(all_ids)``. The window is
held (nothing emitted, offsets unchanged) while it is incomplete:

- its text ends in U+FFFD: a UTF-8 sequence is still open (byte-level BPE decodes bytes
  lossily, so an unfinished character shows as a trailing U+FFFD);
- its last id is a ``<0xNN>`` byte token (ByteFallback decoders only): the decoder turns
  a whole run of byte tokens into text at once, or into one U+FFFD *per byte* if the run
  is not valid UTF-8 as a whole, so a later invalid byte would retroactively change
  text already decoded; a run is released when a non-byte token closes it.

Each step decodes two short windows, so the cost per token is O(window), amortized O(1):
the window is the last emission plus whatever is held. Two caps bound it on pathological
streams (a long run of byte tokens, or invalid UTF-8 that never completes): a byte-token
run is released once ``SOFT_HOLD`` tokens are pending and its text is valid so far; any
hold is released after ``HARD_HOLD`` tokens. Only on such input (hundreds of bytes of
invalid UTF-8 or a 16+ token byte run that later turns invalid) can the stream differ
from the full decode.

Leading space (``leading_space=True``): a SentencePiece decoder with a ``Strip`` step
(Llama-2, Mistral, stories260K) drops the space of the stream's first piece, so a
completion of "Once upon a time," would start "there" where the text is " there"
(llama.cpp prints the space). With the option, the first emission gets that space back
when the first id's piece starts with "▁" and the decoder dropped it; byte-level BPE
("Ġthere") and decoders that keep the space are unchanged.

End of stream: ``flush()`` emits whatever is held, exactly as the full decode renders
it, once. A truly incomplete character therefore comes out as U+FFFD: one per open
sequence for byte-level BPE (lossy UTF-8), one per byte token for ByteFallback (the
``tokenizers`` ByteFallback rule). Special tokens (``tokenizer.special_ids``) are skipped
by default; dropping them before decoding is what ``decode(skip_special=True)`` does.
"""
from __future__ import annotations

from typing import Protocol

__all__ = ["HARD_HOLD", "SOFT_HOLD", "StreamingDetokenizer"]

REPLACEMENT_CHAR = "\ufffd"
SOFT_HOLD = 16   # pending tokens after which a valid-so-far byte-fallback run is released
HARD_HOLD = 64   # pending tokens after which anything held is released


class _DecodesIds(Protocol):
    """What the detokenizer needs from a tokenizer (``edgeinfer.tokenizer.Tokenizer`` has it)."""

    special_ids: frozenset[int]

    def decode(self, ids: list[int], skip_special: bool = True) -> str: ...


class StreamingDetokenizer:
    """Turns a stream of token ids into text deltas that never end inside a character.

    Usage::

        detok = StreamingDetokenizer(tokenizer)
        for token_id in generated:
            print(detok.add(token_id), end="")
        print(detok.flush())
        assert detok.text == tokenizer.decode(generated)

    Invariant: the concatenation of every ``add`` and ``flush`` result equals
    ``tokenizer.decode(ids, skip_special)`` of all ids added, byte for byte (see the
    module docstring for the two pathological exceptions and the hold rules).
    """

    def __init__(self, tokenizer: _DecodesIds, *, skip_special: bool = True,
                 leading_space: bool = False) -> None:
        """Start an empty stream.

        Args:
            tokenizer: has ``decode(ids, skip_special)`` and ``special_ids``; optional
                ``byte_fallback_ids`` (ids of ``<0xNN>`` tokens of a ByteFallback decoder)
                and ``id_to_token`` (for ``leading_space``).
            skip_special: drop special tokens (the default, like ``decode``).
            leading_space: give the first piece back the space a SentencePiece decoder
                strips (module docstring); the text is then ``" " + decode(ids)`` there.
        """
        self._tok = tokenizer
        self._leading_space = leading_space and hasattr(tokenizer, "id_to_token")
        self._skip_special = skip_special
        self._special = frozenset(tokenizer.special_ids) if skip_special else frozenset()
        self._byte_ids = frozenset(getattr(tokenizer, "byte_fallback_ids", ()))
        self.reset()

    def reset(self) -> None:
        """Forget all ids and text; the next ``add`` starts a new stream."""
        self._ids: list[int] = []      # ids that reach the decoder (specials dropped)
        self._prefix = 0               # window start: start of the previous emission
        self._read = 0                 # end of the emitted ids
        self._prefix_len = 0           # len(decode(ids[prefix:read])) in characters
        self._chunks: list[str] = []   # everything emitted, in order

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every returned delta)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def token_ids(self) -> list[int]:
        """Ids added so far that reach the decoder (skipped special tokens excluded); a copy."""
        return list(self._ids)

    @property
    def pending(self) -> int:
        """Number of ids added but not yet turned into emitted text (held back)."""
        return len(self._ids) - self._read

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tok.decode(self._ids[start:stop], self._skip_special)

    def _emit(self, window_text: str) -> str:
        """Emit ``window_text`` beyond the prefix and move the window forward."""
        delta = window_text[self._prefix_len:]
        if self._leading_space and not self._chunks and self._read == 0 and delta \
                and not delta[0].isspace() \
                and (self._tok.id_to_token(self._ids[0]) or "").startswith("\u2581"):
            delta = " " + delta  # the space the decoder's Strip step took from piece one
        # The just-emitted ids start at a clean boundary (``read``): they become the prefix.
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_len = len(self._decode(self._prefix, self._read))
        if delta:
            self._chunks.append(delta)
        return delta

    def add(self, token_id: int) -> str:
        """Add one generated id; return the newly completed text (often "").

        Args:
            token_id: a token id (Python or numpy int).

        Returns:
            Text that is final: it never ends inside a character and is never revised.
        """
        token_id = int(token_id)
        if token_id in self._special:
            return ""
        self._ids.append(token_id)
        window_text = self._decode(self._prefix)
        pending = len(self._ids) - self._read
        if window_text.endswith(REPLACEMENT_CHAR):
            hold = pending < HARD_HOLD
        elif token_id in self._byte_ids:
            hold = pending < SOFT_HOLD
        else:
            hold = False
        if hold:
            return ""
        return self._emit(window_text)  # may be "" (an id that decodes to nothing)

    def flush(self) -> str:
        """End of stream: emit everything still held, exactly as the full decode renders it.

        An incomplete trailing character comes out once as U+FFFD (see module docstring).
        Returns "" when nothing is held. More ids may be added afterwards.
        """
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._prefix))
