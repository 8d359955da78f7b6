"""Row decoder of :class:`..blockrows.BlockRows` tables (an embedding left as GGUF blocks).

One serial kernel for every legacy block type, into a caller's buffer (the decode plan
allocates nothing); the values are :meth:`..blockrows.BlockRows.dequantize_rows`' bit for
bit: fp16 fields widened exactly, one float32 multiply (and add of the min), no fused
multiply-add (no fast-math).
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _half(lo, hi):  # two bytes of a little-endian IEEE fp16 -> float32, exact
    h = np.int64(lo) | (np.int64(hi) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = np.float64(m) * 2.0 ** -24
    elif e == 31:
        v = np.inf if m == 0 else np.nan
    else:
        v = np.float64(1024 + m) * 2.0 ** (e - 25)
    return np.float32(-v if h >> 15 else v)


@njit(cache=True, nogil=True)
def dequant_block_rows(out, raw, ids, kind, scale):  # blocks[ids] -> out[T, D] * scale
    """Rows ``ids`` int64 [T] of ``raw`` uint8 [V, row_bytes] (``kind`` from
    :data:`..blockrows.BLOCK_TYPES`) into ``out`` float32 [T, D]; times ``scale`` when it
    is not 1 (a separate rounding, as ``x * float32(scale)``). Ids must be in range."""
    bbytes = (18, 20, 22, 24, 34)[kind]
    qs_at = (2, 4, 6, 8, 2)[kind]
    nb = out.shape[1] // 32
    one = scale == np.float32(1.0)
    for t in range(ids.shape[0]):
        r = ids[t]
        for b in range(nb):
            o = b * bbytes
            d = _half(raw[r, o], raw[r, o + 1])
            m = np.float32(0.0)
            if kind == 1 or kind == 3:
                m = _half(raw[r, o + 2], raw[r, o + 3])
            qh = np.int64(0)
            if kind == 2 or kind == 3:
                h = o + qs_at - 4
                qh = (np.int64(raw[r, h]) | (np.int64(raw[r, h + 1]) << 8)
                      | (np.int64(raw[r, h + 2]) << 16) | (np.int64(raw[r, h + 3]) << 24))
            for j in range(32):
                if kind == 4:
                    y = d * np.float32(np.int8(raw[r, o + 2 + j]))
                else:
                    byte = raw[r, o + qs_at + (j & 15)]
                    q = np.int64(byte & 15) if j < 16 else np.int64(byte >> 4)
                    if kind >= 2:
                        q |= ((qh >> j) & 1) << 4
                    if kind == 0:
                        y = d * np.float32(q - 8)
                    elif kind == 2:
                        y = d * np.float32(q - 16)
                    else:
                        y = d * np.float32(q) + m
                out[t, b * 32 + j] = y if one else y * scale
