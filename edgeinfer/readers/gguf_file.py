"""The GGUF container: header (metadata + tensor table) parsing over a read-only mmap.

Parsed here rather than with ``gguf.GGUFReader``: the reader builds one numpy view per
array element, which took 5 s (SmolLM2, 49k vocab) to 20 s (Gemma 3, 262k vocab) per
open on a 2-core machine; the same metadata parses here in 0.1-0.9 s. Layout constants
(value types, block sizes) and dequantization come from the ``gguf`` package. Mapping
the metadata to a model config and tensor names is :mod:`edgeinfer.readers.gguf`.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFormatError, UnsupportedModelError

__all__ = ["GGUFFile", "GGUFTensorInfo"]

# GGUF metadata value types (gguf-py constants.GGUFValueType).
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_NP_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
             10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

#: Limits on a GGUF header (each far above any released model; they bound the time and
#: memory a hostile header can cost before it is refused).
MAX_KV = 1 << 16  # metadata entries (real files: under 100)
MAX_TENSORS = 1 << 16  # tensors (real files: under 2000)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 1 << 16
MAX_ARRAY_DEPTH = 2  # arrays of arrays (none in released files)
MAX_METADATA_ELEMENTS = 1 << 24  # array elements over all metadata (Gemma 3: ~800k)
MAX_METADATA_STRING_BYTES = 1 << 29  # string bytes over all metadata (Gemma 3: ~4 MB)
DEFAULT_ALIGNMENT = 32


class _Truncated(Exception):
    pass


class _Corrupt(Exception):
    """A header field outside the format's limits; carries the message."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file.

    Attributes:
        name: GGUF name (``blk.0.attn_q.weight``).
        dims: GGUF dimensions, fastest-varying first (``ne0`` = row length).
        qtype: ``gguf.GGMLQuantizationType`` value.
        offset: absolute byte offset of the data in the file.
        nbytes: byte size of the data.
    """

    name: str
    dims: tuple[int, ...]
    qtype: int
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (HF) shape: the GGUF dims reversed, e.g. ``(out, in)``."""
        return tuple(reversed(self.dims))


class GGUFFile:
    """Parsed GGUF header (metadata + tensor table) over a read-only memory map.

    Attributes:
        path: the file.
        version: GGUF version (2 or 3).
        metadata: key -> value (ints, floats, bools, str, lists; numeric arrays as
            Python lists).
        tensors: GGUF name -> :class:`GGUFTensorInfo`, in file order.

    Raises:
        ModelFormatError: not GGUF, unsupported version or endianness, truncated or
            corrupt header (a duplicate key, counts past :data:`MAX_KV` /
            :data:`MAX_TENSORS` / :data:`MAX_METADATA_ELEMENTS` /
            :data:`MAX_METADATA_STRING_BYTES`, arrays nested past
            :data:`MAX_ARRAY_DEPTH`), ``general.alignment`` not a positive power of two, a
            tensor offset not a multiple of it, tensor data overlapping another tensor or
            reaching past the end of the file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except OSError as e:
            raise ModelFormatError(f"{self.path}: cannot read ({e})") from e
        if size < 24:
            raise ModelFormatError(f"{self.path}: {size} bytes, too short for a GGUF header "
                                   f"(truncated file?)")
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{self.path}: cannot map the file ({e})") from None
        self.size = len(self._mm)  # what is mapped, should the file change after stat()
        try:
            self._parse()
        except BaseException:
            try:
                self._mm.close()
            except BufferError:  # a view still alive in a traceback frame
                pass
            raise

    def _parse(self) -> None:
        import gguf

        mm, size = self._mm, self.size
        if mm[:4] != b"GGUF":
            raise ModelFormatError(f"{self.path}: not a GGUF file (magic {mm[:4]!r})")
        (version,) = struct.unpack_from("<I", mm, 4)
        if version not in (2, 3):
            swapped = struct.unpack_from(">I", mm, 4)[0]
            if swapped in (2, 3):
                raise ModelFormatError(f"{self.path}: big-endian GGUF is not supported")
            raise ModelFormatError(f"{self.path}: GGUF version {version} is not supported "
                                   f"(edgeinfer reads versions 2 and 3)")
        self.version = version
        self._elements = 0
        self._string_bytes = 0
        try:
            n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
            if n_kv > MAX_KV or n_tensors > MAX_TENSORS:
                raise _Corrupt(f"{n_kv} metadata entries and {n_tensors} tensors (at most "
                               f"{MAX_KV} and {MAX_TENSORS})")
            off = 24
            self.metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key, off = self._str(off, MAX_KEY_BYTES)
                (vtype,) = self._unpack("<I", off)
                off += 4
                if key in self.metadata:
                    raise _Corrupt(f"metadata key {key!r} appears twice")
                self.metadata[key], off = self._value(vtype, off, key)
            infos = []
            for _ in range(n_tensors):
                name, off = self._str(off, MAX_KEY_BYTES)
                (nd,) = self._unpack("<I", off)
                off += 4
                if not 1 <= nd <= MAX_DIMS:
                    raise _Corrupt(f"tensor {name!r} has {nd} dimensions (GGUF allows 1 to "
                                   f"{MAX_DIMS})")
                dims = self._unpack(f"<{nd}Q", off)
                off += 8 * nd
                qtype, toff = self._unpack("<IQ", off)
                off += 12
                infos.append((name, tuple(int(d) for d in dims), qtype, toff))
        except _Truncated:
            raise ModelFormatError(
                f"{self.path}: truncated GGUF file: the header ends past the end of the file "
                f"({size} bytes); download it again"
            ) from None
        except _Corrupt as e:
            raise ModelFormatError(f"{self.path}: corrupt GGUF header: {e}; not a usable GGUF "
                                   f"file (download it again)") from None
        except (UnicodeDecodeError, ValueError, struct.error) as e:
            raise ModelFormatError(f"{self.path}: corrupt GGUF header ({e})") from e
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (not isinstance(align, int) or isinstance(align, bool) or align <= 0
                or align & (align - 1)):
            raise ModelFormatError(f"{self.path}: general.alignment = {align!r}; GGUF needs a "
                                   f"positive power of two (default {DEFAULT_ALIGNMENT}); the "
                                   f"file is corrupt")
        self.alignment = align
        data_start = (off + align - 1) // align * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, qtype, toff in infos:
            try:
                qt = gguf.GGMLQuantizationType(qtype)
            except ValueError:
                raise ModelFormatError(f"{self.path}: tensor {name!r} has unknown ggml type "
                                       f"{qtype}") from None
            if qt not in gguf.GGML_QUANT_SIZES:
                raise UnsupportedModelError(f"{self.path}: tensor {name!r} has ggml type {qt.name}, "
                                            f"which has no known block layout")
            block, tsize = gguf.GGML_QUANT_SIZES[qt]
            n = math.prod(dims)
            if dims and dims[0] % block:
                raise ModelFormatError(f"{self.path}: tensor {name!r} row of {dims[0]} is not a "
                                       f"multiple of the {qt.name} block ({block})")
            nbytes = n // block * tsize
            if toff % align:
                raise ModelFormatError(f"{self.path}: tensor {name!r} has data offset {toff}, not a "
                                       f"multiple of general.alignment {align}; the file is corrupt")
            start = data_start + toff
            if start + nbytes > size:
                raise ModelFormatError(
                    f"{self.path}: truncated GGUF file: tensor {name!r} needs bytes "
                    f"{start}..{start + nbytes} but the file has {size}; download it again"
                )
            if name in self.tensors:
                raise ModelFormatError(f"{self.path}: tensor {name!r} appears twice")
            self.tensors[name] = GGUFTensorInfo(name, dims, int(qt), start, nbytes)
        end = data_start
        prev = None
        for t in sorted(self.tensors.values(), key=lambda t: (t.offset, t.nbytes)):
            if t.offset < end and t.nbytes:
                raise ModelFormatError(f"{self.path}: tensor {t.name!r} (bytes {t.offset}.."
                                       f"{t.offset + t.nbytes}) overlaps {prev!r}; the file is "
                                       f"corrupt")
            if t.nbytes:
                end, prev = t.offset + t.nbytes, t.name

    # ---- header parsing ----------------------------------------------------------------
    def _unpack(self, fmt: str, off: int) -> tuple:
        if off + struct.calcsize(fmt) > self.size:
            raise _Truncated
        return struct.unpack_from(fmt, self._mm, off)

    def _str(self, off: int, limit: int | None = None) -> tuple[str, int]:
        (n,) = self._unpack("<Q", off)
        off += 8
        if limit is not None and n > limit:
            raise _Corrupt(f"a name of {n} bytes at offset {off - 8} (at most {limit})")
        if off + n > self.size:
            raise _Truncated
        self._count_bytes(n)
        return self._mm[off:off + n].decode("utf-8", errors="replace"), off + n

    def _count_bytes(self, n: int) -> None:
        self._string_bytes += n
        if self._string_bytes > MAX_METADATA_STRING_BYTES:
            raise _Corrupt(f"more than {MAX_METADATA_STRING_BYTES} bytes of strings in the "
                           f"metadata")

    def _count(self, n: int, key: str) -> None:
        self._elements += n
        if self._elements > MAX_METADATA_ELEMENTS:
            raise _Corrupt(f"metadata {key!r}: more than {MAX_METADATA_ELEMENTS} array elements "
                           f"in all")

    def _value(self, vtype: int, off: int, key: str, depth: int = 0) -> tuple[Any, int]:
        if vtype in _SCALAR_FMT:
            fmt = _SCALAR_FMT[vtype]
            (v,) = self._unpack(fmt, off)
            return v, off + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._str(off)
        if vtype == _ARRAY:
            etype, n = self._unpack("<IQ", off)
            off += 12
            if depth >= MAX_ARRAY_DEPTH:
                raise _Corrupt(f"metadata {key!r}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
            self._count(n, key)
            if etype in _NP_DTYPE:
                dt = np.dtype(_NP_DTYPE[etype])
                if off + n * dt.itemsize > self.size:
                    raise _Truncated
                arr = np.frombuffer(self._mm, dtype=dt, count=n, offset=off)
                vals = arr.astype(bool).tolist() if etype == 7 else arr.tolist()
                return vals, off + n * dt.itemsize
            if etype == _STRING:
                out = []
                mm, size, unpack = self._mm, self.size, struct.unpack_from
                room = MAX_METADATA_STRING_BYTES - self._string_bytes
                for _ in range(n):
                    if off + 8 > size:
                        raise _Truncated
                    (ln,) = unpack("<Q", mm, off)
                    off += 8
                    if off + ln > size:
                        raise _Truncated
                    room -= ln
                    if room < 0:
                        self._count_bytes(MAX_METADATA_STRING_BYTES + 1)  # raises
                    out.append(mm[off:off + ln].decode("utf-8", errors="replace"))
                    off += ln
                self._string_bytes = MAX_METADATA_STRING_BYTES - room
                return out, off
            if etype == _ARRAY:
                out = []
                for _ in range(n):
                    v, off = self._value(_ARRAY, off, key, depth + 1)
                    out.append(v)
                return out, off
            raise _Corrupt(f"metadata {key!r}: unknown array element type {etype}")
        raise _Corrupt(f"metadata {key!r}: unknown value type {vtype}")

    # ---- data ----------------------------------------------------------------------------
    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view ``[rows, row_bytes]`` (no copy)."""
        import gguf

        block, tsize = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.qtype)]
        row_bytes = (info.dims[0] // block) * tsize if info.dims else tsize
        buf = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return buf.reshape(-1, row_bytes)

    def dequantize(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor as a new float32 array in HF (row-major) shape.

        Raises:
            UnsupportedModelError: the ``gguf`` package cannot dequantize its type.
        """
        import gguf

        qt = gguf.GGMLQuantizationType(info.qtype)
        raw = self.raw(info)
        if qt == gguf.GGMLQuantizationType.F32:
            out = raw.view(np.float32).copy()
        elif qt == gguf.GGMLQuantizationType.F16:
            out = raw.view(np.float16).astype(np.float32)
        else:
            try:
                out = gguf.quants.dequantize(raw, qt)
            except NotImplementedError as e:
                raise UnsupportedModelError(f"{self.path}: tensor {info.name!r} is {qt.name}, "
                                            f"which the gguf package cannot dequantize") from e
            out = np.asarray(out, dtype=np.float32)
        return out.reshape(info.shape)
