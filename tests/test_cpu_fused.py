"""The CPU backend's fused decode halves (``attention_input``, ``attention_output_mlp``)
against the numpy reference backend, against the CPU's own unfused composition, and the
vectorized ``exp`` they use for the activation.

Bounds (see tests/test_cpu_kernels.py): vs the reference, the int8-activation GEMVs give
``ACT8_TOL``; vs the unfused CPU ops (same integer GEMVs, same activation rounding) the
only differences are float association and the polynomial ``exp``: ``1e-5``.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from edgeinfer.backends.base import Backend
from edgeinfer.backends.cpu import CpuBackend, fused
from edgeinfer.backends.reference import ReferenceBackend
from test_cpu_kernels import ACT8_TOL, nerr, random_q

REF = ReferenceBackend()


def _qkv_case(rng, d, hq, hkv, hd, group, bias, rdim=None):
    qs = [random_q(rng, n * hd, d, 4, group, sym=False) for n in (hq, hkv, hkv)]
    bs = [rng.standard_normal(n * hd).astype(np.float32) if bias else None
          for n in (hq, hkv, hkv)]
    r2 = (rdim or hd) // 2
    cos = rng.standard_normal((40, r2)).astype(np.float32)
    sin = rng.standard_normal((40, r2)).astype(np.float32)
    nw = (rng.standard_normal(d) * 0.5 + 1).astype(np.float32)
    x = rng.standard_normal((1, d)).astype(np.float32) * 3
    return qs, bs, cos, sin, nw, x


@pytest.mark.parametrize("d,hq,hkv,hd,group,bias,rdim,threads", [
    (64, 8, 4, 8, 32, False, None, 2),      # stories260K-like
    (200, 3, 1, 16, 64, True, None, 1),     # D not a multiple of 32 or of the group
    (576, 9, 3, 64, 128, False, None, 2),   # SmolLM2 (parallel variant: > SERIAL_MAX_BYTES)
    (96, 4, 2, 24, 32, True, 16, 1),        # partial rotary dims
])
def test_attention_input_vs_reference(d, hq, hkv, hd, group, bias, rdim, threads):
    rng = np.random.default_rng(d + hq)
    qs, bs, cos, sin, nw, x = _qkv_case(rng, d, hq, hkv, hd, group, bias, rdim)
    pos = np.array([11], np.int32)
    cpu = CpuBackend(threads=threads)
    outs = {}
    for name, be in (("ref", REF), ("cpu", cpu)):
        ws = [be.upload_weight(q) for q in qs]
        outs[name] = [np.array(t) for t in be.attention_input(
            x, nw, 1e-5, False, ws, bs, cos, sin, pos, (hq, hkv, hd))]
        if be is cpu:
            unf = Backend.attention_input(cpu, x, nw, 1e-5, False, ws, bs, cos, sin, pos,
                                          (hq, hkv, hd))
    assert any(e is not False for e in cpu._dec.values())  # the fused path ran
    for c, r, u in zip(outs["cpu"], outs["ref"], unf):
        assert c.shape == r.shape
        assert nerr(c, r) < ACT8_TOL
        assert nerr(c, u) < 1e-5


@pytest.mark.parametrize("d,f,group,act,threads", [
    (64, 172, 32, "silu", 1),          # F padded 172 -> 192
    (96, 100, 32, "gelu_tanh", 2),
    (576, 1536, 128, "silu", 2),       # SmolLM2 sizes (parallel variant)
    (128, 320, 64, "gelu_tanh", 1),
])
def test_attention_output_mlp_vs_reference(d, f, group, act, threads):
    rng = np.random.default_rng(d + f)
    qs = [random_q(rng, d, d, 4, group, sym=False), random_q(rng, f, d, 4, group, sym=False),
          random_q(rng, f, d, 4, group, sym=False), random_q(rng, d, f, 4, group, sym=False)]
    nw = (rng.standard_normal(d) * 0.5 + 1).astype(np.float32)
    x = rng.standard_normal((1, d)).astype(np.float32)
    a = rng.standard_normal((1, d)).astype(np.float32)
    x0 = x.copy()
    cpu = CpuBackend(threads=threads)
    res = {}
    for name, be in (("ref", REF), ("cpu", cpu)):
        wo, wg, wu, wd = (be.upload_weight(q) for q in qs)
        res[name] = np.array(be.attention_output_mlp(x, a, wo, nw, 1e-5, True, wg, wu, wd, act))
        if be is cpu:
            unf = Backend.attention_output_mlp(cpu, x, a, wo, nw, 1e-5, True, wg, wu, wd, act)
            y = cpu.attention_output_mlp(x, a, wo, nw, 1e-5, True, wg, wu, wd, act)
            # in place: the scratch result fed back as x (what the next layer does)
            y2 = cpu.attention_output_mlp(y, a, wo, nw, 1e-5, True, wg, wu, wd, act)
            ref2 = Backend.attention_output_mlp(cpu, res["cpu"], a, wo, nw, 1e-5, True, wg, wu,
                                                wd, act)
    assert np.array_equal(x, x0)  # x itself is never written
    assert nerr(res["cpu"], res["ref"]) < ACT8_TOL
    assert nerr(res["cpu"], unf) < 1e-5
    assert nerr(y2, ref2) < 1e-5
    with pytest.raises(ValueError):
        cpu.attention_output_mlp(x, a, wo, nw, 1e-5, True, wg, wu, wd, "relu")


def test_exp_polynomial():
    x = np.concatenate([np.linspace(-87, 88, 200001), [-200, -88, 0, 1e-8, 100]])
    x = x.astype(np.float32)
    g = np.zeros((2 * x.size,), np.float32)
    g[:x.size] = -x
    g[x.size:] = 1
    m = np.empty(x.size, np.float32)
    fused.glu_rows(m, g, False)  # silu(-x) = -x / (1 + exp(x))
    with np.errstate(over="ignore"):
        ref = (-x.astype(np.float64)) / (1 + np.exp(x.astype(np.float64)))
    ok = np.abs(ref) > 1e-30
    assert np.all(np.isfinite(m))
    assert np.max(np.abs(m[ok] - ref[ok]) / np.abs(ref[ok])) < 2e-6


def test_decode_step_allocation_free():
    """After warm-up, the fused layer ops allocate no array: the transient peak of traced
    memory during a step stays below the smallest array a step could allocate (D = 1024
    floats = 4 KiB; argument tuples and views take ~2 KB, independent of D)."""
    rng = np.random.default_rng(5)
    d, hq, hkv, hd, f = 1024, 8, 4, 128, 1536
    qs, bs, cos, sin, nw, x = _qkv_case(rng, d, hq, hkv, hd, 128, False)
    cpu = CpuBackend(threads=1)
    ws = [cpu.upload_weight(q) for q in qs]
    mw = [cpu.upload_weight(random_q(rng, o, i, 4, 128, sym=False))
          for o, i in ((d, hq * hd), (f, d), (f, d), (d, f))]
    pos = np.array([3], np.int32)

    def step(x):
        q, k, v = cpu.attention_input(x, nw, 1e-5, False, ws, bs, cos, sin, pos, (hq, hkv, hd))
        return cpu.attention_output_mlp(x, q.reshape(1, -1), mw[0], nw, 1e-5, False, *mw[1:])

    y = step(step(x))
    tracemalloc.start()
    try:
        peaks = []
        for _ in range(3):
            cur = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            y = step(y)
            peaks.append(tracemalloc.get_traced_memory()[1] - cur)
        cur = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        control = np.empty(d, np.float32)  # positive control: numpy data is traced
        control_peak = tracemalloc.get_traced_memory()[1] - cur
    finally:
        tracemalloc.stop()
    assert control_peak >= control.nbytes
    assert max(peaks) < 4 * d
