"""Token sampling: logit processors and truncation samplers as pure numpy functions.

Chain, in this order (``sample``)::

    penalties (repetition, then presence/frequency)  ->  temperature
        ->  top-k  ->  top-p  ->  min-p  ->  draw from the softmax of what is left

This is the Hugging Face ``generate`` order (processors, then ``TemperatureLogitsWarper``
before ``TopK``/``TopP``/``MinP``), so results match the reference implementation and
the papers (min-p, Nguyen et al. 2024, defines its threshold on the tempered
distribution). llama.cpp applies temperature *last* (llama.cpp#4091, its sampler chain
penalties → top-k → top-p → min-p → temperature → dist), which changes the kept set:
case C24, probs [0.80, 0.15, 0.05] with min_p 0.1 and temperature 2 keeps {0, 1, 2}
here and {0, 1} in llama.cpp.

Temperature 0 means greedy: argmax of the penalized logits. It never divides, and it
ignores top-k/top-p/min-p and the random generator (penalties still apply: they are
processors, not samplers, as in HF and llama.cpp).

All arithmetic is float64 (a softmax over 262144 logits in float32 loses the tail).
Public filters never modify their input; they return a new float64 array of the same
shape ``[V]`` where removed entries are ``-inf``. :class:`Sampler` runs the chain on a
workspace allocated once per stream (a decode step allocates nothing; the engine keeps
one); ``sample`` is the one-shot form. Randomness comes only from the
``numpy.random.Generator`` passed in, one ``random()`` per sampled token: the same seed
and inputs give the same tokens.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Sampler",
    "SamplingParams",
    "apply_presence_frequency_penalty",
    "apply_repetition_penalty",
    "apply_temperature",
    "make_rng",
    "min_p_filter",
    "sample",
    "top_k_filter",
    "top_p_filter",
]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; defaults follow llama.cpp's CLI.

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


def make_rng(seed: int | None) -> np.random.Generator:
    """The generator ``sample`` draws from: ``numpy.random.default_rng(seed)`` (PCG64)."""
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------- helpers
def _as_f64_copy(logits: np.ndarray) -> np.ndarray:
    """A float64 copy of a 1-D logits vector. Raises ValueError for other shapes."""
    x = np.array(logits, dtype=np.float64, copy=True)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array [V], got shape {x.shape}")
    return x


def _history_ids(history: Sequence[int] | np.ndarray, vocab: int) -> np.ndarray:
    """History as int64 ids [n]. Raises ValueError for ids outside [0, vocab)."""
    ids = np.asarray(history, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"history ids must be in [0, {vocab}), got range "
                         f"[{ids.min()}, {ids.max()}]")
    return ids


def _repetition_penalty_(x: np.ndarray, ids: np.ndarray, penalty: float) -> None:
    # CTRL (Keskar et al. 2019) as implemented by HF RepetitionPenaltyLogitsProcessor:
    # each distinct seen token once, positive logits divided, negative multiplied, so
    # the token always becomes less likely whatever its sign.
    u = np.unique(ids)
    s = x[u]
    x[u] = np.where(s < 0, s * penalty, s / penalty)


def _presence_frequency_(x: np.ndarray, ids: np.ndarray, presence: float, frequency: float) -> None:
    # OpenAI API definition: logit[j] -= c[j] * frequency + (c[j] > 0) * presence.
    u, counts = np.unique(ids, return_counts=True)
    x[u] -= counts * frequency + presence


# The truncation samplers work on a candidate set: ``idx`` [n] int64 token ids and
# ``vals`` [n] float64 their logits. ``sample`` narrows the set step by step (after top-k
# it holds ~k entries, so top-p and min-p cost O(k log k), not O(V log V)); the public
# ``*_filter`` functions run the same code on the full vocabulary.
def _top_k_keep(vals: np.ndarray, k: int) -> np.ndarray | None:
    """Mask [n] of the k largest values (ties with the k-th kept, as HF); None = keep all."""
    n = vals.size
    if not 0 < k < n:
        return None
    kth = np.partition(vals, n - k)[n - k]  # k-th largest value, O(n)
    return vals >= kth


def _top_p_keep(vals: np.ndarray, top_p: float) -> np.ndarray | None:
    """Mask [n] of the nucleus (HF TopPLogitsWarper); None = keep all.

    HF sorts ascending and drops tokens whose cumulative probability is <= 1 - top_p,
    always keeping the largest. Tokens with p <= (1 - top_p) / n can be dropped before
    sorting (exact: together they weigh <= 1 - top_p and they are the smallest), so the
    sort only sees the plausible candidates.
    """
    if top_p >= 1.0:
        return None
    p = np.exp(vals - vals.max())
    p /= p.sum()
    cand = np.flatnonzero(p > (1.0 - top_p) / vals.size)
    order = cand[np.argsort(p[cand], kind="stable")]  # ascending probability
    cum = np.cumsum(p[order]) + (1.0 - p[cand].sum())  # pre-dropped mass comes first
    remove = cum <= 1.0 - top_p
    remove[-1] = False
    keep = np.zeros(vals.size, dtype=bool)
    keep[order[~remove]] = True
    return keep


def _min_p_keep(vals: np.ndarray, min_p: float) -> np.ndarray | None:
    """Mask [n] of p >= min_p * p_max (HF MinPLogitsWarper), in log space; None = keep all."""
    if min_p <= 0.0:
        return None
    return vals >= vals.max() + math.log(min_p)  # the max itself always survives


def _filter_full(logits: np.ndarray, keep_fn, arg) -> np.ndarray:
    """Apply a candidate-set filter to a whole [V] vector: new float64 array, -inf where dropped."""
    x = _as_f64_copy(logits)
    idx = np.flatnonzero(x > -np.inf)
    if idx.size == 0:
        return x
    keep = keep_fn(x[idx], arg)
    if keep is not None:
        drop = np.ones(x.size, dtype=bool)
        drop[idx[keep]] = False
        np.copyto(x, -np.inf, where=drop)  # (boolean-index assignment is 10x slower)
    return x


# ---------------------------------------------------------------------------- public API
def apply_repetition_penalty(logits: np.ndarray, history_ids: Sequence[int] | np.ndarray,
                             penalty: float) -> np.ndarray:
    """Penalize tokens seen in ``history_ids`` (HF ``RepetitionPenaltyLogitsProcessor``).

    Each distinct id once: positive logits divided by ``penalty``, negative multiplied.

    Args:
        logits: [V] float array.
        history_ids: ids seen so far (prompt + generated, or a recent window).
        penalty: > 0; 1 = no change, > 1 discourages repetition.

    Returns:
        New [V] float64 array.

    Raises:
        ValueError: ``penalty <= 0``, bad logits shape, or an id outside [0, V).
    """
    if not penalty > 0:
        raise ValueError(f"repetition penalty must be > 0, got {penalty!r}")
    x = _as_f64_copy(logits)
    ids = _history_ids(history_ids, x.size)
    if ids.size and penalty != 1.0:
        _repetition_penalty_(x, ids, float(penalty))
    return x


def apply_presence_frequency_penalty(logits: np.ndarray, history_ids: Sequence[int] | np.ndarray,
                                     presence: float, frequency: float) -> np.ndarray:
    """OpenAI presence/frequency penalties: ``logit[j] -= count[j]*frequency + (count[j]>0)*presence``.

    Args:
        logits: [V] float array. history_ids: ids seen. presence, frequency: finite floats.

    Returns:
        New [V] float64 array.

    Raises:
        ValueError: bad logits shape or an id outside [0, V).
    """
    x = _as_f64_copy(logits)
    ids = _history_ids(history_ids, x.size)
    if ids.size and (presence or frequency):
        _presence_frequency_(x, ids, float(presence), float(frequency))
    return x


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """``logits / temperature`` as a new [V] float64 array.

    Raises:
        ValueError: ``temperature <= 0`` (0 is greedy decoding; use ``sample``, which
            takes the argmax without dividing).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to scale logits (0 = greedy), got {temperature!r}")
    return _as_f64_copy(logits) / float(temperature)


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the ``k`` largest logits (and any tied with the k-th); others become -inf.

    ``k <= 0`` or ``k >= V`` keeps everything. Returns a new [V] float64 array.
    """
    return _filter_full(logits, _top_k_keep, int(k))


def top_p_filter(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Nucleus filter (Holtzman et al. 2019, HF ``TopPLogitsWarper``).

    Keeps the most probable tokens whose cumulative probability reaches ``top_p``
    (precisely: drops ascending-sorted tokens whose cumulative mass is <= 1 - top_p),
    always at least the most probable one. Returns a new [V] float64 array.

    Raises:
        ValueError: ``top_p`` outside (0, 1].
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return _filter_full(logits, _top_p_keep, float(top_p))


def min_p_filter(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Min-p filter (Nguyen et al. 2024, HF ``MinPLogitsWarper``): drop p < min_p * p_max.

    Returns a new [V] float64 array; ``min_p == 0`` keeps everything.

    Raises:
        ValueError: ``min_p`` outside [0, 1].
    """
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    return _filter_full(logits, _min_p_keep, float(min_p))


# ---------------------------------------------------------------- allocation-free sampler
# The chain on a workspace allocated once: numpy ufuncs with ``out=`` for the floating
# point, Numba kernels for the rest (edgeinfer/_sampling_kernels.py says why the split
# keeps the token choices bit-identical to the plain numpy chain). Imported by the first
# ``Sampler.start`` that needs them: ``import edgeinfer.api`` must not import Numba.
def _greedy(x: np.ndarray, out: np.ndarray | None) -> int:
    """Plain greedy: argmax of ``x`` [V] as given, no float64 copy (the widening is exact,
    so the same id). ``out``: a 0-d intp array for the index (None: numpy makes one)."""
    i = int(np.argmax(x, out=out))  # the first NaN, else the first +inf, else the max
    m = float(x[i])
    if math.isnan(m) or m == math.inf:
        raise ValueError("logits contain NaN or +inf (a numerical fault in the model forward)")
    if m == -math.inf:
        raise ValueError("every logit is -inf; nothing can be sampled")
    return i


class Sampler:
    """A sampling workspace: ``sample``'s chain with no allocation per token.

    One per generation stream (it holds the penalty window of that stream); reusable
    across streams through :meth:`start`. Not thread-safe: one thread at a time.

    Buffers (allocated by :meth:`start` on first need, then reused; V = ``vocab``):
    the float64 working copy of the logits, candidate ids int64 / logits float64,
    probability and cumulative-sum scratch float64, all [V]; a [top_k] heap; with
    penalties, counts / distinct ids / positions int64 [V] and a [penalty_last_n] ring.

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
        self.params = SamplingParams(temperature=0.0)
        self._penalized = False
        self._buf: dict[str, np.ndarray] = {}
        self._zi = np.zeros((), np.intp)   # argmax result
        self._z = np.zeros((), np.float64)  # reductions' result / broadcast scalar
        self._ring = np.zeros(0, np.int64)  # also the empty int64 array of the unpenalized
        self._state = np.zeros(3, np.int64)
        self._one = np.zeros(1, np.int64)  # accept()'s id
        self._k = None  # the kernels module, imported on first need

    def _get(self, name: str, n: int, dtype=np.float64) -> np.ndarray:
        a = self._buf.get(name)
        if a is None or a.size < n:
            a = self._buf[name] = np.zeros(n, dtype)
        return a

    def start(self, params: SamplingParams, history: Sequence[int] | np.ndarray = ()) -> None:
        """Begin a sequence: take ``params`` and fill the penalty window from ``history``
        (the ids seen so far, prompt included). Allocates what ``params`` need.

        Raises:
            ValueError: history ids outside [0, vocab) (only checked when penalized).
        """
        V = self.vocab
        n = params.penalty_last_n
        self.params = params
        self._penalized = bool(n != 0 and (params.repetition_penalty != 1.0 or
                                           params.presence_penalty or params.frequency_penalty))
        if self._k is None and (self._penalized or params.temperature > 0):
            from . import _sampling_kernels
            self._k = _sampling_kernels
        K = self._k
        if self._penalized:
            ids = _history_ids(history, V)
            ids = np.ascontiguousarray(ids[-n:] if n > 0 else ids)
            counts = self._get("counts", V, np.int64)
            distinct = self._get("distinct", V, np.int64)
            K._window_clear(counts, distinct, self._state)
            if self._ring.size != max(n, 0):
                self._ring = np.zeros(max(n, 0), np.int64)
            K._window_push(ids, counts, distinct, self._get("where", V, np.int64),
                           self._ring, self._state)
        if params.temperature > 0 or self._penalized:
            for name in ("x", "vals", "t", "p", "cp"):
                self._get(name, V)
            self._get("idx", V, np.int64)
            self._get("heap", min(max(params.top_k, 1), V))

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
        self._k._window_push(self._one, self._buf["counts"], self._buf["distinct"],
                             self._buf["where"], self._ring, self._state)

    def sample(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """Pick the next id from ``logits`` [V] (float16/32/64, not modified).

        Returns:
            A token id in [0, V) as a Python int.

        Raises:
            ValueError: logits not [V], containing NaN or +inf, or all -inf; or (sampling
                only) no finite logit left, or +inf, after penalties and temperature
                (float64 logits near 1e308 or penalties that overflow; the numpy chain
                crashed there or drew from NaNs).
        """
        x = np.asarray(logits)  # (an ndarray is passed through: no copy)
        if x.ndim != 1 or x.size != self.vocab:
            raise ValueError(f"logits must be a 1-D array [{self.vocab}], got shape {x.shape}")
        params = self.params
        if params.temperature == 0 and not self._penalized:
            return _greedy(x, self._zi)
        b = self._buf
        xf = b["x"]  # [V] float64 working copy
        src = x
        if x.dtype != np.float32 and x.dtype != np.float64:  # (2 compiled signatures)
            np.copyto(xf, x)
            src = xf
        nd = int(self._state[0]) if self._penalized else 0
        none = self._ring[:0]  # int64 [0]: one compiled signature for both cases
        K = self._k
        status = K._load_penalize(src, xf, b.get("counts", none), b.get("distinct", none), nd,
                                  float(params.repetition_penalty),
                                  float(params.presence_penalty), float(params.frequency_penalty))
        if status == 1:
            raise ValueError("logits contain NaN or +inf (a numerical fault in the model forward)")
        if status == 2:
            raise ValueError("every logit is -inf; nothing can be sampled")
        if params.temperature == 0:
            np.argmax(xf, out=self._zi)
            return int(self._zi)
        idx, vals, t, p, z = b["idx"], b["vals"], b["t"], b["p"], self._z
        n, m = K._temper_top_k(xf, float(params.temperature), int(params.top_k), b["heap"],
                               idx, vals, p)
        if n == 0 or m == math.inf:
            raise ValueError("no finite logit left after penalties and temperature "
                             "(overflow); lower the penalties or raise the temperature")
        if params.top_p < 1.0:
            z[()] = m
            np.subtract(vals[:n], z, out=t[:n])
            np.exp(t[:n], out=p[:n])
            np.add.reduce(p[:n], out=z)
            np.divide(p[:n], z, out=p[:n])
            thr = (1.0 - params.top_p) / n  # below it: dropped before sorting (exact)
            cp = b["cp"]
            k = K._gather_above(p, n, thr, cp)
            np.add.reduce(cp[:k], out=z)
            z[()] = 1.0 - z[()]  # the pre-dropped mass, first in the cumulative sum
            cp[:k].sort()
            np.cumsum(cp[:k], out=t[:k])
            np.add(t[:k], z, out=t[:k])
            n, m = K._top_p_compact(p, n, thr, cp, t, k, 1.0 - params.top_p, idx, vals)
        if params.min_p > 0.0:
            n, m = K._min_p_compact(idx, vals, n, m + math.log(params.min_p))
        # inverse CDF over the survivors (ascending ids): one uniform number per token
        z[()] = m
        np.subtract(vals[:n], z, out=t[:n])
        np.exp(t[:n], out=p[:n])
        np.cumsum(p[:n], out=t[:n])
        i = K._search_right(t, n, rng.random() * t[n - 1])
        self._n = n  # the support size of the last draw (tests compare idx[:n], t[:n])
        return int(idx[min(i, n - 1)])


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           history: Sequence[int] | np.ndarray = ()) -> int:
    """Pick the next token id from ``logits`` with the chain in the module docstring.

    A one-shot :class:`Sampler` (its buffers allocated for this call); a decode loop
    keeps one ``Sampler`` per stream instead (as :meth:`edgeinfer.engine.Engine.stream`).

    Args:
        logits: [V] float16/32/64 logits of the last position (not modified).
        params: validated ``SamplingParams``.
        rng: the generator to draw from (``make_rng(params.seed)``, kept for the whole
            generation so that a seed fixes the entire sequence). Unused when greedy.
        history: ids seen so far, prompt included; the penalties use the last
            ``params.penalty_last_n`` of them.

    Returns:
        A token id in [0, V) as a Python int.

    Raises:
        ValueError: logits not 1-D, containing NaN or +inf, or all -inf; history ids out
            of range.
    """
    x = np.asarray(logits)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array [V], got shape {x.shape}")
    if params.temperature == 0 and (params.penalty_last_n == 0 or (
            params.repetition_penalty == 1.0 and not params.presence_penalty
            and not params.frequency_penalty)):
        return _greedy(x, None)  # no workspace needed
    s = Sampler(x.size)
    s.start(params, history)
    return s.sample(x, rng)
