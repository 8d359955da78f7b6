"""Quantized KV cache kernels (int8 / int4 / k8v4 of :mod:`..kvcache`), read in place.

Two kernels, both on the raw arrays of :meth:`HostKVCache.raw` (float16 scales passed
as their uint16 bits):

* :func:`kv_write_q` encodes one chunk of K (already shifted/scaled per channel by
  ``cache.k_input`` (int4) and Hadamard-rotated by the caller with the cache's own
  ``_rotate``, so the float32 inputs are bit-identical to ``cache.write``'s) and V into codes + scales exactly per the module formulas of
  :mod:`..kvcache` (float32 math, no fast-math: ``max|y| / 127``, f16 round-to-nearest-
  even with saturation, ``rint(y / s)`` half to even, clipping; int4 packed low nibble
  first). Ring layers: slot ``p % S`` and the position table are updated too.
* :func:`attention_q` is the GQA attention of :mod:`.attention` without dequantizing
  the cache: each query head is scaled and rotated once per group (``q_g @ H_G``), so
  ``q . k = (q H) . (k H)`` is a dot with the stored codes, one scale (and for int4 the
  group minimum times the rotated query's group sum) per group; int4's K channel scale
  ``c`` is folded into the query before the rotation and its offset ``m`` adds ``q . m``
  to every score of that query head; V is dequantized on the
  fly inside the weighted sum (int8: one scale per (token, head) folded into the
  probability; int4: per group ``p * s * code + p * m``).

Decode (T = 1) work items take every buffer (scores, rotated query heads, accumulator,
a dequantized row) from a per-cache scratch (:func:`decode_scratch_q_shape`), so a decode step
allocates nothing inside the kernels; prefill items allocate their own.

Format selection is static: ``kmin is None`` means 8-bit symmetric K (int8, k8v4),
``vmin is None`` means 8-bit V with one scale per (token, head) (int8); Numba prunes the
other branch at compile time, so each of the three formats gets its own machine code.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._simd import f32_to_half, half_to_f32
from .attention import _item_span, _softmax_inplace

_FM = {"nsz", "arcp", "contract", "afn", "reassoc"}
_F16_MAX = np.float32(65504.0)


# ---- write: bit-exact encoders ---------------------------------------------------------
@njit(cache=True, inline="always")
def _f16_bits(x):  # float32 -> clipped binary16 bits (RNE), as kvcache._f16
    return f32_to_half(min(max(x, -_F16_MAX), _F16_MAX))


@njit(cache=True)
def _enc_sym8(q, s, y, g):  # y[n] f32 -> q[n] int8, s[n/g] uint16 (f16 bits)
    n = y.shape[0]
    for j in range(n // g):
        b = j * g
        amax = np.float32(0.0)
        for i in range(g):
            amax = max(amax, abs(y[b + i]))
        sb = _f16_bits(amax / np.float32(127.0))
        s[j] = sb
        d = half_to_f32(sb)
        for i in range(g):
            if d == 0:
                q[b + i] = 0
            else:
                r = np.rint(y[b + i] / d)
                q[b + i] = np.int8(min(max(r, np.float32(-127.0)), np.float32(127.0)))


@njit(cache=True)
def _enc_asym4(q, s, m, y, g):  # y[n] f32 -> packed q[n/2] uint8, s/m[n/g] uint16
    n = y.shape[0]
    for j in range(n // g):
        b = j * g
        lo = y[b]
        hi = y[b]
        for i in range(1, g):
            lo = min(lo, y[b + i])
            hi = max(hi, y[b + i])
        mb = _f16_bits(lo)
        m32 = half_to_f32(mb)
        sb = _f16_bits((hi - m32) / np.float32(15.0))
        m[j] = mb
        s[j] = sb
        d = half_to_f32(sb)
        for i in range(0, g, 2):
            c0 = 0
            c1 = 0
            if d != 0:
                r0 = np.rint((y[b + i] - m32) / d)
                r1 = np.rint((y[b + i + 1] - m32) / d)
                c0 = int(min(max(r0, np.float32(0.0)), np.float32(15.0)))
                c1 = int(min(max(r1, np.float32(0.0)), np.float32(15.0)))
            q[(b + i) // 2] = np.uint8(c0 | (c1 << 4))


def _enc_k(kq, ks, kmin, slot, h, y, g):  # pragma: no cover - overloaded below
    raise NotImplementedError


def _enc_v(vq, vs, vmin, slot, h, y, g):  # pragma: no cover
    raise NotImplementedError


@overload(_enc_k)
def _ov_enc_k(kq, ks, kmin, slot, h, y, g):
    if _is_none(kmin):
        return lambda kq, ks, kmin, slot, h, y, g: _enc_sym8(kq[slot, h], ks[slot, h], y, g)
    return lambda kq, ks, kmin, slot, h, y, g: _enc_asym4(kq[slot, h], ks[slot, h],
                                                          kmin[slot, h], y, g)


@overload(_enc_v)
def _ov_enc_v(vq, vs, vmin, slot, h, y, g):
    if _is_none(vmin):
        return lambda vq, vs, vmin, slot, h, y, g: _enc_sym8(vq[slot, h], vs[slot, h:h + 1],
                                                             y, y.shape[0])
    return lambda vq, vs, vmin, slot, h, y, g: _enc_asym4(vq[slot, h], vs[slot, h],
                                                          vmin[slot, h], y, g)


@njit(cache=True)
def kv_write_q(kr, v, kq, ks, kmin, vq, vs, vmin, pos, start, g):
    """Encode kr (rotated K), v float32 [T, Hkv, hd] at positions start.. (slot p % S).

    ``kq``/``vq``: int8 [S, Hkv, hd] or packed uint8 [S, Hkv, hd/2]; ``ks``, ``kmin``,
    ``vs``, ``vmin``: uint16 f16 bits ([S, Hkv, hd/G], int8 V scale [S, Hkv]);
    ``kmin`` / ``vmin`` None for 8-bit K / V. ``pos`` int64 [S] ring positions or [0].
    """
    t_n, hkv, hd = kr.shape
    n_slots = kq.shape[0]
    for t in range(t_n):
        slot = (start + t) % n_slots
        if pos.shape[0] > 0:
            pos[slot] = start + t
        for h in range(hkv):
            _enc_k(kq, ks, kmin, slot, h, kr[t, h], g)
            _enc_v(vq, vs, vmin, slot, h, v[t, h], g)


# ---- attention over the codes ----------------------------------------------------------
@njit(cache=True, fastmath=_FM, inline="always")
def _scores8(s, qs, qsum, kq, ks, kmin, lo, n, kh, gsz, ng, row_f):  # s[g, j] = (qH).(kH)
    gn, hd = qs.shape
    for jj in range(n):
        row = lo + jj
        for g in range(gn):
            acc = np.float32(0.0)
            for j in range(ng):
                b = j * gsz
                a = np.float32(0.0)
                for i in range(gsz):
                    a += qs[g, b + i] * np.float32(kq[row, kh, b + i])
                acc += a * half_to_f32(ks[row, kh, j])
            s[g, jj] = acc


@njit(cache=True, fastmath=_FM, inline="always")
def _scores4(s, qs, qsum, kq, ks, kmin, lo, n, kh, gsz, ng, row_f):  # int4 K: row once
    gn, hd = qs.shape  # row_f [hd]: one dequantized K row (scratch)
    for jj in range(n):
        row = lo + jj
        _deq4_row(row_f, kq, ks, kmin, row, kh, gsz, ng)
        for g in range(gn):
            acc = np.float32(0.0)
            for d in range(hd):
                acc += qs[g, d] * row_f[d]
            s[g, jj] = acc


@njit(cache=True, fastmath=_FM, inline="always")
def _v_accum8(acc, s, lo, n, vq, vs, vmin, kh, gsz, ng, row_f):  # acc[g] += s[g] . V'
    gn, hd = acc.shape
    for jj in range(n):
        row = lo + jj
        vsc = half_to_f32(vs[row, kh])
        for g in range(gn):
            w = s[g, jj] * vsc
            if w != 0:
                for d in range(hd):
                    acc[g, d] += w * np.float32(vq[row, kh, d])


@njit(cache=True, fastmath=_FM, inline="always")
def _v_accum4(acc, s, lo, n, vq, vs, vmin, kh, gsz, ng, row_f):  # as _v_accum8, int4 V
    gn, hd = acc.shape  # row_f [hd]: one dequantized V row, shared by the gn heads
    for jj in range(n):
        row = lo + jj
        _deq4_row(row_f, vq, vs, vmin, row, kh, gsz, ng)
        for g in range(gn):
            pj = s[g, jj]
            if pj != 0:
                for d in range(hd):
                    acc[g, d] += pj * row_f[d]


@njit(cache=True, fastmath=_FM, inline="always")
def _deq4_row(out, cq, cs, cm, row, kh, gsz, ng):  # packed codes * s + m -> out[hd]
    for j in range(ng):
        b = j * gsz
        sc = half_to_f32(cs[row, kh, j])
        mn = half_to_f32(cm[row, kh, j])
        for i in range(gsz // 2):
            c = cq[row, kh, b // 2 + i]
            out[b + 2 * i] = np.float32(c & np.uint8(15)) * sc + mn
            out[b + 2 * i + 1] = np.float32(c >> np.uint8(4)) * sc + mn


def _scores(s, qs, qsum, kq, ks, kmin, lo, n, kh, gsz, ng, row_f):  # pragma: no cover
    raise NotImplementedError


def _v_accum(acc, s, lo, n, vq, vs, vmin, kh, gsz, ng, row_f):  # pragma: no cover
    raise NotImplementedError


def _is_none(t):
    return t is None or isinstance(t, types.NoneType) or t == types.none


@overload(_scores, inline="always", jit_options={"fastmath": _FM})
def _ov_scores(s, qs, qsum, kq, ks, kmin, lo, n, kh, gsz, ng, row_f):  # format by type
    return _scores8.py_func if _is_none(kmin) else _scores4.py_func


@overload(_v_accum, inline="always", jit_options={"fastmath": _FM})
def _ov_v_accum(acc, s, lo, n, vq, vs, vmin, kh, gsz, ng, row_f):
    return _v_accum8.py_func if _is_none(vmin) else _v_accum4.py_func


@njit(cache=True, inline="always")
def _item_scratch_q(scr, item, gn, n, hd, ng):
    """(s [gn, n], qs [gn, hd], acc [gn, hd], qsum [gn, ng], qm [gn], row_f [hd]) float32,
    qs / acc / qsum / qm zeroed: views of ``scr[item]`` when that row is long enough
    (decode, :func:`decode_scratch_q_shape`), else fresh arrays (prefill: O(S) per item)."""
    need = gn * (n + 2 * hd + ng + 1) + hd
    if item < scr.shape[0] and need <= scr.shape[1]:
        row = scr[item]
        s = row[:gn * n].reshape((gn, n))
        b = gn * n
        qs = row[b:b + gn * hd].reshape((gn, hd))
        acc = row[b + gn * hd:b + 2 * gn * hd].reshape((gn, hd))
        b += 2 * gn * hd
        qsum = row[b:b + gn * ng].reshape((gn, ng))
        qm = row[b + gn * ng:b + gn * ng + gn]
        row_f = row[b + gn * ng + gn:need]
        row[gn * n:b + gn * ng + gn] = 0  # qs, acc, qsum, qm
    else:
        s = np.empty((gn, n), np.float32)
        qs = np.zeros((gn, hd), np.float32)
        acc = np.zeros((gn, hd), np.float32)
        qsum = np.zeros((gn, ng), np.float32)
        qm = np.zeros(gn, np.float32)
        row_f = np.empty(hd, np.float32)
    return s, qs, acc, qsum, qm, row_f


def layer_arrays(cache, layer: int) -> tuple:
    """(kq, ks, kmin, vq, vs, vmin, kpos, hmat, koff, kcs) of a quantized host cache's
    layer as :func:`kv_write_q` / :func:`attention_q` take them: float16 scales as their
    uint16 bits (None where the format has none), ``kpos`` a ring's position table or
    int64 [0], ``hmat`` the cache's rotation, int4's K channel offset and scale (else 0
    and 1)."""
    raw = cache.raw(layer)

    def bits(name):
        arr = raw.get(name)
        return None if arr is None else arr.view(np.uint16)
    pos = cache.positions(layer)
    shp = (cache.n_kv_heads, cache.head_dim)
    return (raw["k_q"], bits("k_scale"), bits("k_min"), raw["v_q"], bits("v_scale"),
            bits("v_min"), np.zeros(0, np.int64) if pos is None else pos, cache.rotation,
            raw.get("k_off", np.zeros(shp, np.float32)),
            raw.get("k_cs", np.ones(shp, np.float32)))


def decode_scratch_q_shape(cache, hq: int, hd: int) -> tuple[int, int]:
    """Shape of the quantized-cache decode scratch for ``cache``: float32
    ``[2 * Hkv, grp * (S + 2 hd + hd / G + 1) + hd]`` (``grp = Hq / Hkv``, ``S`` the most
    slots of a layer, ``G`` the cache's group size), one row per decode work item
    (:func:`_item_scratch_q`), so that a decode step allocates nothing here."""
    hkv, g = cache.n_kv_heads, cache.group_size
    n = max(getattr(cache, "slots", [cache.max_tokens]))
    return 2 * hkv, (hq // hkv) * (n + 2 * hd + hd // g + 1) + hd


@njit(cache=True, fastmath=_FM, inline="always")
def _attn_item(item, out, q, hmat, kq, ks, kmin, vq, vs, vmin, koff, kcs, kpos, start, scale,
               window, softcap, split, scr):  # one (token, KV head, query-head half) item
    t_n, hq, hd = q.shape
    hkv = kq.shape[1]
    gsz = hmat.shape[0]
    ng = hd // gsz
    linear = kpos.shape[0] == 0
    t, kh, g0, gn, p, lo, n = _item_span(item, hq, hkv, split, kq.shape[0], linear, start,
                                         window)
    # qs: scaled, channel-scaled (c), rotated query heads; qm = q . m: int4's K channel
    # offset (0 for 8-bit K); s scores; acc the weighted V sum; row_f one dequantized row
    s, qs, acc, qsum, qm, row_f = _item_scratch_q(scr, item, gn, n, hd, ng)
    for g in range(gn):
        for j in range(ng):
            b = j * gsz
            for i in range(gsz):
                qv = q[t, g0 + g, b + i] * scale
                qm[g] += qv * koff[kh, b + i]
                qv *= kcs[kh, b + i]
                for c in range(gsz):
                    qs[g, b + c] += qv * hmat[i, c]
            tot = np.float32(0.0)
            for c in range(gsz):
                tot += qs[g, b + c]
            qsum[g, j] = tot
    _scores(s, qs, qsum, kq, ks, kmin, lo, n, kh, gsz, ng, row_f)
    for g in range(gn):
        for jj in range(n):
            s[g, jj] += qm[g]
    if not linear:
        for jj in range(n):
            kp = kpos[jj]
            if kp < 0 or kp > p or (window > 0 and kp <= p - window):
                for g in range(gn):
                    s[g, jj] = -np.inf
    for g in range(gn):
        _softmax_inplace(s[g], softcap)
    _v_accum(acc, s, lo, n, vq, vs, vmin, kh, gsz, ng, row_f)
    for g in range(gn):
        for d in range(hd):
            out[t, g0 + g, d] = acc[g, d]


@njit(parallel=True, cache=True, fastmath=_FM)
def attention_q(out, q, hmat, kq, ks, kmin, vq, vs, vmin, koff, kcs, kpos, start, scale,
                window, softcap, scr):
    """out[T, Hq, hd] = softmax(q . K^T * scale) V over a quantized cache layer.

    Args:
        out: float32 [T, Hq, hd] (written); q: float32 [T, Hq, hd] (not rotated).
        hmat: float32 [G, G] the cache's Hadamard matrix.
        kq, ks, kmin, vq, vs, vmin: the layer's raw arrays (scales as uint16 bits;
            kmin / vmin None for 8-bit K / V), already holding the new tokens.
        koff, kcs: float32 [Hkv, hd] int4's K channel offset m and scale c (zeros and
            ones for 8-bit K): ``k' = (y' H) * c + m``, so ``q . k' = (H (q * c)) . y'
            + q . m``, one rotation and one dot per query head.
        kpos: int64 [S] position of each slot (ring), or [0]: slot j = position j.
        start, scale, window, softcap: as :func:`.attention.attention`.
        scr: float32 per-item scratch (:func:`decode_scratch_q_shape`), or [0, 0]: items whose
            row is missing or too short allocate their own (prefill).
    """
    t_n, hq, hd = q.shape
    hkv = kq.shape[1]
    split = 2 if (t_n == 1 and hq // hkv > 1) else 1
    for item in prange(t_n * hkv * split):
        _attn_item(item, out, q, hmat, kq, ks, kmin, vq, vs, vmin, koff, kcs, kpos, start,
                   scale, window, softcap, split, scr)


@njit(cache=True, fastmath=_FM)
def attention_q_serial(out, q, hmat, kq, ks, kmin, vq, vs, vmin, koff, kcs, kpos, start, scale,
                       window, softcap, scr):
    """As :func:`attention_q` on the calling thread (short decode contexts: no fork/join)."""
    t_n, hq, hd = q.shape
    hkv = kq.shape[1]
    for item in range(t_n * hkv):
        _attn_item(item, out, q, hmat, kq, ks, kmin, vq, vs, vmin, koff, kcs, kpos, start,
                   scale, window, softcap, 1, scr)
