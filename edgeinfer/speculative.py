"""Prompt-lookup speculative decoding: n-gram drafts verified in one forward.

Drafts (prompt lookup, Saxena 2023,
https://github.com/apoorvumang/prompt-lookup-decoding; llama.cpp's n-gram drafts,
https://github.com/ggml-org/llama.cpp/tree/master/examples/lookup): the last
``n`` ids of the sequence (``n`` from :data:`NGRAM_MAX` down to 1) are looked up among
earlier n-grams of the prompt and of the text generated so far; the ids that followed
the most recent earlier occurrence are the draft.

Verification (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192): the sampled
token and its k drafts run as ONE prefill forward of M = k + 1 tokens
(``Transformer.forward(ids, cache, all_logits=True)``), giving the logits of the k + 1
positions. The engine's sampler then samples position after position exactly as in
plain decoding (same penalties window, same constraint mask, same single
``rng.random()`` per token); a draft is accepted while it equals the sampled token. With
a deterministic draft (q one-hot on d), Leviathan's rule accepts d with probability
``min(1, p(d) / q(d)) = p(d)`` and otherwise samples from ``norm(max(0, p - q))`` (p with
d removed); sampling x ~ p and accepting iff x == d realizes that rule exactly (given
x != d, x is distributed as p without d, renormalized). So the output distribution is
unchanged, greedy output is the longest matching prefix plus the model's own next
token, and a seeded request gives the same tokens with and without speculation. After a
rejection the KV cache is trimmed back (``cache.trim``) to the accepted tokens. A
sliding-window (ring) layer keeps the keys a trim needs because k + 1 <= the prefill
chunk its ring was sized for; a LongRoPE model does not verify across its switch length
(the engine's decode step re-runs the sequence there).

This is exact only where the verify forward's logits of each position are bit-identical
to a decode step's. :func:`exactness_problem` says where that is not proven, and
speculation is then off (logged once per engine):

* the CPU backend with quantized linears: the integer GEMV/GEMM rows do not depend on M
  (``backends/cpu/qgemm.py``, ``tests/test_cache_invariance.py``); int4 KV too, since
  its K channel statistics are fixed by the write at position 0 (the prompt's prefill),
  which speculation never rewrites (a verify writes at positions >= 1 only);
* not with ``exact_decode`` or dense float32 linears (BLAS sgemm and sgemv round
  differently), nor on the reference / OpenCL backends (their M = 1 and M = T paths
  are not proven bit-identical).

Policy (:class:`DraftPolicy`): k starts at :data:`K_START`, grows by 2 on full acceptance
up to ``k_max`` (:data:`K_MAX`), shrinks to (accepted + 1) on a rejection, never below
:data:`K_MIN` (M = 2 runs two GEMV rows on the CPU backend: it cannot pay). A step
without an n-gram match costs a dict lookup. When the acceptance over the last
:data:`WINDOW` verifies falls below :data:`MIN_ACCEPT_RATE`, drafting pauses for a number
of tokens that doubles on each consecutive pause (from :data:`PAUSE_START` up to
:data:`PAUSE_MAX`) and resets after a window that pays.

Modes: ``"ngram"`` drafts whenever that policy allows; ``"auto"`` (the default) also
only while a verify pays by measured time (:class:`CostModel`: the M = k + 1 forward's
cost against a decode step's, with the acceptance rate); ``"off"`` never drafts. A
batched scheduler passes ``"off"``. The tokens are the same in every mode.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

log = logging.getLogger("edgeinfer")

#: the values of ``speculate`` (API, CLI ``--speculate``, server)
SPECULATE_MODES = ("auto", "ngram", "off")
NGRAM_MAX = 3
K_START = 4
K_MIN = 2
K_MAX = 12
WINDOW = 8
MIN_ACCEPT_RATE = 0.25
PAUSE_START = 16
PAUSE_MAX = 512
PRIOR_SLOPE = 0.15
EMA = 0.3
EXPLORE = 16

_UNSET = object()


def check_mode(speculate: str) -> str:
    """``speculate`` itself if it is one of :data:`SPECULATE_MODES`.

    Raises:
        ValueError: another value (names the accepted ones).
    """
    if speculate not in SPECULATE_MODES:
        raise ValueError(f"speculate must be one of {', '.join(SPECULATE_MODES)}, "
                         f"got {speculate!r}")
    return speculate


def exactness_problem(model) -> str | None:
    """Why a verify forward of ``model`` (a Transformer) may not reproduce its decode
    steps bit for bit, or None when it does (module docstring)."""
    be = model.backend
    if getattr(be, "name", None) != "cpu":
        return (f"the {getattr(be, 'name', be)!r} backend's M = k + 1 forward is not proven "
                f"bit-identical to its decode steps")
    if getattr(be, "exact_decode", False):
        return "exact_decode runs float BLAS linears, whose rows depend on M"
    from .models.families import LINEAR_KEYS  # noqa: F401 (models is below edgeinfer)

    handles = [h for layer in model.layers for key, h in layer.items() if key in LINEAR_KEYS]
    handles.append(model.lm_head)
    if any(isinstance(h, np.ndarray) for h in handles):
        return "dense float32 linears (BLAS sgemm and sgemv round differently)"
    return None


def speculation_problem(engine, speculate: str) -> str | None:
    """Why ``engine`` will not speculate in mode ``speculate`` (None: it will). A reason
    other than "off" is logged once per engine (a warning when "ngram" was asked for).

    Raises:
        ValueError: an unknown mode.
    """
    if check_mode(speculate) == "off":
        return "off"
    reason = getattr(engine, "_spec_problem", _UNSET)
    if reason is _UNSET:
        reason = engine._spec_problem = exactness_problem(engine.model)
        if reason is not None:
            log.log(logging.WARNING if speculate == "ngram" else logging.INFO,
                    "speculative decoding off: %s", reason)
    return reason


class NgramIndex:
    """The most recent earlier occurrence of every n-gram (n = 1..``n_max``) of a
    growing id sequence, for drafting.

    ``maps[n][ids[j-n:j]] = j``: the position right after the n-gram's latest
    occurrence whose continuation is known (registered when ``ids[j]`` arrives), so
    the sequence's own suffix never matches itself.
    """

    def __init__(self, ids: Sequence[int] = (), n_max: int = NGRAM_MAX):
        self.n_max = n_max
        self.ids: list[int] = []
        self.maps: list[dict] = [{} for _ in range(n_max + 1)]
        for t in ids:
            self.append(int(t))

    def append(self, token: int) -> None:
        ids = self.ids
        j = len(ids)
        for n in range(1, min(self.n_max, j) + 1):
            self.maps[n][tuple(ids[j - n:j])] = j
        ids.append(token)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` ids continuing the longest suffix (<= n_max) seen before; []
        when no suffix occurred earlier."""
        ids = self.ids
        for n in range(min(self.n_max, len(ids)), 0, -1):
            j = self.maps[n].get(tuple(ids[-n:]))
            if j is not None:
                return ids[j:j + k]
        return []


class DraftPolicy:
    """Draft length and pauses from the acceptance history (module docstring)."""

    def __init__(self, k_max: int = K_MAX):
        self.k_max = max(K_MIN, int(k_max))
        self.k = min(K_START, self.k_max)
        self.window: deque = deque(maxlen=WINDOW)  # (drafted, accepted) per verify
        self.paused = 0  # tokens left to decode without drafting
        self.pause = PAUSE_START

    def allows(self) -> bool:
        if self.paused > 0:
            self.paused -= 1
            return False
        return True

    def update(self, drafted: int, accepted: int) -> None:
        self.k = (min(self.k_max, self.k + 2) if accepted == drafted
                  else max(K_MIN, accepted + 1))
        self.window.append((drafted, accepted))
        if len(self.window) == WINDOW:
            d = sum(w[0] for w in self.window)
            a = sum(w[1] for w in self.window)
            if a < MIN_ACCEPT_RATE * d:
                self.paused = self.pause
                self.pause = min(PAUSE_MAX, 2 * self.pause)
                self.window.clear()
            elif a >= 2 * MIN_ACCEPT_RATE * d:
                self.pause = PAUSE_START


class CostModel:
    """``auto``'s check that a verify pays, from measured times (seconds).

    A decode step costs ``c1`` and a verify of M = k + 1 tokens ``c1 + b * k`` (both
    exponential moving averages of measurements; until a verify is timed,
    ``b = PRIOR_SLOPE * c1``). With a per-draft acceptance probability ``alpha`` (the
    accepted / (accepted + rejections) of the last :data:`WINDOW` verifies, prior 2/3),
    a verify of k drafts yields ``(1 - alpha**(k+1)) / (1 - alpha)`` tokens on average
    (Leviathan et al. 2023, eq. 1). :meth:`best_k` is the k <= ``k_cap`` that maximizes
    tokens per second, or 0 when none beats plain decoding (1 / c1). Every
    :data:`EXPLORE`-th refusal drafts anyway, so that alpha and b follow the text and
    the machine. Only speed depends on this: the tokens are the same either way.
    """

    def __init__(self):
        self.c1: float | None = None
        self.b: float | None = None
        self.window: deque = deque(maxlen=WINDOW)  # (accepted, rejected) per verify
        self.refused = 0

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else old + EMA * (new - old)

    def decode_time(self, dt: float) -> None:
        self.c1 = self._ema(self.c1, dt)

    def verify_time(self, k: int, dt: float, accepted: int) -> None:
        if self.c1 is not None:
            self.b = self._ema(self.b, max(0.0, dt - self.c1) / k)
        self.window.append((accepted, int(accepted < k)))

    def best_k(self, k_cap: int) -> int:
        if self.c1 is None:
            return 0  # time a decode step first
        a = 2 + sum(w[0] for w in self.window)
        r = 1 + sum(w[1] for w in self.window)
        alpha = a / (a + r)
        b = PRIOR_SLOPE * self.c1 if self.b is None else self.b
        best, best_rate = 0, 1.0 / self.c1
        for k in range(K_MIN, k_cap + 1):
            rate = (1 - alpha ** (k + 1)) / (1 - alpha) / (self.c1 + b * k)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0:
            self.refused += 1
            if self.refused % EXPLORE == 0:
                return min(K_MIN, k_cap)
        return best


class Speculator:
    """Supplies :meth:`edgeinfer.engine.Engine.stream`'s next logits, drafting and
    verifying ahead; the engine samples, checks and emits as in plain decoding.

    Between calls the cache may hold drafts beyond the accepted tokens
    (``engine.cached_ids`` holds only those): :attr:`length` is the accepted length,
    and :meth:`close` trims the rest off.

    Args:
        engine: the :class:`~edgeinfer.engine.Engine` (its cache holds the prompt).
        prompt_ids: the prompt (drafts are looked up in it).
        max_tokens: the stream's token limit (no draft past it).
        k_max: most drafts per verify.
        mode: "ngram" (draft whenever the policy allows) or "auto" (also only when
            :class:`CostModel` says a verify pays).
        clock: seconds (``time.perf_counter``), for ``auto``'s cost model.

    Attributes:
        drafted, accepted: draft ids verified / accepted so far.
    """

    def __init__(self, engine, prompt_ids: Sequence[int], max_tokens: int, k_max: int = K_MAX,
                 mode: str = "ngram", clock=time.perf_counter):
        self.engine = engine
        self.cost = CostModel() if mode == "auto" else None
        self.clock = clock
        self.index = NgramIndex(prompt_ids)
        self.policy = DraftPolicy(min(k_max, engine.prefill_chunk - 1))
        self.left = max_tokens  # tokens still to be sampled
        self.drafted = self.accepted = 0
        self._rows: np.ndarray | None = None  # logits [k + 1, V] of the last verify
        self._drafts: list[int] = []
        self._i = 0  # drafts of the last verify accepted so far
        self._t_verify = 0.0  # seconds the last verify took (auto)

    @property
    def length(self) -> int:
        """Accepted positions in the cache."""
        return len(self.engine.cached_ids)

    def next_logits(self, token: int) -> np.ndarray:
        """Logits float32 [V] after ``token`` (the sampled id, appended to the sequence)."""
        eng = self.engine
        self.index.append(int(token))
        self.left -= 1
        if self._rows is not None:
            if self._i < len(self._drafts) and token == self._drafts[self._i]:
                self._i += 1
                self.accepted += 1
                eng.cached_ids.append(int(token))
                row = self._rows[self._i]
                if self._i == len(self._drafts):
                    self._finish_verify()
                return row
            self._rollback()
        drafts = self._draft()
        cost = self.cost
        if not drafts:
            if cost is None:
                return eng.decode_one(token)
            t0 = self.clock()
            row = eng.decode_one(token)
            cost.decode_time(self.clock() - t0)
            return row
        feed = np.asarray([token, *drafts], np.int32)
        t0 = self.clock() if cost is not None else 0.0
        self._rows = eng.model.forward(feed, eng.cache, all_logits=True)
        self._t_verify = self.clock() - t0 if cost is not None else 0.0
        self._drafts = drafts
        self._i = 0
        self.drafted += len(drafts)
        eng.cached_ids.append(int(token))
        return self._rows[0]

    def _draft(self) -> list[int]:
        eng = self.engine
        if not self.policy.allows():
            return []
        # room: the verify's k + 1 positions in the context, no draft past max_tokens
        k = min(self.policy.k, self.left, eng.n_ctx - eng.cache.length - 1)
        if eng._switch is not None and not eng._cache_long:
            k = min(k, eng._switch - eng.cache.length - 1)  # stay below LongRoPE's switch
        if k < K_MIN:
            return []
        if self.cost is not None:
            k = self.cost.best_k(k)
            if k < K_MIN:
                return []
        drafts = self.index.draft(k)
        return drafts if len(drafts) >= K_MIN else []

    def _finish_verify(self) -> None:
        self.policy.update(len(self._drafts), self._i)
        if self.cost is not None:
            self.cost.verify_time(len(self._drafts), self._t_verify, self._i)
        self._rows = None

    def _rollback(self) -> None:
        """Forget the rejected drafts: the cache keeps the accepted positions only."""
        self._finish_verify()
        eng = self.engine
        eng.cache.trim(self.length)
        if eng.cache.length != self.length:  # a ring layer lost a key: recompute
            ids = list(eng.cached_ids)
            eng.cached_ids = ids[:eng.cache.length]
            eng.prefill(ids)

    def close(self) -> None:
        """End of stream: drop drafts not accepted, so the cache holds ``cached_ids``."""
        if self._rows is not None:
            self._rollback()
