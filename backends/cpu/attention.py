"""Causal GQA attention over the host KV cache (f32, or f16 read as uint16 bits).

One kernel serves prefill (T > 1) and decode (T = 1): it first appends k, v to the
cache layer (f32 / f16 linear storage, read in place), then runs one work item per
(query token, KV head) in ``prange``; an item handles the ``Hq / Hkv`` query heads that
share the KV head, so each key and value row is loaded once per group (GQA reuse).
Decode splits each group in two halves so that 2-3 KV heads still feed 2 threads.
Scores for one item live in a buffer of the visible length only (O(S) per item, never
a [T, S] matrix); softmax in float32 with the max subtracted, as the reference.

Quantized caches (int8 / int4 / k8v4, linear or ring) are read in place by
:mod:`.kvquant` instead. f32/f16 *ring* (sliding-window) layers still take the slower
path in the backend: the cache's own ``write`` and ``read_positions``, then this kernel
over the returned float32 rows with their explicit positions.

Decode (T = 1) items take their scores, scaled queries and accumulator from a scratch
array allocated once (:func:`decode_scratch_shape`), so a decode step allocates
nothing in the kernel; prefill items allocate their own (O(S) each, amortized over T).

:func:`attention_serial` is the same work items on the calling thread: the backend uses
it for decode over short contexts, where the fork/join of a parallel region costs more
than it saves on a shared 2-core host. (Timings, and why no BLAS variant:
benchmarks/MEASUREMENTS.md.)
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._attn_ir import row_max, row_sum
from ._simd_ir import (f32_to_half, half_to_f32, i32_as_f32)

#: Fast-math without "no infs / no NaNs": masked scores are -inf and must stay so.
_FM = {"nsz", "arcp", "contract", "afn", "reassoc"}
#: Decode attention (f32 / f16 / quantized cache) runs on one thread while keys * Hq * hd
#: is below this (a parallel region's fork/join costs more at short contexts: ~56 keys
#: of SmolLM2, ~36 of Qwen2.5-0.5B; benchmarks/MEASUREMENTS.md).
ATTN_SERIAL_MAX = 32 * 1024


def _load(v):  # pragma: no cover - replaced by the overload inside Numba
    """Cache element -> float32 (identity for f32, binary16 bits -> f32 for uint16)."""
    raise NotImplementedError


def _store_val(v, like):  # pragma: no cover - replaced by the overload inside Numba
    """float32 -> cache element type of ``like`` (array)."""
    raise NotImplementedError


@overload(_load, inline="always")
def _ov_load(v):
    if isinstance(v, types.Float):
        return lambda v: np.float32(v)
    if v == types.uint16:
        return lambda v: half_to_f32(v)
    return None


@overload(_store_val, inline="always")
def _ov_store_val(v, like):
    if like.dtype == types.uint16:  # saturate at +-65504 like HostKVCache (never inf)
        return lambda v, like: f32_to_half(min(max(np.float32(v), np.float32(-65504.0)),
                                               np.float32(65504.0)))
    return lambda v, like: np.float32(v)


@njit(cache=True, fastmath=_FM, inline="always")
def _append_kv(kc, vc, k, v, start):
    """Write k, v [T, Hkv, hd] float32 into cache rows start..start+T-1 (float32, or
    uint16 f16 bits: :func:`_store_val` converts)."""
    t_n, hkv, hd = k.shape
    for t in range(t_n):
        for h in range(hkv):
            for d in range(hd):
                kc[start + t, h, d] = _store_val(k[t, h, d], kc)
                vc[start + t, h, d] = _store_val(v[t, h, d], vc)


@njit(parallel=True, cache=True, fastmath=_FM)
def attention(out, q, k, v, kc, vc, kpos, write, start, scale, window, softcap, scr):
    """out[T, Hq, hd] = softmax(q . K^T * scale) V over the causal (windowed) past.

    Args:
        out: float32 [T, Hq, hd] (written).
        q: float32 [T, Hq, hd]; k, v: float32 [T, Hkv, hd] (appended to the cache).
        kc, vc: one layer of the cache [S, Hkv, hd], float32 or uint16 (f16 bits); slot
            j holds position j when ``kpos`` is empty.
        kpos: int64 [S] absolute position of each key row (ring / dequantized copies,
            -1 = empty), or [0] for the linear layout (row j = position j).
        write: append k, v at rows start..start+T-1 first (linear layout only).
        start: position of q[0]; keys start..start+T-1 are the new ones.
        scale: score multiplier (1/sqrt(hd) usually).
        window: sliding window (query p sees keys > p - window), 0 for none.
        softcap: tanh soft-capping of scores, 0 for none.
        scr: float32 [rows, cols] per-item scratch (:func:`decode_scratch_shape`), or [0, 0]:
            an item whose row is missing or too short allocates its own (prefill).
    """
    t_n, hq = q.shape[0], q.shape[1]
    hkv = k.shape[1]
    grp = hq // hkv
    if write:
        _append_kv(kc, vc, k, v, start)
    split = 2 if (t_n == 1 and grp > 1) else 1
    for item in prange(t_n * hkv * split):
        _attn_item(item, out, q, kc, vc, kpos, start, scale, window, softcap, split, scr)


@njit(cache=True, fastmath=_FM)
def attention_serial(out, q, k, v, kc, vc, kpos, write, start, scale, window, softcap, scr):
    """As :func:`attention` on the calling thread (short decode contexts: no fork/join)."""
    t_n, hkv = q.shape[0], k.shape[1]
    if write:
        _append_kv(kc, vc, k, v, start)
    for item in range(t_n * hkv):
        _attn_item(item, out, q, kc, vc, kpos, start, scale, window, softcap, 1, scr)


def decode_scratch_shape(cache, hq: int, hd: int) -> tuple[int, int]:
    """Shape of the decode work-item scratch for ``cache``: float32
    ``[2 * Hkv, grp * (S + 2 * hd)]`` (``grp = hq / Hkv``, ``S`` = the most slots of a
    layer), one row per item (scores, scaled query heads, accumulator), so that a decode
    step allocates nothing in the kernel (llama2.c's ``RunState``)."""
    n = max(getattr(cache, "slots", [cache.max_tokens]))
    return 2 * cache.n_kv_heads, (hq // cache.n_kv_heads) * (n + 2 * hd)


@njit(cache=True, inline="always")
def item_scratch(scr, item, gn, n, hd):
    """(s [gn, n], qs [gn, hd], acc [gn, hd] zeroed) float32: views of ``scr[item]`` when
    that row exists and is long enough (decode), else fresh arrays (prefill)."""
    need = gn * (n + 2 * hd)
    if item < scr.shape[0] and need <= scr.shape[1]:
        row = scr[item]
        s = row[:gn * n].reshape((gn, n))
        qs = row[gn * n:gn * (n + hd)].reshape((gn, hd))
        acc = row[gn * (n + hd):need].reshape((gn, hd))
        acc[:] = 0
    else:
        s = np.empty((gn, n), np.float32)
        qs = np.empty((gn, hd), np.float32)
        acc = np.zeros((gn, hd), np.float32)
    return s, qs, acc


@njit(cache=True, inline="always")
def _item_span(item, hq, hkv, split, n_slots, linear, start, window):
    """The work of one (token, KV head, query-head part) item of the f32 / f16 cache
    kernels: (t, kv head, first query head, query heads, position, first key, keys)."""
    grp = hq // hkv
    t = item // (hkv * split)
    kh = (item // split) % hkv
    part = item % split
    g0 = kh * grp + (part * grp) // split  # first query head of this item
    gn = kh * grp + ((part + 1) * grp) // split - g0
    p = start + t
    lo = 0
    if linear:
        if window > 0:
            lo = max(0, p - window + 1)
        n = p + 1 - lo
    else:
        n = n_slots  # ring: every slot, masked by its position
    return t, kh, g0, gn, p, lo, n


@njit(cache=True, fastmath=_FM, inline="always")
def _attn_item(item, out, q, kc, vc, kpos, start, scale, window, softcap, split, scr):
    t_n, hq, hd = q.shape
    hkv = kc.shape[1]
    linear = kpos.shape[0] == 0
    t, kh, g0, gn, p, lo, n = _item_span(item, hq, hkv, split, kc.shape[0], linear, start,
                                         window)
    s, qs, acc = item_scratch(scr, item, gn, n, hd)  # scores; query heads pre-scaled; sum
    for g in range(gn):
        for d in range(hd):
            qs[g, d] = q[t, g0 + g, d] * scale
    _scores(s, qs, kc, kh, lo, n, kpos, linear, p, window)
    for g in range(gn):
        _softmax_inplace(s[g], softcap)
    n4 = n - n % 4
    for j in range(0, n4, 4):  # 4 keys per pass: a quarter of the acc loads/stores
        v0, v1 = vc[lo + j, kh], vc[lo + j + 1, kh]
        v2, v3 = vc[lo + j + 2, kh], vc[lo + j + 3, kh]
        for g in range(gn):
            p0, p1, p2, p3 = s[g, j], s[g, j + 1], s[g, j + 2], s[g, j + 3]
            for d in range(hd):
                acc[g, d] += (p0 * _load(v0[d]) + p1 * _load(v1[d])
                              + p2 * _load(v2[d]) + p3 * _load(v3[d]))
    for j in range(n4, n):
        vr = vc[lo + j, kh]
        for g in range(gn):
            pj = s[g, j]
            for d in range(hd):
                acc[g, d] += pj * _load(vr[d])
    for g in range(gn):
        for d in range(hd):
            out[t, g0 + g, d] = acc[g, d]


@njit(cache=True, fastmath=_FM, inline="always")
def _scores(s, qs, kc, kh, lo, n, kpos, linear, p, window):  # s[grp, n] = qs . K[lo:lo+n]
    grp, hd = qs.shape
    n4 = n - n % 4
    for j in range(0, n4, 4):  # 4 keys per pass: 4 independent reductions share q loads
        k0, k1 = kc[lo + j, kh], kc[lo + j + 1, kh]
        k2, k3 = kc[lo + j + 2, kh], kc[lo + j + 3, kh]
        for g in range(grp):
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for d in range(hd):
                qv = qs[g, d]
                a0 += qv * _load(k0[d])
                a1 += qv * _load(k1[d])
                a2 += qv * _load(k2[d])
                a3 += qv * _load(k3[d])
            s[g, j], s[g, j + 1], s[g, j + 2], s[g, j + 3] = a0, a1, a2, a3
    for j in range(n4, n):
        kr = kc[lo + j, kh]
        for g in range(grp):
            acc = np.float32(0.0)
            for d in range(hd):
                acc += qs[g, d] * _load(kr[d])
            s[g, j] = acc
    if not linear:  # ring / dequantized rows: hide empty, future and out-of-window keys
        for j in range(n):
            kp = kpos[j]
            if kp < 0 or kp > p or (window > 0 and kp <= p - window):
                for g in range(grp):
                    s[g, j] = -np.inf


@njit(cache=True, fastmath=_FM, inline="always")
def exp_f32(x):  # float32 -> float32, e**x; 0 below -87.3, clamped (finite) above 88.7
    """Vectorizable float32 ``exp`` (Cephes ``expf``: 2^k * a degree-6 polynomial on
    |r| <= ln2/2, ~1 ulp, max relative error ~2e-7); unlike a libm call it vectorizes."""
    x = min(max(x, np.float32(-87.3)), np.float32(88.7))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    return p * i32_as_f32((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(cache=True, fastmath=_FM, inline="always")
def exp_neg(x):  # float32 x <= 0 -> exp(x); 0 below -87 (and for -inf, NaN)
    """:func:`exp_f32` for softmax arguments (x - max <= 0); exactly 0 below -87."""
    return exp_f32(x) if x >= np.float32(-87.0) else np.float32(0.0)


@njit(cache=True, fastmath=_FM, inline="always")
def _softmax_inplace(x, softcap):  # x[n] scores -> probabilities (masked -inf -> 0)
    n = x.shape[0]
    if softcap > 0:
        for j in range(n):
            v = x[j]
            if v > -np.inf:
                x[j] = np.float32(math.tanh(v / softcap)) * softcap
    m = row_max(x)
    for j in range(n):
        x[j] = exp_neg(x[j] - m)
    inv = np.float32(1.0) / row_sum(x)  # a fixed order: the same float in every kernel
    for j in range(n):
        x[j] *= inv
