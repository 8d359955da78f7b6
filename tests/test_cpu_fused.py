"""The CPU backend's fused decode kernels (the halves of :mod:`.fused`) and its compiled
decode layers (:mod:`edgeinfer.backends.cpu.plan`: fused, step-wise, with the attention
kernels or the attention op) against the numpy reference backend and against the
model's composition of ops (:func:`edgeinfer.models.block.block_forward`) on the same
backend, and the vectorized ``exp`` they use for the activation.

Bounds (see tests/test_cpu_kernels.py): vs the reference, the integer-activation GEMVs
give ``ACT_TOL``; vs the unfused CPU ops (same integer GEMVs, the same strict row kernels
for norm, RoPE and GLU) bit-identical: a decode step computes what a prefill computes.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from edgeinfer.backends import kvcache
from edgeinfer.backends.base import DecoderBlock, DecodeStep
from edgeinfer.backends.cpu import CpuBackend, fused, plan
from edgeinfer.backends.cpu.gemv import SERIAL_MAX_BYTES
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.models.block import block_forward
from test_cpu_kernels import ACT_TOL, nerr, random_q

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


# ---- the fused halves (backends/cpu/fused.py) ------------------------------------------
@pytest.mark.parametrize("d,hq,hkv,hd,group,bias,rdim,threads", [
    (64, 8, 4, 8, 32, False, None, 2),      # stories260K-like
    (200, 3, 1, 16, 64, True, None, 1),     # D not a multiple of 32 or of the group
    (576, 9, 3, 64, 128, False, None, 2),   # SmolLM2 (parallel variant: > SERIAL_MAX_BYTES)
    (96, 4, 2, 24, 32, True, 16, 1),        # partial rotary dims
])
def test_qkv_rope_vs_reference(d, hq, hkv, hd, group, bias, rdim, threads):
    """rmsnorm + fused q/k/v GEMV + RoPE in one call == the reference ops (ACT_TOL) and
    the CPU's own ops on the same group (bit for bit)."""
    rng = np.random.default_rng(d + hq)
    qs, bs, cos, sin, nw, x = _qkv_case(rng, d, hq, hkv, hd, group, bias, rdim)
    pos = np.array([11], np.int32)
    cpu = CpuBackend(threads=threads)

    def ops(be, g):
        h = be.rmsnorm(x, nw, 1e-5, False)
        q, k, v = be.linear_many(h, g)
        return (be.rope(q.reshape(1, hq, hd), cos, sin, pos),
                be.rope(k.reshape(1, hkv, hd), cos, sin, pos), v.reshape(1, hkv, hd))

    ref = ops(REF, REF.group_linears([REF.upload_weight(q) for q in qs], bs))
    g = cpu.group_linears([cpu.upload_weight(q) for q in qs], bs)
    unf = ops(cpu, g)
    w = g.weight
    y = np.zeros(w.out_features, np.float32)
    fn = fused.qkv_rope_ser if w.nbytes <= SERIAL_MAX_BYTES else fused.qkv_rope_par
    fn(y, x, nw, 1e-5, False, np.zeros(d, np.float32), plan.weight_arrays(w),
       np.zeros(0, np.float32) if g.bias is None else g.bias,
       cpu.act_scratch.get(w.n_blocks, w.n_groups), cos, sin, 11, hq, hkv, hd)
    got = (y[:hq * hd].reshape(1, hq, hd), y[hq * hd:(hq + hkv) * hd].reshape(1, hkv, hd),
           y[(hq + hkv) * hd:].reshape(1, hkv, hd))
    for c, r, u in zip(got, ref, unf):
        assert c.shape == r.shape
        assert nerr(c, r) < ACT_TOL
        assert np.array_equal(c, u)


@pytest.mark.parametrize("d,f,group,act,threads", [
    (64, 172, 32, "silu", 1),          # F padded 172 -> 192
    (96, 100, 32, "gelu_tanh", 2),
    (576, 1536, 128, "silu", 2),       # SmolLM2 sizes (parallel variant)
    (128, 320, 64, "gelu_tanh", 1),
])
def test_out_mlp_vs_reference(d, f, group, act, threads):
    """Wo + residual + rmsnorm + gate/up + GLU + down + residual in one call == the
    reference ops and the CPU's own ops; also in place (output fed back as x)."""
    rng = np.random.default_rng(d + f)
    qs = [random_q(rng, d, d, 4, group, sym=False), random_q(rng, f, d, 4, group, sym=False),
          random_q(rng, f, d, 4, group, sym=False), random_q(rng, d, f, 4, group, sym=False)]
    nw = (rng.standard_normal(d) * 0.5 + 1).astype(np.float32)
    x = rng.standard_normal((1, d)).astype(np.float32)
    a = rng.standard_normal((1, d)).astype(np.float32)
    x0 = x.copy()
    cpu = CpuBackend(threads=threads)

    def ops(be, x, wo, gu, wd):
        x = be.add(x, be.linear(a, wo))
        gate, up = be.linear_many(be.rmsnorm(x, nw, 1e-5, True), gu)
        return be.add(x, be.linear(be.glu(gate, up, act), wd))

    def up(be):
        wo, wg, wu, wd = (be.upload_weight(q) for q in qs)
        return wo, be.group_linears([wg, wu], [None, None]), wd

    ref = ops(REF, x, *up(REF))
    wo, gu, wd = up(cpu)
    unf = ops(cpu, x, wo, gu, wd)
    w = gu.weight
    fn = fused.out_mlp_ser if w.nbytes <= SERIAL_MAX_BYTES else fused.out_mlp_par
    xo = np.zeros((1, d), np.float32)
    nob = tuple(np.zeros(n, np.float32) for n in (d, d, 2 * f, f))

    def call(xin):
        fn(xo, xin, a, nw, 1e-5, True, act == "gelu_tanh", plan.weight_arrays(wo), plan.weight_arrays(w),
           plan.weight_arrays(wd), *(cpu.act_scratch.get(v.n_blocks, v.n_groups) for v in (wo, w, wd)),
           nob, np.zeros(0, np.float32))
        return xo.copy()

    y = call(x)
    assert np.array_equal(x, x0)  # x itself is never written
    assert nerr(y, ref) < ACT_TOL
    assert np.array_equal(y, unf)
    y2 = call(xo)  # in place: the result fed back as x (what the next layer does)
    assert np.array_equal(y2, ops(cpu, y, wo, gu, wd))


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



def test_glu_row_compiles_the_shared_exp_strict():
    """glu_row inlines attention.exp_f32 (declared fast-math) yet stays strict float32: no
    float op of its IR carries a fast-math flag, so every caller gets a row's same bits.
    Control: the same function compiled with exp_f32's flags shows them."""
    import re

    from numba import njit

    from edgeinfer.backends.cpu.attention import _FM
    from edgeinfer.backends.cpu.elementwise import glu_row

    def float_op_flags(fn) -> set[str]:
        ir = "".join(fn.inspect_llvm(sig) for sig in fn.signatures)
        return set(re.findall(r"= f(?:add|sub|mul|div) ((?:[a-z]+ )*)float", ir))

    g = np.linspace(-4, 4, 64).astype(np.float32)
    m = np.empty_like(g)
    # glu_row's own options, compiled here: code loaded from a warm on-disk cache has no IR
    opts = {k: v for k, v in glu_row.targetoptions.items() if k != "nopython"}
    strict = njit(**opts, cache=False)(glu_row.py_func)
    strict(m, g, g, False)
    assert float_op_flags(strict) == {""}
    fast = njit(fastmath=_FM, error_model="numpy")(glu_row.py_func)
    fast(m, g, g, False)
    assert any("contract" in f for f in float_op_flags(fast))

# ---- compiled decode layers (backends/cpu/plan.py) -------------------------------------
def _block(be, qs, bs, mq, nw, cos, sin, heads, window, softcap, act, **norms):
    wq, wk, wv = (be.upload_weight(q) for q in qs)
    wo, wg, wu, wd = (be.upload_weight(q) for q in mq)
    return DecoderBlock(nw, be.group_linears([wq, wk, wv], list(bs)), cos, sin, wo,
                        nw[::-1].copy(), be.group_linears([wg, wu], [None, None]), wd, heads,
                        1e-5, bool(norms), heads[2] ** -0.5, window, softcap, act, **norms)


def _steps(cpu, blk, kv, ring, window, rng, ref=None, check=None, compose_tol=None):
    """Prefill chunks (the composition) and decode steps (the compiled layer) of ``blk``
    on ``cpu`` == an oracle on the same backend bit for bit, outputs and cache bytes, also
    with the layer's output scratch fed back as x (in place). The oracle is the
    composition (:func:`block_forward`), or with ``compose_tol`` the same layer's halves
    around the backend's attention op (fused halves round differently from the single
    ops: their outputs are then within ``compose_tol`` of the composition's). With
    ``ref`` = (backend, block), its outputs within ``check``. Returns the layer plan."""
    _, hkv, hd = blk.heads
    d = blk.input_norm.shape[0]
    kw = {"window_sizes": [window], "max_chunk": 8} if ring else {}
    new_c, orc_c, ref_c, comp_c = (kvcache.HostKVCache(1, hkv, hd, 40, kv, **kw)
                                   for _ in range(4))
    lp = plan.layer_plan(cpu, blk, new_c, 0)
    op = plan.layer_plan(cpu, blk, orc_c, 0)._replace(attn=None)  # the attention op
    pos = np.arange(40, dtype=np.int32)
    start = 0
    for i, t in enumerate((5, 1, 1, 3, 1, 1, 1)):  # prefill chunks and decode steps
        x = rng.standard_normal((t, d)).astype(np.float32) * 2
        p = pos[start:start + t]
        if t == 1:
            x_in = x
            if i % 2:  # the previous step's output buffer as this step's input
                x_in = cpu.scratch("xo", (1, d))
                x_in[...] = x
            y_n = np.array(plan.run_layer(cpu, lp, x_in, p, start, new_c, 0))
            if compose_tol is None:
                y_o = np.array(block_forward(cpu, blk, x, p, orc_c, 0))
            else:
                y_o = np.array(plan.run_layer(cpu, op, x.copy(), p, start, orc_c, 0))
                y_c = np.array(block_forward(cpu, blk, x, p, comp_c, 0))
                assert nerr(y_n, y_c) < compose_tol
        else:
            y_n = np.array(block_forward(cpu, blk, x, p, new_c, 0))
            y_o = np.array(block_forward(cpu, blk, x, p, orc_c, 0))
            if compose_tol is not None:
                block_forward(cpu, blk, x, p, comp_c, 0)
        assert y_n.shape == (t, d)
        assert np.array_equal(y_n, y_o)
        if ref is not None:
            assert nerr(y_n, block_forward(ref[0], ref[1], x, p, ref_c, 0)) < check
        for name, arr in orc_c.raw(0).items():
            assert np.array_equal(arr.view(np.uint8), new_c.raw(0)[name].view(np.uint8)), name
        start += t
    return lp


@pytest.mark.parametrize("kv", ["f32", "f16", "int8", "int4", "k8v4"])
@pytest.mark.parametrize("d,hq,hkv,hd,f,group,bias,window,ring,softcap,act,threads", [
    (64, 8, 4, 8, 172, 32, False, None, False, None, "silu", 2),     # stories260K-like
    (200, 3, 1, 16, 100, 64, True, 5, False, 30.0, "gelu_tanh", 1),  # odd D/F, window, cap
    (96, 4, 2, 32, 128, 32, False, 4, True, None, "silu", 1),        # ring (windowed) layer
    (576, 9, 3, 64, 1536, 128, False, None, False, None, "silu", 2),  # SmolLM2 (parallel)
])
def test_fused_layer_vs_composition(kv, d, hq, hkv, hd, f, group, bias, window, ring,
                                    softcap, act, threads):
    """A plain 4-bit block's compiled layer == the composition of single ops
    (:func:`block_forward`, as prefill runs it) bit for bit, outputs and cache bytes,
    and the reference as a sanity bound only (random weights, four chained
    integer-activation GEMVs per step and K/V from them in a quantized cache); f32/f16
    ring layers take the attention op between the fused halves."""
    rng = np.random.default_rng(d + hd)
    heads = (hq, hkv, hd)
    qs, bs, cos, sin, nw, _ = _qkv_case(rng, d, hq, hkv, hd, group, bias)
    mq = [random_q(rng, d, hq * hd, 4, group, sym=False), random_q(rng, f, d, 4, group, False),
          random_q(rng, f, d, 4, group, sym=False), random_q(rng, d, f, 4, group, sym=False)]
    cpu = CpuBackend(threads=threads)
    bc, br = (_block(be, qs, bs, mq, nw, cos, sin, heads, window, softcap, act)
              for be in (cpu, REF))
    lp = _steps(cpu, bc, kv, ring, window, rng, (REF, br), 0.2)
    assert lp.qkv is not None and lp.mlp is not None and lp.steps is None  # fused halves
    assert (lp.attn is None) == (ring and kv in ("f32", "f16"))  # else the kernels


@pytest.mark.parametrize("kv", ["f32", "f16", "int8", "int4", "k8v4"])
@pytest.mark.parametrize("d,hq,hkv,hd,f,bias,window,ring,softcap,act,threads", [
    (64, 8, 4, 8, 172, False, None, False, None, "silu", 2),       # stories260K-like
    (200, 3, 1, 16, 100, True, 5, False, 30.0, "gelu_tanh", 1),    # odd D/F, bias, window
    (96, 4, 2, 32, 128, False, 4, True, None, "silu", 1),          # ring (windowed) layer
])
def test_dense_layer_equals_composition(kv, d, hq, hkv, hd, f, bias, window, ring,
                                        softcap, act, threads):
    """Dense float32 weights (backends/cpu/stepwise.py): the decode step == the CPU's own
    composition of ops bit for bit (the same BLAS GEMVs and kernels, into scratch),
    outputs and caches, also with the output scratch fed back as x (in place)."""
    rng = np.random.default_rng(d + hd + 1)
    heads = (hq, hkv, hd)
    qs, bs, cos, sin, nw, _ = _qkv_case(rng, d, hq, hkv, hd, 32, bias)
    qs = [q.dequantize() for q in qs]
    mq = [random_q(rng, *s, 4, 32, sym=False).dequantize()
          for s in ((d, hq * hd), (f, d), (f, d), (d, f))]
    cpu = CpuBackend(threads=threads)
    blk = _block(cpu, qs, bs, mq, nw, cos, sin, heads, window, softcap, act)
    lp = _steps(cpu, blk, kv, ring, window, rng)
    assert lp.qkv is None and lp.mlp is None and lp.steps is not None  # the step-wise halves
    assert (lp.attn is None) == (ring and kv in ("f32", "f16"))


def test_layer_overflow_exact_and_mixed():
    """Decode past the cache raises like the composition; exact_decode compiles no plan;
    mixed 4-bit / dense weights take the step-wise halves and equal the composition."""
    rng = np.random.default_rng(3)
    d, hq, hkv, hd, f = 64, 4, 2, 16, 96
    heads = (hq, hkv, hd)
    qs, bs, cos, sin, nw, x = _qkv_case(rng, d, hq, hkv, hd, 32, False)
    mq = [random_q(rng, d, hq * hd, 4, 32, sym=False), random_q(rng, f, d, 4, 32, False),
          random_q(rng, f, d, 4, 32, sym=False), random_q(rng, d, f, 4, 32, sym=False)]
    cpu = CpuBackend(threads=1)
    blk = _block(cpu, qs, bs, mq, nw, cos, sin, heads, None, None, "silu")
    cache = cpu.new_kv_cache(1, hkv, hd, 4, "int8")
    lp = plan.layer_plan(cpu, blk, cache, 0)
    pos = np.arange(40, dtype=np.int32)
    for p in range(4):
        plan.run_layer(cpu, lp, x, pos[p:p + 1], p, cache, 0)
    with pytest.raises(ValueError, match="overflow"):
        plan.run_layer(cpu, lp, x, pos[4:5], 4, cache, 0)
    with pytest.raises(ValueError, match="overflow"):
        block_forward(cpu, blk, x, pos[4:5], cache, 0)
    exact = CpuBackend(threads=1, exact_decode=True)
    be = _block(exact, qs, bs, mq, nw, cos, sin, heads, None, None, "silu")
    step = DecodeStep(exact.upload_embedding(rng.standard_normal((8, d)).astype(np.float32)),
                      1.0, (be,), nw, 1e-5, False,
                      exact.upload_weight(rng.standard_normal((8, d)).astype(np.float32)), None)
    assert exact.compile_decode(step, exact.new_kv_cache(1, hkv, hd, 4, "int8")) is None
    assert cpu.compile_decode(dataclasses.replace(step, blocks=(blk,)),
                              cpu.new_kv_cache(1, hkv, hd, 4, "int8")) is not None
    mixed = _block(cpu, [q.dequantize() for q in qs], bs, mq, nw, cos, sin, heads, None, None,
                   "silu")
    lp = _steps(cpu, mixed, "int8", False, None, rng)
    assert lp.qkv is None and lp.steps is not None  # (its fused MLP half: the op path only)


@pytest.mark.parametrize("kv", ["f32", "f16", "int8", "int4", "k8v4"])
@pytest.mark.parametrize("weights", ["q4", "f32"])
@pytest.mark.parametrize("d,hq,hkv,hd,f,bias,window,ring,norms", [
    (64, 4, 1, 16, 96, False, None, False, "qk+sandwich"),  # Gemma 3 global layer
    (96, 4, 2, 32, 128, False, 4, True, "qk+sandwich"),     # Gemma 3 sliding layer (ring)
    (64, 8, 4, 8, 128, True, 5, False, "sandwich"),         # sandwich norms only, bias
    (64, 8, 4, 8, 96, False, None, False, "qk"),            # QK-norm only (Qwen3-like)
])
def test_normed_layer_equals_composition(kv, weights, d, hq, hkv, hd, f, bias, window,
                                         ring, norms):
    """Blocks with QK-norm / sandwich norms (backends/cpu/stepwise.py), 4-bit and dense
    float32 weights: the decode step == the CPU's own composition of ops bit for bit,
    outputs and caches, also with the output scratch fed back as x; the reference as a
    bound (dense: float association only); f32/f16 ring layers take the attention op."""
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
    blk, br = (_block(be, qs, bs, mq, nw, cos, sin, heads, window, None, "gelu_tanh", **nrm)
               for be in (cpu, REF))
    assert not blk.plain
    lp = _steps(cpu, blk, kv, ring, window, rng, (REF, br),
                1e-4 if weights == "f32" and kv == "f32" else 0.2)
    assert lp.qkv is None and lp.steps is not None
    lin = lp.steps.lin_qkv[0][1]
    assert isinstance(lin, np.ndarray) == (weights == "f32")  # 4-bit: the fused q/k/v GEMV
    assert (lp.attn is None) == (ring and kv in ("f32", "f16"))  # else the kernels ran


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("rows", [7, 300])
def test_glu_reads_a_fused_gate_up_output_in_place_bit_identical(gelu, rows, monkeypatch):
    """Column views of one fused gate|up output go to glu_rows_of_par without copies and
    give the same bits as contiguous copies through glu_rows2(_par) and as glu_row per row
    (the decode's kernel); any other strided pair falls back to the copies."""
    from edgeinfer.backends.cpu import elementwise as ew

    f = 4864
    gu = (np.random.default_rng(rows).standard_normal((rows, 2 * f)) * 3).astype(np.float32)
    g, u = gu[:, :f], gu[:, f:]
    want = np.empty((rows, f), np.float32)
    for r in range(rows):
        ew.glu_row(want[r], np.ascontiguousarray(g[r]), np.ascontiguousarray(u[r]), gelu)
    copies = ew.glu_into(np.empty_like(want), g.copy(), u.copy(), gelu)
    assert ew._fused_columns(g, u) == (gu, 0, f)
    assert ew._fused_columns(u, g) == (gu, f, 0)
    calls, real = [], ew.glu_rows_of_par

    def recorded(y, base, go, uo, act):
        calls.append((go, uo))
        return real(y, base, go, uo, act)

    monkeypatch.setattr(ew, "glu_rows_of_par", recorded)
    got = ew.glu_into(np.empty_like(want), g, u, gelu)
    swapped = ew.glu_into(np.empty_like(want), u, g, gelu)
    assert calls == [(0, f), (f, 0)]
    assert np.array_equal(got, want) and np.array_equal(copies, want)
    assert not np.array_equal(swapped, want)
    # not one base (a copy's column views), or a stepped view: the copy path
    other = gu.copy()
    assert ew._fused_columns(g, other[:, f:]) is None
    assert ew._fused_columns(gu[:, :2 * f:2], gu[:, 1::2]) is None
    assert ew._fused_columns(gu[::2, :f], gu[::2, f:]) is None

