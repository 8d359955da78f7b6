"""The halves of a decode step (T = 1) one op at a time on scratch, allocation-free: what a
:mod:`.plan` runs where the fused 4-bit halves of :mod:`.fused` do not apply (dense float32
weights, as a GGUF runs; QK-norm and sandwich norms, Gemma 3; mixed weight formats).

Op for op the model's composition (:func:`edgeinfer.models.block.block_forward`) with the
kernels :class:`CpuBackend` runs at T = 1, written into scratch, so a step equals the
composition bit for bit: each linear is the BLAS GEMV ``np.matmul(h, W.T, out=)`` (dense
float32) or :func:`.gemv.gemv_quant` (on the fused q/k/v and gate/up weight where the
group has one); RMSNorm and RoPE of :mod:`.elementwise`; GLU by
:func:`.elementwise.glu_into`; residual adds with ``out=``. A fused dense GEMV would save
~15 Python calls per layer but round differently from the BLAS the composition uses.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .elementwise import PAR_MIN_ELEMS, glu_into, is_gelu, rmsnorm_rows, rmsnorm_rows_par, rope_tokens
from .gemv import gemv_quant
from .repack import CpuQuantWeight


class StepwiseBlock(NamedTuple):
    """Prepared arguments and scratch of one layer's decode halves. Linears are tuples of
    (input, W, output, bias or None): dense ``W.T`` with [1, n] rows, or a
    :class:`CpuQuantWeight` with 1-D rows. Scratch is shared by all layers (each stage is
    consumed within the step); ``xo`` (the output) and ``a`` with the fused halves."""

    input_norm: np.ndarray  # [D]
    mlp_norm: np.ndarray  # [D]: before the MLP
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
    a: np.ndarray  # [1, Hq hd]: attention output (written by the plan's attention)
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


def _linears(x, ws, biases, fused, y):
    """The linears of ``ws`` (sharing input x [1, n]) into the columns of y [1, sum out],
    as :meth:`CpuBackend.linear_many` runs them (``fused`` = (weight, bias) of the group's
    fused copy, or None), or None when a weight is neither dense float32 nor repacked."""
    if fused is not None:
        w, b = fused
        if w.in_features != x.shape[1] or w.out_features != y.shape[1]:
            return None
        return ((x[0], w, y[0], b),)
    out, c = [], 0
    for w, b in zip(ws, biases):
        s = _shape(w)
        if s is None or s[1] != x.shape[1] or not _bias_ok(b, s[0]):
            return None
        yw = y[:, c:c + s[0]]
        c += s[0]
        out.append((x[0], w, yw[0], b) if w.__class__ is CpuQuantWeight else (x, w.T, yw, b))
    return tuple(out) if c == y.shape[1] else None


def _group(g):
    """(weights, biases, fused (weight, bias) or None) of a LinearGroup."""
    f = getattr(g, "weight", None)
    return g.weights, g.biases, None if f is None else (f, g.bias)


def prepare(be, blk, qkv_out: np.ndarray) -> StepwiseBlock | None:
    """The :class:`StepwiseBlock` of ``blk`` (a DecoderBlock) on backend ``be``; q/k/v go
    into ``qkv_out`` [1, (Hq + 2 Hkv) hd] (shared with the fused half). None when a linear
    is neither dense float32 nor repacked of matching shape."""
    hq, hkv, hd = blk.heads
    d = blk.input_norm.shape[0]
    f = _shape(blk.gate_up.weights[0])
    if f is None:
        return None
    f = f[0]
    h = be.scratch("dh", (1, d))
    a = be.scratch("attn", (1, hq * hd))
    o = be.scratch("do", (1, d))
    gu = be.scratch("ngu", (1, 2 * f))
    m = be.scratch("dm", (1, f))
    lin_qkv = _linears(h, *_group(blk.qkv), qkv_out)
    lin_o = _linears(a, [blk.wo], [None], None, o)
    lin_gu = _linears(h, *_group(blk.gate_up), gu)
    lin_d = _linears(m, [blk.w_down], [None], None, o)
    if None in (lin_qkv, lin_o, lin_gu, lin_d):
        return None
    y = qkv_out
    q = y[:, :hq * hd].reshape(1, hq, hd)
    k = y[:, hq * hd:(hq + hkv) * hd].reshape(1, hkv, hd)
    norms = tuple((t[0], w, rmsnorm_rows_par if t.size >= PAR_MIN_ELEMS else rmsnorm_rows)
                  for t, w in ((q, blk.q_norm), (k, blk.k_norm)) if w is not None)
    return StepwiseBlock(
        blk.input_norm, blk.mlp_norm, float(blk.eps), bool(blk.unit_offset), norms,
        blk.attn_out_norm, blk.mlp_out_norm, be.act_scratch, h, lin_qkv,
        y[:, :(hq + hkv) * hd].reshape(1, hq + hkv, hd), q, k,
        y[:, (hq + hkv) * hd:].reshape(1, hkv, hd), blk.cos, blk.sin, a, lin_o, o,
        be.scratch("xo", (1, d)), lin_gu, gu[:, :f], gu[:, f:], m, is_gelu(blk.act),
        lin_d)


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
    """After the attention wrote ``p.a``: ``x1 = x + norm_o(a @ Wo.T)``, ``h = rmsnorm(x1)``,
    ``xo = x1 + norm_m(glu(h @ Wg.T, h @ Wu.T) @ Wd.T)`` (absent norms skipped). x float32
    [1, D] (may be ``p.xo``: in place); returns ``p.xo``."""
    xo, o, h, eps, off = p.xo, p.o, p.h, p.eps, p.unit_offset
    _run(p.lin_o, p.act)
    if p.attn_out_norm is not None:
        rmsnorm_rows(o, o, p.attn_out_norm, eps, off)
    np.add(x, o, out=xo)
    rmsnorm_rows(h, xo, p.mlp_norm, eps, off)
    _run(p.lin_gu, p.act)
    glu_into(p.m, p.g, p.u, p.gelu)
    _run(p.lin_d, p.act)
    if p.mlp_out_norm is not None:
        rmsnorm_rows(o, o, p.mlp_out_norm, eps, off)
    np.add(xo, o, out=xo)
    return xo
