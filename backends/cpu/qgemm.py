"""Prefill linear (T > 2) on repacked 4-/8-bit weights: the decode GEMV's numerics for T rows.

Every token row goes through exactly the computation :func:`.gemv.gemv_quant` does for
one token (same activation quantization :func:`.gemv.quantize_act`, same SIMD row kernel
of :mod:`._simd`, same per-row float reduction :func:`.gemv._finish_rows`), so a row's
output does not depend on how many rows are computed with it: prefill of N tokens and
decode of the same tokens one by one give bit-identical linears (a KV-cache hit or a
chat turn computed by decode steps never changes the logits that follow).

Work is tiled for reuse: items are (weight tile of ``TILE_BLOCKS`` 4-row blocks, token
chunk of ``TILE_TOKENS`` rows), tile-major, split across Numba's threads; each item
runs the row kernel for every (block, token) pair, so a weight tile is loaded from
memory once per chunk of tokens and then read from cache (32 rows x in/2 bytes: 9-78
KB for 576-4864 inputs). Tiling changes only the order of independent rows, never the
arithmetic of one row.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .gemv import XQ_DTYPE, XQ_PER_BLOCK, _q4_block, _q8_block, quantize_act
from .repack import CpuQuantWeight

#: 4-row blocks per weight tile (32 rows).
TILE_BLOCKS = 8
#: Token rows per chunk.
TILE_TOKENS = 32


@njit(parallel=True, cache=True, fastmath=True)
def _gemm_int(y, x, wp, sc, sz, bmap, bias, xq, dx, xg, bits):
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
                if bits == 4:
                    _q4_block(i, nblk, y[t], wp, sc, sz, bmap, bias, xq[t], dx[t], xg[t])
                else:
                    _q8_block(i, nblk, y[t], wp, sc, sz, bmap, bias, xq[t], dx[t], xg[t])


_NO_BIAS = np.zeros(0, np.float32)


def gemm_int(x: np.ndarray, w: CpuQuantWeight, bias: np.ndarray | None) -> np.ndarray:
    """y[T, out] = x[T, in] @ W[out, in].T (+ bias), each row as :func:`.gemv.gemv_quant`.

    Args:
        x: float32 [T, in] C-contiguous.
        w: 4- or 8-bit repacked weight.
        bias: float32 [out] or None.

    Returns:
        float32 [T, out] (new array); the scratch (int16 [T, nb * 32] activations and
        their scales) lives for the call.
    """
    t = x.shape[0]
    y = np.empty((t, w.out_features), np.float32)
    xq = np.empty((t, w.n_blocks * XQ_PER_BLOCK), XQ_DTYPE)
    dx = np.empty((t, w.n_blocks), np.float32)
    xg = np.empty((t, w.n_groups), np.float32)
    _gemm_int(y, x, w.wp, w.sc, w.sz, w.bmap, _NO_BIAS if bias is None else bias,
              xq, dx, xg, w.bits)
    return y
