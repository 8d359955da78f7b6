"""Builders of hostile model files for the security tests: a GGUF taken apart into its
parts and put back together (any key, type, alignment or offset), safetensors files with
any header, and a writable copy of the stories260K folder.

The GGUF parser here is independent of edgeinfer's (it keeps each value's raw bytes), so
a test can change one field and leave every other byte as the real file has it.
"""
from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

# GGUF value types (gguf-py GGUFValueType)
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SIZE = {U8: 1, I8: 1, U16: 2, I16: 2, U32: 4, I32: 4, F32: 4, BOOL: 1, U64: 8, I64: 8, F64: 8}
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
        U64: "<Q", I64: "<q", F64: "<d"}


def gguf_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gguf_value(vtype: int, v) -> bytes:
    """Encode a scalar, a string, or an array given as ``(element_type, [values])``."""
    if vtype == STRING:
        return gguf_str(v)
    if vtype == ARRAY:
        etype, items = v
        return struct.pack("<IQ", etype, len(items)) + b"".join(gguf_value(etype, x) for x in items)
    return struct.pack(_FMT[vtype], v)


@dataclass
class GGUFParts:
    """A GGUF file as editable parts; ``kv`` values are raw encoded bytes."""

    version: int
    kv: list[tuple[str, int, bytes]]
    tensors: list[tuple[str, tuple[int, ...], int, int]]  # name, dims, ggml type, offset
    data: bytes
    alignment: int = 32
    extra: dict = field(default_factory=dict)

    def set(self, key: str, vtype: int, value) -> "GGUFParts":
        """Replace (or append) key ``key`` with a value of type ``vtype``."""
        raw = gguf_value(vtype, value)
        for i, (k, _, _) in enumerate(self.kv):
            if k == key:
                self.kv[i] = (key, vtype, raw)
                return self
        self.kv.append((key, vtype, raw))
        return self

    def to_bytes(self, alignment: int | None = None) -> bytes:
        """The file; the data section starts at the next multiple of ``alignment``
        (default: the parts' own), whatever ``general.alignment`` says."""
        align = alignment or self.alignment
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(self.kv)))
        for k, t, raw in self.kv:
            out += gguf_str(k) + struct.pack("<I", t) + raw
        for name, dims, qtype, off in self.tensors:
            out += gguf_str(name) + struct.pack("<I", len(dims))
            out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", qtype, off)
        out += b"\0" * (-len(out) % align)
        return bytes(out) + self.data

    def write(self, path: Path, alignment: int | None = None) -> Path:
        path.write_bytes(self.to_bytes(alignment))
        return path


def _skip_value(buf: bytes, off: int, vtype: int) -> int:
    if vtype in _SIZE:
        return off + _SIZE[vtype]
    if vtype == STRING:
        (n,) = struct.unpack_from("<Q", buf, off)
        return off + 8 + n
    etype, n = struct.unpack_from("<IQ", buf, off)
    off += 12
    if etype in _SIZE:
        return off + n * _SIZE[etype]
    for _ in range(n):
        off = _skip_value(buf, off, etype)
    return off


def gguf_parts(path: Path) -> GGUFParts:
    """Take a GGUF file apart (little-endian v2/v3)."""
    buf = path.read_bytes()
    version, n_t, n_kv = struct.unpack_from("<IQQ", buf, 4)
    off, kv = 24, []
    align = 32
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", buf, off)
        key = buf[off + 8:off + 8 + n].decode()
        off += 8 + n
        (vtype,) = struct.unpack_from("<I", buf, off)
        off += 4
        end = _skip_value(buf, off, vtype)
        kv.append((key, vtype, buf[off:end]))
        if key == "general.alignment":
            (align,) = struct.unpack_from("<I", buf, off)
        off = end
    tensors = []
    for _ in range(n_t):
        (n,) = struct.unpack_from("<Q", buf, off)
        name = buf[off + 8:off + 8 + n].decode()
        off += 8 + n
        (nd,) = struct.unpack_from("<I", buf, off)
        dims = struct.unpack_from(f"<{nd}Q", buf, off + 4)
        off += 4 + 8 * nd
        qtype, toff = struct.unpack_from("<IQ", buf, off)
        off += 12
        tensors.append((name, tuple(dims), qtype, toff))
    start = off + (-off % align)
    return GGUFParts(version, kv, tensors, buf[start:], align, {"data_start": start})


def safetensors_bytes(header: dict | bytes, data: bytes = b"") -> bytes:
    """A safetensors file with exactly this header (a dict is JSON-encoded, padded to 8)."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def copy_folder(src: Path, dst: Path, skip_suffixes: tuple[str, ...] = (".gguf",)) -> Path:
    """A writable copy of a model folder."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix not in skip_suffixes:
            shutil.copy(f, dst / f.name)
            (dst / f.name).chmod(0o644)
    return dst


def edit_json(path: Path, **changes) -> None:
    """Set (or, with None, remove) top-level keys of a JSON file."""
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))
