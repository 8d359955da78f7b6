"""llama.cpp block formats re-laid, losslessly, into :class:`QuantizedTensor`.

A GGUF weight runs at its own quality and (nearly) its own size: its codes, scales and
mins are moved into the layout of :mod:`edgeinfer.backends.quantized` (which every
backend already runs), and nothing is re-quantized. The dequantized result is
bit-identical to ``gguf.quants.dequantize`` of the source blocks (tests), because each
type maps to the same float32 expression:

========  =====================================  ===========================  =====
GGUF      llama.cpp (ggml-quants.c)              here                         bpw
========  =====================================  ===========================  =====
Q4_0      ``d * (q - 8)``, 32 per block          4-bit, group 32, zero 8      4.5
Q4_1      ``d * q + m``                          4-bit, group 32, fp16 mins   5.0
Q8_0      ``d * q``, q int8                      8-bit, group 32              8.5
Q5_0      ``d * (q - 16)``, q 5-bit              8-bit (q - 16), group 32     8.5
Q5_1      ``d * q + m``, q 5-bit                 8-bit (q), fp16 mins         9.0
Q4_K      ``(d*sc) * q - dmin*m``, 256 per       4-bit, group 32, fp32        6.0
          super-block, 6-bit sc / m per 32       scale ``d*sc`` and min
Q5_K      ``(d*sc) * q - dmin*m``, q 5-bit,      8-bit (q), group 32, fp32    10.0
          256 per super-block, 6-bit sc / m      scale ``d*sc`` and min
Q6_K      ``(d*sc) * (q - 32)``, 256 per         8-bit (q - 32), group 16,    10.0
          super-block, int8 sc per 16            fp32 scale ``d*sc``
========  =====================================  ===========================  =====

(``Q4_K``'s, ``Q5_K``'s and ``Q6_K``'s ``d * sc`` is a product of an fp16 and a 6- or 8-bit
integer: exact in float32, not in float16, hence fp32 scales.) Q5_0 / Q5_1 / Q5_K / Q6_K
take 8-bit codes here: the CPU backend repacks the 5-bit ones to 5 bits
(:func:`edgeinfer.backends.cpu.repack.five_bit_codes`) and runs Q6_K's 16-column groups of
8-bit codes with one scale per half block (:mod:`edgeinfer.backends.cpu.qlane`);
the other types are not re-laid: the reader dequantizes them, with a log line.

Block layouts: ggml-common.h (``block_q4_0`` …, ``block_q4_K``) and the ``gguf``
package's ``quants.py``; a 4-bit block stores elements ``j`` and ``j + 16`` in the
low and high nibble of byte ``j``, a Q4_K super-block stores sub-blocks ``2c`` and
``2c + 1`` in the low and high nibbles of its ``c``-th 32 bytes; a Q5_K super-block
adds 32 bytes ``qh`` whose bit ``k`` of byte ``l`` is bit 4 of element ``l`` of sub-block
``k``.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..backends.quantized import QuantizedTensor, pack_nibbles
from ..errors import ModelFormatError

__all__ = ["NATIVE_TYPES", "native_bits_per_weight", "relayout"]

_QK = 32  # elements per block of the legacy types
_QK_K = 256  # elements per K-type super-block


def _blocks(raw: np.ndarray, block_bytes: int, elems: int, name: str, where: str) -> np.ndarray:
    """``raw`` uint8 ``[rows, row_bytes]`` as ``[rows, n_blocks, block_bytes]``.

    Raises:
        ModelFormatError: a row that is not a whole number of blocks.
    """
    if raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] % block_bytes:
        raise ModelFormatError(f"{where}: tensor {name!r}: a row of {raw.shape[-1]} bytes is not "
                               f"a whole number of {block_bytes}-byte blocks ({elems} weights "
                               f"each); the file is corrupt")
    return raw.reshape(raw.shape[0], raw.shape[1] // block_bytes, block_bytes)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of every block: float16 ``[rows, n_blocks]``."""
    return np.ascontiguousarray(b[:, :, at:at + 2]).view(np.float16)[:, :, 0]


def _low_high(qs: np.ndarray) -> np.ndarray:
    """Nibble bytes ``[..., 16]`` of 32 elements (j low, j + 16 high) -> codes ``[..., 32]``."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5 ``qh`` bytes ``[..., 4]`` (a little-endian uint32, bit j = element j) -> ``[..., 32]``
    of 0/1 values."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _rows(a: np.ndarray) -> np.ndarray:
    """``[rows, n_blocks, k]`` -> ``[rows, n_blocks * k]`` contiguous."""
    return np.ascontiguousarray(a.reshape(a.shape[0], -1))


def _q4(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, n_in: int,
        method: str) -> QuantizedTensor:
    return QuantizedTensor(pack_nibbles(_rows(codes)), np.ascontiguousarray(scales), None, 4,
                           _QK, n_in, method, mins=None if mins is None else np.ascontiguousarray(mins))


def _q8(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, n_in: int,
        method: str) -> QuantizedTensor:
    return QuantizedTensor(_rows(codes).astype(np.int8, copy=False), np.ascontiguousarray(scales),
                           None, 8, _QK, n_in, method,
                           mins=None if mins is None else np.ascontiguousarray(mins))


def _q4_0(raw, name, where):
    b = _blocks(raw, 18, _QK, name, where)
    return _q4(_low_high(b[:, :, 2:]), _f16(b, 0), None, b.shape[1] * _QK, "gguf:Q4_0")


def _q4_1(raw, name, where):
    b = _blocks(raw, 20, _QK, name, where)
    return _q4(_low_high(b[:, :, 4:]), _f16(b, 0), _f16(b, 2), b.shape[1] * _QK, "gguf:Q4_1")


def _q8_0(raw, name, where):
    b = _blocks(raw, 34, _QK, name, where)
    return _q8(b[:, :, 2:].view(np.int8), _f16(b, 0), None, b.shape[1] * _QK, "gguf:Q8_0")


def _q5_codes(b: np.ndarray, qh_at: int) -> np.ndarray:
    """5-bit codes 0..31 ``[rows, n_blocks, 32]`` uint8 of a Q5_0 / Q5_1 block array."""
    return _low_high(b[:, :, qh_at + 4:]) | (_high_bits(b[:, :, qh_at:qh_at + 4]) << np.uint8(4))


def _q5_0(raw, name, where):
    b = _blocks(raw, 22, _QK, name, where)
    codes = _q5_codes(b, 2).astype(np.int8) - np.int8(16)
    return _q8(codes, _f16(b, 0), None, b.shape[1] * _QK, "gguf:Q5_0")


def _q5_1(raw, name, where):
    b = _blocks(raw, 24, _QK, name, where)
    return _q8(_q5_codes(b, 4).view(np.int8), _f16(b, 0), _f16(b, 2), b.shape[1] * _QK,
               "gguf:Q5_1")


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K packed 6-bit scales ``[..., 12]`` -> (sc, m) uint8 ``[..., 8]``
    (ggml-quants.c ``get_scale_min_k4``)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k(raw, name, where):
    b = _blocks(raw, 144, _QK_K, name, where)
    rows, nsb = b.shape[:2]
    d = _f16(b, 0).astype(np.float32)[:, :, None]
    dmin = _f16(b, 2).astype(np.float32)[:, :, None]
    sc, mn = _k_scale_min(b[:, :, 4:16])
    scales = (d * sc.astype(np.float32)).reshape(rows, nsb * 8)
    mins = -(dmin * mn.astype(np.float32)).reshape(rows, nsb * 8)
    qs = b[:, :, 16:].reshape(rows, nsb, 4, 1, 32)
    codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=3)  # [r, n, 4, 2, 32]
    return _q4(codes.reshape(rows, nsb * _QK_K), scales, mins, nsb * _QK_K, "gguf:Q4_K")


def _q5_k(raw, name, where):
    b = _blocks(raw, 176, _QK_K, name, where)
    rows, nsb = b.shape[:2]
    d = _f16(b, 0).astype(np.float32)[:, :, None]
    dmin = _f16(b, 2).astype(np.float32)[:, :, None]
    sc, mn = _k_scale_min(b[:, :, 4:16])
    scales = (d * sc.astype(np.float32)).reshape(rows, nsb * 8)
    mins = -(dmin * mn.astype(np.float32)).reshape(rows, nsb * 8)
    qh = b[:, :, 16:48].reshape(rows, nsb, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    qs = b[:, :, 48:].reshape(rows, nsb, 4, 1, 32)
    low = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=3)  # [r, n, 4, 2, 32]
    codes = low.reshape(rows, nsb, 8, 32) | ((qh & np.uint8(1)) << np.uint8(4))  # 0..31
    return _q8(codes.view(np.int8), scales, mins, nsb * _QK_K, "gguf:Q5_K")


def _q6_k(raw, name, where):
    b = _blocks(raw, 210, _QK_K, name, where)
    rows, nsb = b.shape[:2]
    ql = b[:, :, :128].reshape(rows, nsb, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = b[:, :, 128:192].reshape(rows, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = ((ql & np.uint8(0x0F)).reshape(rows, nsb, 2, 4, 32)
         | ((qh & np.uint8(0x03)) << np.uint8(4)))  # [r, n, h, i, l], 0..63
    codes = q.reshape(rows, nsb * _QK_K).view(np.int8) - np.int8(32)
    d = _f16(b, 208).astype(np.float32)[:, :, None]
    scales = (d * b[:, :, 192:208].view(np.int8).astype(np.float32)).reshape(rows, nsb * 16)
    return QuantizedTensor(codes, scales, None, 8, 16, nsb * _QK_K, "gguf:Q6_K")


#: ggml type name -> re-layout function ``(raw [rows, row_bytes], name, where) -> QuantizedTensor``.
NATIVE_TYPES: dict[str, Callable[[np.ndarray, str, str], QuantizedTensor]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k,
    "Q5_K": _q5_k, "Q6_K": _q6_k,
}

_BPW = {"Q4_0": 4.5, "Q4_1": 5.0, "Q8_0": 8.5, "Q5_0": 8.5, "Q5_1": 9.0, "Q4_K": 6.0,
        "Q5_K": 10.0, "Q6_K": 10.0}


def native_bits_per_weight(qtype_name: str) -> float | None:
    """Bits per weight of the re-laid form of a ggml type (None: not re-laid)."""
    return _BPW.get(qtype_name)


def relayout(raw: np.ndarray, qtype_name: str, name: str, where: str) -> QuantizedTensor:
    """The 2-D GGUF tensor ``raw`` (uint8 ``[rows, row_bytes]``, the file's bytes) of ggml
    type ``qtype_name`` as a :class:`QuantizedTensor` ``[rows, row_bytes / block * elems]``
    whose :meth:`~QuantizedTensor.dequantize` equals ``gguf.quants.dequantize`` bit for bit.

    Raises:
        KeyError: a type not in :data:`NATIVE_TYPES`.
        ModelFormatError: a row that is not a whole number of blocks.
    """
    return NATIVE_TYPES[qtype_name](raw, name, where)
