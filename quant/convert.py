"""``convert``: a float checkpoint (HF folder, GGUF, ModelSource) -> one ``.eif`` file.

A GPTQ or AutoAWQ GEMM checkpoint folder is imported instead, losslessly
(:mod:`.import_packed`: its packed weights re-laid, nothing re-quantized).

What is stored (see :mod:`edgeinfer.container`):
  * every decoder linear: INT4 (``method`` grid / rtn / awq / gptq / mse), group
    ``group_size`` (default: the method's, :data:`METHOD_LAYOUT`), or, for
    an input width it does not divide, the largest multiple of 32 below it that does
    (:func:`~edgeinfer.quant.rtn.effective_group`; recorded per tensor);
  * ``model.embed_tokens.weight``: INT8 per row (``embed_bits=8``, default), or float16 /
    float32 (``embed_bits`` 16 / 32);
  * ``lm_head.weight``: tied (``tie_word_embeddings``) -> not stored, the runtime reuses the
    embedding (stored once; a redundant head in the source is ignored, with a
    warning if it differs from the embedding); untied -> INT8 per row by default (same
    ``embed_bits``); untied but absent -> :class:`ModelFormatError`;
  * norms and biases: float32 (AWQ folds its scales into the norms / previous linears).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import resource
import sys
import time
from typing import Any

import numpy as np

from ..backends.quantized import QuantizedTensor
from ..container import write_eif
from ..errors import ModelFormatError
from ..safe_write import check_output
from ..source import ModelSource
from .calibrate import calibration_ids, check_finite, quantize_layers, random_ids
from .gptq import GRIDS as GPTQ_GRIDS
from .gptq_sequential import ASYM_ALPHA, ASYM_DAMP, ASYM_SEQUENCES
from .grid import GROUP_SIZE as GRID_GROUP, SYMMETRIC as GRID_SYMMETRIC
from .signmax import GROUP_SIZE as SIGNMAX_GROUP
from .rotate import rotate_source, rotation_refusal
from .rtn import quantize_rtn

log = logging.getLogger(__name__)

#: the default ``(group_size, symmetric)`` of each method: "grid" (the data-free default)
#: uses Q4_0's layout, symmetric groups of 32 with an fp16 scale (4.5 bits per weight)
METHOD_LAYOUT = {"signmax": (SIGNMAX_GROUP, True), "grid": (GRID_GROUP, GRID_SYMMETRIC),
                 "rtn": (128, False),
                 "awq": (128, False), "gptq": (128, False), "gptaq": (128, False),
                 "mse": (128, False)}


def _sha256(path: str) -> str | None:
    """sha256 of a file, or of the sorted weight/config files of a folder."""
    try:
        h = hashlib.sha256()
        files = ([path] if os.path.isfile(path) else
                 sorted(os.path.join(path, f) for f in os.listdir(path)
                        if f.endswith((".safetensors", ".json", ".gguf"))))
        for fn in files:
            with open(fn, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        return h.hexdigest()
    except OSError:
        return None


def _open(src: str | ModelSource) -> ModelSource:
    """The source with a GGUF's natively loaded block weights as float32 (bit-identical
    to ``gguf.quants.dequantize``): the methods re-quantize from float."""
    if isinstance(src, ModelSource):
        return src.float32() if src.format == "gguf" else src
    try:
        from ..readers import read_model
    except ImportError as e:
        raise ModelFormatError(f"cannot read {src}: the model readers are unavailable ({e})") from None
    source = read_model(str(src))
    return source.float32() if source.format == "gguf" else source


def _table(w: np.ndarray, embed_bits: int, name: str, rows: int = 4096) -> Any:
    """Embedding / head table in its stored form; INT8 per row is quantized in blocks of
    ``rows`` rows (rows are independent) to bound the float64 temporaries (peak RSS)."""
    if embed_bits == 8:
        parts = [quantize_rtn(w[i:i + rows], 8, -1, True, name=name) for i in range(0, len(w), rows)]
        sdt = np.result_type(*[p.scales.dtype for p in parts])
        return QuantizedTensor(np.concatenate([p.qweight for p in parts]),
                               np.concatenate([p.scales.astype(sdt) for p in parts]), None, 8,
                               parts[0].group_size, parts[0].in_features, "rtn")
    if embed_bits == 16:
        return np.asarray(w, np.float16)
    if embed_bits == 32:
        return np.asarray(w, np.float32)
    raise ValueError(f"embed_bits must be 8, 16 or 32, got {embed_bits}")


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (MiB; Linux ``ru_maxrss`` is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@contextlib.contextmanager
def small_pages():
    """numpy's transparent-huge-page advice off while the block runs, restored after
    (also on an exception). A calibration pass allocates and frees activation arrays of
    tens to hundreds of MB per layer, and with the advice (numpy's default on Linux) their
    page faults go through the kernel's huge-page compaction: half of a GPTQ convert's
    system time (benchmarks/MEASUREMENTS.md). A numpy without the switch: no change."""
    mod = getattr(getattr(np, "_core", None), "multiarray", None)
    setter = getattr(mod, "_set_madvise_hugepage", None)
    if setter is None:
        yield
        return
    was = setter(False)  # returns the previous setting
    try:
        yield
    finally:
        setter(was)


def convert(src: str | ModelSource, out_path: str, *, method: str = "gptq", bits: int = 4,
            group_size: int | None = None, symmetric: bool | None = None,
            embed_bits: int | None = None,
            calib_path: str | None = None, n_calib: int | None = None,
            calib_len: int | None = None, seed: int = 0, act_order: bool = False,
            n_search: int = 2048, progress: bool = True, overwrite: bool = False,
            true_sequential: bool = True, rotate: bool | None = None,
            gptq_grid: str | None = None) -> dict:
    """Quantize a model and write it as one self-contained ``.eif`` file.

    Args:
        src: HF folder / GGUF path (read through ``edgeinfer.readers.read_model``) or a
            ModelSource (float32 tensors, lazily loaded is best: one layer at a time). A
            GPTQ / AutoAWQ GEMM folder goes to :func:`.import_packed.import_packed`
            (``embed_bits`` and ``overwrite`` apply; the quantization options do not: the
            checkpoint's own groups and zero points are kept).
        out_path: destination file (written to a temp file, then renamed); checked before
            any work: an existing file is refused unless ``overwrite``, an input always.
        method: "gptq" (default), "awq", "gptaq" (GPTQ fitting each layer to the float
            model's outputs: asymmetric calibration, :mod:`.gptq_sequential`; a float
            forward beside the quantized one, about twice GPTQ's time), "signmax"
            (:mod:`.signmax`: the weights alone, no calibration, seconds; each group's
            largest weight exact), "grid"
            (:mod:`.grid`: a searched scale, no calibration), "rtn" (no calibration) or
            "mse" (:mod:`.mse`; without ``calib_path`` its input scales come from random
            token ids, no data).
        bits: linear weight bits (4).
        group_size: 32 / 64 / 128 or -1 per-channel; None: the method's
            (:data:`METHOD_LAYOUT`: 32 for signmax and grid, else 128); an input width it does not
            divide gets the largest dividing multiple of 32 below it, else is zero-padded
            (see :mod:`.rtn`).
        symmetric: INT4 without zero points; None: the method's (signmax, grid: True,
            else False); signmax is symmetric only.
        embed_bits: 8 (INT8 per row; the default, None, for a quantizing conversion), 16
            or 32 for the embedding and an untied head (an import keeps them as stored).
        calib_path: plain-text calibration file; None -> data-free self-generated text.
        n_calib, calib_len: calibration sequences and their length (defaults: 32 x 512
            with a file, 8 x 128 data-free).
        seed: calibration seed (deterministic output for a given seed).
        act_order: GPTQ column order by activation (resolved at convert time, :mod:`.gptq`).
        n_search: AWQ token sample for its searches.
        progress: tqdm bar over layers (with ETA) on stderr.
        overwrite: replace an existing ``out_path`` (the CLI's ``--force``).
        true_sequential: GPTQ's Hessians from the inputs with the layer's earlier linears
            quantized, one forward per layer (:mod:`.gptq_sequential`); False: from the
            float layer.
        rotate: GPTQ (and GPTAQ) on the model with its residual stream and value heads
            rotated (:mod:`.rotate`; the head becomes its own INT8 table when it was tied);
            None: for GPTQ wherever the architecture allows it.
        gptq_grid: GPTQ's group-parameter rule (:data:`.gptq.GRIDS`); None: "mse".

    Returns:
        report dict: out_path, method, bits, group_size, file_size, bits_per_weight (all
        stored tensor bytes * 8 / weights, norms and embeddings included),
        convert_seconds, peak_rss_mib, calibration, awq_alpha (AWQ).

    Raises:
        ModelFormatError: unreadable source, non-finite weights (the tensor is named), an
            untied model without ``lm_head.weight``.
        ValueError: bad options (``rotate`` or ``gptq_grid`` with another method than GPTQ
            or GPTAQ; GPTAQ without ``true_sequential``).
        UnsupportedModelError: ``rotate`` on an architecture that cannot be rotated (the
            reason named).
        OutputError: ``out_path`` exists (without ``overwrite``), is the source (a GGUF,
            a file of the HF folder, the calibration text; also through a link) or a
            folder; no space, a read-only or unwritable folder. Nothing is left behind.
    """
    if not isinstance(src, ModelSource):
        from .import_packed import import_packed, is_packed_checkpoint

        if is_packed_checkpoint(src):
            return import_packed(src, out_path, embed_bits=embed_bits, overwrite=overwrite)
    embed_bits = 8 if embed_bits is None else embed_bits
    if bits != 4:
        raise ValueError(f"only 4-bit linear weights are supported by the converter, got {bits}")
    if method not in METHOD_LAYOUT:
        raise ValueError(f"unknown method {method!r}; choose {', '.join(METHOD_LAYOUT)}")
    group_size = METHOD_LAYOUT[method][0] if group_size is None else group_size
    symmetric = METHOD_LAYOUT[method][1] if symmetric is None else symmetric
    if method == "signmax" and not symmetric:
        raise ValueError("signmax is symmetric only (zero point 8): drop --no-symmetric, or "
                         "choose grid or rtn for asymmetric groups")
    asked, gptaq = method, method == "gptaq"
    method = "gptq" if gptaq else method  # GPTAQ is GPTQ on other targets
    if method != "gptq" and (rotate or gptq_grid is not None):
        raise ValueError(f"rotate and gptq_grid apply to methods 'gptq' and 'gptaq' only (the "
                         f"rotation pays through GPTQ's error compensation), not {method!r}; use "
                         f"method='gptq', or drop them")
    if gptaq and not true_sequential:
        raise ValueError("gptaq needs true_sequential (the float and quantized inputs of each "
                         "linear, row for row); drop true_sequential=False, or use 'gptq'")
    gptq_grid = "mse" if gptq_grid is None else gptq_grid
    if gptq_grid not in GPTQ_GRIDS:
        raise ValueError(f"unknown GPTQ grid {gptq_grid!r}; choose {' or '.join(GPTQ_GRIDS)}")
    t0 = time.perf_counter()
    source = _open(src)
    inputs = [str(source.path), calib_path]
    check_output(out_path, overwrite=overwrite, inputs=inputs)  # before minutes of work
    if rotate is None:
        rotate = method == "gptq" and rotation_refusal(source.config) is None
    if rotate:
        source = rotate_source(source, seed)  # ValueError naming why, where it cannot
    cfg = source.config
    if not cfg.tie_word_embeddings and "lm_head.weight" not in source.tensors:
        raise ModelFormatError(
            f"{source.path}: tie_word_embeddings is false but lm_head.weight is missing; fix the "
            f"config (set tie_word_embeddings: true if the head is the embedding) or the checkpoint")
    ids, calib_desc = None, "none (rtn needs no calibration)"
    if method == "mse" and calib_path is None:
        ids, calib_desc = random_ids(source, n_calib or 2, calib_len or 256, seed)
    elif method in ("rtn", "grid", "signmax"):
        calib_desc = f"none ({method} needs no calibration)"
    else:
        ids, calib_desc = calibration_ids(source, calib_path, n_calib, calib_len, seed, progress)

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.num_hidden_layers, desc=f"{asked} layers", unit="layer",
                   file=sys.stderr)
    try:
        with small_pages():
            tensors, info = quantize_layers(
                source, ids, method, bits=bits, group_size=group_size, symmetric=symmetric,
                act_order=act_order, n_search=n_search, true_sequential=true_sequential,
                gptq_grid=gptq_grid, gptaq=gptaq,
                on_layer=(lambda i: bar.update(1)) if bar else None)
    finally:
        if bar:
            bar.close()
    emb = check_finite("model.embed_tokens.weight", source.tensors["model.embed_tokens.weight"])
    tensors["model.embed_tokens.weight"] = _table(emb, embed_bits, "model.embed_tokens.weight")
    if cfg.tie_word_embeddings:
        if "lm_head.weight" in source.tensors:
            head = np.asarray(source.tensors["lm_head.weight"], np.float32)
            if head.shape != emb.shape or not np.array_equal(head, emb):
                log.warning("%s: tied embeddings but lm_head.weight differs from the embedding; "
                            "the head is ignored (the config says tied)", source.path)
    else:
        del emb  # one float32 vocabulary table in memory at a time
        head = check_finite("lm_head.weight", source.tensors["lm_head.weight"])
        tensors["lm_head.weight"] = _table(head, embed_bits, "lm_head.weight")
        del head
    emb = None
    tensors["model.norm.weight"] = check_finite("model.norm.weight", source.tensors["model.norm.weight"])
    src_path = str(source.path)
    provenance = {
        "source": src_path, "source_format": source.format,
        "source_sha256": _sha256(src_path) if os.path.exists(src_path) else None,
        "method": asked, "bits": bits, "group_size": group_size, "symmetric": symmetric,
        "group_rule": "requested size, else the largest multiple of 32 below it dividing "
                      "in_features, else zero-padded; per tensor in 'quantization'",
        "embed_bits": embed_bits, "act_order": act_order, "seed": seed,
        **({"true_sequential": true_sequential, "gptq_grid": gptq_grid,
            "gptaq": ({"alpha": ASYM_ALPHA, "ridge": ASYM_DAMP,
                       "float_sequences": min(ASYM_SEQUENCES, len(ids))} if gptaq else None),
            "rotation": ({"residual": "random orthogonal", "value_heads": "random orthogonal",
                          "seed": seed, "norms": "folded into the linears"} if rotate
                         else None)} if method == "gptq" else {}),
        "calibration": calib_desc,
    }
    if ids is not None and calib_path is None:
        provenance["calibration_ids"] = ids.tolist()  # the self-generated text, recorded
    size = write_eif(out_path, cfg, tensors, tokenizer_json=source.tokenizer_json,
                     chat_template=source.chat_template, bos_token=source.bos_token,
                     eos_token=source.eos_token, add_bos_token=source.add_bos_token,
                     generation=source.generation, provenance=provenance,
                     overwrite=overwrite, inputs=inputs)
    n_params = sum((t.out_features * t.in_features) if isinstance(t, QuantizedTensor) else t.size
                   for t in tensors.values())
    n_bytes = sum(t.nbytes for t in tensors.values())  # tensors only (no tokenizer/metadata)
    return {
        "out_path": str(out_path), "method": asked, "bits": bits, "group_size": group_size,
        "file_size": size, "bits_per_weight": round(8.0 * n_bytes / n_params, 4),
        "convert_seconds": round(time.perf_counter() - t0, 2), "peak_rss_mib": round(peak_rss_mib(), 1),
        "calibration": calib_desc, "awq_alpha": info.get("awq_alpha") or None,
    }
