"""OpenCL KV cache ring storage for sliding-window layers, against the host cache and the
reference backend: a windowed layer allocates ``min(max_tokens, W - 1 + max_chunk)``
slots (the host cache's rule and byte count), the kernels find position ``p`` in slot
``p % S`` while decode runs past the window, and trim / reset follow the host rules.

Error measure: test_opencl_kernels.py's ``nerr`` (max error over the output's scale), with
the same dequantized values on both sides, so quantized dtypes stay float32-tight.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'edgeinfer[opencl]')")

from edgeinfer.backends.kvcache import HostKVCache, kv_cache_nbytes
from edgeinfer.backends.opencl import OpenCLBackend
from edgeinfer.backends.reference import ReferenceBackend

REF = ReferenceBackend()
DTYPES = ["f32", "f16", "int8", "int4", "k8v4"]
TOL = {"f32": 1e-5, "f16": 2e-3, "int8": 1e-5, "int4": 1e-5, "k8v4": 1e-5}
# Two layers: 0 is windowed (W = 8, a ring of 8 - 1 + 12 = 19 slots), 1 is global.
W, CHUNK, MAX_TOKENS = 8, 12, 64
WINDOWS = [W, None]
# 3x the window and more: chunks shorter (5, 3) and longer (12, 10) than the window.
STEPS = [12, 5, 1, 1, 1, 10, 1, 1, 3, 1, 1, 1, 1, 1]


@pytest.fixture(scope="module")
def be(opencl_backend):
    return opencl_backend


def nerr(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    assert y.shape == ref.shape and np.isfinite(y).all()
    return float(np.max(np.abs(y - ref), initial=0.0) / max(np.max(np.abs(ref), initial=0.0), 1.0))


def _caches(be, dtype, hkv=2, hd=16, max_tokens=MAX_TOKENS):
    rc = REF.new_kv_cache(2, hkv, hd, max_tokens, dtype, window_sizes=WINDOWS, max_chunk=CHUNK)
    dc = be.new_kv_cache(2, hkv, hd, max_tokens, dtype, window_sizes=WINDOWS, max_chunk=CHUNK)
    return rc, dc


def _step(be, rc, dc, pos, t, rng, hq=4, hkv=2, hd=16, softcap=None):
    """One attention call of T = t tokens on both layers of both caches; worst error."""
    worst = 0.0
    for layer, window in enumerate(WINDOWS):
        q = rng.standard_normal((t, hq, hd)).astype(np.float32)
        k = rng.standard_normal((t, hkv, hd)).astype(np.float32)
        v = rng.standard_normal((t, hkv, hd)).astype(np.float32)
        ref = REF.attention(q, k, v, rc, layer, pos, hd ** -0.5, window, softcap)
        y = be.to_host(be.attention(be.upload(q), be.upload(k), be.upload(v), dc, layer, pos,
                                    hd ** -0.5, window, softcap))
        worst = max(worst, nerr(y, ref))
    return worst


@pytest.mark.parametrize("dtype,split", [(d, False) for d in DTYPES]
                         + [("f32", True), ("f16", True)])  # split-KV serves float caches
def test_windowed_decode_past_the_window_matches_reference(be, dtype, split):
    """Prefill and decode to 40 positions (5x the window) through a 19-slot ring, every
    KV dtype; ``split`` forces the split-KV kernels with 3-key chunks."""
    if split:
        be = OpenCLBackend()
        be.caps = dataclasses.replace(be.caps, split_kv_chunk=3, split_kv_max_t=4)
    rng = np.random.default_rng(3)
    rc, dc = _caches(be, dtype)
    assert dc.slots == rc.slots == [W - 1 + CHUNK, MAX_TOKENS]
    pos, worst = 0, 0.0
    for t in STEPS:
        worst = max(worst, _step(be, rc, dc, pos, t, rng, softcap=30.0 if split else None))
        pos += t
        rc.length = dc.length = pos
    assert pos > 3 * W + CHUNK  # the ring wrapped more than once
    assert worst < TOL[dtype]
    # the ring holds exactly the host ring's positions and (dequantized) values
    np.testing.assert_array_equal(dc.positions(0), rc.positions(0))
    assert dc.positions(1) is None
    for layer in (0, 1):
        (dk, dv), (hk, hv) = dc.read(layer, pos), rc.read(layer, pos)
        assert nerr(dk, hk) < TOL[dtype] and nerr(dv, hv) < TOL[dtype]
    _assert_same_storage(dc.raw(0), rc.raw(0))  # slot by slot, the ring wrapped
    if split:
        assert any(key[1] == "attention_split" for key in be._dc._kernels)


def _assert_same_storage(dev, host):
    """The device ring's arrays equal the host ring's (same names, dtypes, bytes): codes
    exactly but for rare rounding ties (an int8 code by at most one, as in
    test_opencl_kernels.py), scales and minima f16-tight."""
    assert set(dev) == set(host), (sorted(dev), sorted(host))
    for name, h in host.items():
        d = dev[name]
        assert d.dtype == h.dtype and d.nbytes == h.nbytes, name
        a, b = h.reshape(d.shape).astype(np.float64), d.astype(np.float64)
        if d.dtype == np.int8:
            assert np.abs(a - b).max() <= 1 and np.mean(a != b) < 5e-3, name
        elif d.dtype == np.uint8:  # packed 4-bit codes
            assert np.mean(a != b) < 5e-3, name
        else:
            np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_trim_keeps_or_resets_like_the_host_cache(be, dtype):
    """Prefix reuse (engine.prefill trims, then reads ``length``): a trim the ring can serve
    keeps the prefix and decoding continues exactly; one past what the ring still holds
    resets both caches to 0."""
    rng = np.random.default_rng(4)
    rc, dc = _caches(be, dtype)
    pos = 0
    for t in (12, 12, 4):          # 28 positions; the ring holds 9..27
        _step(be, rc, dc, pos, t, rng)
        pos += t
        rc.length = dc.length = pos
    for cache in (rc, dc):
        cache.trim(20)             # keys 13..19 still held: kept
    assert dc.length == rc.length == 20
    np.testing.assert_array_equal(dc.positions(0), rc.positions(0))
    worst, pos = 0.0, 20
    for t in (5, 1, 12, 1):        # overwrite the dropped slots, run past them
        worst = max(worst, _step(be, rc, dc, pos, t, rng))
        pos += t
        rc.length = dc.length = pos
    assert worst < TOL[dtype]
    for cache in (rc, dc):
        cache.trim(10)             # would need keys 3..9: overwritten long ago
    assert dc.length == rc.length == 0
    assert (dc.positions(0) == -1).all()
    assert _step(be, rc, dc, 0, 7, rng) < TOL[dtype]  # a new sequence from position 0


def test_ring_layer_rejects_oversized_chunks_and_wider_windows(be):
    _, dc = _caches(be, "f32")
    x = be.upload(np.zeros((CHUNK + 1, 2, 16), np.float32))
    with pytest.raises(ValueError, match="max_chunk"):
        be.attention(x, x, x, dc, 0, 0, 1.0, W)
    be.attention(x, x, x, dc, 1, 0, 1.0)  # the global layer takes any chunk that fits
    y = be.upload(np.zeros((1, 2, 16), np.float32))
    for window in (None, W + 1):  # would read keys the ring no longer holds
        with pytest.raises(ValueError, match="window"):
            be.attention(y, y, y, dc, 0, 0, 1.0, window)
    be.attention(y, y, y, dc, 0, 0, 1.0, W - 2)  # a narrower window is served


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma3_270m_geometry_allocates_ring_bytes(be, dtype):
    """Gemma 3 270M (18 layers, 1 KV head x 256, window 512 on all but layers 5, 11, 17)
    at 4096 tokens: the device buffers hold 15 rings of 1023 slots + 3 x 4096 slots, and
    ``nbytes`` / ``used_nbytes`` equal the host cache's."""
    layers, hkv, hd, n = 18, 1, 256, 4096
    wins = [None if i % 6 == 5 else 512 for i in range(layers)]
    dc = be.new_kv_cache(layers, hkv, hd, n, dtype, window_sizes=wins, max_chunk=512)
    hc = HostKVCache(layers, hkv, hd, n, dtype, window_sizes=wins, max_chunk=512)
    assert dc.slots == hc.slots and sum(dc.slots) == 15 * 1023 + 3 * 4096
    allocated = sum(b.size for b in dc.buffers.values())   # what the device really holds
    assert allocated == dc.device_nbytes
    assert dc.nbytes == hc.nbytes == kv_cache_nbytes(layers, hkv, hd, n, dtype, wins, 512)
    assert dc.nbytes - dc.device_nbytes == 15 * 1023 * 8    # host position tables
    full = kv_cache_nbytes(layers, hkv, hd, n, dtype)
    assert allocated < 0.38 * full                         # 37.5% of all-global storage
    for length in (0, 100, 1023, 3000, 4096):
        dc.length = hc.length = length
        assert dc.used_nbytes() == hc.used_nbytes(), length
    assert dc.bytes_per_token() == hc.bytes_per_token()
