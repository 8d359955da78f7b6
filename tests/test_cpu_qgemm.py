"""The CPU backend's integer linears (decode GEMV, prefill GEMM of backends/cpu/qgemm.py)
against a numpy oracle of their formula, and the invariance a KV-cache hit relies on: a
row's output is bit-identical whether it is computed alone (M = 1), in a group of 7, or
with all T rows (T across and off the 32-row / 32-token tiles).

Oracle: per 32-column block ``d = max|x_b| / 16256`` (float32), ``q = rint(x / d)``
(exact integers), ``y[r] = sum_g sc[r, g] sum_{b in g} d_b (codes_r,b . q_b)
- sum_g sz[r, g] sum_{b in g} d_b sum(q_b)`` with integer dots exact (int64) and the
float sums in float64: the kernels' only further error is float32 accumulation.
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit
from edgeinfer.backends.cpu import CpuBackend, CpuQuantWeight
from edgeinfer.backends.cpu._simd_ir import ACT_ORDER
from edgeinfer.backends.cpu.gemv import ACT_LEVELS, ActScratch, quantize_act
from edgeinfer.backends.cpu.qgemm import TILE_ROWS, TILE_TOKENS
from test_cpu_kernels import random_q

CPU = CpuBackend(threads=2)
CASES = [  # (bits, out, in, group, symmetric)
    (4, 37, 172, 32, False),    # padded 172 -> 192, a 1-row tail
    (4, 302, 576, 64, False),   # > one 32-row tile, 2-row tail, parallel GEMV
    (4, 96, 256, 128, True),
    (4, 6, 100, -1, True),      # per-channel
    (8, 131, 576, -1, True),    # per-row 8-bit (head style), -128 codes included
    (8, 13, 200, 32, True),
]


def _act_oracle(x: np.ndarray, nb: int):
    """(q int64 [nb, 32], d float32 [nb]) of one row, float32 as the kernel computes."""
    xb = np.zeros(nb * 32, np.float32)
    xb[:x.shape[0]] = x
    xb = xb.reshape(nb, 32)
    d = (np.abs(xb).max(axis=1) / np.float32(ACT_LEVELS)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(xb * inv[:, None]), -ACT_LEVELS, ACT_LEVELS).astype(np.int64)
    return q, d


def _floats(a: np.ndarray) -> np.ndarray:
    """A repacked weight's scale / zero-term array as float64 (uint16: fp16 bits)."""
    return (a.view(np.float16) if a.dtype == np.uint16 else a).astype(np.float64)


def _oracle(qt, h: CpuQuantWeight, x: np.ndarray) -> np.ndarray:
    nb, k = h.n_blocks, qt.in_features
    codes = np.zeros((qt.out_features, nb * 32), np.int64)
    codes[:, :k] = qt.codes()[:, :k] if qt.bits == 4 else qt.qweight[:, :k]
    sc, sz = _floats(h.sc), _floats(h.sz) * h.zero_scale  # zero_scale: 8 where sz is sc
    out = np.empty((x.shape[0], qt.out_features))
    for t in range(x.shape[0]):
        q, d = _act_oracle(x[t], nb)
        idot = np.einsum("rbj,bj->rb", codes.reshape(-1, nb, 32), q)  # exact integers
        per_b = idot * d.astype(np.float64)
        y = np.zeros(qt.out_features)
        for g in range(h.n_groups):
            m = h.bmap == g
            y += sc[:, g] * per_b[:, m].sum(axis=1)
            if sz.shape[1]:  # symmetric 8-bit weights have no zero-point term
                y -= sz[:, g] * float((d[m].astype(np.float64) * q[m].sum(axis=1)).sum())
        out[t] = y
    return out


def test_quantize_act_integers_are_the_oracle_integers():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(172) * np.exp(rng.standard_normal(172) * 2)).astype(np.float32)
    x[40] = 0.0
    x[64:96] = 0.0  # an all-zero block: zero scale, zero codes
    nb = 6
    xq, dx, xg = ActScratch().get(nb, 2)
    quantize_act(xq, dx, xg, x, np.array([0, 0, 0, 1, 1, 1], np.int32))
    assert xq.dtype == np.int16
    lanes = xq.reshape(nb, 32).astype(np.int64)[:, ACT_ORDER]  # lane -> column order
    q, d = _act_oracle(x, nb)
    assert sorted(ACT_ORDER.tolist()) == list(range(32))  # a permutation of the columns
    assert np.array_equal(lanes, q)
    assert np.array_equal(dx, d) and dx[2] == 0 and not q[2].any()
    assert np.abs(q).max() == ACT_LEVELS  # the block maxima use the whole range
    np.testing.assert_allclose(xg, [(d[:3] * q[:3].sum(1)).sum(), (d[3:] * q[3:].sum(1)).sum()],
                               rtol=1e-6)


@njit(fastmath=False)
def _quantize_scalar(xq, dx, xg, x, bmap):  # quantize_act's per-element loop for every block
    k = x.shape[0]
    xg[:] = 0.0
    for b in range(dx.shape[0]):
        amax = np.float32(0.0)
        for j in range(32):
            if b * 32 + j < k:
                amax = max(amax, abs(x[b * 32 + j]))
        d = amax / np.float32(ACT_LEVELS)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        s = 0
        for j in range(32):
            q = 0
            if b * 32 + j < k:
                q = min(max(int(np.rint(x[b * 32 + j] * inv)), -ACT_LEVELS), ACT_LEVELS)
            xq[b * 32 + ACT_ORDER[j]] = q
            s += q
        dx[b] = d
        xg[bmap[b]] += d * np.float32(s)


def test_vector_quantizer_equals_the_scalar_loop():
    """Full blocks go through vector IR (``gemv._quant_block``): the same integers, scales
    and group sums as the per-element loop, bit for bit, on scales from 1e-6 to 1e4, ties
    at half a step, all-zero blocks, -0.0, inf / nan, and a partial last block."""
    rng = np.random.default_rng(5)
    for trial in range(120):
        k = int(rng.integers(1, 700))
        nb = -(-k // 32)
        bmap = (np.arange(nb) // int(rng.choice([1, 2, 4]))).astype(np.int32)
        x = (rng.standard_normal(k) * rng.choice([1e-6, 1.0, 1e4])).astype(np.float32)
        if trial % 3 == 0:
            x[:min(k, 32)] = 0.0
        if trial % 4 == 0:
            x = np.round(x * 4) / np.float32(4)  # ties after scaling
        if trial % 5 == 0:
            x[rng.integers(0, k)] = -0.0
        if trial % 7 == 0:
            x[rng.integers(0, k)] = [np.inf, np.nan][trial % 2]
        got, want = [(np.zeros(nb * 32, np.int16), np.zeros(nb, np.float32),
                      np.zeros(bmap[-1] + 1, np.float32)) for _ in range(2)]
        quantize_act(*got, x, bmap)
        _quantize_scalar(*want, x, bmap)
        for a, b in zip(got, want):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (trial, k)


@pytest.mark.parametrize("bits,out,n_in,group,sym", CASES)
def test_kernels_match_the_oracle(bits, out, n_in, group, sym):
    rng = np.random.default_rng(out + n_in)
    qt = random_q(rng, out, n_in, bits, group, sym)
    h = CPU.upload_weight(qt)
    x = rng.standard_normal((9, n_in)).astype(np.float32)
    x[3, 5] = 60.0  # an outlier block
    want = _oracle(qt, h, x)
    scale = np.abs(want).max()
    for y in (CPU.linear(x, h), np.concatenate([CPU.linear(x[i:i + 1], h) for i in range(9)])):
        err = np.abs(y - want).max() / scale
        assert err < 2e-6, err


@pytest.mark.parametrize("bits,out,n_in,group,sym", CASES)
def test_rows_bit_identical_for_any_m(bits, out, n_in, group, sym):
    rng = np.random.default_rng(out * 7 + n_in)
    qt = random_q(rng, out, n_in, bits, group, sym)
    h = CPU.upload_weight(qt)
    bias = rng.standard_normal(out).astype(np.float32)
    for t in (2, 3, 5, 7, TILE_TOKENS - 1, TILE_TOKENS, TILE_TOKENS + 1, 70):
        x = rng.standard_normal((t, n_in)).astype(np.float32)
        whole = CPU.linear(x, h, bias)
        ones = np.concatenate([CPU.linear(x[i:i + 1], h, bias) for i in range(t)])
        sevens = np.concatenate([CPU.linear(x[i:i + 7], h, bias) for i in range(0, t, 7)])
        assert np.array_equal(whole, ones) and np.array_equal(whole, sevens), t
        assert np.abs(whole).max() > 0


def test_tiles_cover_every_row_and_token():
    """More rows than one weight tile with a tail, more tokens than one chunk: every
    output is written (NaN-filled output would survive otherwise)."""
    from edgeinfer.backends.cpu.qgemm import gemm_int

    rng = np.random.default_rng(5)
    out = TILE_ROWS * 3 + 3
    qt = random_q(rng, out, 128, 4, 32, False)
    h = CPU.upload_weight(qt)
    x = rng.standard_normal((2 * TILE_TOKENS + 5, 128)).astype(np.float32)
    y = gemm_int(x, h, None)
    assert y.shape == (x.shape[0], out) and np.isfinite(y).all()
    np.testing.assert_allclose(y, _oracle(qt, h, x), rtol=0, atol=2e-6 * np.abs(y).max())


def test_exact_decode_control_differs():
    """Control: the float-activation path is not bit-identical to the integer path (so
    the equalities above are not the trivial result of one shared code path)."""
    rng = np.random.default_rng(2)
    qt = random_q(rng, 64, 256, 4, 64, False)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    exact = CpuBackend(threads=2, exact_decode=True)
    a = CPU.linear(x, CPU.upload_weight(qt))
    b = exact.linear(x, exact.upload_weight(qt))
    assert not np.array_equal(a, b) and np.abs(a - b).max() < 1e-3 * np.abs(b).max()


def _jit_rows(kernel):
    from numba import njit

    @njit
    def call(y, r0, wp, sc, xq, dx, bmap, nb):
        kernel(y, r0, wp, sc, xq, dx, bmap, nb)
    return call


def _jit_tokens(kernel):
    from numba import njit

    @njit
    def call(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
        kernel(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)
    return call


@pytest.mark.parametrize("bits,n_in,group,sym", [(4, 192, 32, False), (4, 576, 128, False),
                                                  (4, 576, 96, True), (8, 200, 32, True),
                                                  (8, 576, -1, True)])
def test_token_kernels_equal_one_token_kernels(bits, n_in, group, sym):
    """Each multi-token kernel (1..4 tokens) writes, for every (row, token), exactly the
    float32 the one-token kernel + ``_finish_rows`` writes: the SIMD pair when the host
    has AVX2, and the portable pair (the no-AVX2 fallback) everywhere. Groups of 32, 128,
    96 (groups flush inside a 64-column chunk), per-row; with and without bias."""
    from edgeinfer.backends.cpu import _simd, _simd_ir, _simd_tokens
    from edgeinfer.backends.cpu.gemv import _finish_rows

    rng = np.random.default_rng(n_in + group)
    out, t_n = 11, 6
    qt = random_q(rng, out, n_in, bits, group, sym)
    h = CPU.upload_weight(qt)
    x = rng.standard_normal((t_n, n_in)).astype(np.float32)
    x[2, 7] = 50.0
    xq = np.zeros((t_n, h.n_blocks * 32), np.int16)
    dx = np.zeros((t_n, h.n_blocks), np.float32)
    xg = np.zeros((t_n, h.n_groups), np.float32)
    for t in range(t_n):
        quantize_act(xq[t], dx[t], xg[t], x[t], h.bmap)
    pairs = [(_simd.PORTABLE_ROWS, _simd_tokens.PORTABLE_TOKENS)]
    if _simd_ir.HAVE_AVX2:  # the IR intrinsics are callable from jitted code only
        pairs.append(({k: _jit_rows(v) for k, v in _simd.SIMD_ROWS.items()},
                      {k: _jit_tokens(v) for k, v in _simd_tokens.SIMD_TOKENS.items()}))
    for bias in (np.zeros(0, np.float32), rng.standard_normal(out).astype(np.float32)):
        for rows, toks in pairs:
            want = np.empty((t_n, out), np.float32)
            for t in range(t_n):
                for r in range(out):
                    rows[(1, bits)](want[t], r, h.wp, h.sc, xq[t], dx[t], h.bmap, h.n_blocks)
                _finish_rows(want[t], 0, out, h.sz, xg[t], bias)
            for n in range(1, 5):
                y = np.full((t_n, out), np.nan, np.float32)
                for t0 in range(0, t_n - n + 1, n):  # rows 2..out-1 in one call, 0..1 in another
                    for r0, nr in ((0, 2), (2, out - 2)):
                        toks[(n, bits)](y, t0, r0, nr, h.wp, h.sc, h.sz, xg, bias, xq, dx,
                                        h.bmap, h.n_blocks)
                done = (t_n // n) * n
                assert np.array_equal(y[:done], want[:done]), (n, rows is pairs[0][0])
                assert np.isnan(y[done:]).all()  # nothing written past the tokens asked for
            assert np.abs(want).max() > 0
