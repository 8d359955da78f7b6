"""Round-to-nearest (RTN) group quantization into :class:`QuantizedTensor`.

The building blocks here (group parameters, rounding, packing) are shared by AWQ and
GPTQ so every method produces exactly the layout of
:mod:`edgeinfer.backends.quantized`.

Rules (all math in float64, deterministic):

* **Groups** are ``group_size`` consecutive input columns; ``group_size=-1`` means one
  group per row (per-channel).
* **Group choice for a model (``effective_group``, used by the converter).** When a
  layer's ``in_features`` is not a multiple of the requested group size, the converter uses
  the largest group that is a multiple of 32 (the CPU kernels' integer-dot block), at most
  the request, and divides ``in_features`` (SmolLM2's 576-wide rows at a requested 128 get
  groups of 96: 4.21 bits per weight instead of 4.63 with padding to 640). The group is
  recorded per tensor in the file. Only when no such divisor exists is the row padded.
* **Padding** (https://github.com/ml-explore/mlx/issues/1033). When ``in_features % group_size != 0`` the input dimension is
  zero-padded up to the next multiple of the group (the padded columns are zero weights);
  their codes equal the group's zero point, so they dequantize to exactly 0 and the layer
  output for any ``x`` is unchanged. ``in_features`` keeps the true width.
* **Asymmetric INT4** (AWQ's choice): ``s = (max - min) / 15`` over a range that includes 0,
  ``z = round(-min / s)``, ``q = clip(round(w / s) + z, 0, 15)``.
  **Symmetric INT4** (GPTQ's ``sym``): ``s = 2 * absmax / 15``, ``z = 8`` (the largest
  magnitude then rounds to the edge code with an error of at most s/2).
  **INT8** (embeddings / lm_head): symmetric per row (or group), ``s = absmax / 127``.
* **Guards** (https://github.com/casper-hansen/AutoAWQ/pull/519). Every scale is floored at :data:`SCALE_EPS` (an all-zero or
  tiny group gets a finite scale and codes equal to its zero point: no NaN, no inf). Scales
  are rounded *up* to their storage dtype *before* the zero points and codes are computed,
  so the stored (scale, zero, code) triples are exactly what was optimized and every weight
  is within half a stored step of its dequantized value. If any scale exceeds the fp16 range
  the whole tensor keeps float32 scales (the layout allows it) and a warning is logged.
"""
from __future__ import annotations

import logging

import numpy as np

from ..backends.quantized import (
    FP16_MAX,
    SYMMETRIC_ZERO_4BIT,
    QuantizedTensor,
    pack_nibbles,
)

log = logging.getLogger(__name__)

#: Smallest scale ever stored (a normal fp16 number, so it survives the fp16 cast).
SCALE_EPS = 2.0 ** -14


def resolve_group(in_features: int, group_size: int, bits: int = 4) -> tuple[int, int]:
    """``(group_size, in_padded)`` for a row of ``in_features`` weights.

    ``group_size=-1`` is per-channel: one group spanning the (even-padded, for 4 bits) row.

    Raises:
        ValueError: a non-positive group size other than -1, or an odd group for 4 bits.
    """
    if group_size == -1:
        g = in_features + (in_features % 2 if bits == 4 else 0)
        return g, g
    if group_size <= 0:
        raise ValueError(f"group_size must be positive or -1 (per-channel), got {group_size}")
    if bits == 4 and group_size % 2:
        raise ValueError(f"4-bit group_size must be even (two codes per byte), got {group_size}")
    return group_size, -(-in_features // group_size) * group_size


def effective_group(in_features: int, group_size: int) -> int:
    """The group size the converter uses for rows of ``in_features`` (module docstring).

    ``group_size`` itself when it divides ``in_features`` (or is -1, or below 32); else the
    largest multiple of 32 that is ``<= group_size`` and divides ``in_features``; else
    ``group_size`` (the row is then zero-padded).
    """
    if group_size <= 32 or in_features % group_size == 0:
        return group_size
    for g in range(group_size // 32 * 32, 0, -32):
        if in_features % g == 0:
            return g
    return group_size


def pad_columns(w: np.ndarray, in_padded: int) -> np.ndarray:
    """Zero-pad ``w [out, in]`` to ``[out, in_padded]`` (float64 copy)."""
    w = np.asarray(w, np.float64)
    if w.shape[1] == in_padded:
        return w.copy()
    out = np.zeros((w.shape[0], in_padded), np.float64)
    out[:, : w.shape[1]] = w
    return out


def storage_scales(s: np.ndarray, name: str = "") -> np.ndarray:
    """Round float64 scales to their storage dtype: float16, or float32 on fp16 overflow.
    Magnitudes below ``SCALE_EPS`` become ``SCALE_EPS``; a scale's sign is kept (signmax
    stores negative ones)."""
    s = np.asarray(s, np.float64)
    s = np.copysign(np.maximum(np.abs(s), SCALE_EPS), s)
    with np.errstate(over="ignore"):  # values beyond fp16 become inf here: that is the test
        fits = np.array_equal(s.astype(np.float16).astype(np.float64), s)
    if not fits:
        log.warning("scales of %s exceed the fp16 range (max %.3g): stored as float32",
                    name or "a tensor", float(np.max(np.abs(s))))
        return s.astype(np.float32)
    return s.astype(np.float16)


def round_scales_up(s: np.ndarray) -> np.ndarray:
    """Round float64 scales *up* to the nearest value of their storage dtype (float16, or
    float32 where a scale exceeds the fp16 range), returned as float64.

    Rounding up (never down) keeps the group's whole range on the code grid, so the
    rounding error of every weight stays within half a (stored) step.
    """
    s = np.maximum(np.asarray(s, np.float64), SCALE_EPS)
    dt = np.float16 if np.all(s <= FP16_MAX * (1 - 2.0 ** -11)) else np.float32
    with np.errstate(over="ignore"):
        r = s.astype(dt)
    low = r.astype(np.float64) < s
    r[low] = np.nextafter(r[low], dt(np.inf))
    return r.astype(np.float64)


def group_params(wg: np.ndarray, bits: int, symmetric: bool,
                 clip: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Float64 ``(scale, zero)`` for grouped weights ``wg [..., g]`` (reduced over the last axis).

    The range always includes 0 (GPTQ's quantizer rule: ``min(x.min, 0)``, ``max(x.max, 0)``)
    so the zero point is an exact integer in 0..15 and a constant group (e.g. all 1e5)
    is represented exactly.

    Args:
        wg: float64 ``[..., g]``.
        bits: 4 or 8.
        symmetric: INT4 zero point fixed at 8 (always for INT8: zero 0).
        clip: optional ``[...]`` max-abs clip per group (AWQ clip search): the range is
            computed on ``clip(w, -clip, clip)``.

    Returns:
        ``scale`` (>= SCALE_EPS, already rounded up to its storage dtype, see
        :func:`round_scales_up`) and ``zero`` (integer valued float64), shape ``wg.shape[:-1]``.
    """
    if clip is not None:
        wg = np.clip(wg, -clip[..., None], clip[..., None])
    if bits == 8:
        s = round_scales_up(np.abs(wg).max(axis=-1) / 127.0)
        return s, np.zeros_like(s)
    if symmetric:
        s = round_scales_up(2.0 * np.abs(wg).max(axis=-1) / 15.0)
        return s, np.full_like(s, SYMMETRIC_ZERO_4BIT)
    lo = np.minimum(wg.min(axis=-1), 0.0)
    hi = np.maximum(wg.max(axis=-1), 0.0)
    s = round_scales_up((hi - lo) / 15.0)
    z = np.clip(np.round(-lo / s), 0, 15)
    return s, z


def quantize_codes(w: np.ndarray, s: np.ndarray, z: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``clip(round(w / s) + z)`` (float64 in, float64 integer-valued out), broadcast."""
    if bits == 8:
        return np.clip(np.round(w / s), -127, 127)
    return np.clip(np.round(w / s) + z, 0, 15)


def assemble(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, bits: int,
             group_size: int, in_features: int, method: str) -> QuantizedTensor:
    """Pack codes ``[out, in_padded]`` (padded columns already hold the zero point) into a
    :class:`QuantizedTensor`; ``scales`` in their storage dtype ``[out, n_groups]``;
    ``zeros`` integer ``[out, n_groups]`` or ``None`` (symmetric)."""
    if bits == 4:
        qweight = pack_nibbles(codes.astype(np.uint8))
        zp = None if zeros is None else pack_nibbles(zeros.astype(np.uint8))
    else:
        qweight, zp = codes.astype(np.int8), None
    return QuantizedTensor(qweight, np.ascontiguousarray(scales), zp, bits, group_size,
                           in_features, method)


def checked_weight(w, name: str = "") -> np.ndarray:
    """``w`` as a float32 2-D [out, in] array of finite values.

    Raises:
        ValueError: not 2-D, or NaN/inf (naming ``name``).
    """
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"{name or 'weight'}: expected a 2-D [out, in] weight, got {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError(f"{name or 'weight'}: contains NaN or inf; cannot quantize")
    return w


def quantize_rtn(w: np.ndarray, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                 *, clip: np.ndarray | None = None, method: str = "rtn",
                 name: str = "") -> QuantizedTensor:
    """Round-to-nearest group quantization of a linear/embedding weight.

    Args:
        w: float ``[out, in]`` (HF ``nn.Linear`` orientation); converted to float64.
        bits: 4 (asymmetric or symmetric) or 8 (symmetric per row/group; ``symmetric`` ignored).
        group_size: columns per group, or -1 for per-channel. Non-divisible ``in`` is
            zero-padded (module docstring).
        symmetric: 4-bit only: fixed zero point 8 and no stored zeros.
        clip: optional ``[out, n_groups]`` max-abs clip per group (from AWQ's clip search).
        method: provenance tag stored with the tensor.
        name: tensor name for log messages.

    Returns:
        QuantizedTensor with ``in_features = in``.

    Raises:
        ValueError: non-finite weights (naming ``name``), bad shape, bits or group size.
    """
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"{name or 'weight'}: expected a 2-D [out, in] weight, got shape {w.shape}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if not np.isfinite(w).all():
        raise ValueError(f"{name or 'weight'}: contains NaN or inf; cannot quantize")
    out, n_in = w.shape
    g, in_pad = resolve_group(n_in, group_size, bits)
    wp = pad_columns(w, in_pad).reshape(out, in_pad // g, g)
    s, z = group_params(wp, bits, symmetric or bits == 8, clip)
    s_st = storage_scales(s, name)  # exact: s is already storage-rounded
    codes = quantize_codes(wp, s[..., None], z[..., None], bits).reshape(out, in_pad)
    if in_pad != n_in:  # padded columns hold the zero point: dequantize to exactly 0
        codes[:, n_in:] = np.repeat(z, g, axis=1)[:, n_in:]
    zeros = None if (symmetric or bits == 8) else z
    return assemble(codes, s_st, zeros, bits, g, n_in, method)


def fake_quantize(w: np.ndarray, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                  clip: np.ndarray | None = None) -> np.ndarray:
    """``dequantize(quantize_rtn(w))`` computed directly (float64 ``[out, in]``), for searches.

    Matches :func:`quantize_rtn` bit for bit up to fp16 rounding of the scales (applied here
    too), without packing.
    """
    w = np.asarray(w, np.float64)
    out, n_in = w.shape
    g, in_pad = resolve_group(n_in, group_size, bits)
    wp = pad_columns(w, in_pad).reshape(out, in_pad // g, g)
    s, z = group_params(wp, bits, symmetric or bits == 8, clip)
    q = quantize_codes(wp, s[..., None], z[..., None], bits)
    return ((q - z[..., None]) * s[..., None]).reshape(out, in_pad)[:, :n_in]
