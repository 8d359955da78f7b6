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
"""
from __future__ import annotations

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
            generation prompt), e.g. ``Model.encode_chat``.
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
    if not turns:  # only system messages: nothing to drop
        n = len(render_ids(list(system)))
        if n > budget:
            raise ContextOverflowError(
                f"the system prompt alone renders to {n} tokens but only {budget} fit "
                f"(context {n_ctx} - {reserve} reserved for the reply)")
        return list(system), 0

    def render(k: int) -> tuple[list[dict], int]:
        kept = list(system) + [m for t in turns[k:] for m in t]
        return kept, len(render_ids(kept))

    kept, n = render(0)
    if n <= budget:
        return kept, 0
    last = len(turns) - 1
    _, n_last = render(last)
    if n_last > budget:
        raise ContextOverflowError(
            f"the last user turn with the system prompt renders to {n_last} tokens but only "
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
