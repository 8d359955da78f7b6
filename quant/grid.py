"""Data-free INT4 on a searched grid ("grid"): per group, the fp16 scale (and integer zero
point) minimising the importance-weighted squared error of the dequantized weights.

No calibration data and no forward passes: the weights alone, vectorized over every group
of a tensor in row blocks, float32.

Per group ``w [g]`` with importance ``a [g]``:

* **Candidates** (llama.cpp's k-quant search, ``make_qkx2_quants`` / ``make_qx_quants`` in
  ``ggml/src/ggml-quants.c``, https://github.com/ggml-org/llama.cpp): RTN's own grid
  (:func:`~edgeinfer.quant.rtn.group_params`, so no group is worse than RTN), then
  ``range / (15 + δ)`` (asymmetric) or ``absmax / (7.5 + δ / 2)`` signed so the largest
  magnitude lands on the edge code of its sign (symmetric), for each ``δ`` of
  :data:`DELTAS`. Asymmetric: zero ``z = round(−min / s)``.
* **Refit**: for each candidate's codes the weighted least-squares scale
  ``Σ a q' w / Σ a q'²`` (``q' = q − z``), re-rounded to fp16 and re-coded; asymmetric
  also tries ``z ± 1`` with the refit scale (the zero is an integer code in this layout,
  :mod:`edgeinfer.backends.quantized`, so HQQ's float zero (Badri & Shaji 2023,
  https://mobiusml.github.io/hqq_blog/) is not representable; its alternating
  codes/parameters update is what :data:`REFINE` rounds of "codes, then refit" do).
* **Importance** (data-free): ``"kquant"`` is llama.cpp's weighting for Q4_K without an
  importance matrix (``quantize_row_q4_K_ref``: ``a = sqrt(mean w²) + |w|`` over the
  group); ``None`` is plain squared error.
* The best candidate by the weighted error is kept; the stored fp16 scale is the one
  scored, so the file holds exactly what was optimized.
"""
from __future__ import annotations

import numpy as np

from ..backends.quantized import SYMMETRIC_ZERO_4BIT, QuantizedTensor
from .mse import _codes, _err
from .rtn import (
    SCALE_EPS,
    assemble,
    checked_weight,
    group_params,
    resolve_group,
    storage_scales,
)

#: candidate scales: range / (15 + δ); δ < 0 widens the grid, δ > 0 clips the extremes
DELTAS = (-0.5, 0.0, 0.5, 1.0, 1.5, 2.0)
#: rounds of "codes for the best (s, z), least-squares scale for those codes"
REFINE = 1
#: default layout of the method: symmetric groups of 32, fp16 scale (4.5 bits per weight)
GROUP_SIZE = 32
SYMMETRIC = True


def _fp16_near(s: np.ndarray) -> np.ndarray:
    """float32 scales rounded to the nearest fp16 value (as float32), floored at SCALE_EPS
    and clamped below the fp16 maximum (rows beyond it fall back to float32 in storage)."""
    s = np.maximum(s, np.float32(SCALE_EPS))
    with np.errstate(over="ignore"):
        h = s.astype(np.float16).astype(np.float32)
    return np.where(np.isfinite(h), h, s)


def importance_of(wg: np.ndarray, kind: str | None) -> np.ndarray | None:
    """Data-free importance ``[..., g]`` for grouped weights (module docstring), or None."""
    if kind is None:
        return None
    if kind == "kquant":
        return np.sqrt(np.mean(wg * wg, axis=-1, keepdims=True)) + np.abs(wg)
    if kind == "w2":
        return np.mean(wg * wg, axis=-1, keepdims=True) + wg * wg
    raise ValueError(f"unknown importance {kind!r}; choose None, 'kquant' or 'w2'")


def search_params(wg: np.ndarray, a: np.ndarray | None, symmetric: bool,
                  deltas=DELTAS, refine: int = REFINE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scale, zero and codes minimising ``Σ a (w − (q − z) s)²`` per group.

    Args:
        wg: float32 ``[..., g]`` grouped weights (padded columns zero, weight 0 in ``a``).
        a: float32 importance broadcastable to ``wg``, or None (plain squared error).
        symmetric: zero point fixed at 8.

    Returns:
        ``(s, z, q)``: float32 fp16-valued scales ``wg.shape[:-1]``, zero points (integer
        valued) and codes (``wg.shape``, integer valued 0..15).
    """
    lo = np.minimum(wg.min(axis=-1), 0.0)
    hi = np.maximum(wg.max(axis=-1), 0.0)
    shape = wg.shape[:-1]
    best_e = np.full(shape, np.inf, np.float32)
    best_s = np.zeros(shape, np.float32)
    best_z = np.zeros(shape, np.float32)
    zsym = np.full(shape, np.float32(SYMMETRIC_ZERO_4BIT))

    def score(s, z):
        q = _codes(wg, s, z)
        e = _err(wg, a, q, s, z)
        better = e < best_e
        best_e[better], best_s[better], best_z[better] = e[better], s[better], z[better]
        return q

    def refit(q, s, z):
        qz = q - z[..., None]
        aq = qz if a is None else qz * a
        num = (aq * wg).sum(axis=-1)
        den = (aq * qz).sum(axis=-1)
        return _fp16_near(np.where(den > 0, num / np.where(den > 0, den, 1), s))

    amax = np.maximum(-lo / 8.0, hi / 7.0)  # symmetric: the edge code of each sign
    for d in (None, *deltas):
        if d is None:  # RTN's own grid first: the result is never worse than RTN's
            s, z = (v.astype(np.float32) for v in group_params(wg.astype(np.float64), 4, symmetric))
        elif symmetric:
            s, z = _fp16_near(amax * np.float32(15.0 / (15.0 + d))), zsym
        else:
            s = _fp16_near((hi - lo) / np.float32(15.0 + d))
            z = np.clip(np.rint(-lo / s), 0.0, 15.0)
        q = score(s, z)
        s2 = refit(q, s, z)
        score(s2, z)
        if not symmetric:
            for dz in (-1.0, 1.0):
                score(s2, np.clip(z + dz, 0.0, 15.0))
    for _ in range(refine):  # alternate: codes for the best grid, then its LS scale
        q = _codes(wg, best_s, best_z)
        score(refit(q, best_s, best_z), best_z.copy())
    return best_s, best_z, _codes(wg, best_s, best_z)


def group_blocks(w: np.ndarray, g: int, in_pad: int, rows: int, importance: str | None):
    """Yield ``(r, wg, a)`` per block of ``rows`` rows of ``w [out, in]``: ``wg`` float32
    ``[rows, in_pad / g, g]`` zero-padded, ``a`` its importance (:func:`importance_of`)
    with the padded columns weighted 0 (None when unweighted and unpadded)."""
    out, n_in = w.shape
    ng = in_pad // g
    mask = None
    if in_pad != n_in:
        mask = np.zeros(in_pad, np.float32)
        mask[:n_in] = 1.0
        mask = mask.reshape(1, ng, g)
    for r in range(0, out, rows):
        blk = np.zeros((min(rows, out - r), in_pad), np.float32)
        blk[:, :n_in] = w[r:r + rows]
        wg = blk.reshape(len(blk), ng, g)
        a = importance_of(wg, importance)
        if mask is not None:
            a = mask if a is None else a * mask
        yield r, wg, a


def quantize_grid(w: np.ndarray, group_size: int = GROUP_SIZE, symmetric: bool = SYMMETRIC,
                  importance: str | None = "kquant", *, name: str = "", rows: int = 256,
                  deltas=DELTAS, refine: int = REFINE) -> QuantizedTensor:
    """4-bit group quantization of ``w [out, in]`` on the searched grid (module docstring).

    Args:
        w: float ``[out, in]``; ``in`` not divisible by ``group_size`` is zero-padded as
            :func:`~edgeinfer.quant.rtn.quantize_rtn` (padded columns get weight 0 and
            hold the zero point, so they dequantize to exactly 0).
        group_size, symmetric: the layout (see :mod:`.rtn`).
        importance: ``"kquant"`` (default), ``"w2"`` or None (:func:`importance_of`).
        name: tensor name for messages. rows: rows per block (bounds the temporaries).

    Returns:
        QuantizedTensor with ``method="grid"``.

    Raises:
        ValueError: non-finite weights (naming ``name``), bad shape or group size.
    """
    w = checked_weight(w, name)
    out, n_in = w.shape
    g, in_pad = resolve_group(n_in, group_size, 4)
    S = np.empty((out, in_pad // g), np.float32)
    Z = np.empty_like(S)
    codes = np.empty((out, in_pad), np.uint8)
    for r, wg, a in group_blocks(w, g, in_pad, rows, importance):
        s, z, q = search_params(wg, a, symmetric, deltas, refine)
        S[r:r + rows], Z[r:r + rows] = s, z
        q = q.reshape(len(wg), in_pad)
        if in_pad != n_in:
            q[:, n_in:] = np.repeat(z, g, axis=1)[:, n_in:]
        codes[r:r + rows] = q
    scales = storage_scales(S.astype(np.float64), name)
    return assemble(codes, scales, None if symmetric else Z.astype(np.float64), 4, g, n_in, "grid")
