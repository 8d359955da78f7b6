"""Is a quantized KV cache's content a valid float32 evaluation of the format?

The formats (``edgeinfer.backends.kvformat``) round twice after rotating K by the
Hadamard matrix: the f16 scale / minimum of each group and the integer codes. Both are
discontinuous functions of the rotated values ``y = x_g @ H_G``, and the format fixes no
summation order for that G-term dot product: numpy's matmul follows the BLAS kernel the
CPU dispatches to (and the array's shape), an OpenCL kernel its compiler's loop (with
or without FMA contraction). Two correct implementations therefore store different bits
wherever a value lies within float32 evaluation error of a rounding boundary: e.g. an f16
scale one ulp apart (relative 2^-11), which moves a whole group of dequantized keys and
the attention output by ~1e-4 (the failing int4 head_dim-256 case on Intel: group 7 of
position 26, (max y - mn) / 15 = 0.204528809, the f16 midpoint 0.20452880859375).

So the check here is not "equal to numpy's bits" but: every stored scale, minimum and
code lies in the set of values that some float32 evaluation of the rotation can produce.
The rotation's error is bounded for any order, fused or not (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., eq. 3.5): ``|fl(x . h) - x . h| <= gamma_G
* sum_j |x_j h_j|``, ``gamma_n = n u / (1 - n u)``, ``u = 2^-24``. Everything not rotated
(V; K's ``(k - m) / c``) is one IEEE operation per value and must match exactly.
"""
from __future__ import annotations

import numpy as np

from edgeinfer.backends.kvformat import hadamard, kv_group_size, unpack4

U = 2.0 ** -24  # float32 unit roundoff


def gamma(n: int) -> float:
    """Higham's gamma_n for float32."""
    return n * U / (1 - n * U)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -65504.0, 65504.0).astype(np.float16).astype(np.float64)


def _within(stored: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (stored >= lo) & (stored <= hi)


def _codes_ok(q: np.ndarray, t: np.ndarray, tol: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """q: stored codes; t: the exact pre-rounding value (y - mn) / s or y / s; tol: its
    float32 evaluation error. Admissible codes: clip(rint(t -+ tol), lo, hi)."""
    a = np.clip(np.rint(t - tol), lo, hi)
    b = np.clip(np.rint(t + tol), lo, hi)
    return (q >= a) & (q <= b)


def rotated_exact(x: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """(y float64 [..., hd]: x @ H_G per group, exact up to 2^-53; err float64 [..., hd/g]:
    the bound on any float32 evaluation's error, per group)."""
    h = hadamard(g).astype(np.float64)
    xg = x.astype(np.float64).reshape(*x.shape[:-1], -1, g)
    y = (xg @ h).reshape(x.shape)
    err = gamma(g) * (np.abs(xg) @ np.abs(h)).max(axis=-1)  # |h| entries are all 1/sqrt(g)
    return y, err


def check_asym4(y: np.ndarray, err: np.ndarray, packed: np.ndarray, s: np.ndarray,
                m: np.ndarray, g: int) -> np.ndarray:
    """Per group [..., hd/g]: True where (codes, s, m) is admissible for y (int4 format)."""
    yg = y.reshape(*s.shape, g)
    s64, m64 = s.astype(np.float64), m.astype(np.float64)
    ymin, ymax = yg.min(-1), yg.max(-1)
    ok = _within(m64, _f16(ymin - err), _f16(ymin + err))
    # s = f16((max y - m) / 15) with this side's m: the subtraction and the division each
    # round once more (relative u)
    r = (ymax - m64) / 15.0
    tol = err / 15.0 + 2 * U * np.abs(r)
    ok &= _within(s64, _f16(r - tol), _f16(r + tol))
    q = unpack4(packed).reshape(*s.shape, g).astype(np.float64)
    d = np.where(s64 == 0, 1.0, s64)[..., None]
    t = (yg - m64[..., None]) / d
    tq = err[..., None] / d + 2 * U * (np.abs(t) + 1.0)
    codes = np.where(s64[..., None] == 0, q == 0, _codes_ok(q, t, tq, 0, 15))
    return ok & codes.all(-1)


def check_sym8(y: np.ndarray, err: np.ndarray, q: np.ndarray, s: np.ndarray,
               g: int) -> np.ndarray:
    """Per group [..., hd/g]: True where (codes, s) is admissible for y (int8 K format)."""
    yg = y.reshape(*s.shape, g)
    s64 = s.astype(np.float64)
    r = np.abs(yg).max(-1) / 127.0
    tol = err / 127.0 + U * r
    ok = _within(s64, _f16(r - tol), _f16(r + tol))
    qq = q.reshape(*s.shape, g).astype(np.float64)
    d = np.where(s64 == 0, 1.0, s64)[..., None]
    t = yg / d
    tq = err[..., None] / d + U * (np.abs(t) + 1.0)
    codes = np.where(s64[..., None] == 0, qq == 0, _codes_ok(qq, t, tq, -127, 127))
    return ok & codes.all(-1)


def check_k(dtype: str, k: np.ndarray, raw: dict, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(admissible per group, the stored K groups' shape) of the first ``n`` positions of a
    cache's K (``raw``: its ``raw(layer)`` arrays) for float32 input keys k [n, Hkv, hd]."""
    hd = k.shape[-1]
    g = kv_group_size(hd)
    if dtype == "int4":
        x = ((k - raw["k_off"]) / raw["k_cs"]).astype(np.float32)  # one IEEE op each
        y, err = rotated_exact(x, g)
        ks = np.asarray(raw["k_scale"][:n])
        ok = check_asym4(y, err, np.asarray(raw["k_q"][:n]).reshape(n, k.shape[1], -1),
                         ks.reshape(n, k.shape[1], -1),
                         np.asarray(raw["k_min"][:n]).reshape(n, k.shape[1], -1), g)
    else:  # int8 and k8v4: K symmetric 8-bit
        y, err = rotated_exact(k.astype(np.float32), g)
        ks = np.asarray(raw["k_scale"][:n]).reshape(n, k.shape[1], -1)
        ok = check_sym8(y, err, np.asarray(raw["k_q"][:n]).reshape(n, k.shape[1], -1), ks, g)
    return ok, ks.shape


def assert_same_format(dtype: str, k: np.ndarray, v: np.ndarray, host: dict, dev: dict,
                       n: int) -> int:
    """Assert that a device cache holds the host cache's format for the first ``n``
    positions of input keys / values k, v float32 [n, Hkv, hd]: V (not rotated) and int4's
    ``k_off`` / ``k_cs`` bit for bit, every K group admissible (module docstring) on both
    sides. Returns how many K groups differ in their stored bits (rounding-boundary cases)."""
    k_names = ("k_q", "k_scale", "k_min")
    for name, a in host.items():
        b = np.asarray(dev[name])
        a = np.asarray(a if name in ("k_off", "k_cs") else a[:n]).reshape(b.shape)
        if name not in k_names:
            assert np.array_equal(a, b), f"{name}: not rotated, must match bit for bit"
    for side, raw in (("host", host), ("device", dev)):
        ok, _ = check_k(dtype, k, raw, n)
        bad = np.argwhere(~ok)
        assert not len(bad), f"{side}: K groups (position, head, group) {bad[:5].tolist()} " \
                             f"are no float32 evaluation of the format"
    differ = np.zeros(np.asarray(dev["k_scale"]).reshape(n, k.shape[1], -1).shape, bool)
    for name in k_names:
        if name in dev:
            a = np.asarray(host[name][:n]).reshape(n, k.shape[1], differ.shape[-1], -1)
            b = np.asarray(dev[name]).reshape(a.shape)
            differ |= (a != b).any(-1)
    return int(differ.sum())
