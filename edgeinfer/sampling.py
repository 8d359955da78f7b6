"""Token sampling: one chain, written once as numpy references and once allocation-free.

Chain, in this order::

    penalties (repetition, then presence/frequency)  ->  temperature
        ->  top-k  ->  top-p  ->  min-p  ->  draw from the softmax of what is left

This is the Hugging Face ``generate`` order (processors, then ``TemperatureLogitsWarper``
before ``TopK``/``TopP``/``MinP``), so results match the reference implementation and
the papers (min-p, Nguyen et al. 2024, defines its threshold on the tempered
distribution). llama.cpp applies temperature *last*
(https://github.com/ggml-org/llama.cpp/issues/4091; its chain is penalties → top-k →
top-p → min-p → temperature → dist), which changes the kept set: probs [0.80, 0.15,
0.05] with min_p 0.1 and temperature 2 keep {0, 1, 2} here and {0, 1} in llama.cpp.

A token mask (constrained decoding, :mod:`edgeinfer.constrained`) comes first: the ids
it does not allow are -inf before any step, so the penalties, temperature and filters
only ever see allowed ids.

Temperature 0 means greedy: argmax of the penalized logits. It never divides, and it
ignores top-k/top-p/min-p and the random generator (penalties still apply: they are
processors, not samplers, as in HF and llama.cpp).

Each step is a pure numpy function in :mod:`edgeinfer.sampling_steps` (re-exported here:
the public filters); :func:`sample` is their composition, the definition. A
:class:`Sampler` runs the same chain on a workspace allocated once per stream (a decode
step allocates nothing; the engine keeps one) and picks the same ids, bit for bit.
Randomness comes only from the ``numpy.random.Generator`` passed in, one ``random()``
per sampled token: the same seed and inputs give the same tokens.

:data:`DEFAULTS` are the settings of a caller that gives none (llama.cpp's);
:func:`sampling_defaults` lays a model's generation config over them.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .sampling_steps import (
    ALL_MASKED,
    BAD_LOGITS,
    OVERFLOW,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    apply_temperature,
    apply_token_mask,
    draw,
    draw_support,
    greedy,
    min_p_filter,
    penalty_window,
    top_k_filter,
    top_p_filter,
)

log = logging.getLogger("edgeinfer")

__all__ = [
    "DEFAULTS",
    "MODEL_FIELDS",
    "Sampler",
    "SamplingParams",
    "apply_presence_frequency_penalty",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_token_mask",
    "draw",
    "draw_support",
    "greedy",
    "make_rng",
    "min_p_filter",
    "penalty_window",
    "sample",
    "sampling_defaults",
    "top_k_filter",
    "top_p_filter",
]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; the field defaults are :data:`DEFAULTS` (llama.cpp's).

    Attributes:
        temperature: divide logits by this; 0 = greedy argmax. >= 0.
        top_k: keep the k largest logits (ties at the k-th kept too, as HF); 0 = off.
        top_p: keep the smallest top set whose probability mass >= top_p; 1 = off. (0, 1].
        min_p: keep tokens with p >= min_p * p_max; 0 = off. [0, 1].
        repetition_penalty: HF/CTRL penalty on tokens in the recent history; 1 = off. > 0.
        presence_penalty: OpenAI-style, subtract once per token present; 0 = off.
        frequency_penalty: OpenAI-style, subtract per occurrence; 0 = off.
        penalty_last_n: how many of the most recent history ids the penalties look at
            (llama.cpp ``repeat_last_n``); -1 = the whole history (HF); 0 = penalties off.
        seed: seed for ``make_rng``; None = fresh OS entropy.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        """Validate. Raises ValueError naming the bad field and value."""
        def real(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
                    or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            return float(v)

        def integer(name: str) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {v!r}")  # noqa: TRY004
            return int(v)

        if real("temperature") < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if integer("top_k") < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k!r}")
        if not 0.0 < real("top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {self.top_p!r}")
        if not 0.0 <= real("min_p") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = disabled), got {self.min_p!r}")
        if real("repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = disabled), "
                             f"got {self.repetition_penalty!r}")
        real("presence_penalty")
        real("frequency_penalty")
        if integer("penalty_last_n") < -1:
            raise ValueError(f"penalty_last_n must be >= -1 (-1 = whole history, 0 = off), "
                             f"got {self.penalty_last_n!r}")
        if self.seed is not None and (integer("seed") < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0`` (argmax decoding)."""
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """True when a penalty changes any logit (a window and a non-neutral value)."""
        return self.penalty_last_n != 0 and (self.repetition_penalty != 1.0 or
                                             bool(self.presence_penalty) or
                                             bool(self.frequency_penalty))


#: The settings of a caller that gives none: llama.cpp's CLI and server defaults. The
#: CLI, the API and the server take their defaults from here; a model's generation
#: config overrides :data:`MODEL_FIELDS` of it (:func:`sampling_defaults`).
DEFAULTS = SamplingParams()

#: The fields a model's ``generation_config.json`` may set (its HF key names).
MODEL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation: Mapping | None, base: SamplingParams = DEFAULTS) -> dict:
    """A model's recommended settings: its generation config over ``base``.

    Args:
        generation: ``generation_config.json`` values (``ModelSource.generation``); the
            :data:`MODEL_FIELDS` keys are taken, and an explicit ``"do_sample": false``
            means greedy (temperature 0), as in HF.
        base: the values of the keys the config does not set.

    Returns:
        dict of the :data:`MODEL_FIELDS` fields. A value the sampler would refuse (say, a
        negative temperature) is ignored with a warning.
    """
    out = {key: getattr(base, key) for key in MODEL_FIELDS}
    gen = generation or {}
    for key in MODEL_FIELDS:
        v = gen.get(key)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        try:
            dataclasses.replace(base, **{**out, key: v})
        except ValueError as e:
            log.warning("ignoring generation config %s=%r: %s", key, v, e)
            continue
        out[key] = int(v) if key == "top_k" else float(v)
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def make_rng(seed: int | None) -> np.random.Generator:
    """The generator ``sample`` draws from: ``numpy.random.default_rng(seed)`` (PCG64)."""
    return np.random.default_rng(seed)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           history: Sequence[int] | np.ndarray = (), mask: np.ndarray | None = None) -> int:
    """Pick the next token id from ``logits``: the chain of the numpy references.

    The definition that :class:`Sampler` reproduces bit for bit; it allocates [V]
    arrays per step, so a decode loop keeps one ``Sampler`` per stream instead (as
    :meth:`edgeinfer.engine.Engine.stream`).

    Args:
        logits: [V] float16/32/64 logits of the last position (not modified).
        params: validated ``SamplingParams``.
        rng: the generator to draw from (``make_rng(params.seed)``, kept for the whole
            generation so that a seed fixes the entire sequence). Unused when greedy.
        history: ids seen so far, prompt included; the penalties use the last
            ``params.penalty_last_n`` of them.
        mask: the allowed ids, an int32 bitmask [ceil(V/32)] (:func:`apply_token_mask`);
            None allows every id.

    Returns:
        A token id in [0, V) as a Python int.

    Raises:
        ValueError: logits not 1-D, containing NaN or +inf (greedy and unpenalized: an
            allowed logit NaN or +inf), or all -inf (or all masked); history ids out
            of range; or (sampling only) no finite logit left, or +inf, after penalties
            and temperature (float64 logits near 1e308, or penalties that overflow).
    """
    x = np.asarray(logits)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array [V], got shape {x.shape}")
    if params.temperature == 0 and not params.penalized:
        return greedy(x if mask is None else apply_token_mask(x, mask))
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError(BAD_LOGITS)
    if params.penalized:
        ids = penalty_window(history, params.penalty_last_n, x.size)
        x = apply_repetition_penalty(x, ids, params.repetition_penalty)
        x = apply_presence_frequency_penalty(x, ids, params.presence_penalty,
                                             params.frequency_penalty)
        if np.isnan(x).any():
            raise ValueError(BAD_LOGITS)
    if mask is not None:
        x = apply_token_mask(x, mask)
    if x.max() == -np.inf:
        raise ValueError(ALL_MASKED)
    if params.temperature == 0:
        return int(np.argmax(x))
    x = apply_temperature(x, params.temperature)
    if x.max() in (np.inf, -np.inf):
        raise ValueError(OVERFLOW)
    x = top_k_filter(x, params.top_k)
    x = top_p_filter(x, params.top_p)
    x = min_p_filter(x, params.min_p)
    return draw(x, rng)


# ---------------------------------------------------------------- allocation-free sampler
# The chain on a workspace allocated once: numpy ufuncs with ``out=`` for the floating
# point, Numba kernels for the rest (edgeinfer/_sampling_kernels.py says why the split
# keeps the token choices bit-identical to the references). Imported by the first
# ``Sampler.start`` that needs them: ``import edgeinfer.api`` must not import Numba.
_EMPTY_I64 = np.zeros(0, np.int64)
_EMPTY_F64 = np.zeros(0, np.float64)
_GREEDY = SamplingParams(temperature=0.0)


class Sampler:
    """A sampling workspace: :func:`sample`'s chain with no allocation per token.

    One per generation stream (it holds the penalty window of that stream); reusable
    across streams through :meth:`start`. Not thread-safe: one thread at a time.

    Workspace (allocated by :meth:`start` on first need, then reused; V = ``vocab``):
    ``x`` the float64 working copy of the logits [V]; the candidate set, ``idx`` int64 /
    ``vals`` float64 [V], ascending ids; ``t``, ``p``, ``cp`` float64 [V] scratch (``t``
    holds the last draw's cumulative weights); ``heap`` [top_k] for top-k; with
    penalties, ``counts`` / ``distinct`` / ``where`` int64 [V] and a [penalty_last_n]
    ``ring`` (``_sampling_kernels._window_push`` describes them).

    Usage::

        s = Sampler(vocab); s.start(params, prompt_ids)
        tok = s.sample(logits, rng); s.accept(tok)   # per token

    ``sample(logits, rng)`` after ``start(params, history)`` returns what
    ``sample(logits, params, rng, history)`` does, drawing the same single
    ``rng.random()`` per non-greedy token.
    """

    def __init__(self, vocab: int) -> None:
        if vocab < 1:
            raise ValueError(f"vocab must be >= 1, got {vocab}")
        self.vocab = int(vocab)
        self.params = _GREEDY
        self._penalized = False
        self._k = None  # the kernels module, imported on first need
        self.x = self.vals = self.t = self.p = self.cp = self.heap = _EMPTY_F64
        self.idx = self.counts = self.distinct = self.where = _EMPTY_I64
        self.ring = _EMPTY_I64  # the last penalty_last_n ids (size 0: the whole history)
        self.state = np.zeros(3, np.int64)  # the window's (n_distinct, ring length, position)
        self.n = 0  # the support size of the last draw
        self._zi = np.zeros((), np.intp)    # argmax result
        self._z = np.zeros((), np.float64)  # reductions' result / broadcast scalar
        self._one = np.zeros(1, np.int64)   # accept()'s id

    def start(self, params: SamplingParams, history: Sequence[int] | np.ndarray = ()) -> None:
        """Begin a sequence: take ``params`` and fill the penalty window from ``history``
        (the ids seen so far, prompt included). Allocates what ``params`` need.

        Raises:
            ValueError: history ids outside [0, vocab) (only checked when penalized).
        """
        V = self.vocab
        self.params = params
        self._penalized = params.penalized
        if self._k is None and (self._penalized or params.temperature > 0):
            from . import _sampling_kernels
            self._k = _sampling_kernels
        if self._penalized:
            ids = np.ascontiguousarray(penalty_window(history, params.penalty_last_n, V))
            if self.counts.size < V:
                self.counts, self.distinct, self.where = (np.zeros(V, np.int64) for _ in range(3))
            self._k._window_clear(self.counts, self.distinct, self.state)
            n_ring = max(params.penalty_last_n, 0)
            if self.ring.size != n_ring:
                self.ring = np.zeros(n_ring, np.int64)
            self._k._window_push(ids, self.counts, self.distinct, self.where, self.ring,
                                 self.state)
        if params.temperature > 0 or self._penalized:
            if self.x.size < V:
                self.x, self.vals, self.t, self.p, self.cp = (np.zeros(V) for _ in range(5))
                self.idx = np.zeros(V, np.int64)
            k = min(max(params.top_k, 1), V)
            if self.heap.size < k:
                self.heap = np.zeros(k)

    def accept(self, token: int) -> None:
        """Append a sampled (or forced) id to the penalty window; O(1), no allocation.

        Raises:
            ValueError: ``token`` outside [0, vocab).
        """
        if not self._penalized:
            return
        if not 0 <= token < self.vocab:
            raise ValueError(f"history ids must be in [0, {self.vocab}), got range "
                             f"[{token}, {token}]")
        self._one[0] = token
        self._k._window_push(self._one, self.counts, self.distinct, self.where, self.ring,
                             self.state)

    def sample(self, logits: np.ndarray, rng: np.random.Generator,
               mask: np.ndarray | None = None) -> int:
        """Pick the next id from ``logits`` [V] (float16/32/64, not modified).

        ``mask``: the allowed ids, int32 [ceil(V/32)] (:func:`apply_token_mask`'s layout;
        one row of a batch's [B, ceil(V/32)] array); None allows every id. Masked, a
        step still allocates nothing.

        Returns:
            A token id in [0, V) as a Python int.

        Raises:
            ValueError: as :func:`sample`, with the same messages.
        """
        x = np.asarray(logits)  # (an ndarray is passed through: no copy)
        if x.ndim != 1 or x.size != self.vocab:
            raise ValueError(f"logits must be a 1-D array [{self.vocab}], got shape {x.shape}")
        params = self.params
        if mask is not None and self._k is None:
            from . import _sampling_kernels
            self._k = _sampling_kernels
        if params.temperature == 0 and not self._penalized:
            if mask is None:
                return greedy(x, self._zi)
            i = self._k._masked_argmax(x, mask)
            if i < 0:
                raise ValueError(BAD_LOGITS if i == -1 else ALL_MASKED)
            return int(i)
        self._penalize(x)
        if mask is not None and self._k._apply_mask(self.x, mask) == 0:
            raise ValueError(ALL_MASKED)
        if params.temperature == 0:
            np.argmax(self.x, out=self._zi)
            return int(self._zi)
        n, m = self._k._temper_top_k(self.x, float(params.temperature), int(params.top_k),
                                     self.heap, self.idx, self.vals, self.p)
        if n == 0 or m == math.inf:
            raise ValueError(OVERFLOW)
        if params.top_p < 1.0:
            n, m = self._top_p(n, m, float(params.top_p))
        if params.min_p > 0.0:
            n, m = self._k._min_p_compact(self.idx, self.vals, n, m + math.log(params.min_p))
        return self._draw(n, m, rng.random())

    # ---- the steps (each one checked against its reference in test_sampling_kernels) --
    def _penalize(self, x: np.ndarray) -> None:
        """``self.x = x`` as float64 with the penalties applied (``apply_repetition_penalty``
        then ``apply_presence_frequency_penalty`` over the window). Raises ValueError."""
        src = x
        if x.dtype != np.float32 and x.dtype != np.float64:  # (2 compiled signatures)
            np.copyto(self.x, x)
            src = self.x
        params = self.params
        nd = int(self.state[0]) if self._penalized else 0
        status = self._k._load_penalize(src, self.x, self.counts, self.distinct, nd,
                                        float(params.repetition_penalty),
                                        float(params.presence_penalty),
                                        float(params.frequency_penalty))
        if status == 1:
            raise ValueError(BAD_LOGITS)
        if status == 2:
            raise ValueError(ALL_MASKED)

    def _top_p(self, n: int, m: float, top_p: float) -> tuple[int, float]:
        """Narrow the candidates ``idx[:n]``/``vals[:n]`` (``m`` their max) to the nucleus
        (``top_p_filter``); returns (n', max of vals[:n'])."""
        t, p, cp, z = self.t, self.p, self.cp, self._z
        z[()] = m
        np.subtract(self.vals[:n], z, out=t[:n])
        np.exp(t[:n], out=p[:n])
        np.add.reduce(p[:n], out=z)
        np.divide(p[:n], z, out=p[:n])
        thr = (1.0 - top_p) / n  # below it: dropped before sorting (exact)
        k = self._k._gather_above(p, n, thr, cp)
        np.add.reduce(cp[:k], out=z)
        z[()] = 1.0 - z[()]  # the pre-dropped mass, first in the cumulative sum
        cp[:k].sort()
        np.cumsum(cp[:k], out=t[:k])
        np.add(t[:k], z, out=t[:k])
        return self._k._top_p_compact(p, n, thr, cp, t, k, 1.0 - top_p, self.idx, self.vals)

    def _draw(self, n: int, m: float, u: float) -> int:
        """The id at ``u`` in [0, 1) of the inverse CDF over ``idx[:n]`` (``draw``, its
        ``rng.random()`` being ``u``); ``m`` = max of vals[:n]. Leaves the cumulative
        weights in ``t[:n]`` (``draw_support``)."""
        t, z = self.t, self._z
        z[()] = m
        np.subtract(self.vals[:n], z, out=t[:n])
        np.exp(t[:n], out=self.p[:n])
        np.cumsum(self.p[:n], out=t[:n])
        i = self._k._search_right(t, n, u * t[n - 1])
        self.n = n
        return int(self.idx[min(i, n - 1)])

    def support(self) -> tuple[np.ndarray, np.ndarray]:
        """Views of the last draw's support: ids int64 [n] and cumulative weights
        float64 [n] (what :func:`draw_support` gives for the chain's last vector)."""
        return self.idx[:self.n], self.t[:self.n]
