"""``convert`` of a GPTQ or AutoAWQ GEMM checkpoint: a lossless import into one ``.eif``.

The packed linears are re-laid, never re-quantized (:mod:`.packed_formats`: the ``.eif``'s
dequantized weights equal the checkpoint's own dequantization bit for bit). The other
tensors keep their values: 1-D tensors (norms, biases) as float32, as every conversion
stores them; 2-D ones (the embedding, an unquantized head or linear) as float16 when every
value is an fp16 number (the usual fp16 checkpoint), else float32, unless ``embed_bits``
asks for the embedding and head as INT8 per row (8, lossy) or a float width (16, 32).
The folder is read by :func:`edgeinfer.readers.hf.read_hf_folder` with the checkpoint's
layout, so its config, tokenizer and tensor names are checked as for a float checkpoint.
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ..backends.quantized import QuantizedTensor
from ..container import write_eif
from ..errors import ModelFormatError
from ..readers.hf import quantization_config, read_hf_folder
from ..safe_write import check_output
from ..source import ModelSource
from .packed_formats import PackedLayout, packed_layout

_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def is_packed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a HF folder whose config declares a quantization (GPTQ, AWQ or any
    other: :func:`read_packed` names what it cannot import).

    Raises:
        ModelFormatError: an unreadable ``config.json`` / ``quantize_config.json``.
    """
    return os.path.isdir(path) and quantization_config(path) is not None


def read_packed(path: str | os.PathLike) -> tuple[ModelSource, PackedLayout]:
    """A GPTQ / AutoAWQ GEMM folder as a validated ModelSource whose packed linears load as
    QuantizedTensor, with the layout its config names.

    Raises:
        ModelFormatError: not a quantized checkpoint, or a malformed one (missing or
            mis-shaped parts, ``g_idx`` out of range, non-finite scales ...).
        UnsupportedModelError: a quantization it cannot import losslessly
            (:mod:`.packed_formats`).
    """
    found = quantization_config(path)
    if found is None:
        raise ModelFormatError(f"{path}: no quantization_config in config.json (nor a "
                               f"quantize_config.json): not a GPTQ or AWQ checkpoint; a float "
                               f"model is quantized by edgeinfer convert MODEL -o MODEL.eif")
    qc, where = found
    layout = packed_layout(qc, where)
    return read_hf_folder(path, packed=layout), layout


def _as_stored(a: np.ndarray) -> np.ndarray:
    """float16 when every value of ``a`` is an fp16 number, else float32 (both exact)."""
    a = np.asarray(a, np.float32)
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    return h if np.array_equal(h.astype(np.float32), a) else a


def _dense(name: str, a: np.ndarray, embed_bits: int | None) -> Any:
    if a.ndim == 1:
        return np.asarray(a, np.float32)
    if name in _TABLES and embed_bits is not None:
        from .convert import _table

        return _table(a, embed_bits, name)
    return _as_stored(a)


def import_packed(src: str | os.PathLike, out_path: str | os.PathLike, *,
                  embed_bits: int | None = None, overwrite: bool = False) -> dict:
    """Import a GPTQ / AutoAWQ GEMM checkpoint folder into one ``.eif`` (module docstring).

    Args:
        src: the checkpoint folder (``config.json`` with ``quantization_config``, or
            AutoGPTQ's ``quantize_config.json``; safetensors; ``tokenizer.json``).
        out_path: the ``.eif`` to write (refused if it exists, unless ``overwrite``).
        embed_bits: None (the embedding and an unquantized head as stored), 8, 16 or 32.

    Returns:
        report dict as :func:`edgeinfer.quant.convert.convert`'s, with ``imported`` (the
        format read: "gptq v1", "gptq_v2", "awq gemm") and ``n_packed`` (linears re-laid).

    Raises:
        ModelFormatError, UnsupportedModelError: see :func:`read_packed`.
        ValueError: bad ``embed_bits``. OutputError: see :func:`edgeinfer.quant.convert.convert`.
    """
    if embed_bits not in (None, 8, 16, 32):
        raise ValueError(f"embed_bits must be 8, 16 or 32 (or None: as stored), got {embed_bits}")
    t0 = time.perf_counter()
    source, layout = read_packed(src)
    inputs = [str(source.path)]
    check_output(out_path, overwrite=overwrite, inputs=inputs)
    tensors: dict[str, Any] = {}
    for name in source.tensors:  # one tensor loaded at a time
        t = source.tensors[name]
        tensors[name] = t if isinstance(t, QuantizedTensor) else _dense(name, t, embed_bits)
    n_packed = sum(isinstance(t, QuantizedTensor) and t.method == layout.kind
                   for t in tensors.values())
    if n_packed == 0:
        raise ModelFormatError(f"{src}: the config declares {layout.label} but no tensor "
                               f"P.qweight was found; the checkpoint holds no packed linear")
    from .convert import _sha256, peak_rss_mib

    provenance = {
        "source": str(source.path), "source_format": f"hf {layout.label}",
        "source_sha256": _sha256(str(source.path)), "method": layout.kind, "bits": 4,
        "group_size": layout.group_size, "symmetric": layout.sym, "embed_bits": embed_bits,
        "imported": f"{layout.label}: codes, zero points and scales re-laid without "
                    f"re-quantization ({n_packed} linears)",
        "calibration": "none (imported)",
    }
    size = write_eif(out_path, source.config, tensors, tokenizer_json=source.tokenizer_json,
                     chat_template=source.chat_template, bos_token=source.bos_token,
                     eos_token=source.eos_token, add_bos_token=source.add_bos_token,
                     generation=source.generation, provenance=provenance,
                     overwrite=overwrite, inputs=inputs)
    n_params = sum((t.out_features * t.in_features) if isinstance(t, QuantizedTensor) else t.size
                   for t in tensors.values())
    n_bytes = sum(t.nbytes for t in tensors.values())
    return {
        "out_path": str(out_path), "method": layout.kind, "bits": 4,
        "group_size": layout.group_size, "file_size": size,
        "bits_per_weight": round(8.0 * n_bytes / n_params, 4),
        "convert_seconds": round(time.perf_counter() - t0, 2),
        "peak_rss_mib": round(peak_rss_mib(), 1), "calibration": "none (imported)",
        "awq_alpha": None, "imported": layout.label, "n_packed": n_packed,
    }
