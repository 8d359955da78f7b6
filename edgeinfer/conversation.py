"""Chat context overflow policy: drop whole oldest turns, keep the system prompt.

A conversation is OpenAI-style messages ``[{"role": ..., "content": ...}, ...]``. A
*turn* starts at a ``user`` message and runs up to (not including) the next ``user``
message, so a user message and its assistant reply (and any tool messages) go
together. Leading ``system`` messages are pinned. Messages before the first user
message that are not system (e.g. an assistant greeting) belong to the first turn.

:func:`fit_messages` drops the oldest turns until the conversation, **re-rendered
through the chat template** (never a slice of token ids, so no orphan template
fragment), plus ``reserve`` tokens for the reply, fits ``n_ctx``. The last turn (the
newest user message and what follows it) is never dropped: if it does not fit with
the system prompt, :class:`~edgeinfer.errors.ContextOverflowError` says by how much.
The BOS token, if the template or tokenizer adds one, is part of every render.

:func:`reuse_cached_ids` keeps the previous reply as the model sampled it (as its KV cache
holds it) where re-tokenizing its text would spell it with other ids, so prefix reuse
covers the whole reply.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .errors import ContextOverflowError


def split_turns(messages: Sequence[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(leading system messages, turns); each turn starts at a user message
    (except possibly the first, which holds any non-system messages before it)."""
    msgs = list(messages)
    i = 0
    while i < len(msgs) and msgs[i].get("role") == "system":
        i += 1
    system, turns = msgs[:i], []
    for m in msgs[i:]:
        if m.get("role") == "user" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    # a first "turn" without a user message (greeting) is merged into the next turn
    if len(turns) > 1 and turns[0][0].get("role") != "user":
        turns[1] = turns[0] + turns[1]
        turns.pop(0)
    return system, turns


def fit_messages(messages: Sequence[dict], render_ids: Callable[[list[dict]], list[int]],
                 n_ctx: int, reserve: int = 0) -> tuple[list[dict], int]:
    """Keep the newest whole turns (and the system prompt) whose rendering fits.

    Args:
        messages: the conversation, oldest first.
        render_ids: messages -> prompt token ids through the chat template (with the
            generation prompt), e.g. ``Model.encode_chat``. A ``ContextOverflowError``
            it raises (a render larger than the template's size limit) counts as not
            fitting.
        n_ctx: context length in tokens.
        reserve: tokens kept free for the reply (>= 0).

    Returns:
        (kept messages, number of *messages* dropped); the kept list is the input
        unchanged when it fits.

    Raises:
        ContextOverflowError: the system prompt plus the last turn alone need more than
            ``n_ctx - reserve`` tokens (the message gives both numbers).
        ValueError: no messages, negative ``reserve``, or ``reserve >= n_ctx``.
    """
    if not messages:
        raise ValueError("no messages to fit")
    if reserve < 0 or reserve >= n_ctx:
        raise ValueError(f"reserve must be in 0..{n_ctx - 1} for n_ctx {n_ctx}, got {reserve}")
    budget = n_ctx - reserve
    system, turns = split_turns(messages)

    def count(kept: list[dict]) -> float:
        try:
            return len(render_ids(kept))
        except ContextOverflowError:  # the render itself outgrew its size limit
            return math.inf

    def tokens(n: float) -> str:
        return f"more than {n_ctx} tokens" if n == math.inf else f"{n} tokens"

    if not turns:  # only system messages: nothing to drop
        n = count(list(system))
        if n > budget:
            raise ContextOverflowError(
                f"the system prompt alone renders to {tokens(n)} but only {budget} fit "
                f"(context {n_ctx} - {reserve} reserved for the reply)")
        return list(system), 0

    def render(k: int) -> tuple[list[dict], float]:
        kept = list(system) + [m for t in turns[k:] for m in t]
        return kept, count(kept)

    kept, n = render(0)
    if n <= budget:
        return kept, 0
    last = len(turns) - 1
    _, n_last = render(last)
    if n_last > budget:
        raise ContextOverflowError(
            f"the last user turn with the system prompt renders to {tokens(n_last)} but only "
            f"{budget} fit (context {n_ctx} - {reserve} reserved for the reply); shorten the "
            f"message or raise the context")
    # rendered length shrinks as turns are dropped: binary search the fewest dropped
    lo, hi = 1, last  # render(hi) fits, render(0) does not
    while lo < hi:
        mid = (lo + hi) // 2
        if render(mid)[1] <= budget:
            hi = mid
        else:
            lo = mid + 1
    kept, _ = render(lo)
    return kept, len(messages) - len(kept)


#: Most tokens either side may hold between two points where their texts agree again.
RESYNC_WINDOW = 64


def _text_prefix_of(a: str, b: str) -> bool:
    """Whether ``a`` (an incomplete trailing character, U+FFFD, dropped) starts ``b``."""
    return b.startswith(a.rstrip("\ufffd"))


def reuse_cached_ids(rendered: Sequence[int], cached: Sequence[int],
                     decode: Callable[[list[int]], str],
                     window: int = RESYNC_WINDOW) -> list[int]:
    """``rendered`` with the cached ids substituted where both spell the same text.

    A conversation is re-rendered to text and re-tokenized every turn, but the KV cache
    holds the ids the model *sampled*, and a sampled sequence need not be the canonical
    tokenization of its text: SmolLM2 may sample "Q" + "LT" where the tokenizer writes
    "QL" + "T". Prefix reuse compares ids, so it would stop there and recompute the rest
    of the reply. This walks both sequences past the first differing id while their
    decoded texts stay consistent and, at the furthest point where the texts agree
    again, splices: ``cached[:k] + rendered[j:]``. The result decodes to the text of
    ``rendered``; it spells the reply as the model generated it (as its KV cache holds
    it), which is what the model saw anyway.

    Both decode windows start at the same already-shared id, so decoder effects at a
    window start (SentencePiece's first-space strip) cancel out.

    Args:
        rendered: prompt ids of the new turn (chat template applied).
        cached: ids the KV cache holds (``Engine.cached_ids``).
        decode: ids -> text *keeping* special tokens (e.g.
            ``lambda ids: tokenizer.decode(ids, skip_special=False)``).
        window: give up after this many tokens on either side without the texts agreeing.

    Returns:
        a new list of ids; ``list(rendered)`` when nothing can be spliced (no shared
        prefix, the texts really differ, or the cache already covers the common part).
    """
    r, c = list(rendered), list(cached)
    i = j = _common(c, r)
    if i == 0:
        return r
    best = (i, j)
    anchor_c, anchor_r = i - 1, j - 1  # a shared id: both windows start with it
    while i < len(c) and j < len(r):
        # texts of c[anchor_c:i] and r[anchor_r:j] agree; c[i] != r[j]: walk the side whose
        # text is shorter until they agree again, or disagree, or run past the window.
        si, sj = i, j
        tc, tr = decode(c[anchor_c:i]), decode(r[anchor_r:j])
        synced = False
        while i - si <= window and j - sj <= window:
            if len(tc) <= len(tr) and i < len(c):
                i += 1
                tc = decode(c[anchor_c:i])
            elif j < len(r):
                j += 1
                tr = decode(r[anchor_r:j])
            else:
                break
            if not (_text_prefix_of(tc, tr) or _text_prefix_of(tr, tc)):
                break
            if tc == tr and not tc.endswith("\ufffd"):
                synced = True
                break
        if not synced:
            break
        n = _common(c[i:], r[j:])
        best = (i + n, j + n)
        if n == 0:
            continue  # agree again but differ at once: keep the older anchor
        i, j = i + n, j + n
        anchor_c, anchor_r = i - 1, j - 1
    k, j = best
    if k <= _common(c, r):
        return r
    return c[:k] + r[j:]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
