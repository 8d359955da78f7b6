"""Round-to-nearest on an error-minimising grid: per group, the scale and zero point that
minimise the (importance-weighted) squared error of the dequantized weights.

The search follows llama.cpp's k-quant search (``make_qkx2_quants`` in
``ggml-quants.c``: candidate scales ``range / (n_levels - 1 + δ)`` on a grid of ``δ``,
each followed by a weighted least-squares refit of the scale for the codes it gives,
the best kept), adapted to this layout (:mod:`edgeinfer.backends.quantized`): the zero
point is an integer code (not a float minimum), so for each candidate scale it is
``round(−min / s)``, the scale stored is the fp16 value the search scored, and RTN's own
grid (:func:`~edgeinfer.quant.rtn.group_params`) is the first candidate, so no group
is worse than RTN.

Codes, scales and errors in float32 (the weights are float32): each group's candidates
are scored in one compiled pass with float64 sums (:func:`search_group_params`);
:func:`search_group_params_reference` is the same search in numpy, vectorized over the
groups, the oracle the tests hold it to.
"""
from __future__ import annotations

import functools

import numpy as np

from ..backends.quantized import SYMMETRIC_ZERO_4BIT, QuantizedTensor
from ._compiled import compiled
from .rtn import (
    SCALE_EPS,
    assemble,
    checked_weight,
    group_params,
    resolve_group,
    storage_scales,
)

#: the candidate grid: scale = range / (15 + δ) (asymmetric) or absmax / (7.5 + δ / 2)
#: (symmetric); δ < 0 widens the grid, δ > 0 clips the extremes.
DELTAS = (-0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0)


def _fp16_up(s: np.ndarray) -> np.ndarray:
    """float32 scales rounded up to fp16 values (as float32), floored at SCALE_EPS."""
    s = np.maximum(s, np.float32(SCALE_EPS))
    with np.errstate(over="ignore"):
        h = s.astype(np.float16)
    low = h.astype(np.float32) < s
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h.astype(np.float32)


def _codes(wg, s, z):
    q = np.rint(wg / s[..., None])
    q += z[..., None]
    return np.clip(q, 0.0, 15.0, out=q)


def _err(wg, a, q, s, z):
    d = (q - z[..., None]) * s[..., None] - wg
    d *= d
    if a is not None:
        d *= a
    return d.sum(axis=-1)


def _candidates(wg: np.ndarray, symmetric: bool, deltas) -> tuple[np.ndarray, np.ndarray]:
    """The candidate grids of groups ``wg [G, g]`` (float32): scales and zeros ``[G, C]``,
    RTN's first, then one per ``δ`` (:data:`DELTAS`), in the reference search's order."""
    lo = np.minimum(wg.min(axis=-1), 0.0)
    hi = np.maximum(wg.max(axis=-1), 0.0)
    S = np.empty((len(wg), 1 + len(deltas)), np.float32)
    Z = np.empty_like(S)
    S[:, 0], Z[:, 0] = group_params(wg.astype(np.float64), 4, symmetric)  # exact in float32
    amax = np.maximum(-lo / 8.0, hi / 7.0)  # the largest magnitude on its sign's edge code
    for c, d in enumerate(deltas, 1):
        if symmetric:
            S[:, c] = _fp16_up(amax * np.float32(15.0 / (15.0 + d)))
            Z[:, c] = SYMMETRIC_ZERO_4BIT
        else:
            S[:, c] = _fp16_up((hi - lo) / np.float32(15.0 + d))
            Z[:, c] = np.clip(np.rint(-lo / S[:, c]), 0.0, 15.0)
    return S, Z


def _score_py(w, a, S, Z, fit, num, den, err):
    """For every group ``i`` (rows of ``w``, ``a`` float32 ``[G, g]``) and candidate ``c``
    (``S``, ``Z`` float32 ``[G, C]``): the codes ``clip(rint(w / s) + z, 0, 15)``, their
    weighted error ``err = Σ a ((q − z) s − w)²`` and, with ``fit``, the least-squares
    sums ``num = Σ a (q − z) w``, ``den = Σ a (q − z)²`` (float64 ``[G, C]``)."""
    lo, top = np.float32(0.0), np.float32(15.0)
    for i in range(w.shape[0]):
        for c in range(S.shape[1]):
            s, z = S[i, c], Z[i, c]
            e, nu, de = 0.0, 0.0, 0.0
            for j in range(w.shape[1]):
                q = min(max(np.rint(w[i, j] / s) + z, lo), top)
                qz = q - z
                d = qz * s - w[i, j]
                e += d * d * a[i, j]
                if fit:
                    aq = qz * a[i, j]
                    nu += aq * w[i, j]
                    de += aq * qz
            err[i, c] = e
            if fit:
                num[i, c], den[i, c] = nu, de


@functools.lru_cache(maxsize=1)
def _score_kernel():
    """:func:`_score_py` compiled (its sums may be reassociated: vectorized)."""
    return compiled(_score_py, fastmath={"reassoc"})


def search_group_params(wg: np.ndarray, a: np.ndarray | None, symmetric: bool = False,
                        deltas=DELTAS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scale, zero and codes minimising ``Σ a (w − (q − z) s)²`` per group: the search of
    :func:`search_group_params_reference` (same candidates, same order, the first best
    kept), each group's candidates scored in one compiled pass (:func:`_score_py`) with
    float64 sums instead of numpy's float32 ones, so a near-tie may resolve otherwise.

    Args, Returns: as :func:`search_group_params_reference`.
    """
    shape, g = wg.shape[:-1], wg.shape[-1]
    w2 = np.ascontiguousarray(wg, np.float32).reshape(-1, g)
    a2 = (np.ones_like(w2) if a is None else
          np.ascontiguousarray(np.broadcast_to(np.asarray(a, np.float32), wg.shape)).reshape(-1, g))
    S, Z = _candidates(w2, symmetric, deltas)
    num, den, err = (np.empty(S.shape) for _ in range(3))
    score = _score_kernel()
    score(w2, a2, S, Z, True, num, den, err)
    with np.errstate(invalid="ignore", divide="ignore"):
        S2 = _fp16_up(np.where(den > 0, num / np.where(den > 0, den, 1), S).astype(np.float32))
    err2 = np.empty(S.shape)
    score(w2, a2, S2, Z, False, num, den, err2)
    E = np.empty((len(S), 2 * S.shape[1]))
    E[:, 0::2], E[:, 1::2] = err, err2  # the reference's order: s, then its refit, per δ
    k = np.argmin(E, axis=1)
    rows = np.arange(len(S))
    best_s = np.where(k % 2 == 0, S[rows, k // 2], S2[rows, k // 2])
    best_z = Z[rows, k // 2]
    q = _codes(w2, best_s, best_z)
    return best_s.reshape(shape), best_z.reshape(shape), q.reshape(wg.shape)


def search_group_params_reference(wg: np.ndarray, a: np.ndarray | None, symmetric: bool = False,
                                  deltas=DELTAS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scale, zero and codes minimising ``Σ a (w − (q − z) s)²`` per group (numpy, the
    oracle of :func:`search_group_params`).

    Args:
        wg: float32 ``[..., g]`` grouped weights.
        a: float32 importance broadcastable to ``wg`` (e.g. ``[g]`` or ``[1, n_groups, g]``),
            or None for plain squared error.
        symmetric: zero point fixed at 8.

    Returns:
        ``(s, z, q)``: float32 scales (fp16 values), zero points and codes (``wg.shape``).
    """
    shape, g = wg.shape[:-1], wg.shape[-1]
    S, Z = (c.reshape(*shape, -1) for c in _candidates(wg.reshape(-1, g), symmetric, deltas))
    best_e = np.full(shape, np.inf, np.float32)
    best_s = np.zeros(shape, np.float32)
    best_z = np.zeros(shape, np.float32)
    for c in range(S.shape[-1]):  # RTN's own grid first: never worse than RTN's
        s, z = S[..., c], Z[..., c]
        q = _codes(wg, s, z)
        # weighted least-squares scale for these codes, then re-rounded
        qz = q - z[..., None]
        aq = qz if a is None else qz * a
        num = (aq * wg).sum(axis=-1)
        den = (aq * qz).sum(axis=-1)
        s2 = _fp16_up(np.where(den > 0, num / np.where(den > 0, den, 1), s))
        for cand in (s, s2):
            qc = _codes(wg, cand, z)
            e = _err(wg, a, qc, cand, z)
            better = e < best_e
            best_e[better], best_s[better], best_z[better] = e[better], cand[better], z[better]
    return best_s, best_z, _codes(wg, best_s, best_z)


def quantize_mse(w: np.ndarray, group_size: int = 128, symmetric: bool = False,
                 importance: np.ndarray | None = None, *, name: str = "",
                 rows: int = 512) -> QuantizedTensor:
    """4-bit group quantization of ``w [out, in]`` on the error-minimising grid (module doc).

    Args:
        w: float ``[out, in]``; ``in`` not divisible by ``group_size`` is zero-padded as
            :func:`~edgeinfer.quant.rtn.quantize_rtn` (padded columns get weight 0).
        group_size, symmetric: the layout (see :mod:`.rtn`).
        importance: optional non-negative per-input-column weights ``[in]`` (e.g. mean
            squared activations): the error of column ``j`` counts ``importance[j]`` times.
        name: tensor name for messages. rows: rows per block (memory bound).

    Returns:
        QuantizedTensor with ``method="mse"``.

    Raises:
        ValueError: non-finite weights or importance, bad shape.
    """
    w = checked_weight(w, name)
    out, n_in = w.shape
    g, in_pad = resolve_group(n_in, group_size, 4)
    a = None
    if importance is not None:
        imp = np.asarray(importance, np.float32).reshape(-1)
        if imp.shape != (n_in,) or not np.isfinite(imp).all() or (imp < 0).any():
            raise ValueError(f"{name}: importance must be {n_in} finite non-negative values")
        a = np.zeros(in_pad, np.float32)
        a[:n_in] = imp / max(float(imp.mean()), 1e-30)
        a = a.reshape(1, in_pad // g, g)
    S = np.empty((out, in_pad // g), np.float32)
    Z = np.empty_like(S)
    codes = np.empty((out, in_pad), np.uint8)
    for r in range(0, out, rows):
        blk = np.zeros((min(rows, out - r), in_pad), np.float32)
        blk[:, :n_in] = w[r:r + rows]
        s, z, q = search_group_params(blk.reshape(len(blk), in_pad // g, g), a, symmetric)
        S[r:r + rows], Z[r:r + rows] = s, z
        q = q.reshape(len(blk), in_pad)
        if in_pad != n_in:  # padded columns hold the zero point: dequantize to exactly 0
            q[:, n_in:] = np.repeat(z, g, axis=1)[:, n_in:]
        codes[r:r + rows] = q
    scales = storage_scales(S.astype(np.float64), name)
    return assemble(codes, scales, None if symmetric else Z.astype(np.float64), 4, g, n_in, "mse")
