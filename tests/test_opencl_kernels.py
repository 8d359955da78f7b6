"""OpenCL-backend properties beyond op parity (that is tests/test_ops.py's matrix):
device selection and its errors, path selection (GEMV vs GEMM, row kernels vs per-op,
split-KV), the stored format of quantized KV caches, analytic attention extremes, input
errors, the cache object, program caching.

Runs on whatever OpenCL device is found (PoCL's CPU device in CI); skips with a message
naming what is missing when pyopencl or an OpenCL platform is not available.

Error measure where a test compares: ``nerr = max|y - y_ref| / max(max|y_ref|, 1)``.
"""
from __future__ import annotations


import numpy as np
import pytest

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'edgeinfer[opencl]')")

from edgeinfer.backends.opencl import (
    OpenCLBackend,
    OpenCLUnavailableError,
    list_devices,
)
from edgeinfer.backends.quantized import QuantizedTensor, pack_nibbles
from edgeinfer.backends.reference import ReferenceBackend
from kv_admissible import assert_same_format


@pytest.fixture(scope="module", params=[True, False], ids=["fused", "unfused"])
def be(request):
    """The device's backend with the fused decode path / row kernels (fused.cl) forced on,
    then off (the per-op kernels GPUs use), so both kernel sets run on any device."""
    import dataclasses

    try:
        b = OpenCLBackend()
    except OpenCLUnavailableError as e:
        pytest.skip(f"no usable OpenCL device: {e}")
    b.caps = dataclasses.replace(b.caps, fused=request.param)
    return b


REF = ReferenceBackend()


def nerr(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    assert y.shape == ref.shape, (y.shape, ref.shape)
    assert np.isfinite(y).all(), "non-finite output"
    return float(np.max(np.abs(y - ref), initial=0.0) / max(np.max(np.abs(ref), initial=0.0), 1.0))


def rand_q4(rng, out, n_in, g, symmetric, scale_dtype=np.float16):
    """A QuantizedTensor with *random* codes everywhere, padding included: padded columns
    then dequantize to nonzero values, so a kernel that reads past in_features is caught."""
    in_pad = -(-n_in // g) * g
    ng = in_pad // g
    codes = rng.integers(0, 16, (out, in_pad))
    scales = (rng.random((out, ng)) * 0.1 + 0.01).astype(scale_dtype)
    zeros = None if symmetric else pack_nibbles(rng.integers(0, 16, (out, ng)))
    return QuantizedTensor(pack_nibbles(codes), scales, zeros, 4, g, n_in)


def rand_q8(rng, out, n_in, g, scale_dtype=np.float16):
    in_pad = -(-n_in // g) * g
    codes = rng.integers(-127, 128, (out, in_pad)).astype(np.int8)
    scales = (rng.random((out, in_pad // g)) * 0.01 + 0.001).astype(scale_dtype)
    return QuantizedTensor(codes, scales, None, 8, g, n_in)


# ---- devices and errors -------------------------------------------------------------------

def test_list_devices_reports_capabilities():
    devs = list_devices()
    assert devs, "list_devices() returned nothing although a device was found"
    keys = {"index", "id", "platform", "name", "type", "global_mem_bytes", "local_mem_bytes",
            "max_work_group_size", "fp16", "subgroups"}
    assert keys <= set(devs[0])


def test_bad_index_and_unknown_name_give_clear_errors(be):
    n = len(list_devices())
    with pytest.raises(OpenCLUnavailableError, match=f"index {n + 5} is out of range"):
        OpenCLBackend(device=str(n + 5))
    with pytest.raises(OpenCLUnavailableError, match="does not exist"):
        OpenCLBackend(device="7:3")
    with pytest.raises(OpenCLUnavailableError, match="no OpenCL device name matches 'no-such-gpu'"):
        OpenCLBackend(device="no-such-gpu")


def test_device_by_index_name_and_env(be, monkeypatch):
    d = list_devices()[0]
    assert OpenCLBackend(device="0").device_info["name"] == d["name"]
    assert OpenCLBackend(device=d["id"]).device_info["name"] == d["name"]
    assert OpenCLBackend(device=d["name"][:4].lower()).device_info["name"] == d["name"]
    monkeypatch.setenv("EDGEINFER_OPENCL_DEVICE", "no-such-gpu")
    with pytest.raises(OpenCLUnavailableError, match="no-such-gpu"):
        OpenCLBackend()


def test_fp16_required_but_missing(be):
    if be.device_info["fp16"]:
        pytest.skip("this device has cl_khr_fp16")
    with pytest.raises(OpenCLUnavailableError, match="cl_khr_fp16"):
        OpenCLBackend(require_fp16=True)


def test_no_platform_and_no_pyopencl_messages(monkeypatch):
    import edgeinfer.backends.opencl.device as dev

    monkeypatch.setattr(dev.cl, "get_platforms", list)
    with pytest.raises(OpenCLUnavailableError, match="no OpenCL platform found.*pocl"):
        OpenCLBackend()
    with pytest.raises(OpenCLUnavailableError, match="no OpenCL platform found"):
        list_devices()
    monkeypatch.setattr(dev, "cl", None)
    with pytest.raises(OpenCLUnavailableError, match="needs pyopencl"):
        list_devices()


def test_unavailable_error_is_a_runtime_error():
    assert issubclass(OpenCLUnavailableError, RuntimeError)


# ---- linear -------------------------------------------------------------------------------

def _check_linear(be, rng, w, t, bias=False, bound=1e-5):
    n_out, n_in = w.shape
    x = rng.standard_normal((t, n_in)).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32) if bias else None
    ref = REF.linear(x, REF.upload_weight(w), b)
    y = be.to_host(be.linear(be.upload(x), be.upload_weight(w), None if b is None else be.upload(b)))
    assert nerr(y, ref) < bound, (t, n_out, n_in, nerr(y, ref))


def test_odd_group_takes_the_gemm_path(be):
    """A group size that is not a multiple of 8 cannot take the GEMV: the GEMM path does,
    also for T=1 (its values: tests/test_ops.py, linear-q4-g10)."""
    rng = np.random.default_rng(5)
    assert not be.upload_weight(rand_q4(rng, 9, 70, 10, False)).gemv_ok
    assert be.upload_weight(rand_q4(rng, 9, 70, 32, False)).gemv_ok


def test_row_kernels_fall_back_beyond_kmax(be):
    """Inputs wider than the row kernels' local staging buffer take the per-op kernels."""
    import dataclasses

    rng = np.random.default_rng(21)
    small = OpenCLBackend()
    small.caps = dataclasses.replace(be.caps, kmax=64)
    for n_in in (64, 100):
        w = rand_q4(rng, 12, n_in, 32, False)
        assert small._row_ok(small.upload_weight(w)) == (n_in <= 64)
        for t in (1, 3):
            _check_linear(small, rng, w, t, bias=True)


def test_rope_refuses_positions_outside_the_table(be):
    ang = np.arange(64)[:, None] * np.ones((1, 4))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    x = be.upload(np.ones((5, 3, 8), np.float32))
    with pytest.raises(ValueError, match="outside the RoPE table"):
        be.rope(x, be.upload(cos), be.upload(sin), np.arange(60, 65))


def test_reshape_select_rows(be):
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal((4, 6)).astype(np.float32) for _ in range(2))
    s = be.add(be.upload(a), be.upload(b))
    v = be.reshape(s, (4, 2, 3))
    assert be.to_host(v).shape == (4, 2, 3)
    np.testing.assert_array_equal(be.to_host(be.select_rows(s, slice(3, 4))), (a + b)[3:4])
    np.testing.assert_array_equal(be.to_host(be.select_rows(v, slice(1, 3))), (a + b).reshape(4, 2, 3)[1:3])


# ---- embedding ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dense", "q4", "q8"])
def test_embed_refuses_out_of_range_ids(be, kind):
    rng = np.random.default_rng(4)
    tab = {"dense": rng.standard_normal((50, 72)).astype(np.float32),
           "q4": rand_q4(rng, 50, 72, 32, False), "q8": rand_q8(rng, 50, 72, 32)}[kind]
    with pytest.raises(ValueError, match="out of range"):
        be.embed(be.upload_embedding(tab), np.array([50]), 1.0)


# ---- attention ---------------------------------------------------------------------------

def _attn_pair(be, hq, hkv, hd, steps, dtype="f32", window=None, softcap=None, scale=None,
               rng=None, mag=1.0, max_tokens=64):
    """Run the same sequence of attention calls (T per call from ``steps``) on both
    backends; return the max normalized error over every call."""
    rng = rng or np.random.default_rng(0)
    scale = scale if scale is not None else hd ** -0.5
    rc = REF.new_kv_cache(2, hkv, hd, max_tokens, dtype)
    dc = be.new_kv_cache(2, hkv, hd, max_tokens, dtype)
    pos, worst = 0, 0.0
    for t in steps:
        q = (rng.standard_normal((t, hq, hd)) * mag).astype(np.float32)
        k = (rng.standard_normal((t, hkv, hd)) * mag).astype(np.float32)
        v = rng.standard_normal((t, hkv, hd)).astype(np.float32)
        ref = REF.attention(q, k, v, rc, 1, pos, scale, window, softcap)
        y = be.to_host(be.attention(be.upload(q), be.upload(k), be.upload(v), dc, 1, pos, scale,
                                    window, softcap))
        worst = max(worst, nerr(y, ref))
        pos += t
    return worst


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_attention_split_kv_path_is_taken(be, kv):
    """Forced 16-key chunks take the split-KV kernels for decode over > 32 cached keys
    (their values: tests/test_ops.py, backend opencl-splitkv)."""
    import dataclasses

    sb = OpenCLBackend()
    sb.caps = dataclasses.replace(sb.caps, split_kv_chunk=16, split_kv_max_t=8)
    names, kernel = [], sb._k
    sb._k = lambda file, name, **variant: names.append(name) or kernel(file, name, **variant)
    _attn_pair(sb, 6, 2, 40, [50, 1], dtype=kv, max_tokens=96)
    assert "attention_split" in names, sorted(set(names))
    names.clear()
    _attn_pair(sb, 6, 2, 40, [20, 1], dtype=kv, max_tokens=96)  # 21 keys: not split
    assert "attention_split" not in names, sorted(set(names))


def test_attention_large_scores_stay_finite(be):
    """q = k = 128 x 30.0: q.k = 115200 (> fp16 max); scaled score 10182.34; the softmax
    must stay finite. Every key is identical, so the output is the mean of V."""
    hd = 128
    for dtype in ("f32", "f16"):
        c = be.new_kv_cache(1, 1, hd, 8, dtype)
        q = np.full((3, 1, hd), 30.0, np.float32)
        v = np.arange(3 * hd, dtype=np.float32).reshape(3, 1, hd) / 100
        y = be.to_host(be.attention(be.upload(q), be.upload(q), be.upload(v), c, 0, 0, hd ** -0.5))
        assert np.isfinite(y).all()
        want = np.cumsum(v[:, 0], axis=0) / np.arange(1, 4)[:, None]
        np.testing.assert_allclose(y[:, 0], want, rtol=2e-3 if dtype == "f16" else 1e-5)
    q = np.full((1, 1, 8), 1e3, np.float32)
    k = np.full((1, 1, 8), 1e5, np.float32)  # beyond fp16: stored saturated, never inf
    c = be.new_kv_cache(1, 1, 8, 4, "f16")
    y = be.to_host(be.attention(be.upload(q), be.upload(k), be.upload(k), c, 0, 0, 8 ** -0.5))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, 65504.0)


def test_attention_huge_negative_scores_and_masked_future_keys(be):
    """Every visible score hugely negative (as after adding finfo(fp16).min): the
    max-subtracted softmax still gives finite, uniform weights. Future keys written in
    the same prefill call carry enormous scores and must get weight exactly 0."""
    hd, t = 16, 4
    c = be.new_kv_cache(1, 1, hd, 8, "f32")
    q = np.full((t, 1, hd), -1e3, np.float32)
    k = np.full((t, 1, hd), 1e3, np.float32)           # q.k = -1.6e7 for every key
    k[2:] = -1e3                                      # later keys: q.k = +1.6e7
    v = np.arange(t * hd, dtype=np.float32).reshape(t, 1, hd)
    y = be.to_host(be.attention(be.upload(q), be.upload(k), be.upload(v), c, 0, 0, 1.0))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y[0, 0], v[0, 0])                 # row 0 sees only key 0
    np.testing.assert_allclose(y[1, 0], v[:2, 0].mean(axis=0))   # uniform over 2 keys
    np.testing.assert_allclose(y[2, 0], v[2, 0])                 # key 2 dominates
    ref = REF.attention(q, k, v, REF.new_kv_cache(1, 1, hd, 8), 0, 0, 1.0)
    assert nerr(y, ref) < 1e-6


QKV = ["int8", "int4", "k8v4"]


def _attn_pair_q(be, hq, hkv, hd, steps, dtype, rng=None, scale=None, max_tokens=64,
                 shift=None):
    """The same attention calls over a quantized cache on the device and on the host.

    The stored K bits of two correct implementations may differ where a value sits at a
    rounding boundary (tests/kv_admissible.py: the rotation's summation order is free), so
    the two checks are: the device's cache holds the host's format (V and int4's K
    statistics bit for bit, every K group a float32 evaluation of the format, on both
    sides), and the device's attention equals the reference attending over the device's
    own stored values (float32-tight). Returns (max nerr of the latter, K groups whose
    bits differ from the host's)."""
    rng = rng or np.random.default_rng(0)
    scale = scale if scale is not None else hd ** -0.5
    rc = REF.new_kv_cache(2, hkv, hd, max_tokens, dtype)   # the host format
    dc = be.new_kv_cache(2, hkv, hd, max_tokens, dtype)
    fc = REF.new_kv_cache(2, hkv, hd, max_tokens, "f32")   # the device's values, dequantized
    pos, worst, ks, vs = 0, 0.0, [], []
    for t in steps:
        q, k, v = (rng.standard_normal((t, h, hd)).astype(np.float32) for h in (hq, hkv, hkv))
        if shift is not None:
            k = k + shift
        REF.attention(q, k, v, rc, 1, pos, scale)
        y = be.to_host(be.attention(be.upload(q), be.upload(k), be.upload(v), dc, 1, pos, scale))
        kk, vv = dc.read(1, pos + t)
        ref = REF.attention(q, kk[pos:], vv[pos:], fc, 1, pos, scale)
        worst = max(worst, nerr(y, ref))
        ks.append(k)
        vs.append(v)
        pos += t
    differ = assert_same_format(dtype, np.concatenate(ks), np.concatenate(vs), rc.raw(1),
                                dc.raw(1, pos), pos)
    return worst, differ


@pytest.mark.parametrize("dtype", QKV)
@pytest.mark.parametrize("hq,hkv,hd,shift", [(8, 4, 8, False), (4, 4, 64, False),
                                             (6, 2, 80, False), (3, 1, 256, False),
                                             (14, 2, 64, True)])
def test_quantized_cache_write_matches_host_format(be, dtype, hq, hkv, hd, shift):
    """int8 / int4 / k8v4 KV: the device quantizes on write with the host cache's formulas
    (up to rounding-boundary cases, see :func:`_attn_pair_q`), over prefill and decode
    steps; ``shift``: Qwen-like K with large constant per-channel offsets. (Attention
    over the codes: tests/test_ops.py.)"""
    off = None
    if shift:
        off = np.zeros(64, np.float32)
        off[[30, 31, 62, 63]] = [120, -150, 90, 140]
    worst, _ = _attn_pair_q(be, hq, hkv, hd, [7, 1, 1, 25, 1], dtype, shift=off)
    assert worst < 1e-5


@pytest.mark.parametrize("dtype", QKV)
def test_quantized_cache_codes_equal_host_codes(be, dtype):
    """Same arrays and format as HostKVCache (Hadamard-rotated K, an outlier channel, an
    all-zero V row); k8v4 = int8's K arrays + int4's V arrays, no K channel statistics."""
    from edgeinfer.backends.kvcache import kv_cache_nbytes

    rng = np.random.default_rng(6)
    hkv, hd, n = 2, 64, 10
    rc, dc = REF.new_kv_cache(1, hkv, hd, 16, dtype), be.new_kv_cache(1, hkv, hd, 16, dtype)
    assert dc.nbytes == rc.nbytes == kv_cache_nbytes(1, hkv, hd, 16, dtype)
    k = rng.standard_normal((n, hkv, hd)).astype(np.float32)
    k[..., 3] *= 50  # an outlier channel
    v = rng.standard_normal((n, hkv, hd)).astype(np.float32)
    v[0] = 0.0       # an all-zero row: zero scale, zero codes, no NaN
    q = rng.standard_normal((n, 4, hd)).astype(np.float32)
    REF.attention(q, k, v, rc, 0, 0, 0.125)
    y = be.to_host(be.attention(be.upload(q), be.upload(k), be.upload(v), dc, 0, 0, 0.125))
    host, dev = rc.raw(0), dc.raw(0, n)
    assert set(dev) == set(host), (sorted(dev), sorted(host))
    for name, a in host.items():
        assert dev[name].dtype == a.dtype, name
        assert dev[name].nbytes == (a if name in ("k_off", "k_cs") else a[:n]).nbytes, name
    assert_same_format(dtype, k, v, host, dev, n)
    kk, vv = dc.read(0, n)
    ref = REF.attention(q, kk, vv, REF.new_kv_cache(1, hkv, hd, 16, "f32"), 0, 0, 0.125)
    assert nerr(y, ref) < 1e-5
    hk, hv = rc.read(0, n)
    assert nerr(kk, hk) < 1e-3 and nerr(vv, hv) < 1e-3


def test_quantized_cache_huge_values_stay_finite(be):
    for dtype in QKV:
        c = be.new_kv_cache(1, 1, 8, 4, dtype)
        k = np.full((1, 1, 8), 1e9, np.float32)
        y = be.to_host(be.attention(be.upload(k), be.upload(k), be.upload(k), c, 0, 0, 1.0))
        assert np.isfinite(y).all()


def test_kv_cache_object(be):
    c = be.new_kv_cache(3, 2, 16, 10, "f16")
    assert (c.max_tokens, c.length, c.nbytes) == (10, 0, 2 * 3 * 10 * 2 * 16 * 2)
    c.length = 6
    c.trim(4)
    assert c.length == 4
    with pytest.raises(ValueError):
        c.trim(5)
    c.reset()
    assert c.length == 0
    q = np.zeros((11, 2, 16), np.float32)
    with pytest.raises(ValueError, match="overflow"):
        be.attention(be.upload(q), be.upload(q), be.upload(q), c, 0, 0, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        be.new_kv_cache(1, 1, 8, 4, "int3")
    for dtype in ("int4", "k8v4"):
        with pytest.raises(ValueError, match="even head_dim"):
            be.new_kv_cache(1, 1, 7, 4, dtype)
    k = np.random.default_rng(0).standard_normal((3, 2, 16)).astype(np.float32)
    be.attention(be.upload(k), be.upload(k), be.upload(-k), c, 2, 0, 1.0)
    kk, vv = c.read(2, 3)
    np.testing.assert_allclose(kk, k.astype(np.float16), rtol=0)
    np.testing.assert_allclose(vv, -k.astype(np.float16), rtol=0)


def test_programs_built_once(be):
    rng = np.random.default_rng(0)
    x = be.upload(rng.standard_normal((2, 8)).astype(np.float32))
    w = be.upload(np.ones(8, np.float32))
    be.rmsnorm(x, w, 1e-5)
    n = be._dc.builds
    other = OpenCLBackend()  # same device: shares the context and the program cache
    other.rmsnorm(other.upload(np.ones((2, 8), np.float32)), other.upload(np.ones(8, np.float32)), 1e-5)
    assert other._dc.builds == n


def test_linear_gguf_mins_weights_fall_back_to_dense_with_a_log(be, caplog):
    """A GGUF layout with float group mins (Q4_1 / Q5_1 / Q4_K, re-laid) has no OpenCL
    kernel yet: uploaded dequantized (same values), logged, and the results match."""
    import logging

    import gguf
    from edgeinfer.readers.gguf_blocks import relayout

    rng = np.random.default_rng(8)
    for qname in ("Q4_1", "Q5_1", "Q5_0"):
        raw = gguf.quants.quantize(rng.standard_normal((21, 96)).astype(np.float32),
                                   gguf.GGMLQuantizationType[qname])
        w = relayout(raw, qname, "t", "x.gguf")
        caplog.clear()
        with caplog.at_level(logging.INFO):
            h = be.upload_weight(w)
        logged = any("float group mins" in r.getMessage() for r in caplog.records)
        assert logged == (w.mins is not None), qname  # Q5_0 (no mins) keeps the 8-bit kernels
        for t in (1, 4):
            _check_linear(be, rng, w, t)
        assert h is not None
