"""GPTQ: second-order (OBQ-style) weight quantization with error compensation.

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", ICLR 2023 (Algorithm 1), following the reference
implementation's details (``gptq.py`` of IST-DASLab/gptq and AutoGPTQ):

* ``H = 2 XᵀX / n`` accumulated from calibration inputs (:class:`Hessian`);
* dead columns (``diag(H) == 0``: an input channel that is always zero) get ``H_jj = 1``
  and a zero weight;
* dampening ``λ = percdamp · mean(diag H)`` added to the diagonal (1% by default; raised
  ×10 and retried if the Cholesky factorization still fails);
* ``U = chol(H⁻¹)ᵀ`` (upper; computed as a reversed Cholesky's triangular inverse, see
  :func:`_inverse_cholesky_upper`), columns processed in blocks of ``blocksize`` (128) with the
  lazy batch update of §4 ("Lazy Batch-Updates") and the per-column update
  ``W[:, j:] -= (w_j - q_j) / U_jj · U_j,j:``;
* group parameters (scale/zero over ``group_size`` columns) computed when the first column
  of a group is reached, from the *already error-compensated* weights (as the reference
  does).

**act-order** (``desc_act``, columns processed by decreasing ``H_jj``) is resolved at
convert time with **static groups** (AutoGPTQ's ``static_groups=True``): the parameters of
every contiguous group in the *original* column order are computed up front from the
original weights; columns are then processed in permuted order, each quantized with the
parameters of its original group; finally codes are un-permuted. The result is an ordinary
contiguous-group tensor, exact for the runtime (no ``g_idx``, no activation permutation),
at the price that group ranges do not see the compensation updates (values pushed outside
are clamped to the edge code). This is the rule tested in ``tests/test_awq_gptq.py``.
"""
from __future__ import annotations

import numpy as np

from ..backends.quantized import QuantizedTensor
from .rtn import assemble, group_params, quantize_codes, resolve_group, storage_scales


class Hessian:
    """Running ``H = 2/n · Σ xᵀx`` over calibration rows (float64 ``[in, in]``).

    Call :meth:`add` with each batch of layer inputs ``x [..., in]``; ``n`` counts rows.
    """

    def __init__(self, in_features: int):
        self.H = np.zeros((in_features, in_features), np.float64)
        self.n = 0

    def add(self, x: np.ndarray) -> None:
        """Accumulate inputs ``x [..., in]`` (any float dtype)."""
        x = np.asarray(x, np.float32).reshape(-1, self.H.shape[0])
        m = x.shape[0]
        if m == 0:
            return
        self.H *= self.n / (self.n + m)
        self.n += m
        # the batch product in float32 (as the reference implementation), summed in float64
        self.H += (2.0 / self.n) * (x.T @ x).astype(np.float64)


def _tril_inverse(L: np.ndarray) -> np.ndarray:
    """Inverse of a lower-triangular matrix by blocked recursion (GEMMs; ~n³/3 flops):
    ``[[A, 0], [B, C]]⁻¹ = [[A⁻¹, 0], [−C⁻¹ B A⁻¹, C⁻¹]]``."""
    n = L.shape[0]
    if n <= 128:
        return np.linalg.inv(L)
    h = n // 2
    ai, ci = _tril_inverse(L[:h, :h]), _tril_inverse(L[h:, h:])
    out = np.zeros_like(L)
    out[:h, :h], out[h:, h:] = ai, ci
    out[h:, :h] = -(ci @ (L[h:, :h] @ ai))
    return out


def _inverse_cholesky_upper(H: np.ndarray, percdamp: float) -> np.ndarray:
    """Upper Cholesky factor ``U`` of ``(H + λI)⁻¹`` (``Uᵀ U = H⁻¹``), retrying with larger
    dampening if needed.

    Without forming ``H⁻¹``: with ``P`` the reversal permutation and ``P H P = M Mᵀ``
    (Cholesky), ``H⁻¹ = (P M⁻ᵀ P)(P M⁻¹ P)`` and ``P M⁻¹ P`` is upper triangular with a
    positive diagonal, so ``U = P M⁻¹ P``: one Cholesky and one triangular inverse
    (~2n³/3 flops instead of ~3n³ for inverse-then-Cholesky), in float32 as the reference
    implementation (torch ``cholesky_inverse`` / ``cholesky`` on float32).
    """
    damp = percdamp * float(np.mean(np.diag(H)))
    damp = damp if damp > 0 else 1e-8
    n = H.shape[0]
    for _ in range(6):
        try:
            Hd = (H + damp * np.eye(n)).astype(np.float32)  # float32, as the reference
            M = np.linalg.cholesky(Hd[::-1, ::-1])
            U = _tril_inverse(M)[::-1, ::-1].astype(np.float64)
            if not np.isfinite(U).all():
                raise np.linalg.LinAlgError("non-finite inverse factor")
            return np.ascontiguousarray(U)
        except np.linalg.LinAlgError:
            damp *= 10.0
    raise np.linalg.LinAlgError("GPTQ: Hessian is not positive definite even with dampening")


def gptq_quantize(w: np.ndarray, H: np.ndarray, bits: int = 4, group_size: int = 128,
                  symmetric: bool = False, *, act_order: bool = False, percdamp: float = 0.01,
                  blocksize: int = 128, name: str = "") -> QuantizedTensor:
    """Quantize ``w [out, in]`` with GPTQ given the input Hessian ``H [in, in]``.

    Args:
        w: float weight ``[out, in]`` (rows are independent, so several linears that share
            an input, e.g. q/k/v, may be stacked into one call).
        H: ``2 XᵀX / n`` of the layer inputs (float64 ``[in, in]``, see :class:`Hessian`).
        bits, group_size, symmetric: as :func:`~edgeinfer.quant.rtn.quantize_rtn`
            (``in % group_size != 0`` is zero-padded the same way).
        act_order: process columns by decreasing ``diag(H)`` with static groups (module doc).
        percdamp: dampening as a fraction of ``mean(diag H)``.
        blocksize: lazy-batch block width (rounded up to a multiple of the group size).
        name: tensor name for messages.

    Returns:
        QuantizedTensor with ``method="gptq"``.

    Raises:
        ValueError: shape mismatch or non-finite input.
    """
    W = np.array(w, np.float64)
    out, n_in = W.shape
    if H.shape != (n_in, n_in):
        raise ValueError(f"{name}: Hessian {H.shape} does not match weight {W.shape}")
    if not np.isfinite(W).all():
        raise ValueError(f"{name or 'weight'}: contains NaN or inf; cannot quantize")
    if bits != 4:
        raise ValueError("GPTQ here quantizes linear layers to 4 bits")
    g, in_pad = resolve_group(n_in, group_size, bits)
    n_groups = in_pad // g
    H = np.array(H, np.float64)
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    S = np.zeros((out, n_groups))  # scales in storage precision (float64 copy)
    Z = np.zeros((out, n_groups))
    have = np.zeros(n_groups, bool)

    def set_group(gi: int, cols: np.ndarray) -> None:
        s, z = group_params(cols, bits, symmetric)
        S[:, gi] = s[:, 0]  # already storage-rounded
        Z[:, gi] = z[:, 0]
        have[gi] = True

    if act_order:
        # static groups: parameters from the original contiguous groups, before any update
        Wp = np.zeros((out, in_pad))
        Wp[:, :n_in] = W
        s, z = group_params(Wp.reshape(out, n_groups, g), bits, symmetric)
        S[:], Z[:], have[:] = s, z, True
        perm = np.argsort(-np.diag(H), kind="stable")
    else:
        perm = np.arange(n_in)
    invperm = np.argsort(perm)
    W = W[:, perm]
    H = H[np.ix_(perm, perm)]
    U = _inverse_cholesky_upper(H, percdamp)
    Q = np.zeros((out, n_in))  # codes in permuted order
    bs = max(blocksize, g) // g * g

    for i1 in range(0, n_in, bs):
        i2 = min(i1 + bs, n_in)
        W1 = W[:, i1:i2].copy()
        Err1 = np.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            gi = perm[col] // g
            if not have[gi]:  # dynamic groups: the first column of a group is reached;
                # bs is a multiple of g, so the whole group lies in this block (W1 is current)
                set_group(gi, W1[:, i:i + g][:, None, :])
            wcol = W1[:, i]
            q = quantize_codes(wcol, S[:, gi], Z[:, gi], bits)
            Q[:, col] = q
            deq = (q - Z[:, gi]) * S[:, gi]
            err = (wcol - deq) / U1[i, i]
            W1[:, i:] -= np.outer(err, U1[i, i:])
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]

    scales = storage_scales(S, name)  # S already holds storage-rounded values: exact
    codes = np.empty((out, in_pad))
    codes[:, :n_in] = Q[:, invperm]
    if in_pad != n_in:
        codes[:, n_in:] = np.repeat(Z, g, axis=1)[:, n_in:]
    zeros = None if symmetric else Z
    return assemble(codes, scales, zeros, bits, g, n_in, "gptq")
