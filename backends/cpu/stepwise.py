"""Decode (T = 1) of a block one op at a time on scratch, allocation-free: what runs when
the fused 4-bit Numba path of :mod:`.decode` does not apply, i.e. dense float32 weights (a
GGUF run as it is), blocks with QK-norm and / or sandwich norms (Gemma 3: the optional
norms of :class:`~..base.PreNormBlock`), 4-bit or dense, or mixed weight formats.

A Numba dense GEMV fused like :mod:`.fused` would save the ~15 Python calls per layer
(~1 us each) but round differently from the reference's BLAS (greedy tokens are compared
exactly); dense weights are the large, memory-bound case, where those calls are noise.

The contract's composition (:meth:`Backend.composed_block`) op for op on preallocated
scratch, with the backend's own kernels, so a step equals the CPU composition bit for bit
(tests/test_cpu_fused.py) and allocates nothing: each linear is the call
:meth:`CpuBackend.linear` makes at T = 1 written into scratch (dense float32: the BLAS
GEMV ``np.matmul(h, W.T, out=)``; 4-/8-bit: :func:`.gemv.gemv_quant` on the fused q/k/v
and gate/up weight of :meth:`CpuBackend.linear_many` when it fuses them, one weight at a
time when it does not); RMSNorm (QK-norm per head and the branch-output norms in place)
and RoPE of :mod:`.elementwise`; GLU by :func:`.elementwise.glu_into`; residual adds with
``out=``. The K/V append and attention between the halves are :mod:`.decode`'s, shared
with the plain blocks.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .elementwise import glu_into, rmsnorm_rows, rmsnorm_rows_par, rope_tokens
from .gemv import gemv_quant
from .repack import CpuQuantWeight


class StepwiseBlock(NamedTuple):
    """Prepared arguments and scratch of one layer's decode step. Linears are tuples of
    (input, W, output, bias or None): dense ``W.T`` with [1, n] rows, or a
    :class:`CpuQuantWeight` with 1-D rows. Scratch is shared by all layers (each stage is
    consumed within the step), ``xo`` (the output) with the other decode paths."""

    input_norm: np.ndarray  # [D]
    post_norm: np.ndarray  # [D]: before the MLP
    eps: float
    unit_offset: bool
    qk_norms: tuple  # ((rows view [H, hd], w [hd], rmsnorm kernel), ...) of q / k norms
    attn_out_norm: Any  # [D] or None
    mlp_out_norm: Any  # [D] or None
    act: Any  # the backend's ActScratch
    h: np.ndarray  # [1, D]: rmsnorm output (input norm, then pre-MLP norm)
    lin_qkv: tuple  # linears into ``qkv``
    qk: np.ndarray  # [1, Hq + Hkv, hd]: q and k (RoPE rotates both at once)
    q: np.ndarray  # [1, Hq, hd]
    k: np.ndarray  # [1, Hkv, hd]
    v: np.ndarray  # [1, Hkv, hd]
    cos: np.ndarray
    sin: np.ndarray
    a: np.ndarray  # [1, Hq hd]: attention output (written by decode.attend_*)
    lin_o: tuple
    o: np.ndarray  # [1, D]: Wo a, then Wd m
    xo: np.ndarray  # [1, D]: x + norm(Wo a), then the block's output
    lin_gu: tuple
    g: np.ndarray  # [1, F]
    u: np.ndarray  # [1, F]
    m: np.ndarray  # [1, F]
    gelu: bool
    lin_d: tuple


def _shape(w):
    """(out, in) of a weight this path runs, else None."""
    if w.__class__ is CpuQuantWeight:
        return w.out_features, w.in_features
    if (isinstance(w, np.ndarray) and w.dtype == np.float32 and w.ndim == 2
            and w.flags.c_contiguous):
        return w.shape
    return None


def _bias_ok(b, n):
    return b is None or (isinstance(b, np.ndarray) and b.dtype == np.float32
                         and b.shape == (n,) and b.flags.c_contiguous)


def _linears(be, x, ws, biases, y):
    """The linears of ``ws`` (sharing input x [1, n]) into the columns of y [1, sum out],
    as :meth:`CpuBackend.linear_many` runs them (fused when it fuses), or None."""
    key = tuple(map(id, ws)) + tuple(map(id, biases))
    f = be._fused.get(key)
    if f is None and len(ws) > 1:
        f = be._fused[key] = be._fuse(ws, biases)
    if f:
        if f[0].in_features != x.shape[1] or f[0].out_features != y.shape[1]:
            return None
        return ((x[0], f[0], y[0], f[1]),)
    out, c = [], 0
    for w, b in zip(ws, biases):
        s = _shape(w)
        if s is None or s[1] != x.shape[1] or not _bias_ok(b, s[0]):
            return None
        yw = y[:, c:c + s[0]]
        c += s[0]
        out.append((x[0], w, yw[0], b) if w.__class__ is CpuQuantWeight else (x, w.T, yw, b))
    return tuple(out) if c == y.shape[1] else None


def prep(be, blk):
    """(None, :class:`StepwiseBlock`, D, None, K view) for ``blk`` on backend ``be`` (the
    layout of :func:`.decode._prep_weights`), or False when a linear is neither dense
    float32 nor quantized of matching shape (then the composition runs)."""
    from . import _PAR_MIN_ELEMS, _is_gelu
    hq, hkv, hd = blk.heads
    d = blk.input_norm.shape[0]
    f = _shape(blk.w_gate)
    if f is None:
        return False
    f = f[0]
    y = be._scratch("nqkv", (1, (hq + 2 * hkv) * hd))
    h = be._scratch("dh", (1, d))
    a = be._scratch("attn", (1, hq * hd))
    o = be._scratch("do", (1, d))
    gu = be._scratch("ngu", (1, 2 * f))
    m = be._scratch("dm", (1, f))
    lin_qkv = _linears(be, h, blk.qkv, blk.qkv_bias, y)
    lin_o = _linears(be, a, [blk.wo], [None], o)
    lin_gu = _linears(be, h, [blk.w_gate, blk.w_up], [None, None], gu)
    lin_d = _linears(be, m, [blk.w_down], [None], o)
    if None in (lin_qkv, lin_o, lin_gu, lin_d):
        return False
    q = y[:, :hq * hd].reshape(1, hq, hd)
    k = y[:, hq * hd:(hq + hkv) * hd].reshape(1, hkv, hd)
    norms = tuple((t[0], w, rmsnorm_rows_par if t.size >= _PAR_MIN_ELEMS else rmsnorm_rows)
                  for t, w in ((q, blk.q_norm), (k, blk.k_norm)) if w is not None)
    p = StepwiseBlock(
        blk.input_norm, blk.post_norm, float(blk.eps), bool(blk.unit_offset), norms,
        blk.attn_out_norm, blk.mlp_out_norm, be._act, h, lin_qkv,
        y[:, :(hq + hkv) * hd].reshape(1, hq + hkv, hd), q, k,
        y[:, (hq + hkv) * hd:].reshape(1, hkv, hd), blk.cos, blk.sin, a, lin_o, o,
        be._scratch("xo", (1, d)), lin_gu, gu[:, :f], gu[:, f:], m, _is_gelu(blk.act),
        lin_d)
    return None, p, d, None, p.k


def _run(lins, act):
    for x, w, y, b in lins:
        if w.__class__ is CpuQuantWeight:
            gemv_quant(y, x, w, b, act)
        else:
            np.matmul(x, w, out=y)
            if b is not None:
                np.add(y, b, out=y)


def qkv(x, positions, p):
    """``h = rmsnorm(x)``; q, k, v = h @ W.T (+ b) into scratch; QK-norm per head in
    place; RoPE on q and k at ``positions`` (int32 [1]). Returns the (q, k, v) views."""
    rmsnorm_rows(p.h, x, p.input_norm, p.eps, p.unit_offset)
    _run(p.lin_qkv, p.act)
    for rows, w, fn in p.qk_norms:
        fn(rows, rows, w, p.eps, p.unit_offset)
    rope_tokens(p.qk, p.qk, p.cos, p.sin, positions)
    return p.q, p.k, p.v


def mlp(x, p):
    """After attention wrote ``p.a``: ``x1 = x + norm_o(a @ Wo.T)``, ``h = rmsnorm(x1)``,
    ``xo = x1 + norm_m(glu(h @ Wg.T, h @ Wu.T) @ Wd.T)`` (absent norms skipped). x float32
    [1, D] (may be ``p.xo``: in place); returns ``p.xo``."""
    xo, o, h, eps, off = p.xo, p.o, p.h, p.eps, p.unit_offset
    _run(p.lin_o, p.act)
    if p.attn_out_norm is not None:
        rmsnorm_rows(o, o, p.attn_out_norm, eps, off)
    np.add(x, o, out=xo)
    rmsnorm_rows(h, xo, p.post_norm, eps, off)
    _run(p.lin_gu, p.act)
    glu_into(p.m, p.g, p.u, p.gelu)
    _run(p.lin_d, p.act)
    if p.mlp_out_norm is not None:
        rmsnorm_rows(o, o, p.mlp_out_norm, eps, off)
    np.add(xo, o, out=xo)
    return xo
