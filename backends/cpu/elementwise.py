"""Row-wise kernels: RMSNorm, RoPE, dequantization of weight rows (embedding, prefill tiles).

GLU is numpy ufuncs written into a given output (:func:`glu_into`): their SIMD exp/tanh
beat Numba's scalar libm calls.

Each op has a serial row kernel (used directly for decode, T = 1: a parallel region
costs ~3 us of fork/join on 2 cores, more than the work) and a ``prange`` wrapper
over rows for prefill. All math is float32, as in the reference backend.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

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
@njit(cache=True, fastmath=True, inline="always")
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
@njit(cache=True, fastmath=True, inline="always")
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


# ---- GLU (numpy ufuncs) ---------------------------------------------------------------
def _const(v):  # a read-only float32 [1] operand: a scalar operand allocates a 0-d array
    a = np.full(1, v, np.float32)
    a.flags.writeable = False
    return a


_ONE, _HALF = _const(1.0), _const(0.5)
_GELU_A, _GELU_C = _const(0.044715), _const(0.7978845608028654)  # c = sqrt(2 / pi)


def glu_into(y, g, up, gelu):
    """``y[..., F] = act(g) * up`` in place of ``y`` (float32, same shape as ``g`` and
    ``up``; may not alias ``g``); act SiLU, or GELU-tanh when ``gelu``. Allocates nothing.

    numpy ufuncs (SIMD exp / tanh), not Numba, whose scalar libm ``exp`` per element is
    ~10x slower (benchmarks/MEASUREMENTS.md). Constants are float32 [1] arrays: a scalar
    operand would allocate a 0-d array per ufunc call.
    """
    if gelu:  # 0.5 g (1 + tanh(c (g + 0.044715 g^3))) * up
        np.multiply(g, g, out=y)
        np.multiply(y, _GELU_A, out=y)
        np.add(y, _ONE, out=y)
        np.multiply(y, g, out=y)
        np.multiply(y, _GELU_C, out=y)
        np.tanh(y, out=y)
        np.add(y, _ONE, out=y)
        np.multiply(y, g, out=y)
        np.multiply(y, _HALF, out=y)
    else:  # silu: g / (1 + exp(-g))
        np.negative(g, out=y)
        with np.errstate(over="ignore"):  # exp(-g) -> inf gives the right limit 0
            np.exp(y, out=y)
        np.add(y, _ONE, out=y)
        np.divide(g, y, out=y)
    np.multiply(y, up, out=y)
    return y


# ---- rows of a repacked quantized weight (embedding lookup, prefill GEMM tiles) ------
@njit(cache=True, fastmath=True, nogil=True)
def dequant_rows_q4(out, wp, sc, sz, bmap, rows, scale):  # W4[rows, :K] * scale -> out[R, K]
    """Dequantize rows ``rows`` [R] of a repacked 4-bit weight: ``(code * s - s * z) * scale``.

    ``out`` float32 [R, K] with K <= the padded width; ``wp`` uint8 [out, nb*16].
    Releases the GIL (prefill runs it on several Python threads).
    """
    k = out.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range((k + 31) // 32):
            g = bmap[b]
            s = sc[r, g]
            z = sz[r, g]
            base = (b // 2) * 32
            sh = np.uint8(4 * (b % 2))
            n = min(32, k - b * 32)
            for j in range(n):
                code = (wp[r, base + j] >> sh) & np.uint8(15)
                out[i, b * 32 + j] = (np.float32(code) * s - z) * scale


@njit(cache=True, fastmath=True, nogil=True)
def dequant_rows_q8(out, wp, sc, sz, bmap, rows, scale):  # W8[rows, :K] * scale -> out[R, K]
    """Dequantize rows of a repacked 8-bit weight (``wp`` int8 [out, nb*32]):
    ``(code * s - sz) * scale`` (``sz`` is 0 for symmetric weights)."""
    k = out.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for b in range((k + 31) // 32):
            s = sc[r, bmap[b]]
            z = sz[r, bmap[b]]
            n = min(32, k - b * 32)
            for j in range(n):
                out[i, b * 32 + j] = (np.float32(wp[r, b * 32 + j]) * s - z) * scale
