"""llama.cpp Q4_K / Q5_K keep their scales factored on the CPU: an int8 per 32 columns
times a float32 per 256 (``d * sc`` and ``dmin * m``; backends/cpu/repack.py
``factor_group_terms``), 4.75 and 5.75 bits per weight instead of 6.0 and 7.0.

* The factored form gives the same bits as the float32 form it replaces: decode GEMV and
  prefill GEMM for 1..9 tokens, the exact-decode path, grouped (fused) linears,
  embedding rows (== the dequantized GGUF), the portable kernels of CPUs without AVX2.
* Scales that do not factor (one ulp off, fp16 ``Q4_1`` scales) keep float32, and a
  weight may have one of ``sc`` / ``sz`` factored and the other not.
* The real Q4_K tensors of the catalog's Qwen and Gemma files all factor, and run
  bit-identically.
"""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from numba import njit

from edgeinfer.backends.cpu import CpuBackend, CpuQuantWeight, _simd, _simd_ir, _simd_tokens
from edgeinfer.backends.cpu.gemv import quantize_act
from edgeinfer.backends.cpu.repack import factor_group_terms, factor_scales, pack_factored
from edgeinfer.readers.gguf_blocks import relayout
from edgeinfer.readers.gguf_file import GGUFFile
from test_gguf_native import bits_equal, random_blocks

CPU = CpuBackend(threads=2)
QT = gguf.GGMLQuantizationType


_simd_q4_rows4 = _simd.SIMD_ROWS[(4, 4)]
_simd_q5_rows4 = _simd.SIMD_ROWS[(4, 5)]


@njit
def _simd_rows4(bits, y, r0, wp, sc, xq, dx, bmap, nb):  # the AVX2 intrinsic, from Numba
    if bits == 4:
        _simd_q4_rows4(y, r0, wp, sc, xq, dx, bmap, nb)
    else:
        _simd_q5_rows4(y, r0, wp, sc, xq, dx, bmap, nb)


def float_form(h: CpuQuantWeight, w) -> CpuQuantWeight:
    """``h`` with the float32 scales and zero-point terms of its source ``w``."""
    return dataclasses.replace(h, sc=np.ascontiguousarray(w.scales, np.float32),
                               sz=np.ascontiguousarray(-np.asarray(w.mins, np.float32)))


@pytest.mark.parametrize("qname,bits,bpw", [("Q4_K", 4, 4.75), ("Q5_K", 5, 5.75)])
def test_factored_scales_give_the_float_forms_bits(qname, bits, bpw):
    rng = np.random.default_rng(bits)
    out, nsb = 70, 3
    w = relayout(random_blocks(rng, qname, out, nsb), qname, "t", "x.gguf")
    h = CPU.upload_weight(w)
    assert h.bits == bits and h.sc.dtype == np.uint8 and h.sz.dtype == np.uint8
    assert h.n_groups == h.n_blocks == 8 * nsb
    assert h.nbytes * 8 / (out * w.in_features) == bpw
    hf = float_form(h, w)
    assert hf.nbytes * 8 / (out * w.in_features) == bpw + 1.25  # the form it replaces
    x = rng.standard_normal((9, w.in_features)).astype(np.float32)
    bias = rng.standard_normal(out).astype(np.float32)
    for t in range(1, 10):
        y = CPU.linear(x[:t], h, bias)
        assert bits_equal(y, CPU.linear(x[:t], hf, bias)), t
    assert np.abs(y).max() > 0.1  # real outputs, not zeros
    exact = CpuBackend(threads=1, exact_decode=True)
    assert bits_equal(exact.linear(x[:3], h), exact.linear(x[:3], hf))
    ids = np.array([3, 0, out - 1, 3])
    assert bits_equal(CPU.embed(h, ids), w.dequantize(rows=ids))
    g = CPU.group_linears([h, CPU.upload_weight(w)], [None, bias])
    gf = CPU.group_linears([hf, dataclasses.replace(hf)], [None, bias])
    assert g.weight.sc.dtype == np.uint8 and g.weight.out_features == 2 * out
    for t in (1, 5):
        for a, b in zip(CPU.linear_many(x[:t], g), CPU.linear_many(x[:t], gf)):
            assert bits_equal(a, b)


@pytest.mark.parametrize("bits", [4, 5])
def test_portable_kernels_read_factored_scales(bits):
    """The loops that CPUs without AVX2 run: the same bits from either form, and the
    AVX2 kernels' sums up to float rounding order."""
    rng = np.random.default_rng(11 + bits)
    qname = "Q4_K" if bits == 4 else "Q5_K"
    w = relayout(random_blocks(rng, qname, 8, 2), qname, "t", "x.gguf")
    h = CPU.upload_weight(w)
    hf = float_form(h, w)
    nb = h.n_blocks
    x = rng.standard_normal((4, w.in_features)).astype(np.float32)
    xq = np.zeros((4, nb * 32), np.int16)
    dx = np.zeros((4, nb), np.float32)
    xg = np.zeros((4, nb), np.float32)
    for t in range(4):
        quantize_act(xq[t], dx[t], xg[t], x[t], h.bmap)
    rows = _simd.PORTABLE_ROWS[(4, bits)]
    y, yf, ys = (np.zeros(8, np.float32) for _ in range(3))
    rows(y, 4, h.wp, h.sc, xq[0], dx[0], h.bmap, nb)
    rows(yf, 4, hf.wp, hf.sc, xq[0], dx[0], h.bmap, nb)
    if _simd_ir.HAVE_AVX2:
        _simd_rows4(bits, ys, 4, h.wp, h.sc, xq[0], dx[0], h.bmap, nb)
        np.testing.assert_allclose(y[4:], ys[4:], rtol=1e-5, atol=1e-5 * np.abs(ys).max())
    assert bits_equal(y, yf) and np.abs(y[4:]).max() > 0
    tok = _simd_tokens.PORTABLE_TOKENS[(4, bits)]
    y2, y2f = np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32)
    nob = np.zeros(0, np.float32)
    tok(y2, 0, 0, 8, h.wp, h.sc, h.sz, xg, nob, xq, dx, h.bmap, nb)
    tok(y2f, 0, 0, 8, hf.wp, hf.sc, hf.sz, xg, nob, xq, dx, h.bmap, nb)
    assert bits_equal(y2, y2f)
    ref = x @ w.dequantize().T
    np.testing.assert_allclose(y2, ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


def test_scales_that_do_not_factor_stay_float32():
    rng = np.random.default_rng(2)
    w = relayout(random_blocks(rng, "Q4_K", 12, 2), "Q4_K", "t", "x.gguf")
    nb = w.in_features // 32
    s = np.array(w.scales, np.float32)
    assert factor_group_terms(s, nb).dtype == np.uint8
    s[9, 5] = np.nextafter(s[9, 5], np.float32(1))  # one ulp: no longer d * int8 (row 9:
    assert factor_scales(s, 8) is None              # past the probe rows)
    kept = factor_group_terms(s, nb)
    assert kept is s
    odd = dataclasses.replace(w, scales=s)
    h = CPU.upload_weight(odd)
    assert h.sc.dtype == np.float32 and h.sz.dtype == np.uint8  # each term on its own
    x = rng.standard_normal((3, w.in_features)).astype(np.float32)
    hf = float_form(h, odd)
    assert bits_equal(CPU.linear(x, h), CPU.linear(x, hf))
    assert bits_equal(CPU.embed(h, np.array([9])), odd.dequantize(rows=np.array([9])))
    q41 = relayout(random_blocks(rng, "Q4_1", 12, 8), "Q4_1", "t", "x.gguf")
    assert CPU.upload_weight(q41).sc.dtype == np.uint16  # independent fp16 scales: as fp16


def test_factored_rows_pack_scales_then_super_scales():
    q = np.array([[1, -2, 127, -128, 5]], np.int8)
    d = np.array([[0.5]], np.float32)
    p = pack_factored(q, d, 5)
    assert p.shape == (1, 8 + 4)
    assert p[0, :5].view(np.int8).tolist() == [1, -2, 127, -128, 5]
    assert p[0, 5:8].tolist() == [0, 0, 0]
    assert p[0, 8:].view(np.float32)[0] == 0.5


def test_catalog_q4k_tensors_factor_and_run_bit_identically(qwen_gguf, gemma_gguf):
    """Every Q4_K tensor of the catalog's Qwen and Gemma files factors; the smallest of
    each runs as the float32 form does."""
    rng = np.random.default_rng(0)
    for path in (qwen_gguf, gemma_gguf):
        g = GGUFFile(path)
        infos = sorted((i for i in g.tensors.values() if QT(i.qtype) == QT.Q4_K),
                       key=lambda i: i.nbytes)
        assert infos
        for info in infos:
            w = relayout(g.raw(info), "Q4_K", info.name, str(path))
            nb = w.in_features // 32
            assert factor_group_terms(np.asarray(w.scales, np.float32), nb).dtype == np.uint8
            assert factor_group_terms(-np.asarray(w.mins, np.float32), nb).dtype == np.uint8
        w = relayout(g.raw(infos[0]), "Q4_K", infos[0].name, str(path))
        h = CPU.upload_weight(w)
        assert h.sc.dtype == np.uint8 and h.sz.dtype == np.uint8
        x = rng.standard_normal((5, w.in_features)).astype(np.float32)
        assert bits_equal(CPU.linear(x, h), CPU.linear(x, float_form(h, w)))
        assert bits_equal(CPU.linear(x[:1], h), CPU.linear(x[:1], float_form(h, w)))
