"""How the CPU backend holds scales and zero-point terms (backends/cpu/repack.py), and that
the compact forms compute the floats of the plain float32 ones bit for bit.

* Symmetric 4-bit weights (llama.cpp ``Q4_0``, signmax, symmetric RTN / GPTQ: zero 8) hold
  the term implicitly: ``sz`` is ``sc`` with ``zero_scale`` 8, and every kernel scales the
  activation group sums by 8 instead (exact: a power of two).
* Scales and terms that are fp16 values (GGUF ``d`` and ``m``, ``.eif`` scales) are held
  as uint16 fp16 bits and widened exactly in the kernels.
* Bits: decode GEMV (serial and parallel), every multi-token path (row kernels, few-token
  and 16-token tiles where AMX exists), dequantized rows (embeddings, exact decode), fused
  q/k/v and gate/up groups: equal to the same weight with float32 ``sc`` and ``sz = 8 s``.
* Size: ``Q4_0`` / ``Q4_1`` / ``Q5_0`` / ``Q5_1`` / ``Q8_0`` take their file's bits per
  weight in RAM (4.5 / 5.0 / 5.5 / 6.0 / 8.5; float32 terms took 6.0 / 6.0 / 6.0 / 7.0 / 9.0).
* Models: stories260K with symmetric linears gives the same logits whole, in chunks and by
  decode steps (the fused decode plan included), and batched.
"""
from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest

from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.backends.cpu.gemv import SERIAL_MAX_BYTES
from edgeinfer.backends.cpu.qlane import row_dequant
from edgeinfer.backends.cpu.repack import half_if_exact, term_values
from edgeinfer.quant.rtn import quantize_rtn
from edgeinfer.readers.gguf_blocks import relayout
from layout_models import (assert_rows_bit_identical_whatever_m, batched_step_handles,
                           stories_in_layout)

CPU = CpuBackend(threads=2)
ACT_TOL = 2e-4  # the integer linears' 15-bit activations (tests/test_cpu_kernels.py)


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def nerr(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
FILE_BPW = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5}


def gguf_blocks(rng, qname: str, rows: int, nblk: int) -> np.ndarray:
    """Random llama.cpp ``qname`` bytes [rows, nblk * block bytes]: every code, small
    Gaussian fp16 scales (and mins) of both signs."""
    raw = rng.integers(0, 256, (rows, nblk, BLOCK_BYTES[qname]), dtype=np.uint8)
    for at in (0, 2) if qname in ("Q4_1", "Q5_1") else (0,):
        v = (rng.standard_normal((rows, nblk)) * 0.01).astype(np.float16)
        raw[:, :, at:at + 2] = v.view(np.uint8).reshape(rows, nblk, 2)
    return raw.reshape(rows, nblk * BLOCK_BYTES[qname])


def q4_0(rng, rows: int, nblk: int):
    """A random llama.cpp ``Q4_0`` tensor [rows, 32 nblk] re-laid (symmetric 4-bit, g32)."""
    return relayout(gguf_blocks(rng, "Q4_0", rows, nblk), "Q4_0", "t", "x.gguf")


def stored_zero(h):
    """The same weight with float32 scales and its zero-point term ``8 s`` stored (the
    layout before)."""
    sc = term_values(h.sc, h.n_blocks)
    return replace(h, sc=sc, sz=np.ascontiguousarray(8 * sc), zero_scale=1.0)


def as_float32(h):
    """The same weight with float32 scales and zero-point terms (implicit ones kept)."""
    sc = term_values(h.sc, h.n_blocks)
    return replace(h, sc=sc, sz=sc if h.sz is h.sc else term_values(h.sz, h.n_blocks))


@pytest.mark.parametrize("qname", list(FILE_BPW))
def test_gguf_block_formats_in_ram_at_their_file_size(qname):
    rng = np.random.default_rng(0)
    w = relayout(gguf_blocks(rng, qname, 6, 8), qname, "t", "x.gguf")
    h = CPU.upload_weight(w)
    assert h.sc.dtype == np.uint16 and h.sc.shape == (6, 8)
    assert 8 * h.nbytes / (6 * 256) == FILE_BPW[qname]
    assert gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qname)] == (
        32, BLOCK_BYTES[qname])
    if qname in ("Q4_0", "Q5_0"):  # symmetric: the zero-point term implicit
        assert h.zero_scale == {"Q4_0": 8.0, "Q5_0": 16.0}[qname] and h.sz is h.sc
    if qname == "Q4_0":
        assert w.bits == 4 and w.symmetric and w.group_size == 32
        assert 8 * stored_zero(h).nbytes / (6 * 256) == 6.0  # float32 scale and term per 32
    x = rng.standard_normal((7, 256)).astype(np.float32)
    for t in (1, 7):
        assert bits_equal(CPU.linear(x[:t], h), CPU.linear(x[:t], as_float32(h))), t
    assert nerr(CPU.linear(x, h), x @ w.dequantize().T) < ACT_TOL


def test_which_terms_become_fp16():
    a = np.array([[0.5, -0.0, 2.0 ** -20, 65504.0]], np.float32)  # 2^-20: an fp16 subnormal
    assert half_if_exact(a).dtype == np.uint16
    assert np.array_equal(term_values(half_if_exact(a), 4).view(np.uint32), a.view(np.uint32))
    for v in (0.1, 1e-9, 70000.0):  # not fp16 values: float32 kept
        b = a.copy()
        b[0, 1] = v
        assert half_if_exact(b) is b


def test_asymmetric_weights_keep_their_stored_term():
    rng = np.random.default_rng(1)
    w = quantize_rtn(rng.standard_normal((8, 256)).astype(np.float32), 4, 64)
    assert not w.symmetric
    h = CPU.upload_weight(w)
    assert h.zero_scale == 1.0 and h.sz is not h.sc and h.sz.shape == h.sc.shape
    assert h.sc.dtype == np.uint16  # the .eif's fp16 scales
    assert h.sz.dtype == np.float32  # s * z is not an fp16 value in general
    x = rng.standard_normal((5, 256)).astype(np.float32)
    assert bits_equal(CPU.linear(x, h), CPU.linear(x, as_float32(h)))


@pytest.mark.parametrize("rows, group", [(45, 32), (2100, 32), (70, 128)])
def test_implicit_zero_bit_identical_to_a_stored_one(rows, group):
    """Decode GEMV (serial below SERIAL_MAX_BYTES, parallel above), 4 / 7 / 20 tokens (the
    row kernels, the few-token and 16-token tiles on AMX hosts) and dequantized rows."""
    rng = np.random.default_rng(rows + group)
    k = 384
    if group == 32:
        w = q4_0(rng, rows, k // 32)
    else:
        w = quantize_rtn(rng.standard_normal((rows, k)).astype(np.float32), 4, group,
                         symmetric=True)
    h = CPU.upload_weight(w)
    assert h.zero_scale == 8.0 and h.sz is h.sc and h.sc.dtype == np.uint16
    assert (h.nbytes > SERIAL_MAX_BYTES) == (rows > 1000)
    stored = stored_zero(h)
    x = rng.standard_normal((20, k)).astype(np.float32) * 3
    bias = rng.standard_normal(rows).astype(np.float32)
    for t in (1, 4, 7, 20):
        assert bits_equal(CPU.linear(x[:t], h, bias), CPU.linear(x[:t], stored, bias)), t
    assert nerr(CPU.linear(x, h, bias), x @ w.dequantize().T + bias) < ACT_TOL
    exact = CpuBackend(threads=1, exact_decode=True)  # dequantized tiles + BLAS
    assert bits_equal(exact.linear(x[:3], h, bias), exact.linear(x[:3], stored, bias))
    ids = np.array([0, rows - 1, 3], np.int64)
    got = np.empty((3, k), np.float32)
    want = np.empty_like(got)
    row_dequant(h)(got, h.wp, h.sc, h.sz, h.bmap, ids, np.float32(0.5))
    row_dequant(stored)(want, stored.wp, stored.sc, stored.sz, stored.bmap, ids,
                        np.float32(0.5))
    assert bits_equal(got, want)
    assert np.array_equal(got, w.dequantize(rows=ids) * np.float32(0.5))
    # control: without the 8 the implicit term is wrong (the test can fail)
    wrong = replace(h, zero_scale=1.0)
    assert nerr(CPU.linear(x[:1], wrong, bias), CPU.linear(x[:1], h, bias)) > 0.01


def test_fused_groups_keep_the_zero_implicit():
    rng = np.random.default_rng(5)
    ws = [q4_0(rng, n, 6) for n in (8, 12, 4)]
    hs = [CPU.upload_weight(v) for v in ws]
    grp = CPU.group_linears(hs, [None, None, None])
    assert grp.weight.out_features == 24 and grp.weight.zero_scale == 8.0
    assert grp.weight.sz is grp.weight.sc
    x = rng.standard_normal((5, 192)).astype(np.float32)
    for t in (1, 5):
        for y, hv in zip(CPU.linear_many(x[:t], grp), hs):
            assert bits_equal(y, CPU.linear(x[:t], stored_zero(hv)))


def _sym_layout(w: np.ndarray):
    return quantize_rtn(w, 4, 32, symmetric=True)


@pytest.fixture(scope="module")
def stories_sym4(stories_dir):
    """stories260K with every linear (and the head) symmetric 4-bit, group 32."""
    return stories_in_layout(stories_dir, _sym_layout)


@pytest.mark.parametrize("kv", ["int8", "f16"])
def test_sym4_model_rows_bit_identical_whatever_m(stories_sym4, kv):
    assert_rows_bit_identical_whatever_m(stories_sym4, kv)


def test_sym4_model_batched_step_bit_identical(stories_sym4):
    handles = batched_step_handles(stories_sym4)
    assert all(h.bits == 4 and h.zero_scale == 8.0 for h in handles)
