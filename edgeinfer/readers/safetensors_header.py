"""A safetensors header, parsed and checked before any tensor data is touched.

Used by the HF-folder reader (checkpoint shards) and by the ``.eif`` container (which is
a safetensors file). Layout: ``u64 little-endian N | N bytes of JSON | data``; the JSON
maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data section) plus an optional ``"__metadata__"`` of str -> str
(the safetensors specification, https://github.com/huggingface/safetensors#format).

Checks (each refusal names the file and the tensor or field): header length within the
file and at most :data:`MAX_HEADER_BYTES` (the safetensors library's own limit); the
JSON through :func:`edgeinfer.readers.files.parse_json` (no duplicate names); every entry
has exactly those three fields, a known dtype, a shape of non-negative integers, and
``end - begin == prod(shape) * itemsize``; the tensors tile the data section exactly
(sorted by offset, no gap, no overlap, the last one ending at the end of the file).
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFormatError
from .files import MAX_JSON_DEPTH, parse_json

__all__ = ["DTYPE_SIZES", "MAX_HEADER_BYTES", "SafetensorsHeader", "TensorEntry", "read_header"]

#: The safetensors library refuses headers larger than this (100 MB).
MAX_HEADER_BYTES = 100_000_000
#: Most dimensions a tensor may have.
MAX_DIMS = 8
#: safetensors dtype name -> bytes per element.
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the header; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """The checked header: tensors in header order, metadata, data start, file size."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_header(path: str | os.PathLike, *, hint: str = "download it again",
                shown: str | os.PathLike | None = None) -> SafetensorsHeader:
    """Read and check the header of a safetensors file (no tensor data is read).

    Args:
        path: the file.
        hint: the fix named in errors ("download it again", "re-convert it").
        shown: the name used in errors (default ``path``).

    Raises:
        ModelFormatError: a truncated or foreign file, invalid JSON, a malformed entry,
            offsets outside the data section, or tensors overlapping or leaving gaps.
    """
    real = Path(path)
    path = Path(shown) if shown is not None else real
    try:
        with open(real, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise ModelFormatError(f"{path}: {size} bytes, too short for a safetensors header "
                                       f"(truncated or not safetensors); {hint}")
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > size - 8 or n > MAX_HEADER_BYTES:
                raise ModelFormatError(
                    f"{path}: not a safetensors file or truncated: header length {n} in a "
                    f"{size}-byte file (at most {MAX_HEADER_BYTES}); {hint}")
            raw = f.read(n)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) < n:
        raise ModelFormatError(f"{path}: truncated safetensors header; {hint}")
    doc = parse_json(raw, f"{path}: safetensors header", max_depth=MAX_JSON_DEPTH)
    if not isinstance(doc, dict):
        raise ModelFormatError(f"{path}: safetensors header is a {type(doc).__name__}, not a JSON "
                               f"object; not a safetensors file")
    data_start = 8 + n
    data_size = size - data_start
    meta = doc.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ModelFormatError(f"{path}: safetensors '__metadata__' must map strings to strings; "
                               f"the file is damaged ({hint})")
    tensors: dict[str, TensorEntry] = {}
    for name, info in doc.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ModelFormatError(f"{where}: header entry must have exactly 'dtype', 'shape' and "
                                   f"'data_offsets'; the file is damaged ({hint})")
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise ModelFormatError(f"{where}: unknown dtype {dtype!r} (safetensors dtypes: "
                                   f"{', '.join(DTYPE_SIZES)})")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(_int(d) and d >= 0 for d in shape)):
            raise ModelFormatError(f"{where}: shape {shape!r} is not a list of at most {MAX_DIMS} "
                                   f"non-negative integers; the file is damaged ({hint})")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(_int(o) for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise ModelFormatError(f"{where}: data_offsets {offs!r} are not [begin, end] with "
                                   f"0 <= begin <= end; the file is damaged ({hint})")
        want = math.prod(shape) * DTYPE_SIZES[dtype]
        if offs[1] - offs[0] != want:
            raise ModelFormatError(f"{where}: {offs[1] - offs[0]} bytes of data for shape "
                                   f"{tuple(shape)} {dtype} ({want} bytes); the file is damaged "
                                   f"({hint})")
        if offs[1] > data_size:
            raise ModelFormatError(
                f"{where}: data ends at byte {data_start + offs[1]} but the file has {size}: "
                f"truncated (the copy or conversion was interrupted); {hint}")
        tensors[name] = TensorEntry(name, dtype, tuple(shape), data_start + offs[0],
                                    data_start + offs[1])
    pos = data_start
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != pos:
            what = "overlaps the previous tensor" if t.begin < pos else f"leaves a gap at byte {pos}"
            raise ModelFormatError(f"{path}: tensor {t.name!r} (bytes {t.begin}..{t.end}) {what}; "
                                   f"tensors must tile the data section; the file is damaged "
                                   f"({hint})")
        pos = t.end
    if pos != size:
        raise ModelFormatError(f"{path}: {size - pos} bytes after the last tensor; the file is "
                               f"damaged or not safetensors ({hint})")
    return SafetensorsHeader(tensors, dict(meta), data_start, size)
