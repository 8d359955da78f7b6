"""Numba kernels of :class:`edgeinfer.sampling.Sampler` (allocation-free sampling).

Each works in place on the sampler's preallocated buffers and allocates nothing (no
``np.empty`` inside: Numba's runtime counts those, see tests/test_decode_alloc.py).
Shapes: V = vocabulary size; ``x``/``vals``/``scratch`` float64, ``idx``/``counts``/
``distinct``/``where`` int64.

Why a split with numpy (which ``Sampler.sample`` calls between these): the token
choices must stay bit-identical to the numpy references in
:mod:`edgeinfer.sampling_steps`. Every floating-point result that numpy computes with
its own algorithms (``exp``, whose AVX512F float64 code need not match libm's last bit;
the pairwise ``sum``; ``cumsum``) is still computed by the same numpy call, with ``out=``
on the workspace; these kernels do only what is exact whatever the code: comparisons,
max, selection, compaction, and one IEEE division / multiplication / subtraction per
element in numpy's order of operations. tests/test_sampling_kernels.py checks each one
against its reference.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True)
def _load_penalize(src, x, counts, distinct, n_distinct, rep, presence, frequency):
    """``x[:] = src`` (float32/64 [V] -> f64), reject NaN/+inf, apply the penalties in place.

    ``distinct[:n_distinct]`` [int64] are the ids in the penalty window and ``counts``
    [V] int64 their occurrences. Returns 1 (NaN or +inf: in ``src``, or NaN made by the
    penalties), 2 (every logit -inf after the penalties) or 0. One branch-free pass over
    V (vectorized); the penalties touch only the distinct ids.
    """
    bad = False
    n_finite = 0
    for j in range(x.size):
        v = np.float64(src[j])
        x[j] = v
        bad |= math.isnan(v) | (v == np.inf)
        n_finite += v > -np.inf
    if bad:
        return 1
    for d in range(n_distinct):
        j = distinct[d]
        finite = x[j] > -np.inf
        if rep != 1.0:  # HF/CTRL: each distinct id once, sign-aware
            s = x[j]
            x[j] = s * rep if s < 0 else s / rep
        if presence != 0.0 or frequency != 0.0:  # OpenAI: c*frequency + presence
            x[j] -= counts[j] * frequency + presence
        if math.isnan(x[j]):
            return 1
        n_finite -= finite and x[j] == -np.inf  # (overflow: -1e308 * 1.2)
    return 2 if n_finite == 0 else 0


@njit(cache=True)
def _sift_down(h, i, n):
    """Restore the min-heap ``h[:n]`` below position ``i``."""
    v = h[i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and h[c + 1] < h[c]:
            c += 1
        if h[c] < v:
            h[i] = h[c]
            i = c
        else:
            break
    h[i] = v


@njit(cache=True)
def _kth_largest(a, k):
    """The k-th largest of ``a`` [n] f64 (no NaN), reordering ``a``: quickselect (Hoare
    partition, median of three; equal keys stop both scans, so ties cost nothing)."""
    lo, hi = 0, a.size - 1
    t = a.size - k  # its index in ascending order
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] < a[lo]:
            a[mid], a[lo] = a[lo], a[mid]
        if a[hi] < a[lo]:
            a[hi], a[lo] = a[lo], a[hi]
        if a[hi] < a[mid]:
            a[hi], a[mid] = a[mid], a[hi]
        pivot = a[mid]
        i, j = lo, hi
        while i <= j:
            while a[i] < pivot:
                i += 1
            while a[j] > pivot:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if t <= j:
            hi = j
        elif t >= i:
            lo = i
        else:
            break  # a[j+1 : i] all equal the pivot
    return a[t]


@njit(cache=True)
def _temper_top_k(x, temperature, k, heap, idx, vals, scratch):
    """``x /= temperature`` in place, then gather the top-k candidates.

    The k-th largest value (a multiset order statistic, as ``np.partition``) comes from a
    min-heap ``heap`` [>= k] f64 of the k largest seen. The same pass appends every id
    not below the heap's minimum at its turn (a superset of the answer, as the minimum
    only grows: ~k log(V/k) ids on real logits), which a last pass over those few
    narrows to ``x >= floor`` (ties with the k-th kept, as HF). Input that keeps
    replacing the minimum (ascending logits: O(V log k)) falls back to a quickselect on
    ``scratch`` [V] f64 and a full pass. With top-k off (``not 0 < k < V``) every finite
    id is a candidate. Writes ascending ids to ``idx`` [V] int64 and their values to
    ``vals`` [V] f64. Returns (n, max of vals[:n]).
    """
    n_all = x.size
    for j in range(n_all):  # its own loop: vectorized (fused with the scan it is not)
        x[j] = x[j] / temperature
    floor = -np.inf
    n = 0
    if 0 < k < n_all:
        for j in range(k):
            idx[j] = j
            heap[j] = vals[j] = x[j]
        for i in range(k // 2 - 1, -1, -1):
            _sift_down(heap, i, k)
        n = k
        budget = 16 * k + 256  # heap replacements before giving up on the heap
        for b0 in range(k, n_all, 64):
            h = heap[0]
            hits = 0
            for j in range(b0, min(b0 + 64, n_all)):  # branch-free count (vectorized):
                hits += x[j] >= h                      # most blocks have no candidate
            if hits == 0:
                continue
            for j in range(b0, min(b0 + 64, n_all)):
                v = x[j]
                if v >= heap[0]:
                    idx[n] = j
                    vals[n] = v
                    n += 1
                    if v > heap[0]:
                        heap[0] = v
                        _sift_down(heap, 0, k)
                        budget -= 1
            if budget < 0:
                break
        if budget >= 0:
            floor = heap[0]
            out = 0
            m = -np.inf
            for i in range(n):
                v = vals[i]
                if v >= floor and v > -np.inf:
                    idx[out] = idx[i]
                    vals[out] = v
                    out += 1
                    m = max(m, v)
            return out, m
        scratch[:] = x
        floor = _kth_largest(scratch, k)
    n = 0
    m = -np.inf
    for j in range(n_all):
        v = x[j]
        if v >= floor and v > -np.inf:
            idx[n] = j
            vals[n] = v
            n += 1
            m = max(m, v)
    return n, m


@njit(cache=True)
def _gather_above(p, n, thr, out):
    """``out[:m] = p[:n][p[:n] > thr]`` (order kept); returns m."""
    m = 0
    for i in range(n):
        if p[i] > thr:
            out[m] = p[i]
            m += 1
    return m


@njit(cache=True)
def _top_p_compact(p, n, thr, sorted_p, cum, m, limit, idx, vals):
    """Keep the nucleus among ``idx[:n]``/``vals[:n]`` in place; returns (n', max).

    ``p[:n]`` are the candidates' probabilities, those ``> thr`` the plausible ones
    (``m`` of them, ``sorted_p[:m]`` ascending, ``cum[:m]`` their cumulative sum plus the
    pre-dropped mass). As HF: the ascending order removes while ``cum <= limit``, never
    the last; ties go in ascending id order (a stable argsort of ascending ids), so
    among the ids equal to the last removed value the lowest ones go.
    """
    r = 0
    while r < m - 1 and cum[r] <= limit:  # cum is nondecreasing: a prefix is removed
        r += 1
    v = -np.inf
    n_eq = 0  # how many ids equal to v are removed
    if r > 0:
        v = sorted_p[r - 1]
        lo = r - 1
        while lo > 0 and sorted_p[lo - 1] == v:
            lo -= 1
        n_eq = r - lo
    out = 0
    mx = -np.inf
    for i in range(n):
        q = p[i]
        if not q > thr or q < v:
            continue
        if q == v and n_eq > 0:
            n_eq -= 1
            continue
        idx[out] = idx[i]
        vals[out] = vals[i]
        mx = max(mx, vals[i])
        out += 1
    return out, mx


@njit(cache=True)
def _min_p_compact(idx, vals, n, floor):
    """Keep ``vals >= floor`` among ``idx[:n]``/``vals[:n]`` in place; returns (n', max)."""
    out = 0
    mx = -np.inf
    for i in range(n):
        if vals[i] >= floor:
            idx[out] = idx[i]
            vals[out] = vals[i]
            mx = max(mx, vals[i])
            out += 1
    return out, mx


@njit(cache=True)
def _search_right(cdf, n, target):
    """``np.searchsorted(cdf[:n], target, side="right")`` for an ascending ``cdf``."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if cdf[mid] <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True)
def _window_push(ids, counts, distinct, where, ring, state):
    """Append ``ids`` [int64] to the penalty window.

    ``state`` int64 [3] = (n_distinct, ring length, ring position). With ``ring`` [n]
    (n > 0) the window holds the last n ids: the oldest leaves as one arrives. Without
    (size 0) it keeps the whole history. ``distinct[:n_distinct]`` lists the ids with
    ``counts > 0`` and ``where`` their position in it (swap-remove when a count drops to
    zero), so applying the penalties costs O(distinct ids), not O(V).
    """
    n_ring = ring.size
    for t in ids:
        if n_ring > 0:
            if state[1] == n_ring:
                old = ring[state[2]]
                counts[old] -= 1
                if counts[old] == 0:
                    d = where[old]
                    last = distinct[state[0] - 1]
                    distinct[d] = last
                    where[last] = d
                    state[0] -= 1
            else:
                state[1] += 1
            ring[state[2]] = t
            state[2] = (state[2] + 1) % n_ring
        counts[t] += 1
        if counts[t] == 1:
            where[t] = state[0]
            distinct[state[0]] = t
            state[0] += 1


@njit(cache=True)
def _window_clear(counts, distinct, state):
    for d in range(state[0]):
        counts[distinct[d]] = 0
    state[:] = 0


@njit(cache=True, inline="always")
def _mask_word(mask, w, n):
    """Word ``w`` of a token mask (llguidance's layout: bit ``i % 32`` of word ``i // 32``
    allows id ``i``) as an unsigned 32-bit int64, and the ids it covers below ``n``:
    ``(word, base, stop)``, id ``i`` in ``range(base, stop)`` is bit ``i - base``."""
    base = w * 32
    return np.int64(mask[w]) & 0xFFFFFFFF, base, min(base + 32, n)


@njit(cache=True)
def _apply_mask(x, mask):
    """``x[i] = -inf`` for every id whose bit is clear in ``mask`` (int32 [ceil(V/32)],
    bit ``i % 32`` of word ``i // 32``: llguidance's layout); ids past ``32 * mask.size``
    are masked too. Returns how many finite logits are left."""
    n = x.size
    finite = 0
    for w in range(mask.size):
        word, base, stop = _mask_word(mask, w, n)
        for i in range(base, stop):
            if (word >> (i - base)) & 1:
                finite += x[i] > -np.inf
            else:
                x[i] = -np.inf
    for i in range(32 * mask.size, n):
        x[i] = -np.inf
    return finite


@njit(cache=True)
def _masked_argmax(x, mask):
    """:func:`edgeinfer.sampling_steps.greedy` of ``x`` with the ids ``mask`` clears set
    to -inf (layout as :func:`_apply_mask`), without writing ``x``: the first id of the
    largest allowed logit; -1 when an allowed logit is NaN or +inf, -2 when every
    allowed one is -inf (or none is allowed)."""
    best = -1
    bv = -np.inf
    n = min(x.size, 32 * mask.size)
    for w in range(mask.size):
        word, base, stop = _mask_word(mask, w, n)
        if word == 0:
            continue
        for i in range(base, stop):
            if (word >> (i - base)) & 1:
                v = np.float64(x[i])
                if math.isnan(v) or v == np.inf:
                    return -1
                if v > bv:
                    bv = v
                    best = i
    return best if best >= 0 else -2
