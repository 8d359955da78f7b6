"""The quantized KV formats (int8, int4, k8v4): formulas, helpers and design measurements.

The one source of truth for :mod:`.kvcache` (host storage), :mod:`.cpu.kvquant` and
``opencl/attention_q.cl`` (kernels, tested bit-exact or float32-tight against these
helpers); tests re-implement the formulas independently and compare exactly.

Reproducibility: the format fixes every rounding except the order of the G-term sums
of the K rotation. numpy's ``@`` follows the BLAS kernel the CPU dispatches to (and the
array's shape), an OpenCL kernel its loop and the compiler's FMA contraction, so two
correct implementations store different bits where a rotated value lies within float32
evaluation error of a rounding boundary (an f16 scale one ulp apart moves a group's
keys and the attention output by ~1e-4). ``tests/kv_admissible.py`` checks that every
stored value is *some* float32 evaluation of the format; V and everything else are one
IEEE operation per value and match bit for bit.

Notation, per layer, position ``p`` and KV head ``h``: ``x = k[p, h, :]`` or
``v[p, h, :]`` float32 ``[hd]``. ``G = kv_group_size(hd)`` = the largest power of two
that divides ``hd``, capped at 32 (hd 64 -> 32, hd 80 -> 16, hd 8 -> 8); groups are
``x[j*G:(j+1)*G]``, ``j = 0 .. hd/G - 1``. ``f16()`` rounds to IEEE half (round to
nearest even) after clipping to +-65504; all other math is float32; ``rint`` rounds
half to even (``np.rint``); a zero scale gives all-zero codes (``q = 0``).

**Rotation of K** (QuaRot, Ashkboos et al. 2024; the "incoherence processing" of QuIP,
Chee et al. 2023): before quantizing, each K group is multiplied by the orthonormal
Sylvester-Hadamard matrix ``H_G`` (``H_1 = [1]``, ``H_2n = [[H, H], [H, -H]]``, then
``/ sqrt(G)``; symmetric, so ``H_G = H_G^T = H_G^-1``): ``y = x_g @ H_G``. RoPE'd keys
carry outlier channels (KIVI, Liu et al. 2024, Sec. 3; the 4-bit K failures of
https://github.com/ggml-org/llama.cpp/issues/6172) on which per-token
groups waste their range; the rotation spreads an outlier over the group, and
``q.k = (q H).(k H)``.

**int4 K channel statistics** (offset ``m``, scale ``c`` per layer, KV head, channel).
Qwen2.5's k_proj biases survive RoPE as large near-constant offsets in the lowest-
frequency channels, on which rotated per-token 4-bit groups spent their whole range. KIVI (Liu et al. 2024) quantizes K per channel over
blocks of tokens; we keep every code *per token* (a position's codes depend only on its
own K and the layer's fixed ``m, c``: chunked prefill == decode after the first write,
prefix reuse and ring storage stay exact, no full-precision residual window) and
remove that structure before quantizing: ``(k - m) / c``, ``m, c = k_channel_stats(
k[:32])`` of the write at position 0 (a new sequence; until then ``m = 0, c = 1``).
They are stored and added back, so they change only the quantization error, never the
attention math; kernels fold them in: ``q.k' = (H (q * c)).y' + q.m``. ``c`` is a
power of two near ``sqrt(rms(k - m))`` (the optimum of a uniform-error model without
q: ``c_i^2 ~ rms k_i / rms q_i``), but only in heads whose channel RMS spread (max /
median) exceeds 8 (Qwen's first layers; SmolLM2's spread is ~4, where the offset alone
is best).

Why these choices (per-token codes, ``c`` only in wide heads) and what each format
costs in quality: benchmarks/MEASUREMENTS.md (``benchmarks/kv_quality.py`` measures it).

``int8`` (K: 1 + 2/G bytes per element; V: 1 + 2/hd)
  K, per (p, h, group j), rotated ``y = x_g @ H_G``:
      ``s = f16(max|y| / 127)``;  ``q = clip(rint(y / s), -127, 127)`` int8;
      dequant ``y' = q * s``;  ``k' = y' @ H_G``.
  V, per (p, h) over all hd (no rotation):
      ``s = f16(max|x| / 127)``;  ``q = clip(rint(x / s), -127, 127)``;  ``v' = q * s``.

``int4`` (K and V: 0.5 + 4/G bytes per element, plus 8 bytes per layer, head and
channel for K's ``m, c``), asymmetric, per (p, h, group j); K scaled and rotated
(``u = (x - m) / c``, ``y = u_g @ H_G``), V not (``y = x_g``):
      ``mn = f16(min y)``;  ``s = f16((max y - mn) / 15)``;
      ``q = clip(rint((y - mn) / s), 0, 15)`` uint4;  dequant ``y' = q * s + mn``;
      K: ``k' = (y' @ H_G) * c + m``;  V: ``v' = y'``.
  ``m, c``: :func:`k_channel_stats`. Two codes per byte, **low nibble first**: byte
  ``i`` of a row holds channel ``2i`` in bits 0..3 and ``2i+1`` in bits 4..7.

``k8v4`` (K: 1 + 2/G, V: 0.5 + 4/G bytes per element): K exactly as ``int8``, V exactly
  as ``int4``. K is the sensitive half (https://github.com/ggml-org/llama.cpp/pull/7412),
  so this is the middle ground.

fp16 storage saturates at +-65504 instead of becoming inf (softmax stays finite: see
https://github.com/huggingface/transformers/pull/17306); quantized scales saturate the
same way (entries beyond ~8e6 (int8) or a group minimum beyond +-65504 (int4) are
clipped; int4's ``m`` itself is float32).
"""
from __future__ import annotations

import math

import numpy as np

_F16_MAX = np.float32(65504.0)


def kv_group_size(head_dim: int) -> int:
    """Channels per quantization group: the largest power of two dividing ``head_dim``, <= 32."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return min(32, head_dim & -head_dim)


def hadamard(n: int) -> np.ndarray:
    """Orthonormal Sylvester-Hadamard matrix float32 ``[n, n]`` (n a power of two).

    Symmetric and its own inverse: ``x @ H @ H == x`` up to rounding.
    """
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.float32(math.sqrt(n))).astype(np.float32)


def _f16(x: np.ndarray) -> np.ndarray:
    """Round float32 to float16, saturating at +-65504 (never inf)."""
    return np.clip(x, -_F16_MAX, _F16_MAX).astype(np.float16)


def _rotate(x: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Multiply each G-channel group of x [..., hd] by H_G (float32)."""
    g = h.shape[0]
    shp = x.shape
    return (x.reshape(*shp[:-1], shp[-1] // g, g) @ h).reshape(shp)


def _safe(s: np.ndarray) -> np.ndarray:
    return np.where(s == 0, np.float32(1.0), s)


def quant_sym8(y: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 symmetric codes of y [..., n] in groups of ``g``: (q int8 [..., n], s f16 [..., n/g])."""
    shp = y.shape
    yg = y.reshape(*shp[:-1], shp[-1] // g, g)
    s = _f16(np.abs(yg).max(axis=-1) / np.float32(127.0))
    d = s.astype(np.float32)[..., None]
    q = np.where(d == 0, 0, np.clip(np.rint(yg / _safe(d)), -127, 127))
    return q.astype(np.int8).reshape(shp), s


def dequant_sym8(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """y' = q * s float32 [..., n] from q int8 [..., n], s f16 [..., n/g]."""
    g = q.shape[-1] // s.shape[-1]
    y = q.reshape(*s.shape, g).astype(np.float32) * s.astype(np.float32)[..., None]
    return y.reshape(q.shape)


def quant_asym4(y: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint4 asymmetric codes of y [..., n] in groups of ``g``.

    Returns (packed uint8 [..., n/2] low nibble first, s f16 [..., n/g], m f16 [..., n/g]).
    """
    shp = y.shape
    yg = y.reshape(*shp[:-1], shp[-1] // g, g)
    m = _f16(yg.min(axis=-1))
    m32 = m.astype(np.float32)
    s = _f16((yg.max(axis=-1) - m32) / np.float32(15.0))
    d = s.astype(np.float32)[..., None]
    q = np.where(d == 0, 0, np.clip(np.rint((yg - m32[..., None]) / _safe(d)), 0, 15))
    q = q.astype(np.uint8).reshape(shp)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), s, m


def unpack4(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n/2] -> codes uint8 [..., n] (low nibble = even channel)."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return out


def dequant_asym4(packed: np.ndarray, s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """y' = q * s + m float32 [..., n] from packed uint8 [..., n/2], s and m f16 [..., n/g]."""
    q = unpack4(packed)
    g = q.shape[-1] // s.shape[-1]
    y = (q.reshape(*s.shape, g).astype(np.float32) * s.astype(np.float32)[..., None]
         + m.astype(np.float32)[..., None])
    return y.reshape(q.shape)


#: Positions of a layer's first write that fix int4's K channel statistics.
KSTAT_POSITIONS = 32


def k_channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int4's K channel offset and scale from the first positions a layer receives.

    Args:
        x: float32 ``[n0, Hkv, hd]``, the first ``n0 = min(KSTAT_POSITIONS, T)`` rows of
            the layer's write at position 0 (n0 >= 1).

    Returns:
        (m, c) float32 ``[Hkv, hd]``: ``m = (x[0] + x[1] + ... + x[n0-1]) / n0`` summed in
        that order in float32 (0 where not finite). ``r`` = each channel's RMS deviation
        ``sqrt(mean_t (x - m)^2)`` (float64); in a head whose spread ``max r / median r``
        exceeds 8, ``c = 2^clip(rint(log2(r) / 2), -16, 16)`` (a power of two near
        ``sqrt(r)``) for channels with finite ``r > 0``; ``c = 1`` everywhere else.
        Why: module docstring.
    """
    x = np.asarray(x, np.float32)
    acc = x[0].copy()
    for t in range(1, x.shape[0]):
        acc = acc + x[t]
    m = acc / np.float32(x.shape[0])
    m = np.where(np.isfinite(m), m, np.float32(0)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        r = np.sqrt(((x.astype(np.float64) - m) ** 2).mean(axis=0))  # [Hkv, hd]
        spread = r.max(axis=-1) / np.median(r, axis=-1)              # [Hkv]
    ok = np.isfinite(r) & (r > 0) & (spread > 8)[:, None]
    e = np.clip(np.rint(np.log2(np.where(ok, r, 1.0)) / 2), -16, 16)
    return m, np.where(ok, np.exp2(e), 1.0).astype(np.float32)
