"""Decode (T = 1) of a plain pre-norm block with dense float32 weights, allocation-free.

Dense weights (a GGUF's F32 / F16 / BF16 tensors dequantized at load, float32
safetensors) have no integer kernels to fuse into (:mod:`.fused` is 4-bit only). Here each
linear is the BLAS GEMV of :meth:`CpuBackend.linear` (``h @ W.T``, same shapes and
layouts) written into preallocated scratch with ``np.matmul(..., out=)``, and the other
ops are the backend's own kernels on scratch: RMSNorm and RoPE of :mod:`.elementwise`
(RoPE in place: each pair is read before it is written), the GLU ufuncs of
:func:`.elementwise.glu_into`, residual adds with ``out=``. So a step gives the contract's
composition bit for bit (tests/test_cpu_fused.py) and allocates nothing; the K/V append
and attention between the halves are :mod:`.decode`'s (shared with the 4-bit path).

A Numba dense GEMV fused like :mod:`.fused` would save the ~15 Python calls per layer
(~1 us each), but would round differently from the reference's BLAS (greedy tokens are
compared exactly) and compete with OpenBLAS's threads; dense weights are the large,
memory-bound case, where those calls are noise.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .elementwise import glu_into, rmsnorm_rows, rope_tokens


class DenseBlock(NamedTuple):
    """Prepared arguments and scratch of one layer's dense decode step (float32 arrays;
    ``W.T`` are transposed views of the weights, built once). Scratch is shared by all
    layers of a backend (each stage is consumed within the step), except ``xo``: the
    block's output, also :meth:`CpuBackend.attention_output_mlp`'s 4-bit result buffer."""

    input_norm: np.ndarray  # [D]
    post_norm: np.ndarray  # [D]
    eps: float
    unit_offset: bool
    h: np.ndarray  # [1, D]: rmsnorm output (input norm, then post-attention norm)
    gemv_qkv: tuple  # ((Wq.T, out [1, Hq hd], bias or None), K, V): out views of ``qkv``
    qk: np.ndarray  # [1, Hq + Hkv, hd]: q and k of ``qkv`` (RoPE rotates both at once)
    q: np.ndarray  # [1, Hq, hd]
    k: np.ndarray  # [1, Hkv, hd]
    v: np.ndarray  # [1, Hkv, hd]
    cos: np.ndarray  # [P, r/2]
    sin: np.ndarray  # [P, r/2]
    a: np.ndarray  # [1, Hq hd]: attention output (written by decode.attend_*)
    wo_t: np.ndarray  # [Hq hd, D]
    o: np.ndarray  # [1, D]: Wo a, then Wd m
    xo: np.ndarray  # [1, D]: x + Wo a, then the block's output
    wg_t: np.ndarray  # [D, F]
    wu_t: np.ndarray  # [D, F]
    g: np.ndarray  # [1, F]
    u: np.ndarray  # [1, F]
    m: np.ndarray  # [1, F]: act(g) * u
    gelu: bool
    wd_t: np.ndarray  # [F, D]


def _dense(w, rows, cols):
    """w is an uploaded dense weight [rows, cols]: float32 C-contiguous ndarray (a float32
    memmap included), so ``h @ w.T`` goes straight to BLAS without a copy."""
    return (isinstance(w, np.ndarray) and w.dtype == np.float32 and w.shape == (rows, cols)
            and w.flags.c_contiguous)


def prep(be, blk):
    """(None, :class:`DenseBlock`, D, None, K view) for ``blk`` on backend ``be`` (the
    layout of :func:`.decode._prep_weights`, None marking dense), or False when its
    linears are not all dense float32 of matching shapes (then the composition runs)."""
    from . import _is_gelu
    hq, hkv, hd = blk.heads
    d = blk.wo.shape[0] if isinstance(blk.wo, np.ndarray) else -1
    f = blk.w_gate.shape[0] if isinstance(blk.w_gate, np.ndarray) else -1
    rows = (hq * hd, hkv * hd, hkv * hd)
    if not (all(_dense(w, r, d) for w, r in zip(blk.qkv, rows)) and _dense(blk.wo, d, hq * hd)
            and _dense(blk.w_gate, f, d) and _dense(blk.w_up, f, d)
            and _dense(blk.w_down, d, f)
            and all(b is None or (isinstance(b, np.ndarray) and b.dtype == np.float32
                                  and b.shape == (r,)) for b, r in zip(blk.qkv_bias, rows))):
        return False
    y = be._scratch("dqkv", (1, (hq + 2 * hkv) * hd))
    ends = np.cumsum((0,) + rows)
    gemv = tuple((w.T, y[:, a:b], bias)
                 for w, a, b, bias in zip(blk.qkv, ends[:-1], ends[1:], blk.qkv_bias))
    gu = be._scratch("dgu", (2, f))  # gate and up rows (each a C-contiguous [1, F])
    p = DenseBlock(
        blk.input_norm, blk.post_norm, float(blk.eps), bool(blk.unit_offset),
        be._scratch("dh", (1, d)), gemv, y[:, :(hq + hkv) * hd].reshape(1, hq + hkv, hd),
        y[:, :ends[1]].reshape(1, hq, hd), y[:, ends[1]:ends[2]].reshape(1, hkv, hd),
        y[:, ends[2]:].reshape(1, hkv, hd), blk.cos, blk.sin,
        be._scratch("attn", (1, hq * hd)), blk.wo.T, be._scratch("do", (1, d)),
        be._scratch("xo", (1, d)), blk.w_gate.T, blk.w_up.T, gu[0:1], gu[1:2],
        be._scratch("dm", (1, f)), _is_gelu(blk.act), blk.w_down.T)
    return None, p, d, None, p.k


def qkv(x, positions, p):
    """``h = rmsnorm(x)``; q, k, v = h @ W.T (+ b) into scratch; RoPE on q and k at
    ``positions`` (int32 [1]). x float32 [1, D]. Returns the (q, k, v) views of ``p``."""
    h = p.h
    rmsnorm_rows(h, x, p.input_norm, p.eps, p.unit_offset)
    for wt, y, b in p.gemv_qkv:
        np.matmul(h, wt, out=y)
        if b is not None:
            np.add(y, b, out=y)
    rope_tokens(p.qk, p.qk, p.cos, p.sin, positions)
    return p.q, p.k, p.v


def mlp(x, p):
    """After attention wrote ``p.a``: ``x1 = x + a @ Wo.T``, ``h = rmsnorm(x1)``,
    ``xo = x1 + glu(h @ Wg.T, h @ Wu.T) @ Wd.T``. x float32 [1, D] (may be ``p.xo``: in
    place); returns ``p.xo``."""
    xo, o, h = p.xo, p.o, p.h
    np.matmul(p.a, p.wo_t, out=o)
    np.add(x, o, out=xo)
    rmsnorm_rows(h, xo, p.post_norm, p.eps, p.unit_offset)
    np.matmul(h, p.wg_t, out=p.g)
    np.matmul(h, p.wu_t, out=p.u)
    glu_into(p.m, p.g, p.u, p.gelu)
    np.matmul(p.m, p.wd_t, out=o)
    np.add(xo, o, out=xo)
    return xo
