"""The fast paths of the GPTQ converter against their plain forms: the compiled column
kernel against its Python source, the batched calibration forward (many sequences per
GEMM, fused q/k/v and gate/up) against one reference forward per sequence."""
from __future__ import annotations

import numpy as np

from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.models.families import layer_tensor_names
from edgeinfer.models.rope import rope_tables
from edgeinfer.models.transformer import decoder_layer, upload_layer
from edgeinfer.quant import calibrate as cal
from edgeinfer.quant import calib_backend
from edgeinfer.quant.gptq import _block_kernel, _quantize_block_py, gptq_quantize


def _block_inputs(seed=0, n=64, out=40, b=32, g=16):
    rng = np.random.default_rng(seed)
    f = np.float32
    W0 = rng.normal(0, 0.1, (n, out)).astype(f)
    Wt = (W0 + rng.normal(0, 0.01, (n, out))).astype(f)
    Rb = np.triu(rng.normal(0, 0.3, (b, b))).astype(f)
    S = rng.uniform(0.01, 0.03, (n // g, out)).astype(f)
    Z = rng.integers(0, 16, (n // g, out)).astype(f)
    group_of = (rng.permutation(n) // g).astype(np.int64)
    return Wt, W0, Rb, S, Z, group_of


def test_block_kernel_equals_python():
    Wt, W0, Rb, S, Z, group_of = _block_inputs()
    outs = []
    for fn in (_quantize_block_py, _block_kernel()):
        Qt = np.full(Wt.shape, -1, np.float32)
        D = np.zeros((32, Wt.shape[1]), np.float32)
        fn(Wt, W0, Rb, S, Z, group_of, 32, 64, Qt, D)
        outs.append((Qt, D))
    (q1, d1), (q2, d2) = outs
    assert (q1[:32] == -1).all() and ((q2[32:] >= 0) & (q2[32:] <= 15)).all()
    np.testing.assert_array_equal(q1, q2)
    np.testing.assert_array_equal(d1, d2)
    assert len(np.unique(q2[32:])) > 8  # a real spread of codes, not a clipped block


def test_gptq_codes_independent_of_kernel(monkeypatch):
    """gptq_quantize with the compiled kernel == with the Python one, on one weight."""
    rng = np.random.default_rng(3)
    X = (rng.normal(size=(512, 96)) * rng.uniform(0.2, 2, 96)).astype(np.float32)
    H = 2 * (X.T.astype(np.float64) @ X) / len(X)
    W = rng.normal(0, 0.05, (48, 96)).astype(np.float32)
    fast = gptq_quantize(W, H, 4, 32, False, act_order=True)
    import edgeinfer.quant.gptq as g

    monkeypatch.setattr(g, "_block_kernel", lambda: _quantize_block_py)
    slow = gptq_quantize(W, H, 4, 32, False, act_order=True)
    np.testing.assert_array_equal(fast.codes(), slow.codes())
    np.testing.assert_array_equal(fast.scales, slow.scales)


def test_batched_forward_matches_per_sequence(stories_dir, monkeypatch):
    from edgeinfer.readers import read_model

    src = read_model(str(stories_dir))
    cfg = src.config
    L, n = 40, 5
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (n, L)).astype(np.int32)
    x = np.asarray(src.tensors["model.embed_tokens.weight"], np.float32)[ids]
    lw = cal.load_layer(src, 1)
    cos, sin = rope_tables(cfg, L, cfg.layer_rope_theta(1))
    monkeypatch.setattr(cal, "CHUNK_TOKENS", 2 * L)  # chunks of 2, 2 and 1 sequences
    be = calib_backend.CalibrationBackend()
    rope = (be.upload(cos), be.upload(sin))
    caps = {}
    cal._run_layer(be, cfg, lw, 1, x, rope,
                   lambda j, c: caps.setdefault(j, {k: np.array(v) for k, v in c.items()}))
    y = cal._run_layer(be, cfg, lw, 1, x, rope)
    assert sorted(caps) == list(range(n))
    ref = ReferenceBackend()
    names = layer_tensor_names(1)
    for j in range(n):
        w = upload_layer(ref, {names[k]: v for k, v in lw.items()}, 1)
        cache = ref.new_kv_cache(1, cfg.num_key_value_heads, cfg.head_dim, L)
        cap: dict = {}
        pos = np.arange(L, dtype=np.int32)
        decoder_layer(ref, cfg, w, x[j], pos, rope, cache, 0, 1, capture=cap, capture_only=True)
        for k, a in cap.items():
            np.testing.assert_allclose(caps[j][k], a, rtol=1e-5, atol=1e-5 * np.abs(a).max())
        w = upload_layer(ref, {names[k]: v for k, v in lw.items()}, 1)
        cache = ref.new_kv_cache(1, cfg.num_key_value_heads, cfg.head_dim, L)
        out = decoder_layer(ref, cfg, w, x[j], pos, rope, cache, 0, 1)
        np.testing.assert_allclose(y[j], out, rtol=1e-5, atol=1e-5 * np.abs(out).max())
    assert not np.allclose(y[0], y[1])  # control: the sequences differ


def test_calibration_rowwise_ops_equal_reference():
    """rmsnorm / rope / glu in blocks of OP_ROWS rows give the reference's values exactly
    (gate/up as the column views of one fused product, as the calibration forward has)."""
    rng = np.random.default_rng(5)
    T = 3 * calib_backend.OP_ROWS + 17
    ref, be = ReferenceBackend(), calib_backend.CalibrationBackend()
    x = (rng.normal(size=(T, 96)) * 3).astype(np.float32)
    w = rng.normal(size=96).astype(np.float32)
    for off in (False, True):
        a, b = ref.rmsnorm(x, w, 1e-6, off), be.rmsnorm(x, w, 1e-6, off)
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    qh = rng.normal(size=(T, 4, 16)).astype(np.float32)  # per-head norm (QK-norm) shape
    np.testing.assert_array_equal(ref.rmsnorm(qh, w[:16], 1e-6), be.rmsnorm(qh, w[:16], 1e-6))
    cos = rng.uniform(-1, 1, (T + 5, 8)).astype(np.float32)
    sin = rng.uniform(-1, 1, (T + 5, 8)).astype(np.float32)
    pos = np.tile(np.arange(T // 3 + 1, dtype=np.int32), 3)[:T]
    np.testing.assert_array_equal(ref.rope(qh, cos, sin, pos), be.rope(qh, cos, sin, pos))
    y = rng.normal(0, 4, (T, 192)).astype(np.float32)
    for act in ("silu", "gelu_tanh"):
        a, b = ref.glu(y[:, :96], y[:, 96:], act), be.glu(y[:, :96], y[:, 96:], act)
        np.testing.assert_array_equal(a, b)
        assert np.abs(a).max() > 1.0


def test_calibration_attention_per_sequence():
    """The batched attention (one sequence at a time) equals each sequence run alone,
    exactly, and the reference's per-sequence attention (its cache path) closely."""
    rng = np.random.default_rng(6)
    L, n, hq, hkv, hd = 48, 5, 6, 2, 16
    q = rng.normal(size=(n * L, hq, hd)).astype(np.float32)
    k = rng.normal(size=(n * L, hkv, hd)).astype(np.float32)
    v = rng.normal(size=(n * L, hkv, hd)).astype(np.float32)
    be, ref = calib_backend.CalibrationBackend(), ReferenceBackend()
    be.seq_len = L
    for window in (None, 7):
        out = be.attention(q, k, v, None, 0, 0, 0.25, window)
        assert out.shape == (n * L, hq, hd) and out.dtype == np.float32
        for j in range(n):
            s = slice(j * L, (j + 1) * L)
            be.seq_len = None  # a call of L rows: one sequence
            np.testing.assert_array_equal(out[s], be.attention(q[s], k[s], v[s], None, 0, 0,
                                                               0.25, window))
            be.seq_len = L
            cache = ref.new_kv_cache(1, hkv, hd, L)
            np.testing.assert_allclose(out[s], ref.attention(q[s], k[s], v[s], cache, 0, 0,
                                                             0.25, window),
                                       rtol=1e-5, atol=1e-6)
        assert not np.allclose(out[:L], out[L:2 * L])
