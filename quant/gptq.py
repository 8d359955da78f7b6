"""GPTQ: second-order (OBQ-style) weight quantization with error compensation.

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", ICLR 2023 (Algorithm 1), following the reference
implementation's details (``gptq.py`` of IST-DASLab/gptq and AutoGPTQ):

* ``H = 2 XᵀX / n`` accumulated from calibration inputs (:class:`Hessian`);
* dead columns (``diag(H) == 0``: an input channel that is always zero) get ``H_jj = 1``
  and a zero weight;
* dampening ``λ = percdamp · mean(diag H)`` added to the diagonal (1% by default; raised
  ×10 and retried if the Cholesky factorization still fails);
* ``U = chol(H⁻¹)ᵀ`` (upper), columns processed in blocks of 32 with the lazy batch
  update of §4 ("Lazy Batch-Updates") and the per-column update
  ``W[:, j:] -= (w_j - q_j) / U_jj · U_j,j:`` (done without ``U``: :func:`hessian_factor`);
* group parameters (scale/zero over ``group_size`` columns) computed when the first column
  of a group is reached, from the *already error-compensated* weights (as the reference
  does).
* ``grid="mse"``: those parameters chosen by :func:`~edgeinfer.quant.mse.search_group_params`
  with the columns' ``diag(H)`` as weights (the role of the reference implementation's
  ``Quantizer(mse=True)`` range search, with that module's candidates) instead of the
  group's min-max range.

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

import functools
import math

import numpy as np

from ..backends.quantized import QuantizedTensor
from ._compiled import compiled
from .mse import search_group_params
from .rtn import assemble, group_params, resolve_group, storage_scales

#: group-parameter rules: "minmax" (the reference implementation's quantizer: the group's
#: range, 0 included) or "mse" (:func:`~edgeinfer.quant.mse.search_group_params`, the
#: squared error weighted by ``diag(H)``: the clip search GPTQ's weights then round on)
GRIDS = ("minmax", "mse")


class Hessian:
    """Running ``H = 2/n · Σ xᵀx`` over calibration rows (float64 ``[in, in]``).

    Call :meth:`add` with each batch of layer inputs ``x [..., in]``; ``n`` counts rows.
    Rows are multiplied in batches: short adds are buffered until ``batch_rows`` rows are
    pending; an add with none pending multiplies its whole batches of ``batch_rows`` rows in
    place and buffers the rest. Each product is float32 (as the reference implementation; a symmetric rank-k update, numpy's
    ``x.T @ x``), summed in float64; :attr:`H` scales the sum once. With ``pool`` (a
    :class:`~edgeinfer.backends.cpu.gemm.GemmPool`), an add's whole batches are
    multiplied on its workers, one per worker at a time, and summed in order: the same
    values (each product is the same single-threaded call).
    """

    def __init__(self, in_features: int, batch_rows: int = 1024, pool=None):
        self._sum = np.zeros((in_features, in_features), np.float64)
        self._pending: list[np.ndarray] = []
        self._rows = 0
        self.batch_rows = batch_rows
        self.pool = pool
        self.n = 0

    @property
    def n_features(self) -> int:
        return self._sum.shape[0]

    def add(self, x: np.ndarray) -> None:
        """Accumulate inputs ``x [..., in]`` (any float dtype)."""
        x = np.asarray(x, np.float32).reshape(-1, self._sum.shape[0])
        if x.shape[0] == 0:
            return
        self.n += x.shape[0]
        b, r = self.batch_rows, 0
        if not self._pending:  # whole batches straight from x (no copy)
            r = len(x) - len(x) % b
            self._add_batches(x, range(0, r, b))
            if r == len(x):
                return
        rest = x[r:].copy()  # x may be a view of a buffer the caller reuses
        self._pending.append(rest)
        self._rows += len(rest)
        if self._rows >= b:
            self._flush()

    def _add_batches(self, x: np.ndarray, starts: range) -> None:
        """``_sum += xbᵀ xb`` for the batches ``x[r:r + batch_rows]``, ``r`` in ``starts``,
        in that order (the products on the pool's workers, a wave of one each)."""
        b, pool = self.batch_rows, self.pool
        threads = 1 if pool is None else pool.threads
        for w0 in range(0, len(starts), threads):
            wave = starts[w0:w0 + threads]
            prods: list = [None] * len(wave)

            def one(k):
                xb = np.ascontiguousarray(x[wave[k]:wave[k] + b])
                prods[k] = xb.T @ xb

            if len(wave) < 2:
                for k in range(len(wave)):
                    one(k)
            else:
                pool.run(one, range(len(wave)))
            for p in prods:
                self._sum += p

    def _flush(self) -> None:
        if self._pending:
            x = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
            self._sum += x.T @ x
            self._pending, self._rows = [], 0

    @property
    def H(self) -> np.ndarray:
        """``2/n · Σ xᵀx`` (float64 ``[in, in]``; zeros before any row)."""
        self._flush()
        return self._sum * (2.0 / self.n) if self.n else np.zeros_like(self._sum)


def _cholesky_with_inverse(A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(L, L⁻¹)`` with ``L Lᵀ = A`` (lower), by :func:`_cholesky` plus the inverse's
    off-diagonal block ``(L⁻¹)₂₁ = −L₂₂⁻¹ L₂₁ L₁₁⁻¹``."""
    n = A.shape[0]
    if n <= 192:
        L = np.linalg.cholesky(A)
        return L, np.linalg.inv(L)
    h = n // 2
    L11, I11 = _cholesky_with_inverse(A[:h, :h])
    L21 = A[h:, :h] @ I11.T
    L22, I22 = _cholesky_with_inverse(A[h:, h:] - L21 @ L21.T)
    L, Li = np.zeros_like(A), np.zeros_like(A)
    L[:h, :h], L[h:, :h], L[h:, h:] = L11, L21, L22
    Li[:h, :h], Li[h:, h:] = I11, I22
    Li[h:, :h] = -(I22 @ (L21 @ I11))
    return L, Li


def _cholesky(A: np.ndarray) -> np.ndarray:
    """Lower ``L`` with ``L Lᵀ = A`` by blocked recursion, all but the small diagonal blocks
    in GEMMs (numpy's LAPACK Cholesky runs at a fraction of GEMM speed):
    ``L₁₁ = chol(A₁₁)``, ``L₂₁ = A₂₁ L₁₁⁻ᵀ``, ``L₂₂ = chol(A₂₂ − L₂₁ L₂₁ᵀ)``.

    Raises:
        numpy.linalg.LinAlgError: ``A`` is not positive definite.
    """
    n = A.shape[0]
    if n <= 192:
        return np.linalg.cholesky(A)
    h = n // 2
    L11, I11 = _cholesky_with_inverse(A[:h, :h])
    L21 = A[h:, :h] @ I11.T
    L = np.zeros_like(A)
    L[:h, :h], L[h:, :h] = L11, L21
    L[h:, h:] = _cholesky(A[h:, h:] - L21 @ L21.T)
    return L


def hessian_factor(H: np.ndarray, perm: np.ndarray, percdamp: float) -> np.ndarray:
    """GPTQ's update factor for columns in order ``perm``: ``R̃ = R · diag(R)⁻¹`` (float32,
    upper, unit diagonal) where ``R Rᵀ = P(H + λI)Pᵀ`` with ``R`` upper, ``P`` the column
    permutation and ``λ = percdamp · mean(diag H)`` (raised ×10 and retried if the
    factorization fails).

    ``R`` is the reversed Cholesky factor (``J R J`` is lower for the reversal ``J``), and
    ``R⁻¹ = U`` is the upper Cholesky factor of ``H⁻¹`` that GPTQ's reference implementation
    forms (``Uᵀ U = H⁻¹``). With ``E = (W − Q) U⁻¹`` its per-column updates
    ``w'_k = w_k − Σ_{i<k} E_i U_ik`` are ``w'_k = w_k + Σ_{i<k} (w_i − q_i) R̃_ik``
    (``w`` the original columns, ``q`` the dequantized ones), so no inverse is needed: one
    Cholesky, ~n³/3 flops.

    Raises:
        numpy.linalg.LinAlgError: not positive definite even with dampening.
    """
    damp = percdamp * float(np.mean(np.diag(H)))
    damp = damp if damp > 0 else 1e-8
    n = H.shape[0]
    rev = perm[::-1]
    Hr = np.asarray(H, np.float32)[np.ix_(rev, rev)]  # J P H Pᵀ J
    diag = Hr[np.diag_indices(n)].copy()
    for _ in range(6):
        Hr[np.diag_indices(n)] = diag + np.float32(damp)
        try:
            R = _cholesky(Hr)[::-1, ::-1]
            if not np.isfinite(R).all():
                raise np.linalg.LinAlgError("non-finite factor")
            return np.ascontiguousarray(R / np.diag(R)[None, :])
        except np.linalg.LinAlgError:
            damp *= 10.0
    raise np.linalg.LinAlgError("GPTQ: Hessian is not positive definite even with dampening")


def _quantize_block_py(Wt, W0, Rb, S, Z, group_of, i1, i2, Qt, D):
    """Quantize columns ``i1:i2`` (rows of the transposed weights) in place, one after
    the other: column ``k`` gets the updates of the block's earlier columns,
    ``w'_k = Wt_k + Σ_{i<k} Rb_ik D_i``, is rounded with its group's ``(S, Z)`` into
    ``Qt_k``, and ``D_k = W0_k − (q − z) s`` (the original column minus its dequantized
    value) feeds the next. All float32 [.., out]; compiled by numba (:func:`_block_kernel`).
    The update sum runs over ``i`` in order; BLAS's matrix-vector product (the numpy form
    of this loop) may associate it differently, so codes may differ in rare ties."""
    out = Wt.shape[1]
    acc = np.empty(out, np.float32)
    lo, hi = np.float32(0.0), np.float32(15.0)
    for i in range(i2 - i1):
        j = i1 + i
        gi = group_of[j]
        acc[:] = np.float32(0.0)
        for p in range(i):
            c = Rb[p, i]
            for o in range(out):
                acc[o] += c * D[p, o]
        for o in range(out):
            s = S[gi, o]
            z = Z[gi, o]
            q = np.float32(np.rint((Wt[j, o] + acc[o]) / s)) + z
            q = min(max(q, lo), hi)
            Qt[j, o] = q
            D[i, o] = W0[j, o] - (q - z) * s


@functools.lru_cache(maxsize=1)
def _block_kernel():
    """:func:`_quantize_block_py` compiled (:func:`._compiled.compiled`)."""
    return compiled(_quantize_block_py)


def _inner_block(g: int, act_order: bool) -> int:
    """Width of the column blocks (32): with dynamic groups it must divide ``g`` so every
    group starts a block (its columns are then current, see :func:`gptq_quantize`)."""
    if act_order or g % 32 == 0:
        return 32
    return g if g < 32 else math.gcd(g, 32)


def _group_params(wg: np.ndarray, imp: np.ndarray, bits: int, symmetric: bool,
                  grid: str) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``(scale, zero)`` of ``wg [out, n_groups, g]`` by ``grid`` (:data:`GRIDS`);
    ``imp [n_groups, g]``: the columns' ``diag(H)`` (the "mse" search's weights)."""
    if grid == "minmax":
        return group_params(wg, bits, symmetric)
    s, z, _ = search_group_params(np.asarray(wg, np.float32), imp[None].astype(np.float32),
                                  symmetric)
    return s.astype(np.float64), z.astype(np.float64)


def gptq_quantize(w: np.ndarray, H: np.ndarray, bits: int = 4, group_size: int = 128,
                  symmetric: bool = False, *, act_order: bool = False, percdamp: float = 0.01,
                  grid: str = "minmax", name: str = "", pool=None) -> QuantizedTensor:
    """Quantize ``w [out, in]`` with GPTQ given the input Hessian ``H [in, in]``.

    Columns are processed in blocks of 32: inside a block, each column gets the updates of
    the block's earlier columns (:func:`hessian_factor`'s form; one compiled call per
    block, :func:`_quantize_block_py`) before it is rounded; after the block, one GEMM
    updates every later column (the paper's lazy batch update, §4). The result equals the
    column-by-column algorithm up to float32 rounding; weights, factor and updates are
    float32 (as the reference implementation). Work is done on ``Wᵀ`` so a column is a
    contiguous row.

    Args:
        w: float weight ``[out, in]`` (rows are independent, so several linears that share
            an input, e.g. q/k/v, may be stacked into one call).
        H: ``2 XᵀX / n`` of the layer inputs (float64 ``[in, in]``, see :class:`Hessian`).
        bits, group_size, symmetric: as :func:`~edgeinfer.quant.rtn.quantize_rtn`
            (``in % group_size != 0`` is zero-padded the same way).
        act_order: process columns by decreasing ``diag(H)`` with static groups (module doc).
        percdamp: dampening as a fraction of ``mean(diag H)``.
        grid: the group-parameter rule (:data:`GRIDS`).
        name: tensor name for messages.
        pool: a :class:`~edgeinfer.backends.cpu.gemm.GemmPool`: the factor on one worker,
            then the rows split in one slice per worker (rows are independent: the same
            codes as one slice, see ``tests/test_gptq_speed.py``).

    Returns:
        QuantizedTensor with ``method="gptq"``.

    Raises:
        ValueError: shape mismatch or non-finite input.
    """
    W = np.array(w, np.float32)
    out, n_in = W.shape
    if H.shape != (n_in, n_in):
        raise ValueError(f"{name}: Hessian {H.shape} does not match weight {W.shape}")
    if not np.isfinite(W).all():
        raise ValueError(f"{name or 'weight'}: contains NaN or inf; cannot quantize")
    if bits != 4:
        raise ValueError("GPTQ here quantizes linear layers to 4 bits")
    if grid not in GRIDS:
        raise ValueError(f"unknown grid {grid!r}; choose {' or '.join(GRIDS)}")
    g, in_pad = resolve_group(n_in, group_size, bits)
    n_groups = in_pad // g
    H = np.array(H, np.float32)
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    imp = np.zeros(in_pad, np.float32)  # padded columns weigh nothing
    imp[:n_in] = np.diag(H)
    imp = imp.reshape(n_groups, g)
    params = functools.partial(_group_params, bits=bits, symmetric=symmetric, grid=grid)
    # rows per worker when the rows are split over the pool (None: one call, this thread)
    split = None if pool is None or pool.threads < 2 or out < 2 * pool.threads else \
        -(-out // pool.threads)

    # group parameters, transposed [n_groups, out]: storage-rounded values (exact in float32)
    S = np.zeros((n_groups, out), np.float32)
    Z = np.zeros((n_groups, out), np.float32)
    if act_order:
        # static groups: parameters from the original contiguous groups, before any update
        Wp = np.zeros((out, in_pad))
        Wp[:, :n_in] = W
        W3 = Wp.reshape(out, n_groups, g)
        if grid == "minmax" or split is None:
            s, z = params(W3, imp)
        else:  # the search is rows apart: one slice per worker
            s, z = np.empty((out, n_groups)), np.empty((out, n_groups))

            def search(o0):
                s[o0:o0 + split], z[o0:o0 + split] = params(W3[o0:o0 + split], imp)

            pool.run(search, range(0, out, split))
        S[:], Z[:] = s.T, z.T
        perm = np.argsort(-np.diag(H), kind="stable")
    else:
        perm = np.arange(n_in)
    W0 = np.ascontiguousarray(W[:, perm].T)  # [n_in, out]: column j of W is row j here
    del W
    Qt = np.empty((n_in, out), np.float32)  # codes, permuted order
    loop = functools.partial(_column_loop, perm=perm, g=g, act_order=act_order,
                             params=params, imp=imp)
    if split is None:
        Rt = hessian_factor(H, perm, percdamp)
        del H
        loop(W0, Rt, S, Z, Qt)
    else:
        box = []
        pool.run(lambda _: box.append(hessian_factor(H, perm, percdamp)), [0])
        Rt = box[0]
        del H

        def part(o0):
            sl = slice(o0, min(o0 + split, out))
            s_, z_ = np.ascontiguousarray(S[:, sl]), np.ascontiguousarray(Z[:, sl])
            q_ = np.empty((n_in, s_.shape[1]), np.float32)
            loop(np.ascontiguousarray(W0[:, sl]), Rt, s_, z_, q_)
            S[:, sl], Z[:, sl], Qt[:, sl] = s_, z_, q_

        pool.run(part, range(0, out, split))

    S64, Z64 = S.T.astype(np.float64), Z.T.astype(np.float64)
    scales = storage_scales(S64, name)  # S holds storage-rounded values: exact
    codes = np.empty((out, in_pad), np.uint8)
    codes[:, perm] = Qt.T
    if in_pad != n_in:
        codes[:, n_in:] = np.repeat(Z64, g, axis=1)[:, n_in:]
    zeros = None if symmetric else Z64
    return assemble(codes, scales, zeros, bits, g, n_in, "gptq")


def _column_loop(W0, Rt, S, Z, Qt, *, perm, g, act_order, params, imp) -> None:
    """GPTQ's column loop over ``W0 [n_in, out]`` (the permuted, transposed weight, any
    subset of ``out``) with the factor ``Rt`` (:func:`hessian_factor`): fills the codes
    ``Qt [n_in, out]`` and, with dynamic groups, the group parameters ``S``, ``Z``
    ``[n_groups, out]`` (float32, storage-rounded) by ``params(wg, imp)``
    (:func:`_group_params` bound to the format and grid)."""
    n_in, out = W0.shape
    Wt = W0.copy()  # the columns with the updates of every finished block
    group_of = (perm // g).astype(np.int64)
    b = _inner_block(g, act_order)
    D = np.empty((b, out), np.float32)  # w - deq of the block's columns (original w)
    quantize_block = _block_kernel()
    for i1 in range(0, n_in, b):
        i2 = min(i1 + b, n_in)
        if not act_order and i1 % g == 0:
            # dynamic groups: parameters from the group's columns as the column-by-column
            # algorithm has them here, w_k − Σ_{j<i1} E_j U_jk. Wt holds w_k + Σ_{i<i1} D_i R̃_ik
            # instead (the same once every i < k is in); the two differ by the inverse of the
            # group's diagonal block of R̃ (U = R⁻¹ is triangular): one g x g inverse converts
            i3 = min(i1 + g, n_in)
            cur = W0[i1:i3] + np.linalg.inv(Rt[i1:i3, i1:i3]).T @ (Wt[i1:i3] - W0[i1:i3])
            s, z = params(cur.T.astype(np.float64)[:, None, :], imp[i1 // g:i1 // g + 1, :i3 - i1])
            S[i1 // g], Z[i1 // g] = s[:, 0], z[:, 0]
        quantize_block(Wt, W0, np.ascontiguousarray(Rt[i1:i2, i1:i2]), S, Z, group_of, i1, i2,
                       Qt, D)
        if i2 < n_in:
            Wt[i2:] += Rt[i1:i2, i2:].T @ D[:i2 - i1]
