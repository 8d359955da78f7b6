"""The tiled attention over a quantized KV cache (backends/cpu/_attn_ir.py, kvquant.py).

* The IR kernels compute exactly the float order their docstrings promise (one float32
  FMA chain per output, emulated here with correctly rounded float32 FMAs).
* A decode step gives bit for bit the row a prefill gives for the same query, whatever
  the chunking, the item shape (token blocks, query heads per item), the KV format,
  the head size (padded channels: hd 8, 80, 256), GQA, MQA, sliding windows and rings.
* The result is the attention over the dequantized cache within float32 rounding.
"""
import numpy as np
import pytest
from numba import njit

from edgeinfer.backends import kvcache as kvc
from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.backends.cpu import kvquant
from edgeinfer.backends.cpu._attn_ir import row_max, scores8, vaccum

F32 = np.float32


def fma32(a, b, c):
    """float32 fma(a, b, c), correctly rounded (float64 product is exact; a TwoSum error
    term breaks the one double-rounding case, a float32 midpoint)."""
    p = float(a) * float(b)
    s = p + float(c)
    bb = s - p
    e = (p - (s - bb)) + (float(c) - bb)
    r = np.float32(s)
    if e != 0 and float(r) != s:
        if float(r) > s:
            lo, hi = float(np.nextafter(r, F32(-np.inf))), float(r)
        else:
            lo, hi = float(r), float(np.nextafter(r, F32(np.inf)))
        if s == (lo + hi) / 2:
            r = F32(hi if e > 0 else lo)
    return F32(r)


def test_fma32_emulation_control():
    """The emulation is a real fused multiply-add: it keeps what a multiply then add loses."""
    a = F32(1 + 2 ** -12)
    got = fma32(a, a, F32(-1.0))  # exact: 2^-11 + 2^-24
    assert got == F32(2 ** -11 + 2 ** -24)
    assert F32(a * a) - F32(1.0) == F32(2 ** -11)  # unfused loses the 2^-24


@njit
def _scores(s, qt, kt, nk):
    scores8(s, qt, kt, nk)


@njit
def _vacc(acc, p, vt, nk):
    vaccum(acc, p, vt, nk)


@njit
def _rmax(x):
    return row_max(x)


@pytest.mark.parametrize("hdp,nk", [(64, 21), (8, 8), (80, 3), (256, 17)])
def test_scores8_is_one_fma_chain_per_pair(hdp, nk):
    rng = np.random.default_rng(hdp + nk)
    qt = rng.standard_normal((hdp, 8)).astype(F32)
    kt = rng.standard_normal((-(-nk // 8) * 8, hdp)).astype(F32)
    big = np.full((10, -(-nk // 8) * 8 + 5), np.nan, F32)
    s = big[1:9, 3:]
    _scores(s, qt, kt, nk)
    for lane in range(8):
        for m in range(nk):
            acc = F32(0)
            for i in range(hdp):
                acc = fma32(qt[i, lane], kt[m, i], acc)
            assert s[lane, m] == acc, (lane, m)
    assert np.isnan(big[0]).all() and np.isnan(big[9]).all() and np.isnan(big[:, :3]).all()


@pytest.mark.parametrize("hdp", [8, 64, 80, 128, 136])
def test_vaccum_is_one_fma_chain_per_channel(hdp):
    rng = np.random.default_rng(hdp)
    vt = rng.standard_normal((30, hdp)).astype(F32)
    p = rng.random((1, 30)).astype(F32)
    acc = rng.standard_normal((1, hdp)).astype(F32)
    want = acc.copy()
    for d in range(hdp):
        a = want[0, d]
        for m in range(27):
            a = fma32(p[0, m], vt[m, d], a)
        want[0, d] = a
    _vacc(acc, p, vt, 27)
    np.testing.assert_array_equal(acc, want)


def test_row_max_exact():
    rng = np.random.default_rng(1)
    for n in (1, 7, 8, 9, 63, 64, 517):
        x = rng.standard_normal(n).astype(F32)
        x[rng.integers(0, n)] = -np.inf
        assert _rmax(x) == x.max()
    assert _rmax(np.full(9, -np.inf, F32)) == -np.inf


def _reference(q, kk, vv, scale, window, n_before):
    """Attention of q [T, Hq, hd] at positions n_before.. over dequantized kk, vv [S, Hkv, hd]."""
    t_n, hq, hd = q.shape
    grp = hq // kk.shape[1]
    out = np.empty((t_n, hq, hd), np.float64)
    for t in range(t_n):
        p = n_before + t
        lo = max(0, p - window + 1) if window else 0
        for h in range(hq):
            sc = kk[lo:p + 1, h // grp].astype(np.float64) @ q[t, h] * scale
            e = np.exp(sc - sc.max())
            out[t, h] = (e / e.sum()) @ vv[lo:p + 1, h // grp]
    return out


SHAPES = [(9, 3, 64), (14, 2, 64), (4, 1, 256), (8, 8, 8), (4, 2, 80)]


@pytest.mark.parametrize("dtype", ["int8", "int4", "k8v4"])
@pytest.mark.parametrize("hq,hkv,hd", SHAPES)
def test_decode_equals_prefill_and_reference(dtype, hq, hkv, hd):
    """Prefill 37 tokens in chunks of 23 + 14 (token blocks of 16 and a partial one); each
    position's prefill row equals a decode step of that position over the same cache (the
    step rewrites its own row with the same codes and attends over the rows before it),
    and all rows match the dequantized reference."""
    rng = np.random.default_rng(hq * 100 + hd)
    n = 37
    q = rng.standard_normal((n, hq, hd)).astype(F32)
    k = rng.standard_normal((n, hkv, hd)).astype(F32)
    v = rng.standard_normal((n, hkv, hd)).astype(F32)
    be = CpuBackend()
    cache = kvc._CLASSES[dtype](1, hkv, hd, 64, dtype=dtype)
    pre = np.concatenate([be.attention(q[:23], k[:23], v[:23], cache, 0, 0, 0.125),
                          be.attention(q[23:], k[23:], v[23:], cache, 0, 23, 0.125)])
    cache.length = n
    kk, vv, _ = cache.read_positions(0, n)
    ref = _reference(q, kk, vv, 0.125, 0, 0)
    assert np.abs(pre - ref).max() < 2e-5 * max(1.0, np.abs(ref).max())
    for p in (1, 8, 15, 16, 17, 22, 23, 36):
        got = be.attention(q[p:p + 1], k[p:p + 1], v[p:p + 1], cache, 0, p, 0.125)
        np.testing.assert_array_equal(got[0], pre[p], err_msg=f"position {p}")


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("ring", [False, True])
def test_sliding_window_decode_equals_prefill(dtype, ring):
    """A windowed layer (linear: per-query key ranges inside an item; ring: masked slots)
    gives the same rows by prefill and decode, and the windowed reference."""
    rng = np.random.default_rng(7)
    hq, hkv, hd, w, n = 4, 1, 64, 10, 40
    q = rng.standard_normal((n, hq, hd)).astype(F32)
    k = rng.standard_normal((n, hkv, hd)).astype(F32)
    v = rng.standard_normal((n, hkv, hd)).astype(F32)
    be = CpuBackend()

    def make():
        return kvc._CLASSES[dtype](1, hkv, hd, 64, dtype=dtype,
                                   window_sizes=[w] if ring else None, max_chunk=20)
    cache = make()
    rows = []
    for s in range(0, n, 20):
        rows.append(be.attention(q[s:s + 20], k[s:s + 20], v[s:s + 20], cache, 0, s, 0.125,
                                 window=w))
        cache.length = s + 20
    pre = np.concatenate(rows)
    # a decode step over the same cache; a ring has overwritten the first chunk's window
    for p in range(20 if ring else 1, n):
        got = be.attention(q[p:p + 1], k[p:p + 1], v[p:p + 1], cache, 0, p, 0.125, window=w)
        np.testing.assert_array_equal(got[0], pre[p], err_msg=f"position {p}")
    if not ring:
        kk, vv, _ = cache.read_positions(0, n)
        ref = _reference(q, kk, vv, 0.125, w, 0)
        assert np.abs(pre - ref).max() < 2e-5 * max(1.0, np.abs(ref).max())


def test_serial_and_parallel_decode_agree():
    """The serial decode kernel (short contexts) and the parallel one give the same floats,
    with and without the per-item scratch."""
    rng = np.random.default_rng(3)
    hq, hkv, hd, n = 14, 2, 64, 50
    cache = kvc._CLASSES["int8"](1, hkv, hd, 64, dtype="int8")
    be = CpuBackend()
    be.attention(rng.standard_normal((n, hq, hd)).astype(F32),
                 rng.standard_normal((n, hkv, hd)).astype(F32),
                 rng.standard_normal((n, hkv, hd)).astype(F32), cache, 0, 0, 0.125)
    a = kvquant.layer_arrays(cache, 0)
    q = rng.standard_normal((1, hq, hd)).astype(F32)
    outs = []
    for fn in (kvquant.attention_q, kvquant.attention_q_serial):
        for scr in (np.zeros(kvquant.decode_scratch_q_shape(cache, hq, hd), F32),
                    np.zeros((0, 0), F32)):
            out = np.empty((1, hq, hd), F32)
            fn(out, q, a[7], a[0], a[1], a[2], a[3], a[4], a[5], a[8], a[9], a[6], n - 1,
               0.125, 0, 0.0, scr)
            outs.append(out)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
