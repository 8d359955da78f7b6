"""Data-free INT4 that keeps each group's largest weight exact ("signmax").

Per group of ``g`` weights (symmetric, zero point 8, codes 0..15, value ``(q − 8) s``):

* ``e`` is the group's signed largest-magnitude weight (the first one on a tie).
* **Candidates** put ``e`` on an edge code ``c`` so that it dequantizes to itself:
  ``c = −8`` (llama.cpp's ``Q4_0`` rule, ``quantize_row_q4_0_ref`` in
  ``ggml/src/ggml-quants.c``, https://github.com/ggml-org/llama.cpp: ``s = e / −8``, a
  scale whose sign is opposite to ``e``'s, so ``e`` gets the 8 steps of the wider side)
  and ``c = +7`` (``s = e / 7``: both signs up to ``|e|`` on the grid, for groups whose
  largest weights of either sign are close).
* Each scale is rounded to the nearest fp16 value (the stored value, so ``e`` is exact up
  to that rounding: ``|c| · |s16 − e / c|``), its codes are ``clip(rint(w / s16) + 8)``, and
  the candidate with the lower squared error is kept (``c = −8`` on a tie). Optionally
  importance-weighted (``"kquant"``: llama.cpp's Q4_K weighting without an importance
  matrix, ``sqrt(mean w²) + |w|``, :func:`~edgeinfer.quant.grid.importance_of`); the default
  is the plain error, which measured better on SmolLM2 (README).
* An all-zero group stores the smallest scale (:data:`~edgeinfer.quant.rtn.SCALE_EPS`)
  and code 8: it dequantizes to exactly 0.

Why not a least-squares search (:mod:`.grid`): on the catalog models a lower squared
weight error that moves the largest weight costs more perplexity than it saves (the
README's quality section has the figures). Two candidates, a few vectorized passes over
the weights: no calibration data, no forward passes.
"""
from __future__ import annotations

import numpy as np

from ..backends.quantized import SYMMETRIC_ZERO_4BIT, QuantizedTensor
from .grid import group_blocks
from .rtn import SCALE_EPS, assemble, checked_weight, resolve_group, storage_scales

#: default layout: Q4_0's, symmetric groups of 32 with an fp16 scale (4.5 bits per weight)
GROUP_SIZE = 32
SYMMETRIC = True
#: the edge codes (value ``c · s``) the group's largest weight may take
EDGE_CODES = (-8, 7)


def signed_extreme(wg: np.ndarray) -> np.ndarray:
    """The signed largest-magnitude value of each group ``wg [..., g]`` (first on a tie)."""
    idx = np.abs(wg).argmax(axis=-1)
    return np.take_along_axis(wg, idx[..., None], axis=-1)[..., 0]


def _scale_for(e: np.ndarray, c: int) -> np.ndarray:
    """fp16-nearest ``e / c`` as float32; an all-zero group (``e == 0``) gets SCALE_EPS.
    ``|e / c|`` beyond fp16 (above 65504) keeps float32 (storage falls back for the tensor)."""
    s = (e / np.float32(c)).astype(np.float32)
    with np.errstate(over="ignore"):
        h = s.astype(np.float16).astype(np.float32)
    s = np.where(np.isfinite(h), h, s)
    # a tiny e whose scale underflows fp16 normals: floor the magnitude, keep the sign
    tiny = np.abs(s) < SCALE_EPS
    return np.where(tiny, np.where(e == 0, np.float32(SCALE_EPS),
                                   np.copysign(np.float32(SCALE_EPS), s)), s).astype(np.float32)


def _codes(wg: np.ndarray, s: np.ndarray) -> np.ndarray:
    q = np.rint(wg / s[..., None])
    q += SYMMETRIC_ZERO_4BIT
    return np.clip(q, 0.0, 15.0, out=q)


def signmax_params(wg: np.ndarray, a: np.ndarray | None,
                   edge_codes=EDGE_CODES) -> tuple[np.ndarray, np.ndarray]:
    """Scale and codes per group (module docstring).

    Args:
        wg: float32 ``[..., g]`` grouped weights (padded columns zero).
        a: float32 importance broadcastable to ``wg`` (0 on padded columns), or None.
        edge_codes: the codes ``e`` may take, in order of preference on a tie.

    Returns:
        ``(s, q)``: float32 scales ``wg.shape[:-1]`` (fp16 values, sign included) and
        codes ``wg.shape`` (integer valued 0..15).
    """
    e = signed_extreme(wg)
    best_e = best_s = best_q = None
    for c in edge_codes:
        s = _scale_for(e, c)
        q = _codes(wg, s)
        d = (q - SYMMETRIC_ZERO_4BIT) * s[..., None] - wg
        d *= d
        if a is not None:
            d *= a
        err = d.sum(axis=-1)
        if best_e is None:
            best_e, best_s, best_q = err, s, q
            continue
        better = err < best_e
        best_e = np.where(better, err, best_e)
        best_s = np.where(better, s, best_s)
        best_q = np.where(better[..., None], q, best_q)
    return best_s, best_q


def quantize_signmax(w: np.ndarray, group_size: int = GROUP_SIZE, symmetric: bool = SYMMETRIC,
                     importance: str | None = None, *, name: str = "", rows: int = 512,
                     edge_codes=EDGE_CODES) -> QuantizedTensor:
    """4-bit symmetric group quantization of ``w [out, in]`` keeping each group's largest
    weight exact (module docstring).

    Args:
        w: float ``[out, in]``; ``in`` not divisible by ``group_size`` is zero-padded as
            :func:`~edgeinfer.quant.rtn.quantize_rtn` (padded columns hold code 8 and
            dequantize to exactly 0; they never count in the error).
        group_size: columns per group (the layout of :mod:`.rtn`).
        symmetric: must be True (the rule needs the signed symmetric grid).
        importance: None (plain squared error, the default), ``"kquant"`` or ``"w2"``
            (:func:`~.grid.importance_of`).
        name: tensor name for messages. rows: rows per block (bounds the temporaries).
        edge_codes: see :func:`signmax_params`.

    Returns:
        QuantizedTensor with ``method="signmax"`` (fp16 scales, possibly negative; float32
        only if a scale exceeds the fp16 range).

    Raises:
        ValueError: non-finite weights (naming ``name``), bad shape or group size,
            ``symmetric=False``, an unknown importance.
    """
    if not symmetric:
        raise ValueError("signmax is symmetric only (zero point 8); use --symmetric or "
                         "another method (grid, rtn) for asymmetric groups")
    w = checked_weight(w, name)
    out, n_in = w.shape
    g, in_pad = resolve_group(n_in, group_size, 4)
    S = np.empty((out, in_pad // g), np.float32)
    codes = np.empty((out, in_pad), np.uint8)
    for r, wg, a in group_blocks(w, g, in_pad, rows, importance):
        s, q = signmax_params(wg, a, edge_codes)
        S[r:r + rows] = s
        q = q.reshape(len(wg), in_pad)
        q[:, n_in:] = SYMMETRIC_ZERO_4BIT
        codes[r:r + rows] = q
    scales = storage_scales(S.astype(np.float64), name)
    return assemble(codes, scales, None, 4, g, n_in, "signmax")
