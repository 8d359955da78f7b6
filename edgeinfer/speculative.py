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

Drafts are chosen to be long where the match is: among the last :data:`CANDIDATES`
occurrences of the longest matched n-gram, the one whose matched run (the ids equal
before it, counted back up to :data:`RUN_MAX`) is longest, the most recent on a tie; a
run of r ids that continued in the text so far is likely to go on, so up to
``max(policy k, r)`` ids are drafted (capped by ``k_max``, :data:`K_MAX`).

Policy (:class:`DraftPolicy`): k starts at :data:`K_START`, grows by 2 on full acceptance
up to ``k_max``, shrinks to (accepted + 1) on a rejection, never below :data:`K_MIN`
(M = 2 runs two GEMV rows on the CPU backend: it cannot pay). A step without an n-gram
match costs a dict lookup. When the acceptance over the last :data:`WINDOW` verifies
falls below :data:`MIN_ACCEPT_RATE`, drafting pauses for a number of tokens that doubles
on each consecutive pause (from :data:`PAUSE_START` up to :data:`PAUSE_MAX`) and resets
after a window that pays.

Modes: ``"ngram"`` drafts whenever that policy allows; ``"auto"`` (the default) also
only while a verify pays by measured time (:class:`CostModel`: robust fits of the
decode step's and the verify's cost, the accepted-run distribution, hysteresis); ``"off"``
never drafts. A batched scheduler passes ``"off"``. The tokens are the same in every mode.
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
CANDIDATES = 4     # earlier occurrences kept per n-gram
RUN_MAX = 64       # ids compared back to measure a matched run
K_START = 4
K_MIN = 2
K_MAX = 32
WINDOW = 8
MIN_ACCEPT_RATE = 0.25
PAUSE_START = 16
PAUSE_MAX = 512
# auto's cost model (CostModel)
COST_WINDOW = 16   # decode step timings kept
VERIFY_WINDOW = 16  # verify timings kept
RUN_WINDOW = 16    # verifies whose accepted runs estimate the run distribution
MIN_DECODES = 3    # decode steps timed before a verify is weighed
MIN_OFF_MODE = 3   # verifies at other k than the commonest one before a line is fit
REFRESH = 32       # verifies in a row before a decode step is timed again
PRIOR_SLOPE = 0.15  # a verified draft's cost in decode steps until a verify is timed
PRIOR_ALPHA = (2 / 3, 0.9)  # per-draft acceptance before any verify: short / long runs
PRIOR_WEIGHT = 3.0  # draft positions that prior counts as
ON_GAIN = 1.08     # off -> on when the best k's tokens/s beats decoding by this factor
OFF_GAIN = 1.0     # on -> off below this one
EXPLORE = 16       # refusals before an exploring verify (doubles while it stays off)
EXPLORE_MAX = 256
LONG_RUN = 8        # a matched run this long is weighed apart from shorter ones

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
    """Earlier occurrences of every n-gram (n = 1..``n_max``) of a growing id sequence,
    for drafting.

    ``maps[n][ids[j-n:j]]`` lists (oldest first, at most :data:`CANDIDATES`) the
    positions ``j`` right after the n-gram's occurrences whose continuation is known
    (registered when ``ids[j]`` arrives), so the sequence's own suffix never matches
    itself.
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
            seen = self.maps[n].setdefault(tuple(ids[j - n:j]), [])
            seen.append(j)
            if len(seen) > CANDIDATES:
                del seen[0]
        ids.append(token)

    def match(self) -> tuple[int, int]:
        """(j, run): the continuation ``ids[j:]`` of the longest suffix (<= n_max) seen
        before, from the occurrence with the longest matched run (``run`` ids equal
        before ``j`` and at the end, <= :data:`RUN_MAX`; the latest on a tie); (-1, 0)
        when no suffix occurred earlier."""
        ids = self.ids
        end = len(ids)
        for n in range(min(self.n_max, end), 0, -1):
            seen = self.maps[n].get(tuple(ids[-n:]))
            if not seen:
                continue
            best_j, best_run = -1, 0
            for j in reversed(seen):
                run, cap = n, min(RUN_MAX, j)
                while run < cap and ids[j - run - 1] == ids[end - run - 1]:
                    run += 1
                if run > best_run:
                    best_j, best_run = j, run
            return best_j, best_run
        return -1, 0

    def draft(self, k: int, k_run: int = 0) -> list[int]:
        """Up to ``max(k, min(k_run, run))`` ids continuing :meth:`match` (``run``: its
        matched run); [] when no suffix occurred earlier."""
        j, run = self.match()
        if j < 0:
            return []
        return self.ids[j:j + max(k, min(k_run, run))]


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


def _median(xs) -> float:
    v = sorted(xs)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


class CostModel:
    """``auto``'s choice of k (0: decode instead) from measured times, deterministic
    given them.

    Cost: a decode step costs ``c1``, the median of the last :data:`COST_WINDOW` timed
    steps (one is timed after :data:`REFRESH` verifies in a row); a verify of k drafts
    (M = k + 1) ``c1 + fixed + slope * k``, fit to the last :data:`VERIFY_WINDOW`
    verifies, each timed in units of the c1 of its time (so that a load that slows both
    kinds alike changes no ratio), by Theil-Sen (the median of the pairwise slopes between
    verifies of different k, then the median intercept; Sen 1968) once
    :data:`MIN_OFF_MODE` of them differ from the commonest k, else ``fixed = 0`` and the
    median of ``(t - c1) / k`` (a line through one k is not a fit); before any verify,
    ``slope = PRIOR_SLOPE * c1``. A cost is never below ``c1``. Medians make one slow step
    (another process, a page fault) move nothing.

    Tokens: a verify of k drafts yields ``1 + sum_{i<=k} S(i)``, ``S(i)`` the probability
    that at least i drafts are accepted: a Kaplan-Meier estimate (Kaplan and Meier 1958)
    from the last :data:`RUN_WINDOW` verifies (a fully accepted draft is censored at its
    length), each position's hazard shrunk toward the pooled rejection rate (prior
    ``1 - PRIOR_ALPHA``, 2/3 acceptance from short runs and 0.9 from long ones, worth
    :data:`PRIOR_WEIGHT` positions), the pooled rate beyond the longest draft seen;
    drafts from matched runs of :data:`LONG_RUN` ids or more are counted apart. Unlike
    one per-draft rate, this sees that copied text is accepted in long runs.

    Choice: the k <= ``k_cap`` with the most tokens per second; drafting switches on
    when that beats decoding (1 / c1) by :data:`ON_GAIN` and off below :data:`OFF_GAIN`
    (hysteresis: noise near break-even does not flap). While off, a verify at the policy's
    k runs after :data:`EXPLORE` refusals, the gap doubling up to :data:`EXPLORE_MAX` while
    it stays off, so that the estimates follow the text and the machine. Only speed
    depends on this: the tokens are the same either way.
    """

    def __init__(self):
        self.decodes: deque = deque(maxlen=COST_WINDOW)   # seconds per decode step
        self.verifies: deque = deque(maxlen=VERIFY_WINDOW)  # (k, seconds / c1 then)
        self._fit: tuple[float, float, float] | None = None  # (c1, fixed, slope)
        self.classes = [_RunClass(a) for a in PRIOR_ALPHA]  # matched run < / >= LONG_RUN
        self.since_decode = 0  # verifies since the last timed decode step

    def decode_time(self, dt: float) -> None:
        self.decodes.append(float(dt))
        self.since_decode = 0
        self._fit = None

    def verify_time(self, k: int, dt: float, accepted: int, run: int = 0) -> None:
        """A verify of ``k`` drafts took ``dt`` seconds and ``accepted`` were accepted;
        ``run``: the matched run they were drafted from."""
        if self.decodes:
            self.verifies.append((int(k), float(dt) / _median(self.decodes)))
        self.classes[run >= LONG_RUN].add(k, accepted)
        self.since_decode += 1
        self._fit = None

    def costs(self) -> tuple[float, float, float]:
        """(c1, fixed, slope) in seconds (module docstring)."""
        if self._fit is None:
            c1 = _median(self.decodes)
            v = list(self.verifies)  # costs in decode steps
            modal = max((sum(1 for k, _ in v if k == k0) for k0, _ in v), default=0)
            slopes = [(tj - ti) / (kj - ki) for a, (ki, ti) in enumerate(v)
                      for kj, tj in v[a + 1:] if kj != ki]
            if len(v) - modal >= MIN_OFF_MODE:  # enough verifies off the commonest k
                slope = max(0.0, _median(slopes))
                fixed = _median([t - 1 - slope * k for k, t in v])
            elif v:
                slope, fixed = max(0.0, _median([(t - 1) / k for k, t in v])), 0.0
            else:
                slope, fixed = PRIOR_SLOPE, 0.0
            self._fit = (c1, c1 * fixed, c1 * slope)
        return self._fit

    def rate(self, k: int, run: int = 0) -> float:
        """Expected tokens per second of a verify of k drafts from a matched run of
        ``run`` ids (k = 0: a decode step)."""
        c1, fixed, slope = self.costs()
        if k == 0:
            return 1.0 / c1
        tokens = 1.0 + sum(self.classes[run >= LONG_RUN].survival(k))
        return tokens / max(c1, c1 + fixed + slope * k)

    def best_k(self, k_cap: int, run: int = 0, k_explore: int | None = None) -> int:
        """The number of drafts to verify now, <= ``k_cap`` (0: decode a step), for
        drafts from a matched run of ``run`` ids; an exploring verify drafts
        ``min(k_cap, k_explore)`` (default ``k_cap``)."""
        if len(self.decodes) < MIN_DECODES or k_cap < K_MIN:
            return 0  # time decode steps first
        if self.since_decode >= REFRESH:
            return 0  # a decode step to keep c1 current
        cls = self.classes[run >= LONG_RUN]
        best = max(range(K_MIN, k_cap + 1), key=lambda k: self.rate(k, run))  # first on a tie
        gain = self.rate(best, run) / self.rate(0)
        if gain >= (OFF_GAIN if cls.on else ON_GAIN):
            if not cls.on:
                cls.on, cls.gap = True, EXPLORE
            cls.refused = 0
            return best
        if cls.on:
            cls.on, cls.refused = False, 0
        cls.refused += 1
        if cls.refused >= cls.gap:
            cls.refused = 0
            cls.gap = min(EXPLORE_MAX, 2 * cls.gap)
            return k_cap if k_explore is None else max(K_MIN, min(k_cap, k_explore))
        return 0


class _RunClass:
    """CostModel's state for drafts from one class of matched runs: the accepted runs of
    its last :data:`RUN_WINDOW` verifies, on / off, the exploration gap."""

    def __init__(self, prior_alpha: float):
        self.prior_alpha = prior_alpha
        self.runs: deque = deque(maxlen=RUN_WINDOW)  # (drafted, accepted)
        self.on = True
        self.refused = 0
        self.gap = EXPLORE
        self._surv: list[float] | None = None

    def add(self, drafted: int, accepted: int) -> None:
        self.runs.append((int(drafted), int(accepted)))
        self._surv = None

    def survival(self, k: int) -> list[float]:
        """[S(1), ..., S(k)]: the estimated probability that >= i drafts are accepted."""
        if self._surv is None or len(self._surv) < k:
            runs = list(self.runs)
            events = sum(int(a < d) for d, a in runs)
            exposure = sum(a + int(a < d) for d, a in runs)
            pooled = ((events + (1 - self.prior_alpha) * PRIOR_WEIGHT)
                      / (exposure + PRIOR_WEIGHT))
            surv, s = [], 1.0
            for i in range(1, k + 1):
                at_risk = sum(1 for d, a in runs if d >= i and a >= i - 1)
                rejected = sum(1 for d, a in runs if d >= i and a == i - 1)
                s *= 1 - (rejected + pooled * PRIOR_WEIGHT) / (at_risk + PRIOR_WEIGHT)
                surv.append(s)
            self._surv = surv
        return self._surv[:k]


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
        self._run = 0  # the matched run the last drafts came from

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
        room = min(self.policy.k_max, self.left, eng.n_ctx - eng.cache.length - 1)
        if eng._switch is not None and not eng._cache_long:
            room = min(room, eng._switch - eng.cache.length - 1)  # below LongRoPE's switch
        if room < K_MIN:
            return []
        j, run = self.index.match()
        if j < 0:
            return []
        k = min(room, max(self.policy.k, run))
        drafts = self.index.ids[j:j + k]
        if len(drafts) < K_MIN:
            return []
        if self.cost is not None:
            drafts = drafts[:self.cost.best_k(len(drafts), run, self.policy.k)]
        self._run = run
        return drafts if len(drafts) >= K_MIN else []

    def _finish_verify(self) -> None:
        self.policy.update(len(self._drafts), self._i)
        if self.cost is not None:
            self.cost.verify_time(len(self._drafts), self._t_verify, self._i, self._run)
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
