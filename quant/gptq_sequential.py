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

Asymmetric calibration (GPTAQ, Li et al., ICML 2025, "GPTQv2"): with the float model's
inputs ``X`` of each linear beside the quantized model's ``X̃``, the objective is
``‖W Xᵀ − Ŵ X̃ᵀ‖²`` (match the float layer's output, absorbing the error of the layers
before) instead of ``‖(W − Ŵ) X̃ᵀ‖²``. Its minimiser over unconstrained ``Ŵ`` is
``W + W ΔXᵀ X̃ (X̃ᵀX̃)⁻¹`` (``ΔX = X − X̃``), and the objective equals GPTQ's on that target
plus a constant, so GPTQ runs unchanged on :func:`asymmetric_target` (a step of
``alpha`` toward it, ridge-regularized toward ``W``; GPTAQ scales the same term by its
``alpha``).
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

#: GPTAQ's step toward the least-squares target and its ridge (× mean diag H), chosen on
#: SmolLM2 (``benchmarks/MEASUREMENTS.md``: 32 × 512 calibration tokens overfit a full step).
ASYM_ALPHA = 0.5
ASYM_DAMP = 0.1
#: Calibration sequences carried through the float model for GPTAQ's cross term (the
#: first ones; the Hessians keep all): the float forward is a second forward per layer.
ASYM_SEQUENCES = 32

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
        #: the float model's input of each group in this layer (:func:`float_layer`), or
        #: None: plain GPTQ targets.
        self.float_inputs: dict[str, np.ndarray] | None = None

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
        H = h.H
        del h
        if self.float_inputs is not None:
            xf = self.float_inputs.pop(key)  # the first sequences' rows
            w = asymmetric_target(w, x[:len(xf)], xf, H)
        qt = self.solve(key, w, H)
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


def asymmetric_target(w: np.ndarray, xq: np.ndarray, xf: np.ndarray, H: np.ndarray,
                      alpha: float = ASYM_ALPHA, damp: float = ASYM_DAMP) -> np.ndarray:
    """GPTAQ's target for GPTQ: ``W + alpha · G (H + λI)⁻¹`` with
    ``G = (2/n) W ΔXᵀ X̃``, ``ΔX = xf − xq``, ``H = (2/N) X̃ᵀX̃`` and ``λ = damp · mean(diag H)``
    (the least-squares ``argmin ‖xf Wᵀ − xq Ŵᵀ‖² + λ' ‖Ŵ − W‖²`` at ``alpha`` 1 when
    ``H`` is of the same rows).

    Args:
        w: float32 ``[out, in]``; xq, xf: float32 ``[n, in]`` (the quantized and the float
            model's inputs, row for row); H: float64 ``[in, in]`` of ``xq`` (or of ``N ≥ n``
            rows of which ``xq`` is a sample).

    Returns:
        float32 ``[out, in]``.
    """
    from .gptq import _cholesky_with_inverse

    n, d_in = xq.shape
    out = w.shape[0]
    direct = 2 * out <= d_in  # (ΔX Wᵀ)ᵀ X̃: 2·n·in·out flops; else W (ΔXᵀ X̃): n·in² + out·in²
    acc = np.zeros((out, d_in) if direct else (d_in, d_in))
    for r in range(0, n, HESSIAN_ROWS):  # float32 products summed in float64, as the Hessian
        a = np.asarray(xq[r:r + HESSIAN_ROWS], np.float32)
        dx = np.asarray(xf[r:r + HESSIAN_ROWS], np.float32) - a
        acc += (dx @ w.T).T @ a if direct else dx.T @ a
    G = (acc if direct else w.astype(np.float64) @ acc) * (2.0 / n)
    lam = damp * float(np.mean(np.diag(H)))
    A = np.asarray(H, np.float32).copy()
    A[np.diag_indices(d_in)] += np.float32(lam if lam > 0 else 1e-8)
    _, Li = _cholesky_with_inverse(A)  # (H + λI)⁻¹ = L⁻ᵀ L⁻¹
    Z = (G.astype(np.float32) @ Li.T) @ Li
    return (w + np.float32(alpha) * Z).astype(np.float32)


def _whole_layer(be: CalibrationBackend, cfg, lw: dict, i: int, x: np.ndarray, rope,
                 capture: dict | None = None) -> np.ndarray:
    """Layer ``i`` (uploaded tensors ``lw``) on all sequences ``x [N, L, D]`` in one call:
    the output ``[N, L, D]`` float32; ``capture`` as :func:`.block.block_forward`."""
    n, L, D = x.shape
    cache = be.new_kv_cache(1, cfg.num_key_value_heads, cfg.head_dim, L)  # never written
    pos = np.tile(np.arange(L, dtype=np.int32), n)
    be.seq_len = L
    try:
        y = decoder_layer(be, cfg, lw, x.reshape(-1, D), pos, rope, cache, 0, i, capture=capture)
    finally:
        be.seq_len = None
    return np.asarray(y, np.float32).reshape(n, L, D)


def float_layer(be: CalibrationBackend, cfg, tensors_short: dict, i: int, x: np.ndarray,
                rope) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The float layer ``i`` on ``x [N, L, D]``: its output ``[N, L, D]`` and the input of
    each :data:`CAPTURE_GROUPS` key (float32 ``[N·L, in]``, copies)."""
    lw = {k: (be.upload_weight(np.asarray(v, np.float32)) if k in LINEAR_KEYS else be.upload(v))
          for k, v in tensors_short.items()}
    cap: dict = {}
    y = _whole_layer(be, cfg, lw, i, x, rope, cap)
    rows = x.shape[0] * x.shape[1]
    return y, {k: np.array(v, np.float32).reshape(rows, -1) for k, v in cap.items()}


def gptq_layer(be: SequentialGPTQBackend, cfg, tensors_short: dict, i: int, x: np.ndarray,
               rope, x_float: np.ndarray | None = None
               ) -> tuple[np.ndarray, dict, np.ndarray | None]:
    """Quantize layer ``i`` in one pass over the calibration sequences ``x [N, L, D]``
    (float32; ``tensors_short`` its float tensors by short name); with ``x_float`` (the
    float model's input to the layer), on GPTAQ's targets (:func:`asymmetric_target`).

    Returns:
        ``(y [N, L, D], q, y_float)``: the quantized layer's output, ``tensors_short`` with
        every linear replaced by its QuantizedTensor, and the float layer's output (None
        without ``x_float``).
    """
    y_float = None
    if x_float is not None:
        y_float, be.float_inputs = float_layer(be, cfg, tensors_short, i, x_float, rope)
    lw = {k: (_Float(k, np.ascontiguousarray(v, np.float32)) if k in LINEAR_KEYS
              else be.upload(v)) for k, v in tensors_short.items()}
    be.quantized = {}
    try:
        y = _whole_layer(be, cfg, lw, i, x, rope)
    finally:
        be.float_inputs = None
    q = dict(tensors_short)
    for key, members in CAPTURE_GROUPS.items():
        parts = split_rows(be.quantized[key], [tensors_short[m].shape[0] for m in members])
        q.update(zip(members, parts))
    return y, q, y_float
