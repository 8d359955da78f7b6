"""CPU-backend properties beyond op parity (that is tests/test_ops.py's matrix): the
integer-activation linears' provable error bound under outliers, the portable row kernels,
bit-exact quantized KV writes, f16 saturation, serial == parallel decode attention,
fused linear groups, option and error handling, import hygiene.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from edgeinfer.backends import kvcache
from edgeinfer.backends.cpu import CpuBackend, CpuQuantWeight, _simd
from edgeinfer.backends.cpu.gemv import ActScratch, quantize_act
from edgeinfer.backends.quantized import QuantizedTensor, pack_nibbles
from edgeinfer.backends.reference import ReferenceBackend

#: Bounds on ``nerr = ||y - y_ref|| / ||y_ref||`` (also used by test_cpu_fused.py): float32
#: math on both sides; the integer linears' 15-bit activations (per 32-block, two int8
#: digits) on Gaussian activations (NMSE and its op-parity cases: tests/test_ops.py).
FLOAT_TOL = 1e-5
ACT_TOL = 2e-4

REF = ReferenceBackend()
CPU = CpuBackend()


def nerr(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def act_bound(w_deq, x):
    """Per-output bound on the activation rounding error (see module docstring)."""
    k = x.shape[-1]
    kp = -(-k // 32) * 32
    xb = np.zeros(kp, np.float64)
    xb[:k] = np.abs(x)
    dx = xb.reshape(-1, 32).max(axis=1) / 16256.0
    step = np.repeat(dx, 32)[:k]
    return np.abs(w_deq.astype(np.float64)) @ (step / 2)


def random_q(rng, out, n_in, bits, group, sym=True, scale=0.02):
    """Random codes in the QuantizedTensor layout (group=-1: per-channel)."""
    g = group if group > 0 else n_in + (n_in % 2)
    kp = -(-n_in // g) * g
    ng = kp // g
    s = (rng.random((out, ng)) * scale + scale / 20).astype(np.float16)
    if bits == 4:
        codes = rng.integers(0, 16, (out, kp))
        z = None if sym else pack_nibbles(rng.integers(0, 16, (out, ng)))
        return QuantizedTensor(pack_nibbles(codes), s, z, 4, g, n_in)
    q = rng.integers(-128, 128, (out, kp)).astype(np.int8)  # -128 included (adversarial)
    return QuantizedTensor(q, s, None, 8, g, n_in)


QCASES = [  # (bits, out, in, group, symmetric)
    (4, 37, 172, 32, False),   # padded 172 -> 192, odd rows
    (4, 64, 256, 64, True),
    (4, 13, 896, 128, False),
    (4, 6, 100, -1, True),     # per-channel, in not a multiple of 32
    (4, 7, 64, 16, False),     # groups straddle 32-blocks: dense fallback
    (4, 5, 33, 32, True),      # one column past a block
    (8, 9, 576, -1, True),     # per-row 8-bit (lm_head style)
    (8, 13, 200, 32, True),
    (8, 3, 70, 64, True),
    (4, 302, 576, 64, False),  # > SERIAL_MAX_BYTES: the parallel GEMV, a 2-row tail
    (8, 131, 576, -1, True),   # parallel 8-bit, 3-row tail
]


@pytest.mark.parametrize("bits,out,n_in,group,sym", [c for c in QCASES if c[3] != 16])
@pytest.mark.parametrize("t", [1, 2, 5])  # GEMV and prefill GEMM
def test_act8_outlier_within_provable_bound(bits, out, n_in, group, sym, t):
    """The integer linears' 15-bit activations with an outlier (40.0, which coarsens its
    block's step): every output within ``sum_k |W[r, k]| * dx[block(k)] / 2`` of the reference."""
    rng = np.random.default_rng(out * 1000 + n_in + t)
    w = random_q(rng, out, n_in, bits, group, sym)
    x = rng.standard_normal((t, n_in)).astype(np.float32)
    bias = rng.standard_normal(out).astype(np.float32)
    h = CPU.upload_weight(w)
    assert isinstance(h, CpuQuantWeight)  # (group 16 straddles 32-blocks: dense, exact)
    x[0, n_in // 2] = 40.0
    ref = REF.linear(x, REF.upload_weight(w), bias)
    y = CPU.linear(x, h, bias)
    wd = w.dequantize()
    for i in range(t):
        bound = act_bound(wd, x[i]) * 1.001 + 1e-5 * (np.abs(ref[i]) + 1)
        assert (np.abs(y[i] - ref[i]) <= bound).all()
    assert nerr(y, ref) > 0  # control: the activation rounding is really there


def test_portable_rows_match_simd_math():
    """The no-AVX2 fallback row kernels compute the same sums (checked on the host)."""
    rng = np.random.default_rng(3)
    for bits, n_in, group in [(4, 192, 32), (4, 256, 128), (8, 96, 32)]:
        w = random_q(rng, 8, n_in, bits, group, sym=False)
        h = CPU.upload_weight(w)
        x = rng.standard_normal(n_in).astype(np.float32)
        xq, dx, xg = ActScratch().get(h.n_blocks, h.n_groups)
        quantize_act(xq, dx, xg, x, h.bmap)
        y = np.zeros(8, np.float32)
        rows4 = _simd.PORTABLE_ROWS[(4, bits)]
        rows1 = _simd.PORTABLE_ROWS[(1, bits)]
        rows4(y, 0, h.wp, h.sc, xq, dx, h.bmap, h.n_blocks)
        for r in range(4, 8):
            rows1(y, r, h.wp, h.sc, xq, dx, h.bmap, h.n_blocks)
        if h.sz.shape[1]:  # symmetric 8-bit weights have no zero-point term ([out, 0])
            y -= h.sz @ xg
        ref = w.dequantize() @ x
        assert nerr(y, ref) < ACT_TOL
        assert nerr(y, CPU.linear(x[None], h)[0]) < 1e-5


def test_attention_f16_cache_saturates_like_reference():
    caches = [be.new_kv_cache(1, 1, 8, 4, "f16") for be in (REF, CPU)]
    k = np.full((2, 1, 8), 1e6, np.float32)
    k[1] = -3e5
    q = np.ones((2, 1, 8), np.float32) * 1e-6
    outs = [be.attention(q, k, k, c, 0, 0, 1.0) for be, c in zip((REF, CPU), caches)]
    assert np.array_equal(caches[0].k, caches[1].k)
    assert np.abs(caches[1].k[0, :2]).max() == 65504.0
    assert np.isfinite(outs[1]).all() and nerr(outs[1], outs[0]) < FLOAT_TOL


def test_attention_cache_overflow_raises():
    c = CPU.new_kv_cache(1, 1, 8, 4)
    x = np.zeros((5, 1, 8), np.float32)
    with pytest.raises(ValueError, match="overflow"):
        CPU.attention(x, x, x, c, 0, 0, 1.0)


def test_import_edgeinfer_does_not_import_numba():
    code = ("import sys, edgeinfer, edgeinfer.backends; "
            "sys.exit(1 if 'numba' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_threads_option():
    be = CpuBackend(threads=1)
    assert be.threads == 1
    with pytest.raises(ValueError):
        CpuBackend(threads=0)
    CpuBackend()  # restore the default for other tests


# ---- quantized KV cache kernels (backends/cpu/kvquant.py) ----------------------------
QKV = ["int8", "int4", "k8v4"]


def _kv_chunk(rng, t, hkv, hd, kind):
    k = rng.standard_normal((t, hkv, hd)).astype(np.float32) * 2
    v = rng.standard_normal((t, hkv, hd)).astype(np.float32)
    if kind == "outlier":  # one K channel x50 and a token far beyond the f16 range
        k[:, :, 3] *= 50
        v[0] *= 1e6
    elif kind == "zeros":  # zero rows: zero scale -> all-zero codes
        k[0], v[0] = 0, 0
    elif kind == "ties":  # values on rounding boundaries (x.5 steps of the scale)
        k = (np.round(k * 4) / 4).astype(np.float32)
        v = (np.round(v * 2) / 2).astype(np.float32)
    return k, v


@pytest.mark.parametrize("dtype", QKV)
@pytest.mark.parametrize("hd", [64, 80, 8])
@pytest.mark.parametrize("ring", [False, True])
def test_kv_write_bit_exact(dtype, hd, ring):
    """The Numba KV write produces the same bytes as ``cache.write`` (codes, f16 scales and
    minima, ring position table), for every format, group size and awkward input."""
    rng = np.random.default_rng(hd)
    kw = {"window_sizes": [6, None], "max_chunk": 8} if ring else {}
    ref, cpu = (kvcache.HostKVCache(2, 3, hd, 40, dtype, **kw) for _ in range(2))
    pos = 0
    for t, kind in [(5, "plain"), (1, "outlier"), (8, "zeros"), (1, "ties"), (3, "plain"),
                    (1, "plain")]:
        k, v = _kv_chunk(rng, t, 3, hd, kind)
        q = rng.standard_normal((t, 6, hd)).astype(np.float32)
        ref.write(0, pos, k, v)
        CPU.attention(q, k, v, cpu, 0, pos, 0.125, 6 if ring else None)
        for name, arr in ref.raw(0).items():
            assert np.array_equal(arr.view(np.uint8), cpu.raw(0)[name].view(np.uint8)), name
        if ring:
            assert np.array_equal(ref.positions(0), cpu.positions(0))
        pos += t


@pytest.mark.parametrize("dtype", ["f32"] + QKV)
def test_ring_refuses_a_chunk_beyond_max_chunk(dtype):
    c = kvcache.HostKVCache(2, 2, 32, 64, dtype, window_sizes=[5, None], max_chunk=8)
    with pytest.raises(ValueError, match="chunk"):
        CPU.attention(*(np.zeros((9, h, 32), np.float32) for h in (4, 2, 2)), c, 0, 0, 0.25, 5)


def test_int4_large_k_offset_write_bit_exact():
    """int4's K channel statistics on Qwen-like K (large constant per-channel offsets, an
    outlier channel): the Numba write stores the reference's bytes (codes, m, c), prefill
    and decode. (Attention over them: tests/test_ops.py, attention-int4-large-k-offset.)"""
    rng = np.random.default_rng(7)
    hq, hkv, hd = 14, 2, 64
    caches = [be.new_kv_cache(1, hkv, hd, 64, "int4") for be in (REF, CPU)]
    off = np.zeros(hd, np.float32)
    off[[30, 31, 62, 63]] = [120, -150, 90, 140]
    pos = 0
    for t, kind in [(20, "plain"), (1, "plain"), (7, "outlier"), (1, "plain")]:
        k, v = _kv_chunk(rng, t, hkv, hd, kind)
        q = rng.standard_normal((t, hq, hd)).astype(np.float32)
        o = [be.attention(q, k + off, v, c, 0, pos, hd ** -0.5)
             for be, c in zip((REF, CPU), caches)]
        assert np.isfinite(o[1]).all()
        pos += t
    for name, arr in caches[0].raw(0).items():
        assert np.array_equal(arr.view(np.uint8), caches[1].raw(0)[name].view(np.uint8)), name
    assert np.abs(caches[0].raw(0)["k_off"][:, 31] + 150).max() < 1


@pytest.mark.parametrize("dtype", ["f16", "int8", "int4"])
def test_attention_decode_serial_equals_parallel(dtype):
    """The single-threaded decode kernels (short contexts) == the parallel ones."""
    from edgeinfer.backends.cpu import attention as att, kvquant
    rng = np.random.default_rng(2)
    hq, hkv, hd, n = 9, 3, 64, 50
    c = kvcache.HostKVCache(1, hkv, hd, 64, dtype)
    k, v = _kv_chunk(rng, n, hkv, hd, "plain")
    CPU.attention(rng.standard_normal((n, hq, hd)).astype(np.float32), k, v, c, 0, 0, 0.125)
    q = rng.standard_normal((1, hq, hd)).astype(np.float32)
    outs = []
    for par in (True, False):
        out = np.empty((1, hq, hd), np.float32)
        if dtype == "f16":
            kc, vc = c.k[0].view(np.uint16), c.v[0].view(np.uint16)
            fn = att.attention if par else att.attention_serial
            scr = (np.empty(att.decode_scratch_shape(c, hq, hd), np.float32) if par
                   else np.zeros((0, 0), np.float32))
            fn(out, q, k[-1:], v[-1:], kc, vc, np.zeros(0, np.int64), False, n - 1, 0.125, 0, 0.0,
               scr)
        else:
            raw = c.raw(0)

            def bits(name):
                return None if name not in raw else raw[name].view(np.uint16)
            fn = kvquant.attention_q if par else kvquant.attention_q_serial
            scr = (np.empty(kvquant.decode_scratch_q_shape(c, hq, hd), np.float32) if par
                   else np.zeros((0, 0), np.float32))
            koff = raw.get("k_off", np.zeros((hkv, hd), np.float32))
            kcs = raw.get("k_cs", np.ones((hkv, hd), np.float32))
            fn(out, q, c.rotation, raw["k_q"], bits("k_scale"), bits("k_min"), raw["v_q"],
               bits("v_scale"), bits("v_min"), koff, kcs, np.zeros(0, np.int64), n - 1, 0.125,
               0, 0.0, scr)
        outs.append(out)
    assert nerr(outs[1], outs[0]) < 1e-6


# ---- linear_many (fused q/k/v and gate/up) --------------------------------------------
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, -1)])
@pytest.mark.parametrize("t", [1, 2, 7])
def test_linear_many_fused(bits, group, t):
    """A fused group gives bit-identical outputs to separate linears (the same activation
    quantization and per-row integer dots, decode and prefill) and the reference within
    the usual bounds; members keep working alone and share the fused storage; the given
    handles are left as they were."""
    rng = np.random.default_rng(t)
    n_in = 256
    qts = [random_q(rng, o, n_in, bits, group) for o in (96, 32, 32)]
    be = CpuBackend()
    ws = [be.upload_weight(q) for q in qts]
    sep = [be.upload_weight(q) for q in qts]
    biases = [rng.standard_normal(96).astype(np.float32), None,
              rng.standard_normal(32).astype(np.float32)]
    x = rng.standard_normal((t, n_in)).astype(np.float32)
    wp0 = [w.wp for w in ws]
    g = be.group_linears(ws, biases)
    assert all(w.wp is a for w, a in zip(ws, wp0))  # not modified
    ws = list(g.weights)
    for _ in range(2):
        ys = be.linear_many(x, g)
        for y, w, b, q in zip(ys, sep, biases, qts):
            assert np.array_equal(y, be.linear(x, w, b))
            assert nerr(y, REF.linear(x, REF.upload_weight(q), b)) < ACT_TOL
    base = ws[0].wp.base
    assert base is not None and all(w.wp.base is base for w in ws)
    for w, q in zip(ws, qts):  # a member used alone still computes its own rows
        assert nerr(be.linear(x, w), REF.linear(x, REF.upload_weight(q))) < ACT_TOL


def test_linear_many_mixed_falls_back():
    rng = np.random.default_rng(0)
    w4 = CPU.upload_weight(random_q(rng, 16, 64, 4, 32))
    w8 = CPU.upload_weight(random_q(rng, 8, 64, 8, -1))
    dense = rng.standard_normal((4, 64)).astype(np.float32)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    g = CPU.group_linears([w4, w8, dense], [None, None, None])
    assert g.weights == (w4, w8, dense)
    ys = CPU.linear_many(x, g)
    for y, w in zip(ys, [w4, w8, dense]):
        assert np.array_equal(y, CPU.linear(x, w))


def test_symmetric_8bit_weights_carry_no_zero_point_array():
    """A symmetric 8-bit weight repacks with ``sz`` ``[out, 0]`` (no all-zero copy of the
    scales: Qwen's 151936 x 896 head would hold 17 MB of zeros): every path still matches
    the oracle, embedding rows are exact, and it is not fused with an 8-bit weight that has
    float mins (whose ``sz`` is ``-m``)."""
    rng = np.random.default_rng(11)
    w = random_q(rng, 21, 192, 8, 32)
    h = CPU.upload_weight(w)
    assert h.bits == 8 and h.sz.shape == (21, 0) and h.nbytes == h.wp.nbytes + h.sc.nbytes
    x = rng.standard_normal((5, 192)).astype(np.float32)
    ref = x @ w.dequantize().T
    assert nerr(CPU.linear(x[:1], h), ref[:1]) < ACT_TOL
    assert nerr(CPU.linear(x, h), ref) < ACT_TOL
    assert nerr(CpuBackend(threads=1, exact_decode=True).linear(x, h), ref) < 1e-6
    ids = np.array([20, 0, 7])
    np.testing.assert_array_equal(CPU.embed(h, ids), w.dequantize(rows=ids))
    m = QuantizedTensor(np.abs(w.qweight).astype(np.int8) % 100, w.scales, None, 8, 32, 192,
                        mins=np.full_like(w.scales, -0.5))
    hm = CPU.upload_weight(m)
    assert hm.bits == 8 and hm.sz.shape == (21, 6)  # codes 0..99: not 5-bit
    assert not hasattr(CPU.group_linears([h, hm], [None, None]), "splits")
    assert nerr(CPU.linear(x[:1], hm), x[:1] @ m.dequantize().T) < ACT_TOL
