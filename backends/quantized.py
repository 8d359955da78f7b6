"""The quantized-weight type: layout constants and the numpy reference pack/unpack/dequant.

This module is the one source of truth for edgeinfer's weight layout. The converter
writes it, the container stores it, and every backend repacks *from* it at upload
time (never on disk). Fast kernels are tested against :meth:`QuantizedTensor.dequantize`.

Layout (logical weight ``W[out, in]``, the HF ``nn.Linear`` orientation):

* groups of ``group_size`` consecutive input columns; the input dimension is
  zero-padded up to a multiple of the group size (``in_padded``). Padded columns
  dequantize to exactly 0 (the zero point is an integer), so a kernel may read them
  against zero-padded activations or stop at ``in_features``.
* ``bits == 4``: ``qweight`` uint8 ``[out, in_padded // 2]``, sequential nibbles, low
  nibble first: column ``k`` lives in byte ``k // 2``, bits ``4 * (k % 2)``.
  Codes are unsigned 0..15. ``zeros`` is uint8 ``[out, ceil(n_groups / 2)]`` packed the
  same way (asymmetric), or ``None`` (symmetric: the zero point is 8).
* ``bits == 8``: ``qweight`` int8 ``[out, in_padded]``, symmetric, zero point 0.
* ``scales``: float16 ``[out, n_groups]`` (float32 where a group's scale would overflow
  fp16, see https://github.com/casper-hansen/AutoAWQ/issues/498); dequantization is
  ``w = (q - z) * s`` computed in float32.
* ``mins`` (optional, instead of ``zeros``): float16 or float32 ``[out, n_groups]``, a
  float offset per group: ``w = q * s + m`` in float32, with unsigned codes (4 bits:
  0..15; 8 bits: 0..127 in the int8 array). This is llama.cpp's ``Q4_1`` / ``Q5_1`` /
  ``Q4_K`` form (``d * q + m``; ``Q4_K``: ``(d * sc) * q - dmin * m``), kept exactly so
  a GGUF runs at its own quality (:mod:`edgeinfer.readers.gguf_blocks`). Rows are then
  never padded (``in_features == in_padded``): a padded column would read ``m``, not 0.

The same layout is used by the AWQ paper's asymmetric INT4 (Lin et al., MLSys 2024)
and GPTQ (Frantar et al., ICLR 2023) once their own packings are undone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Layout constants. OpenCL kernels receive these as ``-D`` build options.
NIBBLES_PER_BYTE = 2
SYMMETRIC_ZERO_4BIT = 8
SUPPORTED_BITS = (4, 8)
FP16_MAX = 65504.0


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack unsigned 4-bit codes along the last axis, low nibble first.

    Args:
        codes: integer array ``[..., n]`` with values in 0..15; ``n`` is padded with a
            zero code to an even length.

    Returns:
        uint8 array ``[..., ceil(n / 2)]``: byte ``j`` holds code ``2j`` in bits 0-3 and
        code ``2j + 1`` in bits 4-7.

    Raises:
        ValueError: a code outside 0..15.
    """
    codes = np.asarray(codes)
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError(f"4-bit codes must be in 0..15, got range {codes.min()}..{codes.max()}")
    c = codes.astype(np.uint8)
    if c.shape[-1] % 2:
        c = np.concatenate([c, np.zeros(c.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray, n: int | None = None) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`.

    Args:
        packed: uint8 ``[..., m]``.
        n: number of codes to keep (default ``2 * m``).

    Returns:
        uint8 ``[..., n]`` with values 0..15.
    """
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out if n is None else out[..., :n]


@dataclass
class QuantizedTensor:
    """A group-quantized linear or embedding weight ``W[out, in]``.

    Attributes:
        qweight: bits 4: uint8 ``[out, in_padded // 2]`` (nibbles, low first);
            bits 8: int8 ``[out, in_padded]``.
        scales: float16 (or float32) ``[out, n_groups]``.
        zeros: uint8 ``[out, ceil(n_groups / 2)]`` packed 4-bit zero points, or ``None``
            for symmetric quantization (zero point 8 for 4 bits, 0 for 8 bits).
        bits: 4 or 8.
        group_size: input columns per group (``in_padded`` for per-channel).
        in_features: the true input dimension (before padding).
        method: provenance string ("rtn", "awq", "gptq", "gguf:Q4_1" ...).
        mins: float16/float32 ``[out, n_groups]`` group offsets (``w = q * s + m``), or
            None; excludes ``zeros``.
    """

    qweight: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    bits: int
    group_size: int
    in_features: int
    method: str = "rtn"
    meta: dict = field(default_factory=dict)
    mins: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"unsupported bit width {self.bits}; supported: {SUPPORTED_BITS}")
        if self.qweight.ndim != 2 or self.scales.ndim != 2:
            raise ValueError(f"qweight and scales must be 2-D, got shapes {self.qweight.shape} and "
                             f"{self.scales.shape}")
        if self.scales.dtype not in (np.float16, np.float32):
            raise ValueError(f"scales must be float16 or float32, got {self.scales.dtype}")
        if self.zeros is not None and self.zeros.dtype != np.uint8:
            raise ValueError(f"zeros must be uint8 (packed 4-bit), got {self.zeros.dtype}")
        if not 0 < self.group_size <= max(self.in_padded, 1) or self.in_padded % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide the padded row of "
                             f"{self.in_padded} columns")
        if not self.in_padded - self.group_size < self.in_features <= self.in_padded:
            raise ValueError(f"in_features {self.in_features} does not fit a padded row of "
                             f"{self.in_padded} columns in groups of {self.group_size}")
        out = self.qweight.shape[0]
        if self.mins is not None:
            if self.zeros is not None:
                raise ValueError("a weight has zero points or mins, not both")
            if self.mins.dtype not in (np.float16, np.float32) or self.mins.shape != (out, self.n_groups):
                raise ValueError(f"mins must be float16/float32 {(out, self.n_groups)}, got "
                                 f"{self.mins.dtype} {self.mins.shape}")
            if self.in_features != self.in_padded:
                raise ValueError("a weight with mins cannot have padded columns")
        if self.scales.shape != (out, self.n_groups):
            raise ValueError(
                f"scales shape {self.scales.shape} does not match weight: expected {(out, self.n_groups)}"
            )
        if self.bits == 4:
            if self.qweight.dtype != np.uint8:
                raise ValueError(f"4-bit qweight must be uint8, got {self.qweight.dtype}")
            if self.zeros is not None and self.zeros.shape != (out, (self.n_groups + 1) // 2):
                raise ValueError(
                    f"zeros shape {self.zeros.shape}: expected {(out, (self.n_groups + 1) // 2)}"
                )
        else:
            if self.qweight.dtype != np.int8:
                raise ValueError(f"8-bit qweight must be int8, got {self.qweight.dtype}")
            if self.zeros is not None:
                raise ValueError("8-bit weights are symmetric: zeros must be None")

    # ---- derived sizes -------------------------------------------------------------
    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_padded(self) -> int:
        return int(self.qweight.shape[1] * (NIBBLES_PER_BYTE if self.bits == 4 else 1))

    @property
    def n_groups(self) -> int:
        return self.in_padded // self.group_size

    @property
    def shape(self) -> tuple[int, int]:
        """Logical ``(out, in)`` shape."""
        return (self.out_features, self.in_features)

    @property
    def symmetric(self) -> bool:
        return self.zeros is None and self.mins is None

    @property
    def nbytes(self) -> int:
        """Bytes held by codes, scales and zero points."""
        z = 0 if self.zeros is None else self.zeros.nbytes
        m = 0 if self.mins is None else self.mins.nbytes
        return int(self.qweight.nbytes + self.scales.nbytes + z + m)

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per logical weight, scales and zero points included."""
        return 8.0 * self.nbytes / (self.out_features * self.in_features)

    # ---- reference math ------------------------------------------------------------
    def take_rows(self, start: int, stop: int) -> "QuantizedTensor":
        """Rows ``start:stop`` as a new weight of the same format (copies)."""
        cp = lambda a: None if a is None else np.ascontiguousarray(a[start:stop])  # noqa: E731
        return QuantizedTensor(cp(self.qweight), cp(self.scales), cp(self.zeros), self.bits,
                               self.group_size, self.in_features, self.method, dict(self.meta),
                               cp(self.mins))

    def codes(self) -> np.ndarray:
        """Integer codes ``[out, in_padded]`` (uint8 0..15 for 4 bits, int8 for 8 bits)."""
        if self.bits == 4:
            return unpack_nibbles(self.qweight, self.in_padded)
        return self.qweight

    def zero_points(self) -> np.ndarray:
        """Zero points ``[out, n_groups]`` as float32 (constant for symmetric)."""
        if self.zeros is None:
            z = SYMMETRIC_ZERO_4BIT if self.bits == 4 else 0
            return np.full((self.out_features, self.n_groups), z, np.float32)
        return unpack_nibbles(self.zeros, self.n_groups).astype(np.float32)

    def dequantize(self, rows: slice | np.ndarray | None = None) -> np.ndarray:
        """Reference dequantization ``w = (q - z) * s`` (``w = q * s + m`` with mins) in float32.

        Args:
            rows: optional row selection (e.g. embedding ids) to avoid dequantizing
                the whole table.

        Returns:
            float32 ``[out (or selected rows), in_features]``.
        """
        sel = slice(None) if rows is None else rows
        q = (unpack_nibbles(self.qweight[sel], self.in_padded) if self.bits == 4
             else self.qweight[sel]).astype(np.float32)
        s = self.scales[sel].astype(np.float32)
        g = self.group_size
        if self.mins is not None:
            m = self.mins[sel].astype(np.float32)
            w = q.reshape(q.shape[0], -1, g) * s[:, :, None] + m[:, :, None]
            return w.reshape(q.shape[0], -1)
        z = self.zero_points()[sel]
        w = (q.reshape(q.shape[0], -1, g) - z[:, :, None]) * s[:, :, None]
        return w.reshape(q.shape[0], -1)[:, : self.in_features]


Weight = "np.ndarray | QuantizedTensor"
