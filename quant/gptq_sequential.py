"""GPTQ's true-sequential layer pass: one forward per layer, each linear quantized when
the block reaches it.

The reference implementation's ``--true-sequential`` order (IST-DASLab/gptq ``llama.py``;
AutoGPTQ's default ``true_sequential=True``): q/k/v, then o, then gate/up, then down, each
group's Hessian taken from its input as the block computes it with the *earlier groups
already quantized*. The reference runs one layer forward per group plus one for the
output; here it is one forward over all calibration tokens: :class:`SequentialGPTQBackend`
quantizes a linear (group) the first time the block calls it, from that call's whole
input, and computes the call with the quantized weights. The forward's output (the
quantized layer's) is the next layer's input, as in :func:`.calibrate.quantize_layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..backends.base import LinearGroup
from ..backends.quantized import QuantizedTensor
from ..models.families import CAPTURE_GROUPS, LINEAR_KEYS
from ..models.transformer import decoder_layer
from .calib_backend import CalibrationBackend
from .calibrate import split_rows
from .gptq import Hessian

#: Rows per float32 ``xᵀx`` product of the Hessians (summed in float64).
HESSIAN_ROWS = 4096

#: ``solve(key, w [out, in] float32, H [in, in] float64) -> QuantizedTensor``; ``key`` is
#: the :data:`CAPTURE_GROUPS` key, ``w`` its members' rows stacked in that order.
Solve = Callable[[str, np.ndarray, np.ndarray], QuantizedTensor]


@dataclass(frozen=True, eq=False)
class _Float:
    """A linear not yet quantized: short name and float32 weight ``[out, in]``."""

    short: str
    w: np.ndarray


@dataclass(frozen=True, eq=False)
class _FloatGroup(LinearGroup):
    """q/k/v or gate/up not yet quantized (``weights`` are :class:`_Float`)."""


class SequentialGPTQBackend(CalibrationBackend):
    """:class:`~.calib_backend.CalibrationBackend` whose linears given as :class:`_Float` are
    quantized by ``solve`` on first use (Hessian ``2 XᵀX / n`` of the call's input ``X``,
    all rows), then computed with the dequantized weights (as
    :meth:`~edgeinfer.backends.reference.ReferenceBackend.upload_weight` has them).
    :attr:`quantized` maps each capture key to its stacked QuantizedTensor."""

    def __init__(self, solve: Solve, pool=None):
        super().__init__(pool=pool)
        self.solve = solve
        self.quantized: dict[str, QuantizedTensor] = {}

    def group_linears(self, ws, biases):
        if isinstance(ws[0], _Float):
            return _FloatGroup(tuple(ws), tuple(biases))
        return super().group_linears(ws, biases)

    def _quantize(self, x: np.ndarray, members: tuple) -> np.ndarray:
        """Quantize ``members`` (rows stacked) on the Hessian of ``x [T, in]``; returns
        the dequantized stacked weight (float32)."""
        key = members[0].short
        if key in self.quantized:
            raise RuntimeError(f"{key} quantized twice in one layer pass")
        h = Hessian(x.shape[-1], batch_rows=HESSIAN_ROWS, pool=self.pool)
        h.add(x)
        w = members[0].w if len(members) == 1 else np.concatenate([m.w for m in members])
        qt = self.solve(key, w, h.H)
        del h
        self.quantized[key] = qt
        return qt.dequantize()

    def linear_many(self, x, group):
        if not isinstance(group, _FloatGroup):
            return super().linear_many(x, group)
        w = self._quantize(x, group.weights)
        b = None
        if any(v is not None for v in group.biases):
            b = np.concatenate([np.zeros(len(m.w), np.float32) if v is None else v
                                for m, v in zip(group.weights, group.biases)])
        y = self.linear(x, w, b)
        out, r = [], 0
        for m in group.weights:
            out.append(y[:, r:r + len(m.w)])
            r += len(m.w)
        return out

    def linear(self, x, w, bias=None):
        if isinstance(w, _Float):
            w = self._quantize(x, (w,))
        return super().linear(x, w, bias)


def gptq_layer(be: SequentialGPTQBackend, cfg, tensors_short: dict, i: int, x: np.ndarray,
               rope) -> tuple[np.ndarray, dict]:
    """Quantize layer ``i`` in one pass over the calibration sequences ``x [N, L, D]``
    (float32; ``tensors_short`` its float tensors by short name).

    Returns:
        ``(y [N, L, D], q)``: the quantized layer's output, and ``tensors_short`` with
        every linear replaced by its QuantizedTensor.
    """
    n, L, D = x.shape
    lw = {k: (_Float(k, np.ascontiguousarray(v, np.float32)) if k in LINEAR_KEYS
              else be.upload(v)) for k, v in tensors_short.items()}
    cache = be.new_kv_cache(1, cfg.num_key_value_heads, cfg.head_dim, L)  # never written
    pos = np.tile(np.arange(L, dtype=np.int32), n)
    be.quantized = {}
    be.seq_len = L
    try:
        y = decoder_layer(be, cfg, lw, x.reshape(-1, D), pos, rope, cache, 0, i)
    finally:
        be.seq_len = None
    q = dict(tensors_short)
    for key, members in CAPTURE_GROUPS.items():
        parts = split_rows(be.quantized[key], [tensors_short[m].shape[0] for m in members])
        q.update(zip(members, parts))
    return np.asarray(y, np.float32).reshape(n, L, D), q
