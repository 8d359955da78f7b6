"""Block-dot numerics of 4-bit weights (backends/cpu/_blockdot.py, _amx.py); the 8-bit
row kernels' float steps too (their GEMMs: tests/test_cpu_blockdot_q5_q8.py).

* The row kernels against an exact emulation of their documented float steps: integer
  block dots, then per row ``gacc = fma(float(D), dx, gacc)`` per block and ``acc =
  fma(gacc, sc, acc)`` per group (fma emulated in float64: a float32 product is exact
  there, so one float64 rounding then float32's; the seeds are fixed).
* The GEMM (AMX tiles where the OS grants them, else the row kernels per token) equals
  the GEMV row by row, bit for bit: T across and off the 16-token tiles, panels of 16
  rows with tails, groups of 32 / 96 / 128 / per-row, factored (Q4_K) scales, bias.
* On an AMX CPU the backend's 4-bit linear takes these paths for decode and prefill.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from numba import njit

from edgeinfer.backends.cpu import CpuBackend, _amx, _blockdot, _simd_ir, gemv, qgemm
from edgeinfer.backends.cpu.gemv import _finish_rows, quantize_act
from edgeinfer.backends.cpu.repack import SUPER_GROUPS, pack_factored, term_values
from test_cpu_kernels import random_q

CPU = CpuBackend(threads=2)
pytestmark = pytest.mark.skipif(not _simd_ir.HAVE_AVX2, reason="the block-dot kernels are AVX2 IR")

_K4, _K1 = _blockdot.BLOCKDOT_ROWS[4], _blockdot.BLOCKDOT_ROWS[1]


def rows_of(k4, k1):
    """A jitted ``rows(y, wp, sc, xq, dx, bmap, nb)``: every row by the 4-row kernel
    ``k4``, then the rest by the 1-row ``k1``."""
    @njit(cache=False)
    def rows(y, wp, sc, xq, dx, bmap, nb):
        out = y.shape[0]
        n4 = out // 4
        for i in range(n4):
            k4(y, 4 * i, wp, sc, xq, dx, bmap, nb)
        for r in range(4 * n4, out):
            k1(y, r, wp, sc, xq, dx, bmap, nb)
    return rows


_rows = rows_of(_K4, _K1)


def _fma(a, b, c):
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _emulate(codes, sc_rows, xq, dx, bmap):
    """acc [out] float32 by the module docstring's steps; codes int64 [out, nb * 32]."""
    out, nb = codes.shape[0], dx.shape[0]
    pos = _simd_ir.ACT_ORDER
    q = xq.astype(np.int64).reshape(nb, 32)[:, pos]  # column j of block b
    d = np.einsum("rbj,bj->rb", codes.reshape(out, nb, 32), q)
    assert np.abs(d).max() < 2 ** 24  # float(D) exact
    y = np.empty(out, np.float32)
    for r in range(out):
        acc = gacc = np.float32(0)
        for b in range(nb):
            if b and bmap[b] != bmap[b - 1]:
                acc, gacc = _fma(gacc, sc_rows[r, bmap[b - 1]], acc), np.float32(0)
            gacc = _fma(np.float32(d[r, b]), dx[b], gacc)
        y[r] = _fma(gacc, sc_rows[r, bmap[nb - 1]], acc)
    return y


def _act(h, x):
    xq = np.zeros(h.n_blocks * 32, np.int16)
    dx = np.zeros(h.n_blocks, np.float32)
    xg = np.zeros(h.n_groups, np.float32)
    quantize_act(xq, dx, xg, x, h.bmap)
    return xq, dx, xg


def _codes(qt, h):
    c = np.zeros((qt.out_features, h.n_blocks * 32), np.int64)
    c[:, :qt.in_features] = qt.codes()[:, :qt.in_features]
    return c


@pytest.mark.parametrize("bits,out,n_in,group", [
    (4, 37, 172, 32), (4, 13, 576, 96), (4, 9, 896, 128), (4, 6, 100, -1),
    # 8-bit: codes -128..127 in column order, an odd block count, a partial last block
    (8, 37, 192, 32), (8, 13, 800, -1), (8, 9, 896, -1), (8, 6, 70, 64), (8, 131, 576, -1)])
def test_rows_follow_the_documented_float_steps(bits, out, n_in, group):
    rng = np.random.default_rng(out * n_in)
    qt = random_q(rng, out, n_in, bits, group, sym=bits == 8)
    h = CPU.upload_weight(qt)
    assert h.bits == bits and (bits == 4 or (h.wp == -128).any())
    for scale in (1.0, 1e-3, 50.0):
        x = (rng.standard_normal(n_in) * scale).astype(np.float32)
        x[3] = 40 * scale  # one outlier block
        xq, dx, _ = _act(h, x)
        y = np.full(out, np.nan, np.float32)
        _rows(y, h.wp, h.sc, xq, dx, h.bmap, h.n_blocks)
        want = _emulate(_codes(qt, h), term_values(h.sc, h.n_blocks), xq, dx, h.bmap)
        assert np.array_equal(y.view(np.uint32), want.view(np.uint32))
        assert np.abs(want).max() > 0


def test_rows_read_factored_scales_as_their_float_values():
    rng = np.random.default_rng(7)
    out, n_in = 12, 512
    qt = random_q(rng, out, n_in, 4, 32, sym=False)
    h = CPU.upload_weight(qt)
    nb = h.n_blocks
    q = rng.integers(1, 64, (out, nb)).astype(np.int8)
    d = (rng.random((out, -(-nb // SUPER_GROUPS))) * 1e-3).astype(np.float32)
    fac = pack_factored(q, d, nb)
    values = q.astype(np.float32) * np.repeat(d, SUPER_GROUPS, axis=1)[:, :nb]
    xq, dx, _ = _act(h, rng.standard_normal(n_in).astype(np.float32))
    y_fac = np.empty(out, np.float32)
    y_val = np.empty(out, np.float32)
    _rows(y_fac, h.wp, fac, xq, dx, h.bmap, nb)
    _rows(y_val, h.wp, values, xq, dx, h.bmap, nb)
    assert np.array_equal(y_fac.view(np.uint32), y_val.view(np.uint32))
    want = _emulate(_codes(qt, h), values, xq, dx, h.bmap)
    assert np.array_equal(y_fac.view(np.uint32), want.view(np.uint32))


def _gemv_rows(h, x, bias):  # the decode GEMV of every token: rows kernel + _finish_rows
    y = np.empty((x.shape[0], h.out_features), np.float32)
    b = np.zeros(0, np.float32) if bias is None else bias
    for t in range(x.shape[0]):
        xq, dx, xg = _act(h, x[t])
        xg *= np.float32(h.zero_scale)
        _rows(y[t], h.wp, h.sc, xq, dx, h.bmap, h.n_blocks)
        _finish_rows(y[t], 0, h.out_features, h.sz, xg, b)
    return y


@pytest.mark.parametrize("out,n_in,group,sym,t_n", [(37, 192, 32, False, 5),
                                                    (64, 576, 128, False, 33),
                                                    (50, 576, 96, True, 16),
                                                    (33, 256, -1, False, 17),
                                                    (300, 896, 128, False, 70),
                                                    (21, 160, 32, False, 18)])  # odd blocks
def test_gemm_equals_the_gemv_row_by_row(out, n_in, group, sym, t_n):
    rng = np.random.default_rng(out + t_n)
    h = CPU.upload_weight(random_q(rng, out, n_in, 4, group, sym))
    x = rng.standard_normal((t_n, n_in)).astype(np.float32)
    x[1, 3] = 40.0
    for bias in (None, rng.standard_normal(out).astype(np.float32)):
        want = _gemv_rows(h, x, bias)
        paths = [_amx.gemm_rows] + ([_amx.gemm_amx] if _amx.HAVE_AMX else [])
        for gemm in paths:
            y = gemm(x, h, bias)
            assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), gemm.__name__
        for t in (0, t_n - 1):  # and one token alone (a decode step)
            assert np.array_equal(paths[-1](x[t:t + 1], h, bias)[0], want[t])


def factored_pair(seed: int, out: int, n_in: int = 768):
    """A random 4-bit g32 weight and the same codes with factored (Q4_K-style) scales;
    returns (plain, factored, rng)."""
    rng = np.random.default_rng(seed)
    h = CPU.upload_weight(random_q(rng, out, n_in, 4, 32, sym=False))
    nb = h.n_blocks
    q = rng.integers(-60, 64, (out, nb)).astype(np.int8)
    d = (rng.random((out, -(-nb // SUPER_GROUPS))) * 1e-3).astype(np.float32)
    return h, dataclasses.replace(h, sc=pack_factored(q, d, nb)), rng


def test_amx_gemm_reads_factored_scales():
    if not _amx.HAVE_AMX:
        pytest.skip("this CPU or OS gives no AMX tiles")
    h, hf, rng = factored_pair(3, 40)
    x = rng.standard_normal((20, h.in_features)).astype(np.float32)
    assert np.array_equal(_amx.gemm_amx(x, hf, None), _amx.gemm_rows(x, hf, None))
    assert not np.array_equal(_amx.gemm_amx(x, hf, None), _amx.gemm_amx(x, h, None))


def test_an_amx_cpu_runs_4_bit_linears_in_block_dot_numerics():
    """Where the CPU has AMX the backend's decode GEMV and prefill GEMM of a 4-bit weight
    are the block-dot ones (and agree); elsewhere the lane numerics stay."""
    rng = np.random.default_rng(11)
    qt = random_q(rng, 70, 576, 4, 128, sym=False)
    h = CPU.upload_weight(qt)
    x = rng.standard_normal((9, 576)).astype(np.float32)
    prefill = CPU.linear(x, h)
    decode = np.stack([CPU.linear(x[t:t + 1], h)[0] for t in range(9)])
    assert np.array_equal(prefill, decode)
    blockdot = _gemv_rows(h, x, None)
    assert np.array_equal(decode, blockdot) == _blockdot.BLOCKDOT
    assert (gemv.q4_rows4 is _K4) == _blockdot.BLOCKDOT
    if _blockdot.BLOCKDOT:
        assert np.array_equal(qgemm.gemm_int(x, h, None), blockdot)
