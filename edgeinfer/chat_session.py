"""A conversation that keeps its KV cache between turns (:class:`ChatSession`), and the
final-event bookkeeping of a chat stream."""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from .engine import GenerationEvent

if TYPE_CHECKING:
    from .api import Model


def _with_dropped_turns(events: Iterator[GenerationEvent], dropped: int
                        ) -> Iterator[GenerationEvent]:
    """``events`` with ``dropped`` set as the final event's ``stats.dropped_turns``."""
    for ev in events:
        if ev.stats is not None:
            ev.stats.dropped_turns = dropped
        yield ev


class ChatSession:
    """A conversation with a model that keeps its KV cache between turns.

    Each turn renders the whole conversation through the chat template; the engine
    finds the longest common token prefix with what its KV cache holds and computes
    only the new tokens, so a turn costs about its own length, not the conversation's.
    A conversation that outgrows the context loses its oldest whole turns.

    >>> chat = ChatSession(model, system="You are terse.")   # doctest: +SKIP
    >>> chat.send("What is the capital of France?")          # doctest: +SKIP

    Args:
        model: the :class:`Model` to talk to (sessions on one model take turns: the
            model's lock serializes them, and each turn re-uses whatever prefix the
            cache still holds).
        system: optional system prompt.

    Attributes:
        messages: the OpenAI-style message list (system prompt first, if any).
        last_stats: :class:`GenerationStats` of the last reply.
    """

    def __init__(self, model: Model, system: str | None = None):
        self.model = model
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.last_stats = None

    def stream(self, text: str, **kw) -> Iterator[GenerationEvent]:
        """Add a user message and stream the reply (same keywords as :meth:`Model.stream_ids`).

        The reply (even a cancelled, partial one) is appended to :attr:`messages` when
        the stream ends."""
        self.messages.append({"role": "user", "content": text})
        parts: list[str] = []
        try:
            for ev in self.model.chat_stream(self.messages, **kw):
                parts.append(ev.text)
                if ev.stats is not None:
                    self.last_stats = ev.stats
                yield ev
        finally:
            self.messages.append({"role": "assistant", "content": "".join(parts)})

    def send(self, text: str, **kw) -> str:
        """Add a user message and return the whole reply."""
        return "".join(ev.text for ev in self.stream(text, **kw))

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages = [m for m in self.messages[:1] if m["role"] == "system"]
