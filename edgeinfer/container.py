"""The ``.eif`` container: one self-contained safetensors file (the single source of truth).

Layout (a valid safetensors file, readable by any safetensors tool)::

    u64 little-endian header length N | N bytes JSON header | tensor data

The JSON header maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the start of the data section) plus ``"__metadata__"`` (str -> str).

Tensors:
  * a :class:`~edgeinfer.backends.quantized.QuantizedTensor` ``N`` is stored as
    ``N.qweight`` (uint8 nibbles / int8), ``N.scales`` (float16, or float32 when a scale
    overflows fp16: https://github.com/casper-hansen/AutoAWQ/issues/498) and ``N.zeros`` (packed uint8, asymmetric only);
  * a dense tensor ``N`` is stored as itself (float16 or float32; norms and biases float32).

Metadata (every value a string; the structured ones are JSON):
  ``format`` = "edgeinfer", ``format_version`` = "1", ``config`` (``ModelConfig.to_hf_dict``),
  ``quantization`` (per quantized tensor: bits, group_size, symmetric, method, in_features,
  scales_dtype), ``tokenizer`` (tokenizer.json text), ``chat_template``, ``special``
  (bos/eos strings, add_bos_token), ``generation``, ``provenance``.

Reading maps the file once (``mmap``) and builds every array with ``np.frombuffer`` at the
header's offsets: no copy of the data at load (the CPU backend relies on it), and the
arrays are read-only. Before that, everything is checked: the header
(:mod:`edgeinfer.readers.safetensors_header`), the format version, every metadata JSON
(bounded, no duplicate keys, of the expected type), the config against the tensors, each
tensor's dtype for its role and packed layout, the tokenizer against the config; after
it, one pass over the scales and dense float tensors for NaN/inf (refused) and all-zero
scale rows (a warning). Writing goes through :mod:`edgeinfer.safe_write`: a temporary file
in the destination folder, renamed into place only when complete (an interrupted write
never leaves half a file); an existing target is replaced only with ``overwrite``, an
input never.
"""
from __future__ import annotations

import datetime
import json
import logging
import math
import mmap
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .backends.quantized import SUPPORTED_BITS, QuantizedTensor
from .errors import ModelFormatError
from .models.config import ModelConfig
from .readers.files import MAX_JSON_DEPTH, check_template, parse_json
from .readers.safetensors_header import SafetensorsHeader, read_header
from .readers.tokenizer_files import check_tokenizer_json
from .safe_write import atomic_output
from .source import ModelSource, check_finite, expected_specs

log = logging.getLogger(__name__)

FORMAT_NAME = "edgeinfer"
FORMAT_VERSION = 1
#: safetensors dtype names <-> numpy dtypes used by this format.
_DTYPES = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I8": np.int8}
_NP2ST = {np.dtype(v): k for k, v in _DTYPES.items()}
#: dense (not quantized) tensors: float weights, norms and biases.
_DENSE_DTYPES = ("F32", "F16")
_QSUFFIXES = (".qweight", ".scales", ".zeros")


# ------------------------------------------------------------------------------- writing
def write_eif(path: str | os.PathLike, config: ModelConfig, tensors: Mapping[str, Any], *,
              tokenizer_json: str, chat_template: str | None = None,
              bos_token: str | None = None, eos_token: str | None = None,
              add_bos_token: bool = False, generation: dict | None = None,
              provenance: dict | None = None, overwrite: bool = False,
              inputs: Iterable[str | os.PathLike | None] = ()) -> int:
    """Write a model to ``path`` atomically (:func:`edgeinfer.safe_write.atomic_output`:
    a temporary file in the same folder, renamed when complete).

    Args:
        path: destination ``.eif`` file.
        config: the model config (stored as ``config`` JSON).
        tensors: canonical name -> QuantizedTensor or dense ndarray (float16/float32/...).
        tokenizer_json: the HF ``tokenizer.json`` text.
        chat_template, bos_token, eos_token, add_bos_token: tokenizer settings.
        generation: generation_config values (JSON-serializable).
        provenance: free-form JSON-serializable facts (source, sha256, method ...);
            ``date`` and ``edgeinfer_version`` are added if absent.
        overwrite: replace an existing ``path`` (else it is refused).
        inputs: files or folders the model was read from: never written over.

    Returns:
        The size of the written file in bytes.

    Raises:
        ValueError: a tensor dtype the format does not store, or a name that collides
            with a quantized tensor's parts (nothing is written).
        OutputError: ``path`` exists (without ``overwrite``), is an input or a folder; no
            space, a read-only or unwritable folder (no file is left behind).
    """
    from . import __version__

    arrays: dict[str, np.ndarray] = {}
    quant: dict[str, dict] = {}
    for name, t in tensors.items():
        if isinstance(t, QuantizedTensor):
            if t.mins is not None:
                raise ValueError(f"tensor {name!r}: .eif does not store float group mins "
                                 f"(a GGUF's Q4_1/Q5_1/Q4_K layout) yet; run the GGUF itself, "
                                 f"or convert from its float32 weights")
            parts = {".qweight": t.qweight, ".scales": t.scales}
            if t.zeros is not None:
                parts[".zeros"] = t.zeros
            for suf, a in parts.items():
                if name + suf in tensors:
                    raise ValueError(f"tensor name {name + suf!r} collides with quantized {name!r}")
                arrays[name + suf] = np.ascontiguousarray(a)
            quant[name] = {"bits": t.bits, "group_size": t.group_size, "symmetric": t.symmetric,
                           "method": t.method, "in_features": t.in_features,
                           "scales_dtype": str(np.dtype(t.scales.dtype))}
        else:
            a = np.ascontiguousarray(t)
            if a.dtype not in _NP2ST:
                raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in .eif")
            arrays[name] = a
    prov = dict(provenance or {})
    prov.setdefault("edgeinfer_version", __version__)
    prov.setdefault("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "config": json.dumps(config.to_hf_dict()),
        "quantization": json.dumps(quant),
        "tokenizer": tokenizer_json,
        "chat_template": chat_template or "",
        "special": json.dumps({"bos_token": bos_token, "eos_token": eos_token,
                               "add_bos_token": bool(add_bos_token)}),
        "generation": json.dumps(generation or {}),
        "provenance": json.dumps(prov, default=str),
    }
    blob = _safetensors_header(arrays, meta)
    size = len(blob) + sum(a.nbytes for a in arrays.values())
    with atomic_output(path, overwrite=overwrite, inputs=inputs, size=size) as tmp:
        _write_safetensors(tmp, blob, arrays)
    return os.path.getsize(path)


def _safetensors_header(arrays: dict[str, np.ndarray], meta: dict[str, str]) -> bytes:
    """The 8-byte little-endian header length and the JSON header (``__metadata__`` +
    name -> dtype/shape/data_offsets, padded with spaces to 8 bytes), data in dict order."""
    header: dict = {"__metadata__": meta}
    offset = 0
    for name, a in arrays.items():
        header[name] = {"dtype": _NP2ST[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def _write_safetensors(path: str, header: bytes, arrays: dict[str, np.ndarray]) -> None:
    """Write the header, then the raw data of each array in order, tensor by tensor.

    Unlike ``safetensors.numpy.save_file``, which builds the whole file in memory first,
    this streams each array to disk, so writing a model costs no second copy of it
    (Qwen2.5-0.5B: peak RSS of ``convert`` 2.4 GB -> about 1 GB)."""
    with open(path, "wb") as f:
        f.write(header)
        for a in arrays.values():
            f.write(memoryview(np.ascontiguousarray(a)).cast("B"))


# ------------------------------------------------------------------------------- reading
_FIX = "re-convert the model (edgeinfer convert) or re-download it"


def _open_header(path: str) -> SafetensorsHeader:
    """The checked safetensors header of an ``.eif`` file whose format and version we read."""
    header = read_header(path, hint=_FIX)
    _check_format(path, header.metadata)
    return header


def _check_format(path: str, meta: dict) -> None:
    fmt = meta.get("format")
    if fmt != FORMAT_NAME:
        raise ModelFormatError(
            f"{path}: not an edgeinfer model (format={fmt!r}); it looks like a plain safetensors "
            f"file: point edgeinfer at its HF folder or convert it with `edgeinfer convert`")
    ver = meta.get("format_version", "")
    if not re.fullmatch(r"[0-9]{1,6}", ver):
        raise ModelFormatError(f"{path}: metadata format_version {ver!r} is not a version number "
                               f"(an integer such as {str(FORMAT_VERSION)!r}); {_FIX}")
    v = int(ver)
    if v > FORMAT_VERSION:
        raise ModelFormatError(
            f"{path}: written by a newer edgeinfer (format version {v}, this one reads up to "
            f"{FORMAT_VERSION}); upgrade edgeinfer (pip install -U edgeinfer)")
    if v != FORMAT_VERSION:
        raise ModelFormatError(f"{path}: format_version {v} is not one edgeinfer wrote "
                               f"(this one reads {FORMAT_VERSION}); {_FIX}")


def _json_meta(path: str, meta: dict, key: str, default: Any, kind: type = dict) -> Any:
    """Metadata ``key`` parsed as JSON (bounded, no duplicate keys) and of type ``kind``."""
    raw = meta.get(key)
    if raw is None or raw == "":
        return default
    v = parse_json(raw, f"{path}: metadata {key!r}", max_depth=MAX_JSON_DEPTH)
    if not isinstance(v, kind):
        raise ModelFormatError(f"{path}: metadata {key!r} is a {type(v).__name__}, expected a "
                               f"{kind.__name__}; {_FIX}")
    return v


def _quant_params(path: str, quant: dict) -> dict[str, dict]:
    """The ``quantization`` metadata, every entry's fields type-checked."""
    out = {}
    for name, q in quant.items():
        where = f"{path}: metadata 'quantization' of tensor {name!r}"
        if not isinstance(q, dict):
            raise ModelFormatError(f"{where} is not an object; {_FIX}")
        for key, ok in (("bits", lambda v: v in SUPPORTED_BITS), ("group_size", lambda v: v >= 1),
                        ("in_features", lambda v: v >= 1)):
            v = q.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or not ok(v):
                raise ModelFormatError(f"{where}: {key} = {v!r} is invalid; {_FIX}")
        if not isinstance(q.get("symmetric", False), bool) or not isinstance(q.get("method", ""), str):
            raise ModelFormatError(f"{where}: 'symmetric' must be a bool and 'method' a string")
        out[name] = q
    return out


def _map_arrays(path: str, header: SafetensorsHeader) -> tuple[dict[str, np.ndarray], mmap.mmap | None]:
    """(name -> read-only ndarray viewing the mmapped file (no copy), the map).

    The header is already checked (offsets inside the file, sizes matching shapes)."""
    out: dict[str, np.ndarray] = {}
    if not header.tensors:
        return out, None
    for t in header.tensors.values():
        if t.dtype not in _DTYPES:
            raise ModelFormatError(f"{path}: tensor {t.name!r} has dtype {t.dtype}; .eif stores "
                                   f"{', '.join(_DTYPES)}; {_FIX}")
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if len(mm) != header.file_size:
        mm.close()
        raise ModelFormatError(f"{path}: the file changed while it was opened; open it again")
    for t in header.tensors.values():
        dt = _DTYPES[t.dtype]
        count = math.prod(t.shape)
        out[t.name] = np.frombuffer(mm, dtype=dt, count=count, offset=t.begin).reshape(t.shape)
    return out, mm


def _check_values(path: str, tensors: dict[str, Any]) -> None:
    """NaN/inf in scales and dense float tensors refused; all-zero scale rows warned about.

    Cost: one read pass over every scale and dense float tensor (codes are integers and
    cannot be non-finite), in bounded chunks.
    """
    for name, t in tensors.items():
        if isinstance(t, QuantizedTensor):
            check_finite(t.scales, f"{name}.scales", path)
            zero_rows = int((~t.scales.any(axis=1)).sum()) if t.scales.size else 0
            if zero_rows:
                log.warning("%s: tensor %r has %d of %d rows whose scales are all zero (those "
                            "outputs are always 0); the file may be damaged: re-convert it",
                            path, name, zero_rows, t.scales.shape[0])
        else:
            check_finite(t, name, path)


def read_eif(path: str | os.PathLike) -> ModelSource:
    """Open an ``.eif`` file as a :class:`ModelSource` (memory-mapped, no data copy).

    Quantized tensors come back as :class:`QuantizedTensor` whose arrays view the map;
    dense tensors as read-only ndarrays (float16 dense weights are kept as stored).

    Raises:
        ModelFormatError: a foreign file (not safetensors, or no/unknown ``format``), a
            newer or non-integer ``format_version``, a truncated file or a malformed header
            (offsets outside the data, overlapping tensors), metadata that is not valid
            JSON of the right type, a config the tensors do not back, a tensor the config
            needs that is missing, a tensor the config does not use, a wrong dtype or packed
            shape, NaN/inf scales or weights, or a tokenizer that does not fit the config.
            The message names the file, the tensor or field, and the fix.
        UnsupportedModelError: a config edgeinfer cannot run (architecture, RoPE type).
    """
    from .readers import config_from_dict

    path = os.fspath(path)
    header = _open_header(path)
    meta = header.metadata
    config = config_from_dict(_json_meta(path, meta, "config", {}), f"{path}: metadata 'config'")
    quant = _quant_params(path, _json_meta(path, meta, "quantization", {}))
    special = _json_meta(path, meta, "special", {})
    generation = _json_meta(path, meta, "generation", {})
    provenance = _json_meta(path, meta, "provenance", {})
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos = special.get("add_bos_token", False)
    if not all(v is None or isinstance(v, str) for v in (bos, eos)) or not isinstance(add_bos, bool):
        raise ModelFormatError(f"{path}: metadata 'special' must hold bos_token/eos_token strings "
                               f"and an add_bos_token bool; {_FIX}")
    tokenizer_json = meta.get("tokenizer", "")
    where = f"{path}: metadata 'tokenizer'"
    check_tokenizer_json(parse_json(tokenizer_json, where), where, config.vocab_size,
                         {"special bos_token": bos, "special eos_token": eos})

    arrays, mapping = _map_arrays(path, header)
    tensors: dict[str, Any] = {}
    used: set[str] = set()
    for name, q in quant.items():
        try:
            qw, sc = arrays[name + ".qweight"], arrays[name + ".scales"]
        except KeyError as e:
            raise ModelFormatError(f"{path}: quantized tensor {name!r} lacks {e.args[0]!r}; "
                                   f"the file is damaged: re-convert it") from None
        symmetric = q.get("symmetric", False)
        zeros = None if symmetric else arrays.get(name + ".zeros")
        if zeros is None and not symmetric:
            raise ModelFormatError(f"{path}: asymmetric tensor {name!r} lacks {name + '.zeros'!r}")
        try:
            tensors[name] = QuantizedTensor(qw, sc, zeros, q["bits"], q["group_size"],
                                            q["in_features"], q.get("method", "unknown"))
        except ValueError as e:
            raise ModelFormatError(f"{path}: quantized tensor {name!r} is inconsistent: {e}; "
                                   f"{_FIX}") from None
        used.update((name + ".qweight", name + ".scales") + (() if symmetric else (name + ".zeros",)))
    for name, a in arrays.items():
        if name in used:
            continue
        if header.tensors[name].dtype not in _DENSE_DTYPES:
            raise ModelFormatError(f"{path}: dense tensor {name!r} has dtype "
                                   f"{header.tensors[name].dtype}; .eif stores dense weights as "
                                   f"{' or '.join(_DENSE_DTYPES)} (or {name!r} is a quantized part "
                                   f"without a 'quantization' entry); {_FIX}")
        tensors[name] = a
    if config.tie_word_embeddings and "lm_head.weight" in tensors:
        log.warning("%s: tie_word_embeddings is true; the stored lm_head.weight is not used", path)
        del tensors["lm_head.weight"]
    expected = {s.name for s in expected_specs(config, tensors, path)}
    unknown = sorted(n for n in tensors if n not in expected)
    if unknown:
        raise ModelFormatError(
            f"{path}: tensor(s) {', '.join(unknown[:5])}{' …' if len(unknown) > 5 else ''} are not "
            f"used by a {config.model_type} model with the embedded config; the config and the "
            f"weights disagree: {_FIX}")
    src = ModelSource(
        path=path, format="eif", config=config, tensors=tensors,
        shapes={k: tuple(v.shape) for k, v in tensors.items()},
        tokenizer_json=tokenizer_json,
        chat_template=check_template(meta.get("chat_template") or None,
                                     f"{path}: metadata 'chat_template'"),
        bos_token=bos, eos_token=eos, add_bos_token=add_bos,
        generation=generation,
        provenance={**provenance, "quantization": quant,
                    "format_version": int(meta["format_version"])},
        mapping=mapping,
    )
    src.validate()
    _check_values(path, tensors)
    return src


# ------------------------------------------------------------------------------- info
def _kind(name: str) -> str:
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if "self_attn" in name and name.endswith("_proj.weight"):
        return "attention"
    if "mlp" in name and name.endswith("_proj.weight"):
        return "mlp"
    return "other"


def describe_eif(path: str | os.PathLike) -> dict:
    """Everything ``edgeinfer info`` shows about an ``.eif`` file, without loading weights.

    Returns:
        dict with ``path``, ``file_size`` (bytes), ``format``, ``format_version``, ``config``,
        ``quantization``, ``special``, ``generation``, ``provenance``, ``chat_template``,
        ``tokenizer_chars``, ``n_tensors``, ``params`` (logical weights), ``bits_per_weight``
        (all stored tensor bytes * 8 / logical parameters) and ``bits_per_weight_by_kind``
        (embedding / attention / mlp / lm_head / other).

    Raises:
        ModelFormatError: as :func:`read_eif` for foreign, newer or truncated files, a
            malformed header, or malformed metadata.
    """
    path = os.fspath(path)
    header = _open_header(path)
    meta = header.metadata
    quant = _quant_params(path, _json_meta(path, meta, "quantization", {}))
    by_kind: dict[str, list[int]] = {}  # kind -> [bytes, params]
    for name, t in header.tensors.items():
        base = name
        for suf in _QSUFFIXES:
            if name.endswith(suf) and name[: -len(suf)] in quant:
                base = name[: -len(suf)]
        acc = by_kind.setdefault(_kind(base), [0, 0])
        acc[0] += t.end - t.begin
        if base in quant:
            if name.endswith(".qweight") and t.shape:
                acc[1] += int(t.shape[0]) * int(quant[base]["in_features"])
        else:
            acc[1] += math.prod(t.shape)
    total_b = sum(v[0] for v in by_kind.values())
    total_p = sum(v[1] for v in by_kind.values())
    return {
        "path": path, "file_size": header.file_size, "format": meta.get("format"),
        "format_version": int(meta.get("format_version", 0)),
        "config": _json_meta(path, meta, "config", {}), "quantization": quant,
        "special": _json_meta(path, meta, "special", {}),
        "generation": _json_meta(path, meta, "generation", {}),
        "provenance": _json_meta(path, meta, "provenance", {}),
        "chat_template": meta.get("chat_template", ""),
        "tokenizer_chars": len(meta.get("tokenizer", "")),
        "n_tensors": len(header.tensors),
        "params": total_p,
        "bits_per_weight": 8.0 * total_b / max(total_p, 1),
        "bits_per_weight_by_kind": {k: 8.0 * b / max(p, 1) for k, (b, p) in sorted(by_kind.items())},
    }
