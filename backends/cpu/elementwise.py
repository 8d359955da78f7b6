"""Row-wise kernels: RMSNorm, RoPE, dequantization of weight rows (embedding, prefill tiles).

GLU uses a vectorizable polynomial ``exp`` (:func:`glu_row`). The per-row kernels are
strict float32 and not inlined, so the fused decode and prefill compute a row alike.

Each op has a serial row kernel (used directly for decode, T = 1: a parallel region
costs ~3 us of fork/join on 2 cores, more than the work) and a ``prange`` wrapper
over rows for prefill. All math is float32, as in the reference backend.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._simd_ir import (group_value)
from .attention import exp_f32

#: Row-wise ops on fewer elements than this run serially (a parallel region costs ~3 us).
PAR_MIN_ELEMS = 32768


def is_gelu(act: str) -> bool:
    """True for GELU-tanh, False for SiLU gating.

    Raises:
        ValueError: any other activation name.
    """
    if act == "silu":
        return False
    if act == "gelu_tanh":
        return True
    raise ValueError(f"unsupported activation {act!r}")


# ---- RMSNorm -------------------------------------------------------------------------
# The per-row kernels below are strict float32 (no fast-math) and not inlined: each row is
# computed by the same instruction sequence in every caller (prefill's row loops, the
# fused decode halves), so a token's values never depend on how many tokens run with it.
@njit(cache=True)
def _rmsnorm_row(y, x, w, eps, unit_offset):  # x[N] -> y[N] = x / rms(x) * (w | 1 + w)
    n = x.shape[0]
    ss = np.float32(0.0)
    for i in range(n):
        ss += x[i] * x[i]
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(n) + eps)
    if unit_offset:
        for i in range(n):
            y[i] = x[i] * inv * (np.float32(1.0) + w[i])
    else:
        for i in range(n):
            y[i] = x[i] * inv * w[i]


@njit(cache=True, fastmath=True)
def rmsnorm_rows(y, x, w, eps, unit_offset):  # x[R, N] -> y[R, N], serial
    """RMSNorm of each row of ``x`` [R, N] float32 into ``y``; ``w`` [N]; serial."""
    for r in range(x.shape[0]):
        _rmsnorm_row(y[r], x[r], w, np.float32(eps), unit_offset)


@njit(parallel=True, cache=True, fastmath=True)
def rmsnorm_rows_par(y, x, w, eps, unit_offset):  # x[R, N] -> y[R, N], rows in parallel
    """As :func:`rmsnorm_rows`, rows split across threads (prefill)."""
    for r in prange(x.shape[0]):
        _rmsnorm_row(y[r], x[r], w, np.float32(eps), unit_offset)


# ---- RoPE (NeoX rotate-half pairing) -------------------------------------------------
@njit(cache=True)  # strict, not inlined (see _rmsnorm_row)
def _rope_token(y, x, cos, sin, pos):  # x[H, hd] -> y[H, hd] rotated at position pos
    h, hd = x.shape
    r2 = cos.shape[1]
    for j in range(h):
        for i in range(r2):
            c = cos[pos, i]
            s = sin[pos, i]
            a = x[j, i]
            b = x[j, i + r2]
            y[j, i] = a * c - b * s
            y[j, i + r2] = b * c + a * s
        for i in range(2 * r2, hd):  # partial rotary: the rest passes through
            y[j, i] = x[j, i]


@njit(cache=True, fastmath=True)
def rope_tokens(y, x, cos, sin, positions):  # x[T, H, hd] -> y[T, H, hd], serial
    """Rotate ``x`` [T, H, hd] by ``positions`` [T] with tables cos/sin [P, r/2]."""
    for t in range(x.shape[0]):
        _rope_token(y[t], x[t], cos, sin, positions[t])


@njit(parallel=True, cache=True, fastmath=True)
def rope_tokens_par(y, x, cos, sin, positions):  # x[T, H, hd] -> y[T, H, hd], parallel
    """As :func:`rope_tokens`, tokens split across threads (prefill)."""
    for t in prange(x.shape[0]):
        _rope_token(y[t], x[t], cos, sin, positions[t])


# ---- GLU ---------------------------------------------------------------------------------
@njit(cache=True, error_model="numpy")  # strict, not inlined (see _rmsnorm_row)
def glu_row(m, g, u, gelu):  # g[F], u[F] -> m[F] = act(g) * u
    """``m[i] = act(g[i]) * u[i]``: SiLU ``g / (1 + e^-g)``, or GELU-tanh when ``gelu``
    (``tanh(z) = 1 - 2 / (e^2z + 1)``); ``exp``: :func:`.attention.exp_f32` (Cephes
    ``expf``, ~1 ulp), inlined into this strict float32 kernel (Numba inlines its IR, so
    this function's flags apply, not exp_f32's fast-math). ``m`` may alias ``g`` or ``u``."""
    f = m.shape[0]
    if gelu:
        c = np.float32(0.7978845608028654)
        for i in range(f):
            x = g[i]
            z = c * (x + np.float32(0.044715) * x * x * x)
            th = np.float32(1.0) - np.float32(2.0) / (exp_f32(np.float32(2.0) * z)
                                                  + np.float32(1.0))
            m[i] = np.float32(0.5) * x * (np.float32(1.0) + th) * u[i]
    else:
        for i in range(f):
            x = g[i]
            m[i] = x / (np.float32(1.0) + exp_f32(-x)) * u[i]


@njit(cache=True)
def glu_rows2(y, g, u, gelu):  # g[R, F], u[R, F] -> y[R, F], serial
    """:func:`glu_row` on each row (any strides)."""
    for r in range(g.shape[0]):
        glu_row(y[r], g[r], u[r], gelu)


@njit(parallel=True, cache=True)
def glu_rows2_par(y, g, u, gelu):  # as glu_rows2, rows split across threads
    """As :func:`glu_rows2`, rows split across threads (prefill)."""
    for r in prange(g.shape[0]):
        glu_row(y[r], g[r], u[r], gelu)


@njit(parallel=True, cache=True)
def glu_rows_of_par(y, gu, go, uo, gelu):  # gu[R, W] -> y[R, F] from gu[r, go:go+F], gu[r, uo:]
    """:func:`glu_row` on ``gu[r, go:go+F]`` and ``gu[r, uo:uo+F]`` (F = ``y.shape[1]``),
    rows split across threads: a fused gate|up output read in place (prefill)."""
    f = y.shape[1]
    for r in prange(y.shape[0]):
        row = gu[r]
        glu_row(y[r], row[go:go + f], row[uo:uo + f], gelu)


def _fused_columns(g, up):
    """(gu, go, uo) when ``g`` and ``up`` are column views [R, F] of one C-contiguous
    float32 [R, W] array ``gu`` starting at columns go / uo, else None."""
    base = g.base
    if (base is None or up.base is not base or not isinstance(base, np.ndarray)
            or base.ndim != 2 or base.dtype != np.float32 or not base.flags.c_contiguous
            or base.shape[0] != g.shape[0] or g.shape != up.shape
            or g.strides != base.strides or up.strides != base.strides):
        return None
    go, rg = divmod(g.ctypes.data - base.ctypes.data, 4)
    uo, ru = divmod(up.ctypes.data - base.ctypes.data, 4)
    f = g.shape[1]
    if rg or ru or not (0 <= go <= base.shape[1] - f and 0 <= uo <= base.shape[1] - f):
        return None
    return base, go, uo


def glu_into(y, g, up, gelu):
    """``y[..., F] = act(g) * up`` into ``y`` (float32 C-contiguous, same shape as ``g``
    and ``up``); act SiLU, or GELU-tanh when ``gelu`` (:func:`glu_row` per row: the fused
    decode's numerics). Column views ``g`` / ``up`` of one fused gate|up output [R, W] are
    read in place (:func:`glu_rows_of_par`); other strided ones are copied to contiguous
    rows first; contiguous ones allocate nothing.
    """
    if g.ndim != 2:
        f = g.shape[-1]
        glu_into(y.reshape(-1, f), g.reshape(-1, f), up.reshape(-1, f), gelu)
        return y
    if g.size >= PAR_MIN_ELEMS and not g.flags.c_contiguous:
        fused = _fused_columns(g, up)
        if fused is not None:
            glu_rows_of_par(y, fused[0], fused[1], fused[2], gelu)
            return y
    # C-contiguous rows, as the fused decode passes them: the same compiled row kernel
    # (a strided row compiles to other, unvectorized code whose results differ by ulps)
    g, up = np.ascontiguousarray(g), np.ascontiguousarray(up)
    fn = glu_rows2_par if g.size >= PAR_MIN_ELEMS else glu_rows2
    fn(y, g, up, gelu)
    return y


# ---- rows of a repacked quantized weight (embedding lookup, prefill GEMM tiles) ------
@njit(cache=True, fastmath=True, nogil=True)
def dequant_rows_q4(out, wp, sc, sz, bmap, rows, scale):  # W4[rows, :K] * scale -> out[R, K]
    """Dequantize rows ``rows`` [R] of a repacked 4-bit weight: ``(code * s - s * z) * scale``.

    ``out`` float32 [R, K] with K <= the padded width; ``wp`` uint8 [out, nb*16].
    Releases the GIL (prefill runs it on several Python threads).
    """
    _dequant_q4(out, wp, sc, sz, bmap, rows, scale, np.float32(1.0))


@njit(cache=True, fastmath=True, nogil=True)
def dequant_rows_q4_sym(out, wp, sc, sz, bmap, rows, scale):  # W4[rows, :K] * scale -> out[R, K]
    """As :func:`dequant_rows_q4` for a symmetric weight (``sz`` is ``sc``, zero 8)."""
    _dequant_q4(out, wp, sc, sz, bmap, rows, scale, np.float32(8.0))


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def _dequant_q4(out, wp, sc, sz, bmap, rows, scale, zmul):
    k = out.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range((k + 31) // 32):
            g = bmap[b]
            s = group_value(sc, r, g, bmap.shape[0])
            z = group_value(sz, r, g, bmap.shape[0]) * zmul  # exact: zmul is 1 or 8
            base = (b // 2) * 32
            sh = np.uint8(4 * (b % 2))
            n = min(32, k - b * 32)
            for j in range(n):
                code = (wp[r, base + j] >> sh) & np.uint8(15)
                out[i, b * 32 + j] = (np.float32(code) * s - z) * scale


@njit(cache=True, fastmath=True, nogil=True)
def dequant_rows_q5(out, wp, sc, sz, bmap, rows, scale):  # W5[rows, :K] * scale -> out[R, K]
    """Dequantize rows ``rows`` [R] of a 5-bit weight: ``(code * s - sz) * scale`` into
    ``out`` float32 [R, K] (K <= the padded width). Releases the GIL."""
    _dequant_q5(out, wp, sc, sz, bmap, rows, scale, np.float32(1.0))


@njit(cache=True, fastmath=True, nogil=True)
def dequant_rows_q5_sym(out, wp, sc, sz, bmap, rows, scale):  # W5[rows, :K] * scale -> out[R, K]
    """As :func:`dequant_rows_q5` for ``Q5_0`` (``sz`` is ``sc``, zero 16: ``sz = 16 s``)."""
    _dequant_q5(out, wp, sc, sz, bmap, rows, scale, np.float32(16.0))


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def _dequant_q5(out, wp, sc, sz, bmap, rows, scale, zmul):
    k = out.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range((k + 31) // 32):
            g = bmap[b]
            s = group_value(sc, r, g, bmap.shape[0])
            z = group_value(sz, r, g, bmap.shape[0]) * zmul  # exact: zmul is 1 or 16
            c0 = (b // 2) * 40  # .repack.CHUNK_BYTES_Q5
            sh = np.uint8(4 * (b % 2))
            h0 = c0 + 32 + 4 * (b % 2)
            for j in range(min(32, k - b * 32)):
                code = (wp[r, c0 + j] >> sh) & np.uint8(15)
                code |= ((wp[r, h0 + (j >> 3)] >> np.uint8(j & 7)) & np.uint8(1)) << np.uint8(4)
                out[i, b * 32 + j] = (np.float32(code) * s - z) * scale


@njit(cache=True, fastmath=True, nogil=True)
def dequant_rows_q8(out, wp, sc, sz, bmap, rows, scale):  # W8[rows, :K] * scale -> out[R, K]
    """Dequantize rows of a repacked 8-bit weight (``wp`` int8 [out, nb*32]):
    ``(code * s - sz) * scale`` (``sz`` ``[out, 0]`` for symmetric weights: no term)."""
    k = out.shape[1]
    has_z = sz.shape[1] > 0
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range((k + 31) // 32):
            s = group_value(sc, r, bmap[b], bmap.shape[0])
            z = group_value(sz, r, bmap[b], bmap.shape[0]) if has_z else np.float32(0.0)
            n = min(32, k - b * 32)
            for j in range(n):
                out[i, b * 32 + j] = (np.float32(wp[r, b * 32 + j]) * s - z) * scale
