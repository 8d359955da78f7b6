"""The steps of the sampling chain as numpy reference functions (the public filters).

The chain, in order (:func:`edgeinfer.sampling.sample` composes these)::

    penalty_window -> apply_repetition_penalty -> apply_presence_frequency_penalty
        -> apply_temperature -> top_k_filter -> top_p_filter -> min_p_filter -> draw
    (temperature 0: greedy, the argmax of the penalized logits)

Each function is pure: it never modifies its input. The filters return a new float64
array ``[V]`` in which removed entries are ``-inf``; ``draw`` and ``greedy`` return an
id. All arithmetic is float64 (a softmax over 262144 logits in float32 loses the
tail). :class:`edgeinfer.sampling.Sampler` runs the same steps on a preallocated
workspace (``edgeinfer/_sampling_kernels.py``); tests/test_sampling_kernels.py checks
each of its kernels against the function here, bit for bit.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "apply_presence_frequency_penalty",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_token_mask",
    "draw",
    "draw_support",
    "greedy",
    "min_p_filter",
    "penalty_window",
    "top_k_filter",
    "top_p_filter",
]

# the chain's errors (ValueError), the same words from the references and the Sampler
BAD_LOGITS = "logits contain NaN or +inf (a numerical fault in the model forward)"
ALL_MASKED = "every logit is -inf; nothing can be sampled"
OVERFLOW = ("no finite logit left after penalties and temperature (overflow); lower the "
            "penalties or raise the temperature")


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


# The truncation filters work on a candidate set: ``vals`` [n] float64, the finite
# logits in ascending id order; each returns a keep mask [n] (None = keep all).
def _top_k_keep(vals: np.ndarray, k: int) -> np.ndarray | None:
    """The k largest values (ties with the k-th kept, as HF)."""
    n = vals.size
    if not 0 < k < n:
        return None
    kth = np.partition(vals, n - k)[n - k]  # k-th largest value, O(n)
    return vals >= kth


def _top_p_keep(vals: np.ndarray, top_p: float) -> np.ndarray | None:
    """The nucleus (HF TopPLogitsWarper).

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
    """p >= min_p * p_max (HF MinPLogitsWarper), in log space."""
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


# ---------------------------------------------------------------------------- penalties
def penalty_window(history: Sequence[int] | np.ndarray, last_n: int, vocab: int) -> np.ndarray:
    """The ids the penalties look at: the last ``last_n`` of ``history`` (llama.cpp
    ``repeat_last_n``); -1 = all of it (HF); 0 = none.

    Returns:
        int64 [n] ids.

    Raises:
        ValueError: an id outside [0, vocab).
    """
    ids = _history_ids(history, vocab)
    if last_n == 0:
        return ids[:0]
    return ids[-last_n:] if last_n > 0 else ids


def apply_repetition_penalty(logits: np.ndarray, history_ids: Sequence[int] | np.ndarray,
                             penalty: float) -> np.ndarray:
    """Penalize tokens seen in ``history_ids`` (CTRL, Keskar et al. 2019, as HF
    ``RepetitionPenaltyLogitsProcessor``).

    Each distinct id once: positive logits divided by ``penalty``, negative multiplied,
    so the token becomes less likely whatever its sign.

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
        u = np.unique(ids)
        s = x[u]
        x[u] = np.where(s < 0, s * float(penalty), s / float(penalty))
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
        u, counts = np.unique(ids, return_counts=True)
        x[u] -= counts * float(frequency) + float(presence)
    return x


# ---------------------------------------------------------------------------- temperature
def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """``logits / temperature`` as a new [V] float64 array.

    Raises:
        ValueError: ``temperature <= 0`` (0 is greedy decoding: :func:`greedy`, which
            takes the argmax without dividing).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to scale logits (0 = greedy), got {temperature!r}")
    return _as_f64_copy(logits) / float(temperature)


# ---------------------------------------------------------------------------- truncation
def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the ``k`` largest logits (and any tied with the k-th, as HF
    ``TopKLogitsWarper``); others become -inf.

    ``k <= 0`` or ``k >= V`` keeps everything. Returns a new [V] float64 array.
    """
    return _filter_full(logits, _top_k_keep, int(k))


def top_p_filter(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Nucleus filter (Holtzman et al. 2019, HF ``TopPLogitsWarper``).

    Keeps the most probable tokens whose cumulative probability reaches ``top_p``
    (precisely: drops ascending-sorted tokens whose cumulative mass is <= 1 - top_p;
    ties in ascending id order), always at least the most probable one. Returns a new
    [V] float64 array.

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


def apply_token_mask(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``logits`` as float64 with every id the bitmask does not allow set to -inf.

    ``mask`` is int32 [ceil(V/32)] (llguidance's layout): id ``i`` is allowed when bit
    ``i % 32`` of word ``i // 32`` is set; ids past ``32 * mask.size`` are not allowed.

    Raises:
        ValueError: ``mask`` is not a 1-D int32 array.
    """
    m = np.asarray(mask)
    if m.ndim != 1 or m.dtype != np.int32:
        raise ValueError(f"mask must be a 1-D int32 bitmask, got {m.dtype} {m.shape}")
    x = _as_f64_copy(logits)
    bits = np.unpackbits(m.view(np.uint8), bitorder="little")[:x.size].astype(bool)
    x[:bits.size][~bits] = -np.inf
    x[bits.size:] = -np.inf
    return x


# ---------------------------------------------------------------------------- the choice
def greedy(logits: np.ndarray, out: np.ndarray | None = None) -> int:
    """The argmax of ``logits`` [V] as given (float16/32/64; no float64 copy: the
    widening is exact, so the same id). ``out``: a 0-d intp array for the index, so
    that the call allocates nothing (None: numpy makes one).

    Raises:
        ValueError: NaN or +inf in ``logits``, or every logit -inf.
    """
    i = int(np.argmax(logits, out=out))  # the first NaN, else the first +inf, else the max
    m = float(logits[i])
    if math.isnan(m) or m == math.inf:
        raise ValueError(BAD_LOGITS)
    if m == -math.inf:
        raise ValueError(ALL_MASKED)
    return i


def draw_support(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What :func:`draw` picks from: the finite ids (int64 [n], ascending) and the
    cumulative sum of their unnormalized probabilities ``exp(logit - max)`` (float64 [n]).

    Raises:
        ValueError: no finite logit.
    """
    x = np.asarray(logits, dtype=np.float64)
    ids = np.flatnonzero(x > -np.inf)
    if ids.size == 0:
        raise ValueError(ALL_MASKED)
    vals = x[ids]
    return ids, np.cumsum(np.exp(vals - vals.max()))


def draw(logits: np.ndarray, rng: np.random.Generator) -> int:
    """A token from the softmax of the finite ``logits`` [V], by inverse CDF over
    ascending ids with exactly one ``rng.random()``.

    Raises:
        ValueError: no finite logit.
    """
    ids, cdf = draw_support(logits)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[min(i, ids.size - 1)])
