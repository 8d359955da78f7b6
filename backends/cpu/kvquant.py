"""Quantized KV cache kernels (int8 / int4 / k8v4 of :mod:`..kvcache`), read in place.

Two kernels, both on the raw arrays of :meth:`HostKVCache.raw` (float16 scales passed
as their uint16 bits):

* :func:`kv_write_q` encodes one chunk of K (already shifted/scaled per channel by
  ``cache.k_input`` (int4) and Hadamard-rotated by the caller with the cache's own
  ``_rotate``, so the float32 inputs are bit-identical to ``cache.write``'s) and V into codes + scales exactly per the module formulas of
  :mod:`..kvcache` (float32 math, no fast-math: ``max|y| / 127``, f16 round-to-nearest-
  even with saturation, ``rint(y / s)`` half to even, clipping; int4 packed low nibble
  first). Ring layers: slot ``p % S`` and the position table are updated too.
* :func:`attention_q` is the GQA attention of :mod:`.attention` over the codes: each
  query head is scaled and rotated once (``q_g @ H_G``), so ``q . k = (q H) . (k H)``
  needs no rotation of the keys; int4's K channel scale ``c`` is folded into the query
  before the rotation and its offset ``m`` adds ``q . m`` to every score of that query
  head. Keys and values are dequantized (exactly: ``code * s`` (+ ``m``)) a tile of
  KEY_TILE rows at a time into a small float32 buffer, and the scores and the weighted
  V sum run over the tiles in :mod:`._attn_ir`, 8 queries per pass over a key tile.

Work items: a decode step, one per KV head (its query heads in the lanes; two halves
when the KV heads are odd in number, :func:`_split`); a prefill, TOKEN_BLOCK tokens of
one KV head's query heads.
Every float a query's output depends on is computed in an order fixed per query (FMA
chains in :mod:`._attn_ir`, ``row_max`` / ``row_sum`` in the softmax), so decode and
prefill, serial and parallel, agree bit for bit (``tests/test_cpu_attn_tiles.py``).
Decode work items take every buffer (scores, queries, accumulators, tiles) from a
per-cache scratch (:func:`decode_scratch_q_shape`), so a decode step allocates nothing
inside the kernels; prefill items allocate their own.

Format selection is static: ``kmin is None`` means 8-bit symmetric K (int8, k8v4),
``vmin is None`` means 8-bit V with one scale per (token, head) (int8); Numba prunes the
other branch at compile time, so each of the three formats gets its own machine code.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._simd_ir import (f32_to_half, half_to_f32)
from ._attn_ir import scores8, vaccum
from .attention import _softmax_inplace

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
#: Keys per dequantized tile of a work item (K and V tiles: float32 [KEY_TILE, hdp]).
KEY_TILE = 64
#: Tokens per prefill work item (two 8-lane query blocks per head).
TOKEN_BLOCK = 16


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


@njit(cache=True, fastmath=_FM, inline="always")
def _deq8_k(out, kq, ks, row, kh, gsz, ng):  # code * s per group: exact (7 + 11 bits)
    for j in range(ng):
        b = j * gsz
        sc = half_to_f32(ks[row, kh, j])
        for i in range(gsz):
            out[b + i] = np.float32(kq[row, kh, b + i]) * sc


@njit(cache=True, fastmath=_FM, inline="always")
def _deq8_v(out, vq, vs, row, kh, hd):  # code * s, one scale per (token, head): exact
    sc = half_to_f32(vs[row, kh])
    for d in range(hd):
        out[d] = np.float32(vq[row, kh, d]) * sc


def _deq_k(out, kq, ks, kmin, row, kh, gsz, ng):  # pragma: no cover - overloaded below
    raise NotImplementedError


def _deq_v(out, vq, vs, vmin, row, kh, gsz, ng):  # pragma: no cover
    raise NotImplementedError


def _is_none(t):
    return t is None or isinstance(t, types.NoneType) or t == types.none


@overload(_deq_k, inline="always", jit_options={"fastmath": _FM})
def _ov_deq_k(out, kq, ks, kmin, row, kh, gsz, ng):  # format by type
    if _is_none(kmin):
        return lambda out, kq, ks, kmin, row, kh, gsz, ng: _deq8_k(out, kq, ks, row, kh, gsz, ng)
    return lambda out, kq, ks, kmin, row, kh, gsz, ng: _deq4_row(out, kq, ks, kmin, row, kh,
                                                                 gsz, ng)


@overload(_deq_v, inline="always", jit_options={"fastmath": _FM})
def _ov_deq_v(out, vq, vs, vmin, row, kh, gsz, ng):
    if _is_none(vmin):
        return lambda out, vq, vs, vmin, row, kh, gsz, ng: _deq8_v(out, vq, vs, row, kh,
                                                                   gsz * ng)
    return lambda out, vq, vs, vmin, row, kh, gsz, ng: _deq4_row(out, vq, vs, vmin, row, kh,
                                                                 gsz, ng)


@njit(cache=True, inline="always")
def _split(t_n, hkv, grp):
    """Query-head parts per KV head of a decode step: 2 for an odd number of KV heads (so
    that 2 threads get equal items; measured in the README's run H), else 1 (a part's
    heads share one pass over the keys)."""
    return 2 if (t_n == 1 and hkv % 2 == 1 and grp > 1) else 1


@njit(cache=True, inline="always")
def _n_items(t_n, hkv, grp):
    if t_n == 1:
        return hkv * _split(t_n, hkv, grp)
    return hkv * ((t_n + TOKEN_BLOCK - 1) // TOKEN_BLOCK)


@njit(cache=True, inline="always")
def _span_q(item, t_n, hq, hkv):
    """(kv head, first token, tokens, first query head, query heads) of a work item:
    decode, a KV head's query heads (or half of them); prefill, TOKEN_BLOCK tokens of
    all of a KV head's query heads, the token blocks in the order 0, last, 1, last - 1,
    ... so that the threads' contiguous item ranges get equal causal work."""
    grp = hq // hkv
    if t_n == 1:
        split = _split(t_n, hkv, grp)
        kh = item // split
        part = item % split
        g0 = kh * grp + (part * grp) // split
        return kh, 0, 1, g0, kh * grp + ((part + 1) * grp) // split - g0
    nb = (t_n + TOKEN_BLOCK - 1) // TOKEN_BLOCK
    kh = item % hkv
    b = item // hkv
    blk = b // 2 if b % 2 == 0 else nb - 1 - b // 2
    t0 = blk * TOKEN_BLOCK
    return kh, t0, min(TOKEN_BLOCK, t_n - t0), kh * grp, grp


@njit(cache=True, inline="always")
def _key_range(p, linear, window, n_slots):
    """(first key, keys) a query at position ``p`` attends over (ring: every slot)."""
    if not linear:
        return 0, n_slots
    lo = max(0, p - window + 1) if window > 0 else 0
    return lo, p + 1 - lo


@njit(cache=True, inline="always")
def _scratch_q(scr, item, nqp, nup, hdp):
    """(s [nqp, nup], qt [nqp/8, hdp, 8], acc [nqp, hdp], qm [nqp], kt, vt [KEY_TILE, hdp])
    float32, qt / acc / qm zeroed: views of ``scr[item]`` when that row is long enough
    (decode, :func:`decode_scratch_q_shape`), else fresh arrays (prefill)."""
    need = nqp * (nup + 2 * hdp + 1) + 2 * KEY_TILE * hdp
    if item < scr.shape[0] and need <= scr.shape[1]:
        row = scr[item]
    else:
        row = np.empty(need, np.float32)
    s = row[:nqp * nup].reshape((nqp, nup))
    b = nqp * nup
    z = row[b:b + nqp * (2 * hdp + 1)]
    z[:] = 0
    qt = z[:nqp * hdp].reshape((nqp // 8, hdp, 8))
    acc = z[nqp * hdp:2 * nqp * hdp].reshape((nqp, hdp))
    qm = z[2 * nqp * hdp:]
    b += nqp * (2 * hdp + 1)
    kt = row[b:b + KEY_TILE * hdp].reshape((KEY_TILE, hdp))
    vt = row[b + KEY_TILE * hdp:need].reshape((KEY_TILE, hdp))
    return s, qt, acc, qm, kt, vt


def decode_scratch_q_shape(cache, hq: int, hd: int) -> tuple[int, int]:
    """Shape of the quantized-cache decode scratch for ``cache``: float32 ``[items,
    nqp * (S8 + 2 hdp + 1) + 2 KEY_TILE hdp]`` (``nqp`` a decode item's query heads
    rounded up to 8, ``S8`` the most slots of a layer rounded up to 8, ``hdp`` = hd
    rounded up to 8), one row per decode work item (:func:`_scratch_q`), so that a decode
    step allocates nothing here."""
    hkv = cache.n_kv_heads
    grp = hq // hkv
    split = _split(1, hkv, grp)
    per_item = -(-grp // split)  # query heads of a decode item, rounded up
    nqp = -(-per_item // 8) * 8
    n = max(getattr(cache, "slots", [cache.max_tokens]))
    hdp = -(-hd // 8) * 8
    return hkv * split, nqp * (-(-n // 8) * 8 + 2 * hdp + 1) + 2 * KEY_TILE * hdp


@njit(cache=True, fastmath=_FM, inline="always")
def _attn_item(item, out, q, hmat, kq, ks, kmin, vq, vs, vmin, koff, kcs, kpos, start, scale,
               window, softcap, scr):
    """One work item (:func:`_span_q`): its queries (query head major, then token) sit in
    8-lane blocks; scores and the V sum go through :mod:`._attn_ir` over dequantized
    tiles of KEY_TILE keys, whose float order does not depend on the item's shape, so a
    decode step and a prefill give the same floats for the same query."""
    t_n, hq, hd = q.shape
    hkv = kq.shape[1]
    gsz = hmat.shape[0]
    ng = hd // gsz
    n_slots = kq.shape[0]
    linear = kpos.shape[0] == 0
    kh, t0, tn, g0, gn = _span_q(item, t_n, hq, hkv)
    nq = tn * gn
    nqp = (nq + 7) // 8 * 8
    hdp = (hd + 7) // 8 * 8
    u0, _ = _key_range(start + t0, linear, window, n_slots)
    u_lo, u_n = _key_range(start + t0 + tn - 1, linear, window, n_slots)
    u1 = u_lo + u_n
    nup = (u1 - u0 + 7) // 8 * 8
    s, qt, acc, qm, kt, vt = _scratch_q(scr, item, nqp, nup, hdp)
    # the queries, scaled, channel-scaled (int4's c), rotated; qm = q . m (int4's offset)
    qrow = kt[0]  # free until the first tile
    for gl in range(gn):
        for tl in range(tn):
            qi = gl * tn + tl
            qrow[:] = 0
            for j in range(ng):
                b = j * gsz
                for i in range(gsz):
                    qv = q[t0 + tl, g0 + gl, b + i] * scale
                    qm[qi] += qv * koff[kh, b + i]
                    qv *= kcs[kh, b + i]
                    for c in range(gsz):
                        qrow[b + c] += qv * hmat[i, c]
            qb = qt[qi // 8]
            for d in range(hd):
                qb[d, qi % 8] = qrow[d]
    if hdp > hd:  # pad channels: 0 in every tile
        kt[:, hd:] = 0
        vt[:, hd:] = 0
    for kb in range(u0, u1, KEY_TILE):
        nk = min(KEY_TILE, u1 - kb)
        for m in range(nk):
            _deq_k(kt[m], kq, ks, kmin, kb + m, kh, gsz, ng)
        for m in range(nk, (nk + 7) // 8 * 8):
            kt[m, :] = 0
        for blk in range(nqp // 8):
            scores8(s[blk * 8:blk * 8 + 8, kb - u0:], qt[blk], kt, nk)
    for gl in range(gn):
        for tl in range(tn):
            qi = gl * tn + tl
            p = start + t0 + tl
            lo, n = _key_range(p, linear, window, n_slots)
            row = s[qi, lo - u0:lo - u0 + n]
            for jj in range(n):
                row[jj] += qm[qi]
            if not linear:
                for jj in range(n):
                    kp = kpos[jj]
                    if kp < 0 or kp > p or (window > 0 and kp <= p - window):
                        row[jj] = -np.inf
            _softmax_inplace(row, softcap)
    for kb in range(u0, u1, KEY_TILE):
        nk = min(KEY_TILE, u1 - kb)
        for m in range(nk):
            _deq_v(vt[m], vq, vs, vmin, kb + m, kh, gsz, ng)
        for gl in range(gn):
            for tl in range(tn):
                qi = gl * tn + tl
                lo, n = _key_range(start + t0 + tl, linear, window, n_slots)
                a = max(lo, kb)
                e = min(lo + n, kb + nk)
                if a < e:
                    vaccum(acc[qi:qi + 1], s[qi:qi + 1, a - u0:], vt[a - kb:], e - a)
    for gl in range(gn):
        for tl in range(tn):
            qi = gl * tn + tl
            for d in range(hd):
                out[t0 + tl, g0 + gl, d] = acc[qi, d]


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
    for item in prange(_n_items(t_n, hkv, hq // hkv)):
        _attn_item(item, out, q, hmat, kq, ks, kmin, vq, vs, vmin, koff, kcs, kpos, start,
                   scale, window, softcap, scr)


@njit(cache=True, fastmath=_FM)
def attention_q_serial(out, q, hmat, kq, ks, kmin, vq, vs, vmin, koff, kcs, kpos, start, scale,
                       window, softcap, scr):
    """As :func:`attention_q` on the calling thread (short decode contexts: no fork/join)."""
    t_n, hq, hd = q.shape
    hkv = kq.shape[1]
    for item in range(_n_items(t_n, hkv, hq // hkv)):
        _attn_item(item, out, q, hmat, kq, ks, kmin, vq, vs, vmin, koff, kcs, kpos, start,
                   scale, window, softcap, scr)


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
