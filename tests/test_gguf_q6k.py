"""llama.cpp Q6_K runs natively: lossless re-layout (8-bit codes ``q - 32``, a float32
``d * sc`` scale per 16 columns) and the lane-scaled CPU kernels (backends/cpu/_simd_k.py,
backends/cpu/qlane.py).

* Re-layout vs ``gguf.quants.dequantize``: bit-identical on synthetic blocks with extreme
  scales (fp16 max, subnormal, zero, sc = -128 / 127) and on the catalog Qwen file's real
  Q6_K blocks; a truncated Q6_K tensor is a clear ModelFormatError.
* Kernels: the AVX2 row kernels vs the portable Numba loops vs the numpy oracle; the
  activation-rounding bound under an outlier; decode GEMV == prefill GEMM row for row;
  embedding rows exact; OpenCL runs the layout on its 8-bit kernels.
* Models: logits of a model whose linears are all Q6_K-layout are bit-identical computed
  whole, in chunks and by decode steps (and batched decode == alone); the catalog Qwen
  file loads with no float32 linear and the same holds for it (slow).
"""
from __future__ import annotations

import types

import gguf
import numpy as np
import pytest
from numba import njit

from edgeinfer.backends.cpu import CpuBackend, CpuQuantWeight, _simd_k, qlane
from edgeinfer.backends.cpu.gemv import SERIAL_MAX_BYTES, ActScratch, quantize_act
from edgeinfer.backends.cpu.repack import factor_lane_scales, repack_lanes8
from edgeinfer.backends.quantized import QuantizedTensor
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.errors import ModelFormatError
from edgeinfer.readers.gguf_blocks import relayout
from edgeinfer.readers.gguf_file import GGUFFile
from layout_models import (assert_rows_bit_identical_whatever_m, batched_step_handles,
                           stories_in_layout)

Q6 = gguf.GGMLQuantizationType.Q6_K
REF = ReferenceBackend()
CPU = CpuBackend(threads=2)
ACT_TOL = 2e-4  # the integer linears' 15-bit activations (tests/test_cpu_kernels.py)


def nerr(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def q6k_blocks(rng, rows: int, nsb: int, d=None) -> np.ndarray:
    """Random Q6_K bytes [rows, nsb * 210]: every code and sub-scale pattern; ``d`` the
    fp16 super-block scales (default: small Gaussian)."""
    raw = rng.integers(0, 256, (rows, nsb, 210), dtype=np.uint8)
    if d is None:
        d = rng.standard_normal((rows, nsb)) * 0.01
    raw[:, :, 208:210] = np.asarray(d, np.float16).reshape(rows, nsb, 1).view(np.uint8)
    return raw.reshape(rows, nsb * 210)


def q6_layout(w: np.ndarray) -> QuantizedTensor:
    """A float32 weight [out, in] rounded into the Q6_K re-layout's form (8-bit codes in
    -32..31, a float32 scale per 16 columns; the row zero-padded to 16)."""
    out, k = w.shape
    kp = -(-k // 16) * 16
    wp = np.zeros((out, kp), np.float32)
    wp[:, :k] = w
    g = wp.reshape(out, kp // 16, 16)
    s = (np.abs(g).max(axis=2) / 31.0).astype(np.float32)
    s[s == 0] = 1.0
    codes = np.clip(np.rint(g / s[:, :, None]), -32, 31).astype(np.int8).reshape(out, kp)
    return QuantizedTensor(codes, s, None, 8, 16, k, "gguf:Q6_K")


# ---- re-layout ------------------------------------------------------------------------------
def test_relayout_bit_identical_with_extreme_scales():
    rng = np.random.default_rng(60)
    d = np.array([[65504.0, -65504.0, 6e-8], [0.0, 1.0, -2.0 ** -14]])  # max, subnormal, 0
    raw = q6k_blocks(rng, 2, 3, d)
    sc = raw.reshape(2, 3, 210)[:, :, 192:208]
    sc[0, :, :4] = np.array([-128, 127, 0, 1], np.int8).view(np.uint8)  # extreme sub-scales
    raw = raw.reshape(2, 630)
    w = relayout(raw, "Q6_K", "t", "x.gguf")
    ref = gguf.quants.dequantize(raw, Q6)
    assert (w.bits, w.group_size, w.scales.dtype, w.in_features) == (8, 16, np.float32, 768)
    assert int(w.qweight.min()) == -32 and int(w.qweight.max()) == 31
    assert bits_equal(w.dequantize(), ref)
    assert np.abs(ref).max() > 2e8 and (ref == 0).any()  # the extremes are really there
    # control: the ql / qh / sc / d bytes each matter (one bit flipped in each)
    for at in (5, 130, 193, 209):
        raw2 = raw.copy()
        raw2[1, 210 + at] ^= 0x04
        assert not bits_equal(relayout(raw2, "Q6_K", "t", "x.gguf").dequantize(), ref), at


def test_relayout_of_real_qwen_q6k_blocks(qwen_gguf):
    """The catalog Qwen2.5-Coder Q4_K_M file's Q6_K ffn_down tensors (rows of 4864)."""
    g = GGUFFile(qwen_gguf)
    q6 = [i for i in g.tensors.values() if i.qtype == Q6]
    assert len(q6) == 12 and all(i.name.endswith("ffn_down.weight") for i in q6)
    info = q6[0]
    raw = g.raw(info)[:64]
    w = relayout(np.ascontiguousarray(raw), "Q6_K", info.name, str(qwen_gguf))
    ref = gguf.quants.dequantize(raw, Q6)
    assert w.shape == ref.shape == (64, 4864)
    assert bits_equal(w.dequantize(), ref)
    # the CPU kernels on the real rows vs the float oracle
    x = np.random.default_rng(1).standard_normal((3, 4864)).astype(np.float32)
    h = CPU.upload_weight(w)
    assert isinstance(h, CpuQuantWeight) and h.lane_scales
    assert nerr(CPU.linear(x, h), x @ ref.T) < ACT_TOL


def test_truncated_q6k_tensor_is_a_format_error(tmp_path):
    rng = np.random.default_rng(2)
    path = tmp_path / "q6.gguf"
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_tensor("blk.0.ffn_down.weight", q6k_blocks(rng, 8, 2), raw_dtype=Q6)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    g = GGUFFile(path)
    info = g.tensors["blk.0.ffn_down.weight"]
    assert info.shape == (8, 512)  # control: the whole file reads
    w = relayout(g.raw(info), "Q6_K", info.name, str(path))
    assert bits_equal(w.dequantize(), gguf.quants.dequantize(g.raw(info), Q6))
    del g, info
    data = path.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:-300])  # the tensor's last super-block and a half cut off
    with pytest.raises(ModelFormatError, match=r"cut\.gguf.*truncated.*blk\.0\.ffn_down\.weight"):
        GGUFFile(bad)
    with pytest.raises(ModelFormatError, match=r"x\.gguf.*'blk\.0\.ffn_down\.weight'.*210-byte"):
        relayout(np.zeros((8, 419), np.uint8), "Q6_K", "blk.0.ffn_down.weight", "x.gguf")


# ---- kernels --------------------------------------------------------------------------------
_S4, _S1 = _simd_k.SIMD_LANE_ROWS[4], _simd_k.SIMD_LANE_ROWS[1]


@njit
def _simd_rows4(y, r0, wp, sc, xq, dx, nb):  # the IR intrinsics are callable from Numba only
    _S4(y, r0, wp, sc, xq, dx, nb)


@njit
def _simd_rows1(y, r0, wp, sc, xq, dx, nb):
    _S1(y, r0, wp, sc, xq, dx, nb)


_S64, _S61 = _simd_k.SIMD_LANE6_ROWS[4], _simd_k.SIMD_LANE6_ROWS[1]


@njit
def _simd6_rows4(y, r0, wp, sc, xq, dx, nb):
    _S64(y, r0, wp, sc, xq, dx, nb)


@njit
def _simd6_rows1(y, r0, wp, sc, xq, dx, nb):
    _S61(y, r0, wp, sc, xq, dx, nb)


@pytest.mark.parametrize("out,nsb", [(9, 1), (37, 2), (301, 3)])  # 1-row tails; > serial bytes
def test_simd_portable_and_oracle_agree(out, nsb):
    rng = np.random.default_rng(out + nsb)
    w = relayout(q6k_blocks(rng, out, nsb), "Q6_K", "t", "x.gguf")
    h = CPU.upload_weight(w)
    x = rng.standard_normal(w.in_features).astype(np.float32)
    xq, dx, xg = ActScratch().get(h.n_blocks, h.n_groups)
    quantize_act(xq, dx, xg, x, h.bmap)
    oracle = w.dequantize() @ x
    ys = []
    assert h.bits == 6  # 6-bit codes, int8 lane scales times d (the SIMD_LANE6 kernels)
    for kernels in ({4: _simd6_rows4, 1: _simd6_rows1}, _simd_k.PORTABLE_LANE6_ROWS):
        if kernels[4] is _simd6_rows4 and not _simd_k.HAVE_AVX2:
            continue
        y = np.zeros(out, np.float32)
        nblk = out // 4
        for i in range(nblk):
            kernels[4](y, 4 * i, h.wp, h.sc, xq, dx, h.n_blocks)
        for r in range(4 * nblk, out):
            kernels[1](y, r, h.wp, h.sc, xq, dx, h.n_blocks)
        assert nerr(y, oracle) < ACT_TOL
        ys.append(y)
    assert nerr(ys[0], ys[-1]) < 1e-6  # the same exact integer dots, float order aside
    assert nerr(CPU.linear(x[None], h)[0], ys[0]) < 1e-6
    # control: one scale per 32 columns (the even halves' scales) is far off
    wrong = QuantizedTensor(w.qweight, np.ascontiguousarray(w.scales[:, ::2]), None, 8, 32,
                            w.in_features)
    assert nerr(CPU.linear(x[None], CPU.upload_weight(wrong))[0], oracle) > 0.1


@pytest.mark.parametrize("t", [1, 2, 5, 40])  # GEMV, 2-row GEMV, prefill GEMM (> 1 chunk)
def test_activation_rounding_bound_and_row_identity(t):
    """Each output within ``sum_k |W[r, k]| * dx[block(k)] / 2`` of the float reference
    (an outlier coarsens its block), and every row of a T-row call equals that row's
    decode GEMV bit for bit."""
    rng = np.random.default_rng(t)
    w = relayout(q6k_blocks(rng, 45, 2), "Q6_K", "t", "x.gguf")
    x = rng.standard_normal((t, w.in_features)).astype(np.float32)
    x[0, 100] = 40.0
    bias = rng.standard_normal(45).astype(np.float32)
    h = CPU.upload_weight(w)
    y = CPU.linear(x, h, bias)
    wd = w.dequantize().astype(np.float64)
    ref = x.astype(np.float64) @ wd.T + bias
    for i in range(t):
        dx = np.abs(x[i]).reshape(-1, 32).max(axis=1) / 16256.0
        bound = np.abs(wd) @ (np.repeat(dx, 32) / 2) * 1.001 + 1e-5 * (np.abs(ref[i]) + 1)
        assert (np.abs(y[i] - ref[i]) <= bound).all()
        assert bits_equal(CPU.linear(x[i:i + 1], h, bias)[0], y[i])
    assert nerr(y, ref) > 0  # control: the activation rounding is there


@pytest.mark.parametrize("rows,t", [(45, 4), (45, 7), (6, 33), (37, 40)])
def test_multi_token_gemm_equals_the_decode_gemv_row_by_row(rows, t):
    """The prefill GEMM that builds each block's 6-bit codes once for 4 tokens
    (``qlane._gemm_q6l`` with ``_simd_k.q6l_row_tokens``; the portable loops where the host
    lacks AVX2) gives each token its decode GEMV's bits: full 4-token steps, token tails,
    a row count with no full 4-row group, bias."""
    rng = np.random.default_rng(rows * t)
    w = relayout(q6k_blocks(rng, rows, 3), "Q6_K", "t", "x.gguf")
    h = CPU.upload_weight(w)
    x = rng.standard_normal((t, w.in_features)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    y = np.full((t, rows), np.nan, np.float32)
    qlane._gemm_q6l(y, x, h.wp, h.sc, h.sz, h.bmap, bias,
                    np.empty((t, h.n_blocks * 32), np.int16), np.empty((t, h.n_blocks), np.float32),
                    np.empty((t, h.n_groups), np.float32))
    want = np.stack([CPU.linear(x[i:i + 1], h, bias)[0] for i in range(t)])
    assert np.isfinite(y).all() and bits_equal(y, want)
    assert bits_equal(CPU.linear(x, h, bias), want)
    assert qlane.LANE6_TOKENS == 4
    # the portable multi-token loops (hosts without AVX2), on the last 4 tokens: each
    # token its 1-row loop's bits
    xq = np.empty((t, h.n_blocks * 32), np.int16)
    dx = np.empty((t, h.n_blocks), np.float32)
    xg = np.empty((t, h.n_groups), np.float32)
    for i in range(t):
        quantize_act(xq[i], dx[i], xg[i], x[i], h.bmap)
    yp, y1 = np.full((t, rows), np.nan, np.float32), np.full((t, rows), np.nan, np.float32)
    for r in range(rows):
        _simd_k._p_lane6_row_tokens(yp, r, h.wp, h.sc, xq, dx, h.n_blocks, t - 4)
        for i in range(t - 4, t):
            _simd_k.PORTABLE_LANE6_ROWS[1](y1[i], r, h.wp, h.sc, xq[i], dx[i], h.n_blocks)
    assert np.isfinite(yp[t - 4:]).all() and bits_equal(yp, y1)
    assert nerr(yp[t - 4:], want[t - 4:] - bias) < 1e-6


def test_padded_row_embedding_and_exact_decode():
    """172 columns (padded to 176 codes, 192 for the kernel): the kernels, embedding rows
    and the float-activation path (exact_decode) all match the oracle."""
    rng = np.random.default_rng(4)
    w = q6_layout(rng.standard_normal((30, 172)).astype(np.float32))
    h = CPU.upload_weight(w)
    assert h.lane_scales and h.sc.shape == (30, 12) and (h.sc[:, 11] == 0).all()
    x = rng.standard_normal((6, 172)).astype(np.float32)
    ref = REF.linear(x, REF.upload_weight(w))
    assert nerr(CPU.linear(x, h), ref) < ACT_TOL
    assert nerr(CpuBackend(threads=1, exact_decode=True).linear(x, h), ref) < 1e-6
    ids = np.array([3, 0, 29, 3])
    assert bits_equal(CPU.embed(CPU.upload_embedding(w), ids), w.dequantize(rows=ids))


def test_fused_q6k_linears_and_no_mixing():
    rng = np.random.default_rng(6)
    ws = [relayout(q6k_blocks(rng, n, 2), "Q6_K", "t", "x.gguf") for n in (8, 12)]
    hs = [CPU.upload_weight(w) for w in ws]
    grp = CPU.group_linears(hs, [None, None])
    assert grp.weight.lane_scales and grp.weight.out_features == 20
    x = rng.standard_normal((1, 512)).astype(np.float32)
    for y, h in zip(CPU.linear_many(x, grp), hs):
        assert bits_equal(y, CPU.linear(x, h))
    q8 = QuantizedTensor(ws[0].qweight, np.ascontiguousarray(ws[0].scales[:, ::2]), None, 8,
                         32, 512)
    mixed = CPU.group_linears([hs[0], CPU.upload_weight(q8)], [None, None])
    assert not hasattr(mixed, "splits")  # a 32-column-group 8-bit weight is not fused in


def _extreme_q6k(rng):
    """Q6_K bytes [2, 630] with fp16 max, subnormal and zero ``d`` and sub-scales -128 / 127
    (as test_relayout_bit_identical_with_extreme_scales)."""
    d = np.array([[65504.0, -65504.0, 6e-8], [0.0, 1.0, -2.0 ** -14]])
    raw = q6k_blocks(rng, 2, 3, d)
    raw.reshape(2, 3, 210)[0, :, 192:196] = np.array([-128, 127, 0, 1], np.int8).view(np.uint8)
    return raw


@pytest.mark.parametrize("case", ["extreme", "tails", "parallel"])
def test_six_bit_form_bit_identical_to_the_8bit_one(case):
    """The 6-bit form (6.625 bits per weight) gives the 8-bit form's values bit for bit:
    serial and parallel GEMV, prefill GEMM, exact decode, embedding rows, a fused group."""
    rng = np.random.default_rng(len(case))
    rows, nsb = {"extreme": (2, 3), "tails": (37, 2), "parallel": (600, 3)}[case]
    raw = _extreme_q6k(rng) if case == "extreme" else q6k_blocks(rng, rows, nsb)
    w = relayout(raw, "Q6_K", "t", "x.gguf")
    h6, h8 = CPU.upload_weight(w), repack_lanes8(w)
    assert (h6.bits, h8.bits) == (6, 8) and h6.n_groups == h8.n_groups
    assert h6.nbytes * 8 / (rows * 256 * nsb) == pytest.approx(6.625, abs=0.02)
    assert (case == "parallel") == (h6.nbytes > SERIAL_MAX_BYTES)
    x = rng.standard_normal((40, w.in_features)).astype(np.float32)
    for t in (1, 2, 5, 40):
        assert bits_equal(CPU.linear(x[:t], h6), CPU.linear(x[:t], h8)), t
    exact = CpuBackend(threads=1, exact_decode=True)
    assert bits_equal(exact.linear(x[:3], h6), exact.linear(x[:3], h8))
    ids = np.array([rows - 1, 0, rows // 2, 0])
    assert bits_equal(CPU.embed(h6, ids), CPU.embed(h8, ids))
    assert bits_equal(CPU.embed(h6, ids), w.dequantize(rows=ids))
    g6 = CPU.group_linears([h6, CPU.upload_weight(w)], [None, None])
    g8 = CPU.group_linears([h8, repack_lanes8(w)], [None, None])
    assert g6.weight.bits == 6 and g8.weight.bits == 8
    for y6, y8 in zip(CPU.linear_many(x[:1], g6), CPU.linear_many(x[:1], g8)):
        assert bits_equal(y6, y8)


def test_scales_that_do_not_factor_keep_the_8bit_form():
    """Lane scales with no exact int8 x float32 factoring per 256 columns (and all-zero
    super-blocks, which do) are told apart: the former stay 8-bit, the latter go 6-bit."""
    rng = np.random.default_rng(8)
    w = relayout(q6k_blocks(rng, 4, 2), "Q6_K", "t", "x.gguf")
    q, d = factor_lane_scales(w.scales)
    assert bits_equal(q.astype(np.float32) * np.repeat(d, 16, axis=1), w.scales)
    s = w.scales.copy()
    s[:, 16:] = 0.0
    assert factor_lane_scales(s) is not None
    s[1, 3] = np.nextafter(s[1, 3], np.float32(1))  # one ulp: no longer d * int8
    assert factor_lane_scales(s) is None
    odd = QuantizedTensor(w.qweight, s, None, 8, 16, w.in_features, "gguf:Q6_K")
    h = CPU.upload_weight(odd)
    assert h.bits == 8 and bits_equal(CPU.embed(h, np.array([1])), odd.dequantize(rows=[1]))


def test_opencl_runs_the_layout_on_its_8bit_kernels():
    pytest.importorskip("pyopencl")
    from edgeinfer.backends.opencl import OpenCLBackend, OpenCLUnavailableError

    try:
        be = OpenCLBackend()
    except OpenCLUnavailableError as e:
        pytest.skip(f"no usable OpenCL device: {e}")
    rng = np.random.default_rng(7)
    w = relayout(q6k_blocks(rng, 21, 2), "Q6_K", "t", "x.gguf")
    h = be.upload_weight(w)
    assert h.fmt == "q8" and h.gemv_ok and h.group_size == 16  # no float32 fallback
    for t in (1, 5):
        x = rng.standard_normal((t, 512)).astype(np.float32)
        y = be.to_host(be.linear(be.upload(x), h))
        assert nerr(y, REF.linear(x, REF.upload_weight(w))) < 1e-5


# ---- models ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stories_q6(stories_dir):
    """stories260K with every linear (and the head) in the Q6_K re-layout's form."""
    return stories_in_layout(stories_dir, q6_layout)


@pytest.mark.parametrize("kv", ["int8", "f16"])
def test_q6k_model_rows_bit_identical_whatever_m(stories_q6, kv):
    assert_rows_bit_identical_whatever_m(stories_q6, kv)


def test_q6k_model_batched_step_bit_identical(stories_q6):
    assert all(h.lane_scales for h in batched_step_handles(stories_q6))


@pytest.mark.slow
def test_qwen_catalog_file_natively_no_float_linears_and_rows_bit_identical(qwen_gguf):
    """Qwen2.5-Coder-0.5B Q4_K_M (Q5_0, Q4_K, Q6_K, Q8_0) loads with every linear and the
    head quantized, runs them on the integer kernels, and its logits do not depend on how
    the rows were computed."""
    from test_cache_invariance import _prompt, _rows_three_ways

    from edgeinfer.models.transformer import Transformer
    from edgeinfer.readers.gguf import read_gguf
    from edgeinfer.speculative import exactness_problem

    src = read_gguf(qwen_gguf)
    down = [src.tensors[n] for n in src.shapes if n.endswith("down_proj.weight")]
    assert sum(t.group_size == 16 for t in down) == 12
    assert not any(isinstance(src.tensors[n], np.ndarray) for n in src.shapes
                   if n.endswith("proj.weight"))
    tr = Transformer(src.config, src.tensors, CpuBackend(threads=2), 64)
    assert exactness_problem(tr) is None  # speculative decoding is allowed again
    small = types.SimpleNamespace(config=src.config, tensors=src.tensors)
    whole, chunks, steps = _rows_three_ways(small, _prompt(src, 12), "f16")
    assert np.array_equal(whole, chunks) and np.array_equal(whole, steps)
    assert np.isfinite(whole).all() and whole.std() > 0.1
