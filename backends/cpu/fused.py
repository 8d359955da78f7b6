"""Fused decode (T = 1) kernels: the two halves of a pre-norm decoder block around attention.

One Numba call per half instead of one Python call per op (a decode step is dozens of
small ops per layer, whose Python dispatch would be a large share of the step):

* :func:`qkv_rope` — ``h = rmsnorm(x)``; ``y = Wqkv @ h (+ b)`` (the fused q/k/v weight
  of :meth:`CpuBackend.group_linears`); RoPE on the q and k parts of ``y``, in place.
* :func:`out_mlp` — ``x1 = x + Wo @ a``; ``h = rmsnorm(x1)``; ``g, u = Wgu @ h``;
  ``m = act(g) * u``; ``x_out = x1 + Wd @ m``.

Each GEMV is the one of :mod:`.gemv` (15-bit activations per 32-block, integer dots, 4-row
blocks in ``prange``), and the norm, RoPE and GLU are the row kernels of :mod:`.elementwise`, so a
decode step computes bit for bit what a prefill computes for the same token.

``*_par`` variants split the rows of each GEMV across Numba's threads; ``*_ser`` run on
the calling thread (small weights, where a fork/join costs more than the work).
All arrays are float32 C-contiguous unless stated; all outputs are preallocated by the
caller (nothing is allocated here).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .elementwise import _rmsnorm_row, _rope_token, glu_row
from .gemv import _q4_block, _times, quantize_act


@njit(cache=True)
def glu_rows(m, gu, gelu):  # gu[2F] = [gate | up] -> m[F] = act(gate) * up
    """``m[i] = act(gu[i]) * gu[F + i]`` by :func:`.elementwise.glu_row` (prefill's GLU)."""
    f = m.shape[0]
    glu_row(m, gu[:f], gu[f:], gelu)


@njit(cache=True, fastmath=True, inline="always")
def _rope_qk(y, cos, sin, pos, nq, nk, hd):  # RoPE on y[:nq*hd] and y[nq*hd:(nq+nk)*hd]
    q = y[:nq * hd].reshape((nq, hd))
    _rope_token(q, q, cos, sin, pos)
    k = y[nq * hd:(nq + nk) * hd].reshape((nk, hd))
    _rope_token(k, k, cos, sin, pos)


@njit(parallel=True, cache=True, fastmath=True)
def qkv_rope_par(y, x, nw, eps, off, h, w, bias, act, cos, sin, pos, nq, nk, hd):
    """``y[(nq + 2 nk) * hd] = RoPE_qk(Wqkv @ rmsnorm(x[0]) + bias)``, rows across threads.

    ``x`` [1, D]; ``nw``, ``h`` (scratch) [D]; ``w`` = (wp, sc, sz, bmap, zero_scale) of the fused
    4-bit weight (:class:`~.repack.CpuQuantWeight` arrays; the group sums are scaled by
    ``zero_scale``, 1 or 8); ``bias`` [rows] or [0]; ``act`` = (xq, dx, xg) scratch for D inputs;
    ``cos``/``sin`` [P, r/2]; ``pos`` int position.
    """
    wp, sc, sz, bmap, zm = w
    xq, dx, xg = act
    _rmsnorm_row(h, x[0], nw, np.float32(eps), off)
    quantize_act(xq, dx, xg, h, bmap)
    _times(xg, zm)
    out = y.shape[0]
    nblk = out // 4
    for i in prange(nblk + out - nblk * 4):
        _q4_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg)
    _rope_qk(y, cos, sin, pos, nq, nk, hd)


@njit(cache=True, fastmath=True)
def qkv_rope_ser(y, x, nw, eps, off, h, w, bias, act, cos, sin, pos, nq, nk, hd):
    """As :func:`qkv_rope_par` on the calling thread."""
    wp, sc, sz, bmap, zm = w
    xq, dx, xg = act
    _rmsnorm_row(h, x[0], nw, np.float32(eps), off)
    quantize_act(xq, dx, xg, h, bmap)
    _times(xg, zm)
    out = y.shape[0]
    nblk = out // 4
    for i in range(nblk + out - nblk * 4):
        _q4_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg)
    _rope_qk(y, cos, sin, pos, nq, nk, hd)


@njit(parallel=True, cache=True, fastmath=True)
def out_mlp_par(xo, x, a, nw, eps, off, gelu, wo, wgu, wd, act_a, act_h, act_m, nob, bias0):
    """``xo[0] = x1 + Wd @ act_glu(Wgu @ rmsnorm(x1))`` with ``x1 = x[0] + Wo @ a[0]``.

    ``xo``, ``x`` [1, D], ``a`` [1, Hq * hd]; ``xo`` may be ``x`` (in place). ``w*`` =
    (wp, sc, sz, bmap, zero_scale) of 4-bit weights; ``act_*`` =
    (xq, dx, xg) scratch for the inputs of Wo, Wgu, Wd; ``nob`` = (o [D], h [D],
    gu [2F], m [F]) float32 scratch; ``bias0`` float32 [0]. Rows across threads.
    """
    o, h, gu, m = nob
    wp, sc, sz, bmap, zm = wo
    xq, dx, xg = act_a
    quantize_act(xq, dx, xg, a[0], bmap)
    _times(xg, zm)
    n = o.shape[0]
    nblk = n // 4
    for i in prange(nblk + n - nblk * 4):
        _q4_block(i, nblk, o, wp, sc, sz, bmap, bias0, xq, dx, xg)
    for i in range(n):
        xo[0, i] = x[0, i] + o[i]
    _rmsnorm_row(h, xo[0], nw, np.float32(eps), off)
    wp, sc, sz, bmap, zm = wgu
    xq, dx, xg = act_h
    quantize_act(xq, dx, xg, h, bmap)
    _times(xg, zm)
    n2 = gu.shape[0]
    nblk2 = n2 // 4
    for i in prange(nblk2 + n2 - nblk2 * 4):
        _q4_block(i, nblk2, gu, wp, sc, sz, bmap, bias0, xq, dx, xg)
    glu_rows(m, gu, gelu)
    wp, sc, sz, bmap, zm = wd
    xq, dx, xg = act_m
    quantize_act(xq, dx, xg, m, bmap)
    _times(xg, zm)
    for i in prange(nblk + n - nblk * 4):
        _q4_block(i, nblk, o, wp, sc, sz, bmap, bias0, xq, dx, xg)
    for i in range(n):
        xo[0, i] += o[i]


@njit(cache=True, fastmath=True)
def out_mlp_ser(xo, x, a, nw, eps, off, gelu, wo, wgu, wd, act_a, act_h, act_m, nob, bias0):
    """As :func:`out_mlp_par` on the calling thread."""
    o, h, gu, m = nob
    wp, sc, sz, bmap, zm = wo
    xq, dx, xg = act_a
    quantize_act(xq, dx, xg, a[0], bmap)
    _times(xg, zm)
    n = o.shape[0]
    nblk = n // 4
    for i in range(nblk + n - nblk * 4):
        _q4_block(i, nblk, o, wp, sc, sz, bmap, bias0, xq, dx, xg)
    for i in range(n):
        xo[0, i] = x[0, i] + o[i]
    _rmsnorm_row(h, xo[0], nw, np.float32(eps), off)
    wp, sc, sz, bmap, zm = wgu
    xq, dx, xg = act_h
    quantize_act(xq, dx, xg, h, bmap)
    _times(xg, zm)
    n2 = gu.shape[0]
    nblk2 = n2 // 4
    for i in range(nblk2 + n2 - nblk2 * 4):
        _q4_block(i, nblk2, gu, wp, sc, sz, bmap, bias0, xq, dx, xg)
    glu_rows(m, gu, gelu)
    wp, sc, sz, bmap, zm = wd
    xq, dx, xg = act_m
    quantize_act(xq, dx, xg, m, bmap)
    _times(xg, zm)
    for i in range(nblk + n - nblk * 4):
        _q4_block(i, nblk, o, wp, sc, sz, bmap, bias0, xq, dx, xg)
    for i in range(n):
        xo[0, i] += o[i]
