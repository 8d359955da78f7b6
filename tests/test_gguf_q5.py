"""llama.cpp Q5_0 / Q5_1 run at 5 bits on the CPU: the re-laid 8-bit codes (q - 16, or q
with float mins; tests/test_gguf_native.py) are repacked into 4-bit chunks plus a u32 of
fifth bits per block (backends/cpu/repack.py, the ``bits == 5`` kernels of
backends/cpu/_simd.py and _simd_tokens.py).

* Repack: which weights become 5-bit (Q5_0, Q5_1, any symmetric 8-bit weight whose codes
  fit -16..15) and which stay 8-bit (a code of 16, Q8_0, lane scales); the packed bytes
  of a hand-made row; 5.5 code bits per weight.
* Kernels: AVX2 rows vs portable rows vs the float oracle (tails of 1-3 rows, an odd
  block count, groups of 32 and 64); multi-token kernels vs portable and decode GEMV ==
  prefill GEMM row for row; embedding rows exact; exact_decode; fused groups.
* Models: a model whose linears are all Q5_0-form gives bit-identical logits whole, in
  chunks and by decode steps; the catalog Qwen file loads its Q5_0 linears at 5 bits with
  the 8-bit path's greedy tokens (slow).
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from numba import njit

from edgeinfer.backends.cpu import CpuBackend, CpuQuantWeight, _simd, _simd_ir, _simd_tokens
from edgeinfer.backends.cpu.gemv import ActScratch, quantize_act
from edgeinfer.backends.cpu.repack import five_bit_codes, term_values
from edgeinfer.backends.quantized import QuantizedTensor
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.readers.gguf_blocks import relayout
from layout_models import (assert_rows_bit_identical_whatever_m, batched_step_handles,
                           stories_in_layout)

REF = ReferenceBackend()
CPU = CpuBackend(threads=2)
ACT_TOL = 2e-4  # the integer linears' 15-bit activations (tests/test_cpu_kernels.py)
QT = {"Q5_0": gguf.GGMLQuantizationType.Q5_0, "Q5_1": gguf.GGMLQuantizationType.Q5_1}
BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24}


def nerr(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def q5_blocks(rng, qname: str, rows: int, nblk: int) -> np.ndarray:
    """Random ``qname`` bytes [rows, nblk * block bytes]: every code and fifth-bit pattern,
    small Gaussian fp16 scales (and mins)."""
    bb = BLOCK_BYTES[qname]
    raw = rng.integers(0, 256, (rows, nblk, bb), dtype=np.uint8)
    for at in (0, 2) if qname == "Q5_1" else (0,):
        v = (rng.standard_normal((rows, nblk)) * 0.01).astype(np.float16)
        raw[:, :, at:at + 2] = v.view(np.uint8).reshape(rows, nblk, 2)
    return raw.reshape(rows, nblk * bb)


def q5_layout(w: np.ndarray) -> QuantizedTensor:
    """A float32 weight [out, in] rounded into the Q5_0 re-layout's form (8-bit codes in
    -16..15, an fp16 scale per 32 columns)."""
    out, k = w.shape
    kp = -(-k // 32) * 32
    wp = np.zeros((out, kp), np.float32)
    wp[:, :k] = w
    g = wp.reshape(out, kp // 32, 32)
    s = (np.abs(g).max(axis=2) / 16.0).astype(np.float16)
    s[s == 0] = 1.0
    codes = np.clip(np.rint(g / s[:, :, None].astype(np.float32)), -16, 15)
    return QuantizedTensor(codes.astype(np.int8).reshape(out, kp), s, None, 8, 32, k, "gguf:Q5_0")


# ---- repack ---------------------------------------------------------------------------------
def test_which_weights_run_at_five_bits():
    rng = np.random.default_rng(1)
    for qname in QT:
        w = relayout(q5_blocks(rng, qname, 6, 4), qname, "t", "x.gguf")
        h = CPU.upload_weight(w)
        assert h.bits == 5 and h.wp.shape == (6, 4 * 20) and h.wp.dtype == np.uint8
        assert (h.wp.nbytes * 8) / w.qweight.size == 5.0  # the codes: 5 bits a weight
    codes = rng.integers(-16, 16, (4, 64)).astype(np.int8)
    s = np.ones((4, 2), np.float16)
    assert CPU.upload_weight(QuantizedTensor(codes, s, None, 8, 32, 64)).bits == 5
    codes[2, 7] = 16  # one code outside -16..15: stays 8-bit
    assert five_bit_codes(QuantizedTensor(codes, s, None, 8, 32, 64)) is None
    assert CPU.upload_weight(QuantizedTensor(codes, s, None, 8, 32, 64)).bits == 8
    codes[2, 7] = -17
    assert CPU.upload_weight(QuantizedTensor(codes, s, None, 8, 32, 64)).bits == 8
    q8 = relayout(np.ascontiguousarray(rng.integers(0, 256, (3, 34), dtype=np.uint8)),
                  "Q8_0", "t", "x.gguf")
    q8.scales[:] = 1.0
    assert CPU.upload_weight(q8).bits == 8  # Q8_0's codes span -128..127
    lane = QuantizedTensor(np.zeros((2, 32), np.int8), np.ones((2, 2), np.float16), None,
                           8, 16, 32)
    assert CPU.upload_weight(lane).lane_scales  # groups of 16: the lane kernels (Q6_K)


def test_packed_bytes_of_a_hand_made_row():
    """Codes u (Q5_0 stored as q - 16) = column index mod 32, 64 columns: nibbles as the
    4-bit layout (block 0 low, block 1 high), then per block a little-endian u32 whose bit
    j is bit 4 of column j."""
    u = np.arange(64) % 32
    w = QuantizedTensor((u - 16).astype(np.int8)[None], np.ones((1, 2), np.float16), None,
                        8, 32, 64)
    h = CPU.upload_weight(w)
    row = h.wp[0]
    assert row.shape == (40,)
    j = np.arange(32)
    assert np.array_equal(row[:32], (j & 15) | ((j & 15) << 4))
    assert np.array_equal(row[32:36].view("<u4"), [0xFFFF0000])  # columns 16-31 have bit 4
    assert np.array_equal(row[36:40].view("<u4"), [0xFFFF0000])
    # w = (u - 16) s: sz = 16 s, held as sc itself (no second [out, ng] array)
    assert h.zero_scale == 16.0 and h.sz is h.sc
    assert h.nbytes == h.wp.nbytes + h.sc.nbytes


# ---- kernels --------------------------------------------------------------------------------
_S4, _S1 = _simd.SIMD_ROWS[(4, 5)], _simd.SIMD_ROWS[(1, 5)]


@njit
def _simd_rows4(y, r0, wp, sc, xq, dx, bmap, nb):  # IR intrinsics are callable from Numba only
    _S4(y, r0, wp, sc, xq, dx, bmap, nb)


@njit
def _simd_rows1(y, r0, wp, sc, xq, dx, bmap, nb):
    _S1(y, r0, wp, sc, xq, dx, bmap, nb)


@pytest.mark.parametrize("qname,out,nblk,group", [("Q5_0", 9, 3, 32), ("Q5_1", 37, 4, 32),
                                                  ("Q5_0", 301, 28, 32), ("Q5_0", 14, 6, 64)])
def test_simd_portable_and_oracle_agree(qname, out, nblk, group):
    rng = np.random.default_rng(out + nblk)
    w = relayout(q5_blocks(rng, qname, out, nblk), qname, "t", "x.gguf")
    if group == 64:  # one scale per two blocks: a group flush every chunk, not every block
        w = QuantizedTensor(w.qweight, np.ascontiguousarray(w.scales[:, ::2]), None, 8, 64,
                            w.in_features)
    h = CPU.upload_weight(w)
    assert h.bits == 5
    x = rng.standard_normal(w.in_features).astype(np.float32)
    xq, dx, xg = ActScratch().get(h.n_blocks, h.n_groups)
    quantize_act(xq, dx, xg, x, h.bmap)
    oracle = w.dequantize() @ x
    ys = []
    kernel_sets = [{4: _simd.PORTABLE_ROWS[(4, 5)], 1: _simd.PORTABLE_ROWS[(1, 5)]}]
    if _simd_ir.HAVE_AVX2:
        kernel_sets.insert(0, {4: _simd_rows4, 1: _simd_rows1})
    for kernels in kernel_sets:
        y = np.zeros(out, np.float32)
        nblk4 = out // 4
        for i in range(nblk4):
            kernels[4](y, 4 * i, h.wp, h.sc, xq, dx, h.bmap, h.n_blocks)
        for r in range(4 * nblk4, out):
            kernels[1](y, r, h.wp, h.sc, xq, dx, h.bmap, h.n_blocks)
        y -= h.zero_scale * (term_values(h.sz, h.n_blocks) @ xg)
        assert nerr(y, oracle) < ACT_TOL
        ys.append(y)
    assert nerr(ys[0], ys[-1]) < 1e-6  # the same exact integer dots, float order aside
    assert nerr(CPU.linear(x[None], h)[0], ys[0]) < 1e-6
    # control: the fifth bits matter (cleared, the result is far off)
    cleared = h.wp.reshape(out, -1, 40).copy()
    cleared[:, :, 32:] = 0
    y0 = np.zeros(out, np.float32)
    for r in range(out):
        _simd.PORTABLE_ROWS[(1, 5)](y0, r, cleared.reshape(out, -1), h.sc, xq, dx, h.bmap,
                                    h.n_blocks)
    assert nerr(y0 - h.zero_scale * (term_values(h.sz, h.n_blocks) @ xg), oracle) > 0.1


@pytest.mark.parametrize("t", [2, 5, 40])  # 2 tokens, tails of the 4-token kernels, > 1 chunk
def test_decode_and_prefill_rows_bit_identical(t):
    rng = np.random.default_rng(t)
    for qname in QT:
        w = relayout(q5_blocks(rng, qname, 45, 5), qname, "t", "x.gguf")
        h = CPU.upload_weight(w)
        x = rng.standard_normal((t, w.in_features)).astype(np.float32)
        bias = rng.standard_normal(45).astype(np.float32)
        y = CPU.linear(x, h, bias)
        ref = x @ w.dequantize().T + bias
        assert nerr(y, ref) < ACT_TOL
        for i in range(t):
            assert bits_equal(CPU.linear(x[i:i + 1], h, bias)[0], y[i])


def test_tokens_kernels_simd_equal_portable():
    """The prefill GEMM (the AVX2 multi-token kernels where the host has AVX2) vs the
    portable multi-token loops called directly, tokens 0-3 and 4-5 of six."""
    from edgeinfer.backends.cpu import qgemm

    rng = np.random.default_rng(9)
    w = relayout(q5_blocks(rng, "Q5_1", 33, 7), "Q5_1", "t", "x.gguf")
    h = CPU.upload_weight(w)
    x = rng.standard_normal((6, w.in_features)).astype(np.float32)
    bias = rng.standard_normal(33).astype(np.float32)
    y_gemm = qgemm.gemm_int(x, h, bias)
    xq = np.zeros((6, h.n_blocks * 32), np.int16)
    dx = np.zeros((6, h.n_blocks), np.float32)
    xg = np.zeros((6, h.n_groups), np.float32)
    for i in range(6):
        quantize_act(xq[i], dx[i], xg[i], x[i], h.bmap)
    xg *= np.float32(h.zero_scale)  # the kernels take the group sums times the zero scale
    y = np.zeros((6, 33), np.float32)
    for t0, n in ((0, 4), (4, 2)):
        _simd_tokens.PORTABLE_TOKENS[(n, 5)](y, t0, 0, 33, h.wp, h.sc, h.sz, xg, bias, xq, dx,
                                             h.bmap, h.n_blocks)
    assert nerr(y_gemm, y) < 1e-6
    assert nerr(y_gemm, x @ w.dequantize().T + bias) < ACT_TOL
    assert nerr(y[4] - bias, _portable_rows(h, x[4])) < 1e-6


def _portable_rows(h, x):
    xq, dx, xg = ActScratch().get(h.n_blocks, h.n_groups)
    quantize_act(xq, dx, xg, x, h.bmap)
    y = np.zeros(h.out_features, np.float32)
    for r in range(h.out_features):
        _simd.PORTABLE_ROWS[(1, 5)](y, r, h.wp, h.sc, xq, dx, h.bmap, h.n_blocks)
    return y - h.zero_scale * (term_values(h.sz, h.n_blocks) @ xg)


def test_embedding_rows_exact_decode_and_fused_groups():
    rng = np.random.default_rng(4)
    w = q5_layout(rng.standard_normal((30, 172)).astype(np.float32))  # padded to 192 codes
    h = CPU.upload_weight(w)
    assert h.bits == 5 and h.n_blocks == 6
    ids = np.array([3, 0, 29, 3])
    assert bits_equal(CPU.embed(CPU.upload_embedding(w), ids), w.dequantize(rows=ids))
    x = rng.standard_normal((6, 172)).astype(np.float32)
    ref = REF.linear(x, REF.upload_weight(w))
    assert nerr(CPU.linear(x, h), ref) < ACT_TOL
    assert nerr(CpuBackend(threads=1, exact_decode=True).linear(x, h), ref) < 1e-6
    ws = [q5_layout(rng.standard_normal((n, 172)).astype(np.float32)) for n in (8, 12)]
    hs = [CPU.upload_weight(v) for v in ws]
    grp = CPU.group_linears(hs, [None, None])
    assert grp.weight.bits == 5 and grp.weight.out_features == 20
    for t in (1, 5):
        for y, hv in zip(CPU.linear_many(x[:t], grp), hs):
            assert bits_equal(y, CPU.linear(x[:t], hv))

    assert grp.weight.sz is grp.weight.sc  # fused Q5_0 rows keep sz implicit too


@pytest.mark.parametrize("rows", [45, 2100])  # serial GEMV; > SERIAL_MAX_BYTES: parallel
def test_q5_0_implicit_zero_term_bit_identical_to_a_stored_one(rows):
    """Q5_0's ``sz = 16 s`` held as ``sc`` with ``zero_scale`` 16 (no [out, ng] array)
    gives the bits of the same weight with ``sz`` stored: decode GEMV, prefill GEMM and
    dequantized rows (embedding and prefill tiles)."""
    from dataclasses import replace

    from edgeinfer.backends.cpu.gemv import SERIAL_MAX_BYTES
    from edgeinfer.backends.cpu.qlane import row_dequant

    rng = np.random.default_rng(rows)
    w = relayout(q5_blocks(rng, "Q5_0", rows, 12), "Q5_0", "t", "x.gguf")
    h = CPU.upload_weight(w)
    assert h.sz is h.sc and h.zero_scale == 16.0
    assert (h.nbytes > SERIAL_MAX_BYTES) == (rows > 1000)
    stored = replace(h, sz=16 * term_values(h.sc, h.n_blocks), zero_scale=1.0)
    assert h.sc.dtype == np.uint16 and stored.nbytes == h.nbytes + 4 * h.sc.size
    x = rng.standard_normal((7, w.in_features)).astype(np.float32) * 3
    bias = rng.standard_normal(rows).astype(np.float32)
    for t in (1, 7):
        a, b = CPU.linear(x[:t], h, bias), CPU.linear(x[:t], stored, bias)
        assert bits_equal(a, b)
    assert nerr(CPU.linear(x, h, bias), x @ w.dequantize().T + bias) < ACT_TOL
    ids = np.array([0, rows - 1, 3], np.int64)
    got = np.empty((3, w.in_features), np.float32)
    want = np.empty_like(got)
    row_dequant(h)(got, h.wp, h.sc, h.sz, h.bmap, ids, np.float32(0.5))
    row_dequant(stored)(want, stored.wp, stored.sc, stored.sz, stored.bmap, ids, np.float32(0.5))
    assert bits_equal(got, want)
    assert np.array_equal(got, w.dequantize(rows=ids) * np.float32(0.5))  # -0 == 0: s < 0
    # control: without the 16 the implicit term is wrong (the test can fail)
    wrong = replace(h, zero_scale=1.0)
    assert nerr(CPU.linear(x[:1], wrong, bias), CPU.linear(x[:1], h, bias)) > 0.01


# ---- models ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stories_q5(stories_dir):
    """stories260K with every linear (and the head) in the Q5_0 re-layout's form."""
    return stories_in_layout(stories_dir, q5_layout)


@pytest.mark.parametrize("kv", ["int8", "f16"])
def test_q5_model_rows_bit_identical_whatever_m(stories_q5, kv):
    assert_rows_bit_identical_whatever_m(stories_q5, kv)


def test_q5_model_batched_step_bit_identical(stories_q5):
    assert all(h.bits == 5 for h in batched_step_handles(stories_q5))


@pytest.mark.slow
def test_qwen_catalog_q5_0_linears_at_five_bits_same_greedy_tokens(qwen_gguf, monkeypatch):
    """The catalog Qwen2.5-Coder Q4_K_M file: its Q5_0 linears run at 5 bits (less memory
    than the 8-bit path by their 3 code bits per weight) and greedy decoding gives the
    8-bit path's tokens."""
    import sys

    from edgeinfer.models.transformer import Transformer
    from edgeinfer.readers.gguf import read_gguf

    src = read_gguf(qwen_gguf)
    prompt = np.array([1, 750, 16724, 1445, 982, 262, 470], np.int32)  # token ids

    def run():
        tr = Transformer(src.config, src.tensors, CpuBackend(threads=2), 64)
        lin = [h for layer in tr.layers for h in layer.values()
               if isinstance(h, CpuQuantWeight)]
        cache = tr.new_cache(64, "int8")
        ids, logits = list(prompt), tr.forward(prompt, cache)
        for _ in range(12):
            ids.append(int(np.argmax(logits[-1])))
            logits = tr.forward(np.array(ids[-1:], np.int32), cache)
        return ids, lin

    ids5, lin5 = run()
    n5 = sum(h.bits == 5 for h in lin5)
    bytes5 = sum(h.wp.nbytes for h in lin5)
    monkeypatch.setattr(sys.modules["edgeinfer.backends.cpu.repack"], "five_bit_codes",
                        lambda w: None)
    ids8, lin8 = run()
    assert n5 >= 24 * 4 and not any(h.bits == 5 for h in lin8)  # q, k, o, gate, up per layer
    assert ids5 == ids8
    assert bytes5 < sum(h.wp.nbytes for h in lin8) - 60e6
