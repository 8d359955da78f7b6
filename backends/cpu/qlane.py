"""Decode GEMV, prefill GEMM and row dequantization for 8-bit weights with a scale per 16
columns (llama.cpp ``Q6_K`` re-laid by :mod:`edgeinfer.readers.gguf_blocks`).

Same numerics as :mod:`.gemv` / :mod:`.qgemm` for every token row: the activations are
quantized by :func:`.gemv.quantize_act` (15-bit integers per 32-column block), the row
kernels of :mod:`._simd_k` take exact integer dots per half block and apply
``dx_b * s_(half)`` per lane, and :func:`.gemv._finish_rows` adds the bias. Prefill
runs that same per-row computation for each token (tiled as :mod:`.qgemm`: weight tiles
of ``TILE_BLOCKS`` 4-row blocks by token chunks of ``TILE_TOKENS``), so decode and
prefill agree bit for bit whatever the number of rows. For 6-bit weights the prefill
kernel builds each row's codes once for ``LANE6_TOKENS`` tokens
(:data:`._simd_k.q6l_row_tokens`, the same steps per token).

Weights (:class:`.repack.CpuQuantWeight` with ``lane_scales``): ``wp`` int8
``[out, nb * 32]``, ``sc`` float32 ``[out, 2 * nb]``, ``sz`` float32 ``[out, 0]``
(symmetric: no zero-point term), ``bmap`` int32 ``[nb]`` (``2 b``; only for the shared
activation quantizer's per-group sums, unused here). 6-bit ones (``bits`` 6: 6-bit codes,
int8 lane scales times a float32 per 256 columns, :mod:`.repack`) run the same steps on
:mod:`._simd_k`'s 6-bit row kernels, with the same sums.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._simd_k import (LANE6_TOKENS, lane6_code, lane6_scale, q6l_rows1, q6l_rows4,
                      q6l_row_tokens, q8l_rows1, q8l_rows4)
from .elementwise import (dequant_rows_q4, dequant_rows_q4_sym, dequant_rows_q5,
                          dequant_rows_q5_sym, dequant_rows_q8)
from .gemv import SERIAL_MAX_BYTES, XQ_DTYPE, XQ_PER_BLOCK, _finish_rows, quantize_act
from .repack import CpuQuantWeight

#: 4-row blocks per weight tile of the prefill GEMM (32 rows).
TILE_BLOCKS = 8
#: Token rows per chunk of the prefill GEMM.
TILE_TOKENS = 32


@njit(cache=True, fastmath=True, inline="always")
def _lane_block(i, nblk, y, wp, sc, sz, bias, xq, dx, xg):  # row block i of W @ x
    nb = dx.shape[0]
    if i < nblk:
        r0, nr = i * 4, 4
        q8l_rows4(y, r0, wp, sc, xq, dx, nb)
    else:
        r0, nr = nblk * 4 + (i - nblk), 1
        q8l_rows1(y, r0, wp, sc, xq, dx, nb)
    _finish_rows(y, r0, nr, sz, xg, bias)


@njit(cache=True, fastmath=True, inline="always")
def _lane6_block(i, nblk, y, wp, sc, sz, bias, xq, dx, xg):  # row block i of W6 @ x
    nb = dx.shape[0]
    if i < nblk:
        r0, nr = i * 4, 4
        q6l_rows4(y, r0, wp, sc, xq, dx, nb)
    else:
        r0, nr = nblk * 4 + (i - nblk), 1
        q6l_rows1(y, r0, wp, sc, xq, dx, nb)
    _finish_rows(y, r0, nr, sz, xg, bias)


@njit(parallel=True, cache=True, fastmath=True)
def gemv_q6l(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):  # W6[out, in] @ x[in] (+ b) -> y[out]
    """Lane-scaled 6-bit GEMV (:mod:`.repack`), row blocks of 4 split across threads."""
    quantize_act(xq, dx, xg, x, bmap)
    out = y.shape[0]
    nblk = out // 4
    for i in prange(nblk + out - nblk * 4):
        _lane6_block(i, nblk, y, wp, sc, sz, bias, xq, dx, xg)


@njit(cache=True, fastmath=True)
def gemv_q6l_serial(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):
    """As :func:`gemv_q6l` on the calling thread."""
    quantize_act(xq, dx, xg, x, bmap)
    out = y.shape[0]
    nblk = out // 4
    for i in range(nblk + out - nblk * 4):
        _lane6_block(i, nblk, y, wp, sc, sz, bias, xq, dx, xg)


@njit(parallel=True, cache=True, fastmath=True)
def gemv_q8l(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):  # W[out, in] @ x[in] (+ b) -> y[out]
    """Lane-scaled 8-bit GEMV, row blocks of 4 split across threads; bias [out] or [0]."""
    quantize_act(xq, dx, xg, x, bmap)
    out = y.shape[0]
    nblk = out // 4
    for i in prange(nblk + out - nblk * 4):
        _lane_block(i, nblk, y, wp, sc, sz, bias, xq, dx, xg)


@njit(cache=True, fastmath=True)
def gemv_q8l_serial(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):
    """As :func:`gemv_q8l` on the calling thread (small weights: no fork/join)."""
    quantize_act(xq, dx, xg, x, bmap)
    out = y.shape[0]
    nblk = out // 4
    for i in range(nblk + out - nblk * 4):
        _lane_block(i, nblk, y, wp, sc, sz, bias, xq, dx, xg)


def gemv_fn(w: CpuQuantWeight):
    """The GEMV of a lane-scaled weight ``(y, x, wp, sc, sz, bmap, bias, xq, dx, xg)``:
    serial up to ``SERIAL_MAX_BYTES``, else parallel (as :func:`.gemv.gemv_quant`)."""
    if w.bits == 6:
        return gemv_q6l_serial if w.nbytes <= SERIAL_MAX_BYTES else gemv_q6l
    return gemv_q8l_serial if w.nbytes <= SERIAL_MAX_BYTES else gemv_q8l


@njit(parallel=True, cache=True, fastmath=True)
def _gemm_q8l(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):
    t_n = x.shape[0]
    for t in prange(t_n):
        quantize_act(xq[t], dx[t], xg[t], x[t], bmap)
    out = y.shape[1]
    nblk = out // 4
    n_items = nblk + out - nblk * 4
    n_tiles = -(-n_items // TILE_BLOCKS)
    n_chunks = -(-t_n // TILE_TOKENS)
    for it in prange(n_tiles * n_chunks):
        tile = it // n_chunks
        c = it - tile * n_chunks
        i1 = min(n_items, (tile + 1) * TILE_BLOCKS)
        t1 = min(t_n, (c + 1) * TILE_TOKENS)
        for i in range(tile * TILE_BLOCKS, i1):
            for t in range(c * TILE_TOKENS, t1):
                _lane_block(i, nblk, y[t], wp, sc, sz, bias, xq[t], dx[t], xg[t])


@njit(parallel=True, cache=True, fastmath=True)
def _gemm_q6l(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):  # as _gemm_q8l, 4 tokens a call
    t_n = x.shape[0]
    for t in prange(t_n):
        quantize_act(xq[t], dx[t], xg[t], x[t], bmap)
    out = y.shape[1]
    nb = dx.shape[1]
    tile_rows = 4 * TILE_BLOCKS
    n_tiles = -(-out // tile_rows)
    n_chunks = -(-t_n // TILE_TOKENS)
    for it in prange(n_tiles * n_chunks):
        tile = it // n_chunks
        c = it - tile * n_chunks
        r1 = min(out, (tile + 1) * tile_rows)
        t0, t1 = c * TILE_TOKENS, min(t_n, (c + 1) * TILE_TOKENS)
        for ra in range(tile * tile_rows, r1, 4):  # 4 rows over the same 4 tokens (in L1)
            rb = min(r1, ra + 4)
            t = t0
            while t + LANE6_TOKENS <= t1:
                for r in range(ra, rb):
                    q6l_row_tokens(y, r, wp, sc, xq, dx, nb, t)
                t += LANE6_TOKENS
            for j in range(t, t1):
                for r in range(ra, rb):
                    q6l_rows1(y[j], r, wp, sc, xq[j], dx[j], nb)
            for j in range(t0, t1):
                _finish_rows(y[j], ra, rb - ra, sz, xg[j], bias)


_NO_BIAS = np.zeros(0, np.float32)


def gemm_lane(x: np.ndarray, w: CpuQuantWeight, bias: np.ndarray | None) -> np.ndarray:
    """y[T, out] = x[T, in] @ W[out, in].T (+ bias) for a lane-scaled weight, each row
    bit-identical to its decode GEMV (:func:`gemv_fn`).

    Args:
        x: float32 [T, in] C-contiguous.
        w: repacked weight with ``lane_scales``.
        bias: float32 [out] or None.

    Returns:
        float32 [T, out] (new array).
    """
    t = x.shape[0]
    y = np.empty((t, w.out_features), np.float32)
    xq = np.empty((t, w.n_blocks * XQ_PER_BLOCK), XQ_DTYPE)
    dx = np.empty((t, w.n_blocks), np.float32)
    xg = np.empty((t, w.n_groups), np.float32)
    gemm = _gemm_q6l if w.bits == 6 else _gemm_q8l
    gemm(y, x, w.wp, w.sc, w.sz, w.bmap, _NO_BIAS if bias is None else bias, xq, dx, xg)
    return y


@njit(cache=True, fastmath=True, nogil=True)
def dequant_rows_q8l(out, wp, sc, sz, bmap, rows, scale):  # W[rows, :K] * scale -> out[R, K]
    """Dequantize rows ``rows`` [R] of a lane-scaled weight: ``code * sc[r, k // 16] *
    scale`` into ``out`` float32 [R, K] (K <= the padded width). ``sz`` / ``bmap`` are
    taken for the signature of :func:`.elementwise.dequant_rows_q8` and unused.
    Releases the GIL."""
    k = out.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for j in range((k + 15) // 16):
            s = sc[r, j]
            for c in range(j * 16, min(k, j * 16 + 16)):
                out[i, c] = np.float32(wp[r, c]) * s * scale


@njit(cache=True, fastmath=True, nogil=True)
def dequant_rows_q6l(out, wp, sc, sz, bmap, rows, scale):  # W6[rows, :K] * scale -> out[R, K]
    """As :func:`dequant_rows_q8l` for a 6-bit weight (codes and packed lane scales of
    :mod:`.repack`). Releases the GIL."""
    k = out.shape[1]
    nb = bmap.shape[0]
    for i in range(rows.shape[0]):
        r = rows[i]
        for j in range((k + 15) // 16):
            s = lane6_scale(sc, r, j >> 1, j & 1, nb)
            for c in range(j * 16, min(k, j * 16 + 16)):
                out[i, c] = np.float32(lane6_code(wp, r, c)) * s * scale


def row_dequant(w: CpuQuantWeight):
    """The row dequantizer ``(out, wp, sc, sz, bmap, rows, scale)`` of any repacked weight:
    :func:`dequant_rows_q8l` for lane scales, else :mod:`.elementwise`'s 4- / 5- / 8-bit
    one."""
    if w.lane_scales:
        return dequant_rows_q6l if w.bits == 6 else dequant_rows_q8l
    if w.bits == 5 and w.zero_scale != 1.0:
        return dequant_rows_q5_sym
    if w.bits == 4 and w.zero_scale != 1.0:
        return dequant_rows_q4_sym
    return {4: dequant_rows_q4, 5: dequant_rows_q5, 8: dequant_rows_q8}[w.bits]
