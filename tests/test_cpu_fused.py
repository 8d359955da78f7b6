"""The CPU backend's fused decode halves (``attention_input``, ``attention_output_mlp``)
and whole block (``decoder_block``, 4-bit and dense float32 weights) against the numpy
reference backend, against the CPU's own unfused composition, and the vectorized ``exp``
they use for the activation.

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


# ---- decoder_block: the whole plain pre-norm block (backends/cpu/decode.py) -------------
def _block(be, qs, bs, mq, nw, cos, sin, heads, window, softcap, act):
    from edgeinfer.backends.base import PreNormBlock
    wq, wk, wv = (be.upload_weight(q) for q in qs)
    wo, wg, wu, wd = (be.upload_weight(q) for q in mq)
    return PreNormBlock(nw, [wq, wk, wv], list(bs), cos, sin, wo, nw[::-1].copy(), wg, wu, wd,
                        heads, 1e-5, False, heads[2] ** -0.5, window, softcap, act)


@pytest.mark.parametrize("kv", ["f32", "f16", "int8", "int4", "k8v4"])
@pytest.mark.parametrize("d,hq,hkv,hd,f,group,bias,window,ring,softcap,act,threads", [
    (64, 8, 4, 8, 172, 32, False, None, False, None, "silu", 2),     # stories260K-like
    (200, 3, 1, 16, 100, 64, True, 5, False, 30.0, "gelu_tanh", 1),  # odd D/F, window, cap
    (96, 4, 2, 32, 128, 32, False, 4, True, None, "silu", 1),        # ring (windowed) layer
    (576, 9, 3, 64, 1536, 128, False, None, False, None, "silu", 2),  # SmolLM2 (parallel)
])
def test_decoder_block_vs_composition(kv, d, hq, hkv, hd, f, group, bias, window, ring,
                                      softcap, act, threads):
    """The fused decode block == the CPU's own composition of ops (same kernels: outputs
    to float association, caches byte-identical), and the reference as a sanity bound only
    (random weights, four chained int8-activation GEMVs per step and K/V from them in a
    4-bit cache drift to ~0.05 over the steps at SmolLM2 sizes, ~0.12 with int4 K whose
    channel statistics come from those K; the same for the composition),
    over a prefill then decode steps; f32/f16 ring layers fall back to the composition."""
    from edgeinfer.backends import kvcache
    rng = np.random.default_rng(d + hd)
    heads = (hq, hkv, hd)
    qs, bs, cos, sin, nw, _ = _qkv_case(rng, d, hq, hkv, hd, group, bias)
    mq = [random_q(rng, d, hq * hd, 4, group, sym=False), random_q(rng, f, d, 4, group, False),
          random_q(rng, f, d, 4, group, sym=False), random_q(rng, d, f, 4, group, sym=False)]
    cpu = CpuBackend(threads=threads)
    bc, br = (_block(be, qs, bs, mq, nw, cos, sin, heads, window, softcap, act)
              for be in (cpu, REF))
    kw = {"window_sizes": [window], "max_chunk": 8} if ring else {}
    fused_c, comp_c, ref_c = (kvcache.HostKVCache(1, hkv, hd, 40, kv, **kw) for _ in range(3))
    pos = np.arange(40, dtype=np.int32)
    start = 0
    for t in (5, 1, 1, 3, 1, 1, 1):  # prefill chunks (the composition) and decode steps
        x = rng.standard_normal((t, d)).astype(np.float32) * 2
        p = pos[start:start + t]
        y_f = np.array(cpu.decoder_block(x, bc, p, fused_c, 0))
        y_c = np.array(Backend.decoder_block(cpu, x, bc, p, comp_c, 0))
        y_r = REF.decoder_block(x, br, p, ref_c, 0)
        assert y_f.shape == (t, d)
        assert nerr(y_f, y_c) < 1e-5
        assert nerr(y_f, y_r) < 0.2  # sanity only (see the docstring)
        for name, arr in comp_c.raw(0).items():
            assert np.array_equal(arr.view(np.uint8), fused_c.raw(0)[name].view(np.uint8)), name
        start += t
    prepared = fused_c._cpu_dec[0][1]
    assert (prepared is False) == (ring and kv in ("f32", "f16"))  # else the fused path ran


def _decode_equals_composition(cpu, blk, kv, ring, window, rng, ref=None, tol=None):
    """Prefill chunks and decode steps of ``blk`` through ``cpu.decoder_block`` equal the
    contract's composition on the same backend bit for bit, outputs and cache bytes, also
    with the block's output scratch fed back as x (in place); with ``ref`` = (backend,
    block), its outputs within ``tol``. Returns the cache the decode path wrote."""
    from edgeinfer.backends import kvcache
    _, hkv, hd = blk.heads
    d = blk.input_norm.shape[0]
    kw = {"window_sizes": [window], "max_chunk": 8} if ring else {}
    new_c, comp_c, ref_c = (kvcache.HostKVCache(1, hkv, hd, 40, kv, **kw) for _ in range(3))
    pos = np.arange(40, dtype=np.int32)
    start = 0
    for i, t in enumerate((5, 1, 1, 3, 1, 1, 1)):  # prefill chunks and decode steps
        x = rng.standard_normal((t, d)).astype(np.float32) * 2
        p = pos[start:start + t]
        y_c = np.array(Backend.decoder_block(cpu, x, blk, p, comp_c, 0))
        if t == 1 and i % 2:  # the previous step's output buffer as this step's input
            x_in = cpu._scratch("xo", (1, d))
            x_in[...] = x
        else:
            x_in = x
        y_n = np.array(cpu.decoder_block(x_in, blk, p, new_c, 0))
        assert np.array_equal(y_n, y_c)
        if ref is not None:
            assert nerr(y_n, ref[0].decoder_block(x, ref[1], p, ref_c, 0)) < tol
        for name, arr in comp_c.raw(0).items():
            assert np.array_equal(arr.view(np.uint8), new_c.raw(0)[name].view(np.uint8)), name
        start += t
    return new_c


@pytest.mark.parametrize("kv", ["f32", "f16", "int8", "int4", "k8v4"])
@pytest.mark.parametrize("d,hq,hkv,hd,f,bias,window,ring,softcap,act,threads", [
    (64, 8, 4, 8, 172, False, None, False, None, "silu", 2),       # stories260K-like
    (200, 3, 1, 16, 100, True, 5, False, 30.0, "gelu_tanh", 1),    # odd D/F, bias, window
    (96, 4, 2, 32, 128, False, 4, True, None, "silu", 1),          # ring (windowed) layer
])
def test_decoder_block_dense_equals_composition(kv, d, hq, hkv, hd, f, bias, window, ring,
                                                softcap, act, threads):
    """Dense float32 weights (backends/cpu/stepwise.py): the decode step == the CPU's own
    composition of ops bit for bit (the same BLAS GEMVs and kernels, into scratch), outputs
    and caches, also with the block's output scratch fed back as x (in place); f32/f16
    ring layers fall back to the composition."""
    rng = np.random.default_rng(d + hd + 1)
    heads = (hq, hkv, hd)
    qs, bs, cos, sin, nw, _ = _qkv_case(rng, d, hq, hkv, hd, 32, bias)
    qs = [q.dequantize() for q in qs]
    mq = [random_q(rng, *s, 4, 32, sym=False).dequantize()
          for s in ((d, hq * hd), (f, d), (f, d), (d, f))]
    cpu = CpuBackend(threads=threads)
    blk = _block(cpu, qs, bs, mq, nw, cos, sin, heads, window, softcap, act)
    dense_c = _decode_equals_composition(cpu, blk, kv, ring, window, rng)
    assert blk._cpu_prep[1][0] is None  # dense weights prepared (decode.py's marker)
    prepared = dense_c._cpu_dec[0][1]
    assert (prepared is False) == (ring and kv in ("f32", "f16"))  # else the dense path ran


def test_decoder_block_overflow_and_fallbacks():
    """Decode past the cache raises like the composition; exact_decode takes the
    composition; mixed 4-bit / dense weights take the step-wise path
    (backends/cpu/stepwise.py) and equal the composition."""
    from edgeinfer.backends.cpu.stepwise import StepwiseBlock
    rng = np.random.default_rng(3)
    d, hq, hkv, hd, f = 64, 4, 2, 16, 96
    heads = (hq, hkv, hd)
    qs, bs, cos, sin, nw, x = _qkv_case(rng, d, hq, hkv, hd, 32, False)
    mq = [random_q(rng, d, hq * hd, 4, 32, sym=False), random_q(rng, f, d, 4, 32, False),
          random_q(rng, f, d, 4, 32, sym=False), random_q(rng, d, f, 4, 32, sym=False)]
    cpu = CpuBackend(threads=1)
    blk = _block(cpu, qs, bs, mq, nw, cos, sin, heads, None, None, "silu")
    cache = cpu.new_kv_cache(1, hkv, hd, 4, "int8")
    pos = np.arange(40, dtype=np.int32)
    for p in range(4):
        cpu.decoder_block(x, blk, pos[p:p + 1], cache, 0)
    with pytest.raises(ValueError, match="overflow"):
        cpu.decoder_block(x, blk, pos[4:5], cache, 0)
    exact = CpuBackend(threads=1, exact_decode=True)
    be = _block(exact, qs, bs, mq, nw, cos, sin, heads, None, None, "silu")
    c2 = exact.new_kv_cache(1, hkv, hd, 4, "int8")
    y = exact.decoder_block(x, be, pos[:1], c2, 0)
    assert "_cpu_dec" not in c2.__dict__ and y.shape == (1, d)
    mixed = _block(cpu, [q.dequantize() for q in qs], bs, mq, nw, cos, sin, heads, None, None,
                   "silu")
    c3 = cpu.new_kv_cache(1, hkv, hd, 4, "int8")
    y = cpu.decoder_block(x, mixed, pos[:1], c3, 0)
    assert isinstance(mixed._cpu_prep[1][1], StepwiseBlock)
    assert np.array_equal(y, Backend.decoder_block(cpu, x, mixed, pos[:1],
                                                   cpu.new_kv_cache(1, hkv, hd, 4, "int8"), 0))


@pytest.mark.parametrize("kv", ["f32", "f16", "int8", "int4", "k8v4"])
@pytest.mark.parametrize("weights", ["q4", "f32"])
@pytest.mark.parametrize("d,hq,hkv,hd,f,bias,window,ring,norms", [
    (64, 4, 1, 16, 96, False, None, False, "qk+sandwich"),  # Gemma 3 global layer
    (96, 4, 2, 32, 128, False, 4, True, "qk+sandwich"),     # Gemma 3 sliding layer (ring)
    (64, 8, 4, 8, 128, True, 5, False, "sandwich"),         # sandwich norms only, bias
    (64, 8, 4, 8, 96, False, None, False, "qk"),            # QK-norm only (Qwen3-like)
])
def test_decoder_block_normed_equals_composition(kv, weights, d, hq, hkv, hd, f, bias, window,
                                                 ring, norms):
    """Blocks with QK-norm / sandwich norms (backends/cpu/stepwise.py), 4-bit and dense
    float32 weights: the decode step == the CPU's own composition of ops bit for bit,
    outputs and caches, also with the output scratch fed back as x; the reference as a
    bound (dense: float association only); f32/f16 ring layers fall back to the
    composition, as for plain blocks."""
    import dataclasses

    from edgeinfer.backends.cpu.stepwise import StepwiseBlock
    rng = np.random.default_rng(d + hd + f)
    heads = (hq, hkv, hd)
    qs, bs, cos, sin, nw, _ = _qkv_case(rng, d, hq, hkv, hd, 32, bias)
    mq = [random_q(rng, *s, 4, 32, sym=False) for s in ((d, hq * hd), (f, d), (f, d), (d, f))]
    if weights == "f32":
        qs, mq = [q.dequantize() for q in qs], [q.dequantize() for q in mq]
    nrm = {n: (rng.standard_normal(s) * 0.3).astype(np.float32) for n, s in (
        ("q_norm", hd), ("k_norm", hd), ("attn_out_norm", d), ("mlp_out_norm", d))
        if ("qk" if n[1] == "_" else "sandwich") in norms}
    cpu = CpuBackend(threads=1)
    blk, br = (dataclasses.replace(_block(be, qs, bs, mq, nw, cos, sin, heads, window, None,
                                          "gelu_tanh"), unit_offset=True, **nrm)
               for be in (cpu, REF))
    assert not blk.plain
    new_c = _decode_equals_composition(cpu, blk, kv, ring, window, rng, (REF, br),
                                       1e-4 if weights == "f32" and kv == "f32" else 0.2)
    assert isinstance(blk._cpu_prep[1][1], StepwiseBlock)
    lin = blk._cpu_prep[1][1].lin_qkv[0][1]
    assert isinstance(lin, np.ndarray) == (weights == "f32")  # 4-bit: the fused q/k/v GEMV
    prepared = new_c._cpu_dec[0][1]
    assert (prepared is False) == (ring and kv in ("f32", "f16"))  # else the new path ran
