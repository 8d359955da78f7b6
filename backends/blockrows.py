"""An embedding table left in its file's llama.cpp block encoding, rows dequantized on lookup.

An untied embedding ``[V, D]`` is read one row per token and never multiplied as a
matrix, so a backend that can decode blocks needs no copy of it: :class:`BlockRows` keeps
the GGUF's own bytes (a read-only view of the file mapping) and only the rows a prompt
looks up become resident. Qwen2.5-0.5B's 151936 x 896 Q5_0 table is 94 MB in the file and
145 MB as 8-bit codes.

Types: the legacy 32-element blocks of ggml-common.h (``block_q4_0`` ...), each row a
whole number of blocks; element ``j`` of a block at byte offset ``o``:

======  =====  ========================================================================
type    bytes  value (``d``, ``m`` fp16 at bytes 0 and 2; ``qh`` a little-endian uint32)
======  =====  ========================================================================
Q4_0    18     ``d * (q - 8)``, ``q`` nibble ``j % 16`` of byte ``2 + j % 16`` (low first)
Q4_1    20     ``d * q + m``, nibbles from byte 4
Q5_0    22     ``d * (q - 16)``, ``q = nibble | bit j of qh << 4``, qh at 2, nibbles at 6
Q5_1    24     ``d * q + m``, qh at 4, nibbles at 8
Q8_0    34     ``d * q``, ``q`` int8 at byte ``2 + j``
======  =====  ========================================================================

(The nibble of element ``j`` is the low one of byte ``j`` for ``j < 16``, the high one of
byte ``j - 16`` otherwise.) Every value is computed in float32 as ``gguf.quants`` does,
so a row equals ``gguf.quants.dequantize`` of it bit for bit (tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: ggml type name -> (bytes per 32-element block, kind code of the CPU kernel)
BLOCK_TYPES = {"Q4_0": (18, 0), "Q4_1": (20, 1), "Q5_0": (22, 2), "Q5_1": (24, 3),
               "Q8_0": (34, 4)}


@dataclass(eq=False)
class BlockRows:
    """Rows of a table ``[V, D]`` stored as llama.cpp blocks (see the module docstring).

    Attributes:
        raw: uint8 ``[V, D / 32 * block_bytes]``, usually a read-only view of a file map.
        qtype: a key of :data:`BLOCK_TYPES`.
        name: the tensor's name, for error messages.

    Raises:
        ValueError: an unknown type or a row that is not ``D / 32`` whole blocks.
    """

    raw: np.ndarray
    qtype: str
    name: str = "embedding"

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_TYPES:
            raise ValueError(f"{self.name}: block type {self.qtype!r} has no row decoder; "
                             f"known: {', '.join(BLOCK_TYPES)}")
        if self.raw.dtype != np.uint8 or self.raw.ndim != 2 or self.raw.shape[1] % self.block_bytes:
            raise ValueError(f"{self.name}: rows must be uint8 [V, n * {self.block_bytes}] "
                             f"({self.qtype} blocks), got {self.raw.dtype} {self.raw.shape}")

    @property
    def block_bytes(self) -> int:
        return BLOCK_TYPES[self.qtype][0]

    @property
    def kind(self) -> int:
        """The type's code for the CPU row kernel."""
        return BLOCK_TYPES[self.qtype][1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.raw.shape[1] // self.block_bytes * 32

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def dequantize_rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 ``[T, D]`` of rows ``ids`` [T] (numpy, the reference decoder).

        Raises:
            IndexError: an id outside ``0..V-1``.
        """
        ids = np.asarray(ids, np.int64).reshape(-1)
        v = self.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= v):
            raise IndexError(f"token id out of range 0..{v - 1}")
        b = self.raw[ids].reshape(ids.size, -1, self.block_bytes)
        d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[:, :, 0].astype(np.float32)[..., None]
        qt = self.qtype
        if qt == "Q8_0":
            return (d * b[:, :, 2:].view(np.int8).astype(np.float32)).reshape(ids.size, -1)
        m = None
        if qt in ("Q4_1", "Q5_1"):
            m = np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[:, :, 0].astype(np.float32)[..., None]
        at = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[qt]
        qs = b[:, :, at:at + 16]
        q = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)
        if qt in ("Q5_0", "Q5_1"):
            h = at - 4
            q = q | (np.unpackbits(b[:, :, h:h + 4], axis=-1, bitorder="little") << np.uint8(4))
        if m is None:
            off = np.float32(8 if qt == "Q4_0" else 16)
            y = d * (q.astype(np.float32) - off)
        else:
            y = d * q.astype(np.float32) + m
        return y.reshape(ids.size, -1)

    def dequantize(self, rows_per_chunk: int = 4096) -> np.ndarray:
        """The whole table as float32 ``[V, D]``."""
        v, d = self.shape
        out = np.empty((v, d), np.float32)
        for r0 in range(0, v, rows_per_chunk):
            out[r0:r0 + rows_per_chunk] = self.dequantize_rows(np.arange(r0, min(v, r0 + rows_per_chunk)))
        return out
