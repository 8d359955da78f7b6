"""GPTQ and AutoAWQ GEMM checkpoints: their packed linears re-laid as :class:`QuantizedTensor`.

A lossless re-layout, no re-quantization: the codes, zero points and fp16 scales are moved
into edgeinfer's layout (:mod:`edgeinfer.backends.quantized`: nibbles along the input,
low first; groups of consecutive input columns), so ``QuantizedTensor.dequantize()``
equals the checkpoint's own ``W[o, i] = scales[g, o] * (q[i, o] - z[g, o])`` bit for bit
(computed in float32, where the product of a 4-bit integer and an fp16 scale is exact;
torch's fp16 reference dequantization rounds that product to fp16 again).

GPTQ (AutoGPTQ, GPTQModel, transformers' GPTQ integration), per linear ``P``:

* ``P.qweight`` int32 ``[in / 8, out]``: the code of input ``8r + k`` in bits
  ``4k .. 4k + 3`` of row ``r`` (sequential order);
* ``P.qzeros`` int32 ``[n_groups, out / 8]``: the zero of output ``8c + k`` in bits
  ``4k ..`` of column ``c``; ``checkpoint_format`` ``gptq`` (v1, the default) stores
  ``z - 1`` and is read as AutoGPTQ reads it, ``z = (nibble & 15) + 1`` (1 .. 16);
  ``gptq_v2`` stores ``z``;
* ``P.scales`` fp16 ``[n_groups, out]``; ``P.g_idx`` int32 ``[in]`` (optional): the group
  of each input column, ``n_groups = ceil(in / group_size)``.

AutoAWQ GEMM (``WQLinear_GEMM``), per linear ``P``: ``P.qweight`` int32 ``[in, out / 8]``
and ``P.qzeros`` int32 ``[n_groups, out / 8]`` both packed along the output with AWQ's
order: nibble ``k`` of word ``c`` holds output ``8c + AWQ_ORDER[k]``; ``z`` stored as is;
``P.scales`` fp16 ``[n_groups, out]``; the group of input ``i`` is ``i // group_size``.

What edgeinfer's layout cannot hold exactly is refused, naming the tensor and the fix:

* **act-order** ``g_idx`` (``desc_act``: columns assigned to groups out of order). Groups
  here are contiguous runs of input columns and the runtime has no input permutation (a
  gather of ``x`` before every q/k/v and gate/up matmul would be needed; permuting the
  producer's output instead changes the residual stream), so only the trivial
  ``g_idx == arange(in) // group_size`` is read (also what ``static_groups`` writes).
  Fix: re-export with ``desc_act=False`` / ``static_groups=True``, or convert the float
  model with ``edgeinfer convert --method gptq`` (its act-order is resolved at convert time).
* a v1 zero point 16 (stored nibble 15: AutoGPTQ packs ``z = 0`` as ``-1``) in a group that
  uses code 0: nibble zero points are 0..15. A group with ``z = 16`` and no code 0 is
  re-expressed exactly as ``z = 15`` and codes ``- 1`` (the same integers ``q - z``).
* bits other than 4, AWQ ``version`` other than GEMM, AWQ without zero points.

Rows whose width the group does not divide are padded to whole groups with the group's
zero point as code (padded columns dequantize to exactly 0, as the layout requires).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..backends.quantized import SYMMETRIC_ZERO_4BIT, QuantizedTensor, pack_nibbles
from ..errors import ModelFormatError, UnsupportedModelError
from .export_gptq import unpack_int32

#: AutoAWQ's pack order: nibble ``k`` of a word holds output column ``8c + AWQ_ORDER[k]``.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: 4-bit codes per int32 word.
PACK = 8
_INT_DTYPES = ("I32", "U32")
_SCALE_DTYPES = ("F16", "BF16", "F32")


def unpack_awq(words: np.ndarray) -> np.ndarray:
    """AutoAWQ words ``[rows, cols]`` (int32) -> codes uint8 ``[rows, 8 * cols]`` in output
    order (undoes :data:`AWQ_ORDER`)."""
    nib = unpack_int32(words, axis=1).reshape(words.shape[0], -1, PACK)  # nibble order
    out = np.empty_like(nib)
    out[:, :, list(AWQ_ORDER)] = nib  # nibble k -> output AWQ_ORDER[k]
    return out.reshape(words.shape[0], -1)


def _bad(where: str, name: str, why: str, fix: str = "the checkpoint is damaged or not the "
         "format its config names; re-download or re-export it") -> ModelFormatError:
    return ModelFormatError(f"{where}: {name}: {why}; {fix}")


@dataclass(frozen=True)
class PackedLayout:
    """One checkpoint's packing (implements ``edgeinfer.readers.hf.PackedLinears``).

    Attributes:
        kind: "gptq" or "awq".
        group_size: input columns per group, -1 per-channel (one group per row).
        sym: GPTQ ``sym``: every zero point must be 8 (stored without zeros here).
        zero_offset: added to a stored zero nibble (GPTQ v1: 1; v2 and AWQ: 0).
        label: the format for messages and provenance ("gptq v1", "gptq_v2", "awq gemm").
    """

    kind: str
    group_size: int
    sym: bool
    zero_offset: int
    label: str

    @property
    def parts(self) -> tuple[str, ...]:
        return (".qweight", ".qzeros", ".scales", ".g_idx") if self.kind == "gptq" else \
            (".qweight", ".qzeros", ".scales")

    # ---- shapes, without reading data ------------------------------------------------------
    def _group(self, n_in: int) -> int:
        return n_in + n_in % 2 if self.group_size == -1 else self.group_size

    def shape(self, prefix: str, metas: dict[str, tuple[str, tuple[int, ...]]],
              where: str) -> tuple[int, int]:
        """The logical ``(out, in)`` of ``prefix.weight`` from its parts' dtypes and shapes.

        Raises:
            ModelFormatError: a missing part, a wrong dtype, or shapes that disagree.
        """
        need = (".qweight", ".scales") + (() if self.sym and self.kind == "gptq" else (".qzeros",))
        for p in need:
            if p not in metas:
                raise _bad(where, prefix + p, f"missing: a {self.label} linear needs "
                           f"{', '.join(prefix + q for q in need)}")
        for p, (dt, shp) in metas.items():
            ok = _SCALE_DTYPES if p == ".scales" else _INT_DTYPES
            if dt not in ok or len(shp) != (1 if p == ".g_idx" else 2):
                raise _bad(where, prefix + p, f"{dt} {list(shp)}, expected a "
                           f"{'1' if p == '.g_idx' else '2'}-D {' / '.join(ok)} tensor")
        qw = metas[".qweight"][1]
        out, n_in = (qw[1], PACK * qw[0]) if self.kind == "gptq" else (PACK * qw[1], qw[0])
        if out == 0 or n_in == 0:
            raise _bad(where, prefix + ".qweight", f"empty shape {list(qw)}")
        if out % PACK:
            raise _bad(where, prefix + ".scales", f"{out} outputs is not a multiple of {PACK}, "
                       f"so qzeros cannot pack them")
        n_groups = -(-n_in // self._group(n_in))
        want = {".scales": (n_groups, out), ".qzeros": (n_groups, out // PACK),
                ".g_idx": (n_in,)}
        for p, w in want.items():
            if p in metas and tuple(metas[p][1]) != w:
                raise _bad(where, prefix + p, f"shape {list(metas[p][1])}, expected {list(w)} "
                           f"for a {out} x {n_in} weight (qweight {list(qw)}) in groups of "
                           f"{self.group_size} ({n_groups} groups)")
        return out, n_in

    # ---- data ------------------------------------------------------------------------------
    def load(self, prefix: str, arrays: dict[str, Callable[[], np.ndarray]],
             where: str) -> QuantizedTensor:
        """``prefix.weight`` as a QuantizedTensor (module docstring).

        Raises:
            ModelFormatError: non-finite scales, ``g_idx`` out of range, ``sym`` with zero
                points other than 8.
            UnsupportedModelError: an act-order ``g_idx``, or a v1 zero point 16 on a group
                that uses code 0 (module docstring).
        """
        name = prefix + ".weight"
        qw = arrays[".qweight"]()
        if self.kind == "gptq":
            codes = np.ascontiguousarray(unpack_int32(qw, axis=0).T)  # [out, in]
        else:
            codes = np.ascontiguousarray(unpack_awq(qw).T)
        out, n_in = codes.shape
        g = self._group(n_in)
        n_groups = -(-n_in // g)
        scales = self._scales(arrays[".scales"](), prefix, where)  # [out, n_groups]
        if ".g_idx" in arrays:
            self._check_g_idx(arrays[".g_idx"](), n_in, g, n_groups, prefix, where)
        if ".qzeros" in arrays:
            qz = arrays[".qzeros"]()
            nib = unpack_int32(qz, axis=1) if self.kind == "gptq" else unpack_awq(qz)
            zeros = nib.T.astype(np.int16) + self.zero_offset  # [out, n_groups], 0..16
        else:  # GPTQ sym without qzeros: the fixed zero point
            zeros = np.full((out, n_groups), SYMMETRIC_ZERO_4BIT, np.int16)
        in_padded = n_groups * g
        full = np.empty((out, in_padded), np.int16)
        full[:, :n_in] = codes
        full[:, n_in:] = zeros[:, -1:]  # padded columns: the zero point -> exactly 0
        grouped = full.reshape(out, n_groups, g)
        sixteen = zeros == 16
        if sixteen.any():  # v1 z = 16: z = 15 and codes - 1 where no code is 0
            uses0 = sixteen & (grouped.min(axis=2) == 0)
            if uses0.any():
                o, j = (int(v[0]) for v in np.nonzero(uses0))
                raise UnsupportedModelError(
                    f"{where}: {prefix}.qzeros: {int(uses0.sum())} group(s) (first: output {o}, "
                    f"group {j}) have zero point 16 (GPTQ v1 stores z - 1; a z = 0 packed as -1 "
                    f"reads back as 16) and use code 0, which a 4-bit zero point cannot hold; "
                    f"convert the float model instead (edgeinfer convert FLOAT_MODEL --method gptq)")
            grouped[sixteen] -= 1
            zeros = np.where(sixteen, 15, zeros)
        if self.sym:
            if (zeros != SYMMETRIC_ZERO_4BIT).any():
                o, j = (int(v[0]) for v in np.nonzero(zeros != SYMMETRIC_ZERO_4BIT))
                raise _bad(where, prefix + ".qzeros", f"the config says sym=true but output {o}, "
                           f"group {j} has zero point {int(zeros[o, j])} (not 8)")
            zp = None
        else:
            zp = pack_nibbles(zeros.astype(np.uint8))
        return QuantizedTensor(pack_nibbles(full.astype(np.uint8)), scales, zp, 4, g, n_in,
                               self.kind, {"imported": self.label})

    def _scales(self, s: np.ndarray, prefix: str, where: str) -> np.ndarray:
        """``[out, n_groups]`` float16, or float32 where a value is not an fp16 number."""
        if not np.isfinite(s).all():
            raise _bad(where, prefix + ".scales", f"{int((~np.isfinite(s)).sum())} non-finite "
                       f"value(s) (NaN/inf)")
        s = np.ascontiguousarray(s.T)
        if s.dtype == np.float16:
            return s
        with np.errstate(over="ignore"):
            h = s.astype(np.float16)
        return h if np.array_equal(h.astype(np.float32), s.astype(np.float32)) else \
            s.astype(np.float32)

    def _check_g_idx(self, g_idx: np.ndarray, n_in: int, g: int, n_groups: int, prefix: str,
                     where: str) -> None:
        gi = np.asarray(g_idx).astype(np.int64)
        if gi.min() < 0 or gi.max() >= n_groups:
            i = int(np.flatnonzero((gi < 0) | (gi >= n_groups))[0])
            raise _bad(where, prefix + ".g_idx", f"column {i} is in group {int(gi[i])}, outside "
                       f"0..{n_groups - 1}")
        trivial = np.arange(n_in, dtype=np.int64) // g
        if not np.array_equal(gi, trivial):
            i = int(np.flatnonzero(gi != trivial)[0])
            raise UnsupportedModelError(
                f"{where}: {prefix}.g_idx is an act-order grouping (desc_act: column {i} is in "
                f"group {int(gi[i])}, not {int(trivial[i])}); edgeinfer's groups are contiguous "
                f"columns and its runtime has no input permutation, so this cannot be re-laid "
                f"losslessly; re-export the checkpoint with desc_act=False (or static_groups="
                f"True), or convert the float model (edgeinfer convert FLOAT_MODEL --method gptq, "
                f"whose act-order is resolved at convert time)")


def _int(qc: dict, keys: tuple[str, ...], where: str, default: int | None = None) -> int:
    v = next((qc[k] for k in keys if k in qc), default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ModelFormatError(f"{where}: quantization_config {keys[0]!r} must be an integer, "
                               f"got {v!r}")
    return v


def packed_layout(qc: dict, where: str) -> PackedLayout:
    """The :class:`PackedLayout` a ``quantization_config`` (or ``quantize_config.json``) names.

    Raises:
        ModelFormatError: a missing or malformed field (group size 0, bits not an integer).
        UnsupportedModelError: a quant method other than GPTQ / AWQ, bits other than 4, a
            GPTQ ``checkpoint_format`` other than gptq / gptq_v2, an AWQ version other than
            GEMM or without zero points.
    """
    method = str(qc.get("quant_method", "gptq" if "desc_act" in qc else "")).lower()
    if method not in ("gptq", "awq"):
        raise UnsupportedModelError(f"{where}: quant_method {qc.get('quant_method')!r}: edgeinfer "
                                    f"imports GPTQ and AutoAWQ GEMM checkpoints; convert the float "
                                    f"model instead (edgeinfer convert FLOAT_MODEL -o MODEL.eif)")
    bits = _int(qc, ("bits", "w_bit"), where)
    if bits != 4:
        raise UnsupportedModelError(f"{where}: a {bits}-bit {method.upper()} checkpoint; edgeinfer "
                                    f"imports 4-bit checkpoints (re-quantize the float model with "
                                    f"edgeinfer convert FLOAT_MODEL --method {method})")
    group = _int(qc, ("group_size", "q_group_size"), where, 128)
    if group == 0 or group < -1:
        raise ModelFormatError(f"{where}: quantization_config group_size {group}: expected a "
                               f"positive number of columns or -1 (per-channel)")
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedModelError(f"{where}: GPTQ checkpoint_format {fmt!r}; edgeinfer reads "
                                        f"'gptq' (v1) and 'gptq_v2'; save it in one of those")
        sym = qc.get("sym", True)
        if not isinstance(sym, bool):
            raise ModelFormatError(f"{where}: quantization_config 'sym' must be true or false, "
                                   f"got {sym!r}")
        return PackedLayout("gptq", group, sym, 1 if fmt == "gptq" else 0,
                            "gptq v1" if fmt == "gptq" else "gptq_v2")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedModelError(f"{where}: AWQ version {qc.get('version')!r}; edgeinfer imports "
                                    f"AutoAWQ GEMM checkpoints (version 'gemm'); save it as GEMM")
    if qc.get("zero_point", True) is not True:
        raise UnsupportedModelError(f"{where}: AWQ without zero points (zero_point: false) is not "
                                    f"an AutoAWQ GEMM layout edgeinfer imports")
    return PackedLayout("awq", group, False, 0, "awq gemm")
