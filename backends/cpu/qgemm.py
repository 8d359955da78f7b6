"""Integer linear for T > 1 tokens (prefill, batched decode, speculative verify) on
repacked 4-/5-/8-bit weights: the decode GEMV's numerics for T rows.

Every token row is quantized as :func:`.gemv.quantize_act` does for one token, and its
dot products, group scales, zero-point term and bias follow the decode GEMV's sequence
of float operations exactly (the multi-token kernels of :mod:`._simd_tokens`), so a
row's output does not depend on how many rows are computed with it: prefill of N
tokens and decode of the same tokens one by one give bit-identical linears (a KV-cache
hit or a chat turn computed by decode steps never changes the logits that follow).

Work is tiled for reuse: items are (tile of ``TILE_ROWS`` weight rows, chunk of
``TILE_TOKENS`` tokens), split across Numba's threads; an item runs the kernel for
each group of up to ``TOKEN_BLOCK`` (4) tokens over the tile's rows, so a weight chunk
is widened once per 4 tokens, the tile is read from memory once per chunk of tokens and
then from cache (32 rows x in/2 bytes: 9-78 KB for 576-4864 inputs), and the 4 tokens'
activations stay in L1 while the rows stream. Tiling changes only the order of
independent (row, token) outputs, never the arithmetic of one.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._amx import AMX_MIN_TOKENS, HAVE_AMX, gemm_amx, gemm_rows
from ._amx_few import FEW_MIN_TOKENS, gemm_few
from ._blockdot import BLOCKDOT
from ._simd_tokens import (TOKEN_BLOCK, q4_tok1, q4_tok2, q4_tok3, q4_tok4, q5_tok1, q5_tok2,
                           q5_tok3, q5_tok4, q8_tok1, q8_tok2, q8_tok3, q8_tok4)
from .gemv import XQ_DTYPE, XQ_PER_BLOCK, quantize_rows
from .repack import CpuQuantWeight

#: Rows per weight tile.
TILE_ROWS = 32
#: Token rows per chunk.
TILE_TOKENS = 32


@njit(cache=True, fastmath=True, inline="always")
def _tokens(n, bits, y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):  # n (1..4) tokens x nr rows
    if bits == 5:
        if n == 4:
            q5_tok4(y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
        elif n == 3:
            q5_tok3(y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
        elif n == 2:
            q5_tok2(y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
        else:
            q5_tok1(y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
    elif bits == 4:
        if n == 4:
            q4_tok4(y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
        elif n == 3:
            q4_tok3(y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
        elif n == 2:
            q4_tok2(y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
        else:
            q4_tok1(y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
    else:
        if n == 4:
            q8_tok4(y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
        elif n == 3:
            q8_tok3(y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
        elif n == 2:
            q8_tok2(y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
        else:
            q8_tok1(y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


@njit(parallel=True, cache=True, fastmath=True)
def _gemm_int(y, x, wp, sc, sz, bmap, bias, xq, dx, xg, bits, zmul):
    t_n = x.shape[0]
    quantize_rows(xq, dx, xg, x, bmap, zmul)
    out = y.shape[1]
    nb = dx.shape[1]
    n_tiles = -(-out // TILE_ROWS)
    n_chunks = -(-t_n // TILE_TOKENS)
    for it in prange(n_tiles * n_chunks):
        tile = it // n_chunks
        c = it - tile * n_chunks
        r0 = tile * TILE_ROWS
        nr = min(out, r0 + TILE_ROWS) - r0
        t1 = min(t_n, (c + 1) * TILE_TOKENS)
        t = c * TILE_TOKENS
        while t < t1:
            n = min(TOKEN_BLOCK, t1 - t)
            _tokens(n, bits, y, t, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
            t += n


_NO_BIAS = np.zeros(0, np.float32)


def blockdot_path(t: int, bits: int = 4):
    """The GEMM a 4-, 5- or 8-bit weight takes for ``t`` tokens on a CPU with AMX-INT8:
    the 16-token tiles (:func:`._amx.gemm_amx`, 4- and 5-bit from
    :data:`._amx.AMX_MIN_TOKENS`), the few-token tiles
    (:func:`._amx_few.gemm_few`: from :data:`._amx_few.FEW_MIN_TOKENS`; 8-bit for every
    count above), or the row kernels (:func:`._amx.gemm_rows`: fewer tokens, or
    without the OS's tile permission). All give the same floats."""
    if HAVE_AMX and t >= AMX_MIN_TOKENS.get(bits, t + 1):
        return gemm_amx
    if HAVE_AMX and t >= FEW_MIN_TOKENS[bits]:
        return gemm_few
    return gemm_rows


def gemm_int(x: np.ndarray, w: CpuQuantWeight, bias: np.ndarray | None) -> np.ndarray:
    """y[T, out] = x[T, in] @ W[out, in].T (+ bias), each row as :func:`.gemv.gemv_quant`.

    Args:
        x: float32 [T, in] C-contiguous.
        w: 4-, 5- or 8-bit repacked weight.
        bias: float32 [out] or None.

    Returns:
        float32 [T, out] (new array); the scratch (int16 [T, nb * 32] activations and
        their scales) lives for the call.
    """
    if BLOCKDOT and not w.lane_scales:  # AMX hosts: the block-dot numerics of the GEMV
        return blockdot_path(x.shape[0], w.bits)(x, w, bias)
    t = x.shape[0]
    y = np.empty((t, w.out_features), np.float32)
    xq = np.empty((t, w.n_blocks * XQ_PER_BLOCK), XQ_DTYPE)
    dx = np.empty((t, w.n_blocks), np.float32)
    xg = np.empty((t, w.n_groups), np.float32)
    _gemm_int(y, x, w.wp, w.sc, w.sz, w.bmap, _NO_BIAS if bias is None else bias,
              xq, dx, xg, w.bits, np.float32(w.zero_scale))
    return y
