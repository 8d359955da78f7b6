"""KV cache dtypes f32/f16/int8/int4: the format's formulas, attention quality, C23, C27,
C28 (ring storage), trim/reset/nbytes, and greedy tokens on stories260K."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from edgeinfer.backends.kvcache import (
    ALL_KV_DTYPES,
    HostKVCache,
    Int4KVCache,
    Int8KVCache,
    kv_bytes_per_token_layer,
    kv_cache_nbytes,
)
from edgeinfer.backends.reference import ReferenceBackend
from greedy import greedy


# ---- an independent numpy re-implementation of the formulas (module docstring) -------
def h_matrix(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(n)).astype(np.float32)


def f16(x):
    return np.clip(x, -65504, 65504).astype(np.float16)


def ref_int8_sym(y, g):
    """Per group of g: s = f16(max|y|/127); q = clip(rint(y/s), -127, 127); y' = q*s."""
    yg = y.reshape(*y.shape[:-1], -1, g).astype(np.float32)
    s = f16(np.abs(yg).max(-1) / np.float32(127)).astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s == 0, 0, np.clip(np.rint(yg / s), -127, 127))
    return (q.astype(np.int8).astype(np.float32) * s).reshape(y.shape)


def ref_int4_asym(y, g):
    """Per group of g: m = f16(min); s = f16((max-m)/15); q = clip(rint((y-m)/s), 0, 15); q*s+m."""
    yg = y.reshape(*y.shape[:-1], -1, g).astype(np.float32)
    m = f16(yg.min(-1)).astype(np.float32)[..., None]
    s = f16((yg.max(-1, keepdims=True) - m) / np.float32(15)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s == 0, 0, np.clip(np.rint((yg - m) / s), 0, 15))
    return (q.astype(np.float32) * s + m).reshape(y.shape)


def rot(x, g):
    h = h_matrix(g)
    return (x.reshape(*x.shape[:-1], -1, g) @ h).reshape(x.shape)


def ref_k_stats(x):
    """int4's K channel statistics: m = sequential float32 mean of the first <= 32 rows;
    c = 2^rint(log2(rms(x - m)) / 2) in heads whose max / median channel RMS > 8, else 1."""
    x = x[:32].astype(np.float32)
    m = x[0]
    for row in x[1:]:
        m = (m + row).astype(np.float32)
    m = (m / np.float32(len(x))).astype(np.float32)
    r = np.sqrt(((x.astype(np.float64) - m) ** 2).mean(0))
    with np.errstate(divide="ignore", invalid="ignore"):
        wide = (r.max(-1) / np.median(r, -1) > 8)[:, None] & (r > 0)
    e = np.clip(np.rint(np.log2(np.where(wide, r, 1.0)) / 2), -16, 16)
    return m, np.where(wide, 2.0 ** e, 1.0).astype(np.float32)


def ref_dequant(dtype, k, v, g, first=None):
    """Dequantized k, v of ``dtype``; ``first``: rows of the write at position 0 (int4)."""
    if dtype == "f32":
        return k, v
    if dtype == "f16":
        return k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    if dtype == "int8":
        return rot(ref_int8_sym(rot(k, g), g), g), ref_int8_sym(v, v.shape[-1])
    if dtype == "k8v4":
        return rot(ref_int8_sym(rot(k, g), g), g), ref_int4_asym(v, g)
    m, c = ref_k_stats(k[:first])
    return rot(ref_int4_asym(rot((k - m) / c, g), g), g) * c + m, ref_int4_asym(v, g)


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def attention(dtype, q, k, v, **cache_kw):
    c = HostKVCache(1, k.shape[1], k.shape[2], k.shape[0], dtype, **cache_kw)
    return ReferenceBackend().attention(q, k, v, c, 0, 0, 1.0 / math.sqrt(q.shape[-1]))


# ---- formulas ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_KV_DTYPES)
@pytest.mark.parametrize("hd", [64, 8, 80])
def test_read_matches_the_formula_exactly(dtype, hd):
    rng = np.random.default_rng(1)
    g = {64: 32, 8: 8, 80: 16}[hd]
    k, v = rand(rng, 10, 2, hd, scale=3.0), rand(rng, 10, 2, hd)
    k[3, 1, :] = 0.0  # a zero group: scale 0, codes 0, no NaN
    c = HostKVCache(2, 2, hd, 16, dtype)
    assert c.group_size == g
    c.write(1, 0, k[:6], v[:6])
    c.write(1, 6, k[6:], v[6:])  # two writes == one
    kr, vr = c.read(1, 10)
    ek, ev = ref_dequant(dtype, k, v, g, first=6)
    assert kr.dtype == np.float32 and kr.shape == (10, 2, hd)
    # the quantized values (codes * scale) are bit-exact; rotations are float32 matmuls
    # whose summation order may differ, hence the 1-ulp-level tolerance on K.
    np.testing.assert_allclose(kr, ek, rtol=0, atol=2e-6 * max(1.0, np.abs(ek).max()))
    np.testing.assert_array_equal(vr, ev)
    assert not np.isnan(kr).any()
    if dtype != "int4":  # int4 stores k - m: a zero row reads back as ~0 (checked above)
        assert np.all(kr[3, 1] == 0)


def test_int8_int4_raw_codes_and_nibble_order():
    rng = np.random.default_rng(2)
    k, v = rand(rng, 4, 1, 64), rand(rng, 4, 1, 64)
    c8 = HostKVCache(1, 1, 64, 4, "int8")
    assert isinstance(c8, Int8KVCache)
    c8.write(0, 0, k, v)
    raw = c8.raw(0)
    y = rot(k, 32).reshape(4, 1, 2, 32)
    s = f16(np.abs(y).max(-1) / np.float32(127))
    np.testing.assert_array_equal(raw["k_scale"], s)
    np.testing.assert_array_equal(raw["k_q"].reshape(4, 1, 2, 32),
                                  np.clip(np.rint(y / s.astype(np.float32)[..., None]), -127, 127))
    assert raw["v_scale"].shape == (4, 1) and raw["v_q"].dtype == np.int8
    assert c8.k_q.shape == (1, 4, 1, 64)  # stacked [L, S, Hkv, hd] as for f32/f16

    c4 = HostKVCache(1, 1, 64, 4, "int4")
    assert isinstance(c4, Int4KVCache)
    c4.write(0, 0, k, v)
    raw = c4.raw(0)
    assert raw["v_q"].shape == (4, 1, 32) and raw["v_q"].dtype == np.uint8
    m = f16(v.reshape(4, 1, 2, 32).min(-1))
    s = f16((v.reshape(4, 1, 2, 32).max(-1) - m.astype(np.float32)) / np.float32(15))
    np.testing.assert_array_equal(raw["v_min"], m)
    np.testing.assert_array_equal(raw["v_scale"], s)
    codes = np.clip(np.rint((v.reshape(4, 1, 2, 32) - m.astype(np.float32)[..., None])
                            / s.astype(np.float32)[..., None]), 0, 15).astype(np.uint8).reshape(4, 1, 64)
    np.testing.assert_array_equal(raw["v_q"] & 15, codes[..., 0::2])  # low nibble = even channel
    np.testing.assert_array_equal(raw["v_q"] >> 4, codes[..., 1::2])


# ---- attention quality --------------------------------------------------------------
# Reached (seed 0): cosine over all outputs f16 0.9999999, int8 0.99997, int4 0.9951,
# k8v4 0.9971.
@pytest.mark.parametrize("dtype,bound", [("f16", 0.99999), ("int8", 0.9999), ("int4", 0.99),
                                         ("k8v4", 0.995)])
def test_attention_over_quantized_cache_vs_f32(dtype, bound):
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, 128, 8, 64), rand(rng, 128, 2, 64), rand(rng, 128, 2, 64)
    ref = attention("f32", q, k, v)
    out = attention(dtype, q, k, v)
    assert np.isfinite(out).all()
    assert cosine(out, ref) >= bound


def _c27(seed):
    rng = np.random.default_rng(seed)
    k = rand(rng, 64, 1, 128)
    k[:, :, 17] *= 50.0  # one outlier channel
    return rand(rng, 64, 1, 128), k, rand(rng, 64, 1, 128)


# C27. Reached over seeds 0-4: int8 0.99993-0.99995; int4 (the outlier widens the head's
# channel spread, so it gets the channel scale c = 8) 0.9950-0.9960, worst single query
# 0.974; rotation only (c = 1, the previous format) 0.982-0.990, with neither 0.93-0.96.
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_c27_outlier_channel(seed):
    q, k, v = _c27(seed)
    ref = attention("f32", q, k, v)
    o8, o4 = attention("int8", q, k, v), attention("int4", q, k, v)
    assert np.isfinite(o8).all() and np.isfinite(o4).all()
    assert cosine(o8, ref) >= 0.999
    assert cosine(attention("k8v4", q, k, v), ref) >= 0.995  # 8-bit K is unaffected
    assert cosine(o4, ref) >= 0.99


def _int4_variant(q, k, v, stats=True, rotation=True):
    """int4 attention with its K channel statistics (m = 0, c = 1) and/or rotation off."""
    c = HostKVCache(1, k.shape[1], k.shape[2], k.shape[0], "int4")
    if not stats:
        c.k_input = lambda layer, start, kk: kk
    if not rotation:
        c._h = np.eye(c.group_size, dtype=np.float32)
    return ReferenceBackend().attention(q, k, v, c, 0, 0, 1 / math.sqrt(q.shape[-1]))


def worst_row_cosine(a, b):
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    return float(np.min(np.sum(a * b, -1) / na / nb))


def test_c27_channel_statistics_and_rotation_are_the_mitigation():
    """On the outlier channel, int4 without its K channel statistics (the rotation only)
    is clearly worse, and without either worse still."""
    full, rot_only, neither = [], [], []
    for seed in range(3):
        q, k, v = _c27(seed)
        ref = attention("f32", q, k, v)
        full.append(cosine(_int4_variant(q, k, v), ref))
        rot_only.append(cosine(_int4_variant(q, k, v, stats=False), ref))
        neither.append(cosine(_int4_variant(q, k, v, stats=False, rotation=False), ref))
    assert np.mean(full) - np.mean(rot_only) > 0.004
    assert np.mean(rot_only) - np.mean(neither) > 0.02


# Qwen-like K: N(0,1) plus large constant per-channel offsets (k_proj biases that RoPE
# barely rotates in its lowest-frequency channels). Reached over seeds 0-4: int4 cosine
# 0.9950-0.9956, worst query 0.977-0.987; without the channel offset 0.645-0.676 (the
# +195% perplexity of Qwen2.5 with the previous format); int8 0.9969-0.9974.
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int4_large_constant_k_offset(seed):
    rng = np.random.default_rng(seed)
    q, k, v = rand(rng, 64, 4, 64), rand(rng, 64, 2, 64), rand(rng, 64, 2, 64)
    k[..., [30, 31, 62, 63]] += np.array([120, -150, 90, 140], np.float32)
    ref = attention("f32", q, k, v)
    out = attention("int4", q, k, v)
    assert np.isfinite(out).all()
    assert cosine(out, ref) >= 0.994 and worst_row_cosine(out, ref) >= 0.97
    assert cosine(_int4_variant(q, k, v, stats=False), ref) < 0.8
    # error bound on K itself: |k' - k| <= half a step per group of the shifted, rotated
    # K (range ~7 / 15 here), never the offsets' magnitude
    c = HostKVCache(1, 2, 64, 64, "int4")
    c.write(0, 0, k[:40], v[:40])
    c.write(0, 40, k[40:], v[40:])
    m, cs = c.raw(0)["k_off"].copy(), c.raw(0)["k_cs"].copy()
    np.testing.assert_array_equal((m, cs), ref_k_stats(k[:40]))
    assert np.abs(c.read(0, 64)[0] - k).max() < 1.0
    c.length = 64
    c.trim(10)  # prefix reuse keeps the statistics; a write at 0 (new sequence) refixes them
    c.write(0, 10, k[10:20] * 2, v[10:20])
    assert np.array_equal(c.raw(0)["k_off"], m)
    c.write(0, 0, k[:5] - 7, v[:5])
    np.testing.assert_array_equal(c.raw(0)["k_off"], ref_k_stats(k[:5] - 7)[0])


def test_c23_fp16_storage_no_overflow():
    """q = k = 128 x 30.0: the raw dot 115200 > 65504; scores must be 10182.34, no inf/NaN."""
    hd = 128
    q = np.full((1, 1, hd), 30.0, np.float32)
    k = np.full((4, 1, hd), 30.0, np.float32)
    rng = np.random.default_rng(3)
    v = rand(rng, 4, 1, hd)
    c = HostKVCache(1, 1, hd, 4, "f16")
    be = ReferenceBackend()
    be.attention(q[:1] * 0, k[:3], v[:3], c, 0, 0, 1 / math.sqrt(hd))  # fill 0..2
    out = be.attention(q, k[3:], v[3:], c, 0, 3, 1 / math.sqrt(hd))
    kk, _ = c.read(0, 4)
    score = float(q[0, 0] @ kk[0, 0]) / math.sqrt(hd)
    assert score == pytest.approx(10182.34, abs=0.01)
    assert np.isfinite(out).all()
    # all four keys are identical: uniform weights, exactly the fp32 result
    ref = v.astype(np.float16).astype(np.float32).mean(axis=0)
    np.testing.assert_allclose(out[0], ref, atol=1e-5)
    for dtype in ("int8", "int4"):
        assert np.isfinite(attention(dtype, np.repeat(q, 4, 0), k, v)).all()
    # values beyond the fp16 range saturate instead of becoming inf
    c.write(0, 0, np.full((1, 1, hd), 1e6, np.float32), v[:1])
    assert np.isfinite(c.read(0, 1)[0]).all()


# ---- bookkeeping --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_KV_DTYPES)
def test_nbytes_trim_reset(dtype):
    c = HostKVCache(3, 2, 64, 40, dtype)
    per = kv_bytes_per_token_layer(2, 64, dtype)
    expect = {"f32": 2 * 2 * 64 * 4, "f16": 2 * 2 * 64 * 2,
              "int8": 2 * (64 + 2 * 2) + 2 * (64 + 2), "int4": 2 * 2 * (32 + 4 * 2),
              "k8v4": 2 * (64 + 2 * 2) + 2 * (32 + 4 * 2)}[dtype]
    assert per == expect
    assert c.nbytes == 3 * 40 * per == kv_cache_nbytes(3, 2, 64, 40, dtype)
    assert c.bytes_per_token() == 3 * per
    rng = np.random.default_rng(4)
    k, v = rand(rng, 20, 2, 64), rand(rng, 20, 2, 64)
    for layer in range(3):
        c.write(layer, 0, k, v)
    c.length = 20
    before = c.read(2, 12)
    c.trim(12)
    assert c.length == 12
    c.write(2, 12, k[:3] * 5, v[:3] * 5)
    after = c.read(2, 12)
    np.testing.assert_array_equal(before[0], after[0])
    with pytest.raises(ValueError):
        c.trim(13)
    c.reset()
    assert c.length == 0
    with pytest.raises(ValueError, match="overflow"):
        c.write(0, 38, k[:3], v[:3])


@pytest.mark.parametrize("dtype", ["f32", "int4"])
def test_used_nbytes_counts_only_held_slots(dtype):
    """Generation stats' kv_bytes: a ring layer holds at most its slots (Gemma 3's
    sliding-window layers), a linear layer ``length`` positions."""
    per = kv_bytes_per_token_layer(1, 16, dtype)
    c = HostKVCache(2, 1, 16, 64, dtype, window_sizes=[8, None], max_chunk=4)
    assert c.slots == [11, 64] and c.used_nbytes() == 11 * 8  # empty: the ring table only
    c.length = 5
    assert c.used_nbytes() == 5 * per + 11 * 8 + 5 * per
    c.length = 40
    assert c.used_nbytes() == 11 * per + 11 * 8 + 40 * per  # (not 40/64 of nbytes)
    lin = HostKVCache(2, 1, 16, 64, dtype)
    lin.length = 40
    assert lin.used_nbytes() == 40 * lin.nbytes // 64


def test_float_caches_keep_k_v_arrays():
    c = HostKVCache(2, 2, 16, 8, "f16")
    assert c.k.shape == (2, 8, 2, 16) and c.k.dtype == np.float16
    assert c.raw(1)["k"].base is c.k or np.shares_memory(c.raw(1)["k"], c.k)


def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        HostKVCache(1, 1, 8, 4, "q4_0")
    with pytest.raises(ValueError, match="window_sizes"):
        HostKVCache(2, 1, 8, 4, "f32", window_sizes=[None])
    with pytest.raises(ValueError, match="even"):
        HostKVCache(1, 1, 7, 4, "int4")


# ---- C28: ring storage for sliding-window layers ------------------------------------
def _run(be, cache, layer_qkv, start, window):
    q, k, v = layer_qkv
    return be.attention(q, k, v, cache, 0, start, 0.25, window=window)


@pytest.mark.parametrize("dtype", ["f32", "int8", "int4"])
def test_c28_ring_equals_linear_across_turns_and_trim(dtype):
    """Window 8, chunks up to 4: a ring of 11 slots. Mixed prefill/decode, a trim back
    into the window and a turn longer than the window give the same outputs as a linear
    cache, and read_positions holds exactly the expected positions."""
    rng = np.random.default_rng(5)
    W, n = 8, 40
    q, k, v = rand(rng, n, 2, 16), rand(rng, n, 1, 16), rand(rng, n, 1, 16)
    be = ReferenceBackend()
    ring = HostKVCache(1, 1, 16, 64, dtype, window_sizes=[W], max_chunk=4)
    lin = HostKVCache(1, 1, 16, 64, dtype)
    assert ring.slots == [W - 1 + 4] and ring.nbytes < lin.nbytes
    assert ring.nbytes == kv_cache_nbytes(1, 1, 16, 64, dtype, [W], 4)

    def step(s, t):
        sl = slice(s, s + t)
        a = be.attention(q[sl], k[sl], v[sl], ring, 0, s, 0.25, window=W)
        b = be.attention(q[sl], k[sl], v[sl], lin, 0, s, 0.25, window=W)
        np.testing.assert_array_equal(a, b)
        ring.length = lin.length = s + t

    pos = 0
    for t in (4, 4, 1, 1, 1, 1, 3, 1):  # turn 1: prefill chunks then decode
        step(pos, t)
        pos += t
    assert pos == 16
    _, _, held = ring.read_positions(0, pos)
    assert list(held) == list(range(pos - 11, pos))  # exactly min(n, slots) entries
    # prefix reuse: trim by 2 keeps everything the window needs
    ring.trim(14)
    lin.trim(14)
    assert ring.length == 14
    pos = 14
    for t in (4, 4, 4, 2, 1, 1):  # turn 2 longer than the window
        step(pos, t)
        pos += t
    # a trim too deep for the ring (keys of the window already overwritten) resets it
    ring.trim(20)
    assert ring.length == 0
    with pytest.raises(ValueError, match="chunk"):
        ring.write(0, 0, k[:5], v[:5])


# ---- whole model: stories260K greedy tokens per KV dtype -----------------------------
@pytest.fixture(scope="module")
def stories(stories_dir):
    from edgeinfer.models.config import ModelConfig
    from edgeinfer.models.transformer import Transformer
    from safetensors.numpy import load_file

    # read directly (not through edgeinfer.readers) so this file tests the cache alone
    cfg = ModelConfig.from_hf_dict(json.loads((stories_dir / "config.json").read_text()))
    model = Transformer(cfg, load_file(str(stories_dir / "model.safetensors")), ReferenceBackend(),
                        max_positions=128)
    model.dir = stories_dir
    return model


def test_stories260k_greedy_tokens_per_kv_dtype(stories):
    ids = [1, 403, 407, 261, 378]  # BOS "Once upon a time"
    ref = greedy(stories, ids, 32, "f32")
    assert greedy(stories, ids, 32, "f16") == ref
    assert greedy(stories, ids, 32, "int8") == ref
    assert greedy(stories, ids, 32, "k8v4") == ref
    int4 = greedy(stories, ids, 32, "int4")
    agree = next((i for i, (a, b) in enumerate(zip(int4, ref)) if a != b), 32)
    # measured: int4 follows f32 for the first 21 of 32 tokens (reported, loosely bounded)
    assert agree >= 8, (agree, int4, ref)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_per_token_formats_are_chunking_invariant(stories, dtype):
    """Codes depend only on each position's own K/V (and, for int4, the K channel
    statistics of the write at position 0, the same 4-token chunk here): prefill N ==
    prefill in chunks + decode (up to float32 rounding of the projections, which may
    flip a rare code)."""
    ids = np.array([1, 403, 407, 261, 378, 29, 445, 270, 260, 300, 411])
    full_cache = stories.new_cache(32, dtype)
    stories.forward(ids[:4], full_cache)
    full = stories.forward(ids[4:], full_cache)[-1]
    cache = stories.new_cache(32, dtype)
    stories.forward(ids[:4], cache)
    stories.forward(ids[4:-1], cache)
    step = stories.forward(ids[-1:], cache)[-1]
    assert np.max(np.abs(full - step)) < 1e-3 * np.max(np.abs(full))


def test_engine_prefix_reuse_with_int8_cache(stories):
    from edgeinfer.engine import Engine
    from edgeinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_json_text((stories.dir / "tokenizer.json").read_text(), bos_token="<s>",
                                   eos_token="</s>", add_bos_token=True)
    eng = Engine(stories, tok, n_ctx=96, kv_dtype="int8", prefill_chunk=4)
    assert type(eng.cache).__name__ == "Int8KVCache"
    prompt = tok.encode("Once upon a time, there was a little girl", add_special=True)
    fresh, _ = eng.generate(prompt + [29], max_tokens=12)
    eng.reset()
    eng.generate(prompt, max_tokens=5)
    text, final = eng.generate(prompt + [29], max_tokens=12)
    assert final.stats.reused_tokens == len(prompt)
    assert text == fresh
    # no windows: kv_bytes is length x bytes per position
    used = eng.cache.length * eng.cache.nbytes // 96
    assert final.stats.kv_bytes == eng.cache.used_nbytes() == used
