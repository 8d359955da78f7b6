"""AWQ and GPTQ on synthetic layers: both beat RTN where activations have outlier channels;
the AWQ fold preserves the float function (llama and gemma (1 + w) norms); GPTQ act-order
resolves to ordinary contiguous groups (static groups)."""
from __future__ import annotations

import numpy as np
import pytest
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.models.config import ModelConfig
from edgeinfer.models.rope import rope_tables
from edgeinfer.models.transformer import decoder_layer, layer_tensor_names, upload_layer
from edgeinfer.quant.awq import AWQ_SCALE_GROUPS, fold_scale, search_clip, search_scale
from edgeinfer.quant.gptq import Hessian, gptq_quantize
from edgeinfer.quant.rtn import group_params, quantize_rtn


def _outlier_layer(seed=0, n=2048, n_in=256, n_out=128):
    """x [n, in]: correlated channels (rank-32 latent + noise, as real activations are; with
    white inputs H is diagonal and GPTQ degenerates to RTN) and 4 outlier channels (x30);
    W [out, in] ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((n, 32)) @ rng.standard_normal((32, n_in)) / np.sqrt(32)
    x = (latent + 0.3 * rng.standard_normal((n, n_in))).astype(np.float32)
    x[:, [c for c in (3, 77, 150, 201) if c < n_in]] *= 30.0
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    return x, w


def _out_mse(x, w, wq):
    return float(np.mean((x @ w.T - x @ wq.T) ** 2))


def test_awq_beats_rtn_on_outlier_channels():
    x, w = _outlier_layer()
    rtn = _out_mse(x, w, quantize_rtn(w, 4, 64).dequantize())
    s, alpha, losses = search_scale(x, np.abs(x).mean(0), w, 4, 64)
    assert alpha > 0 and losses[0] == pytest.approx(rtn, rel=1e-3)  # α = 0 is RTN
    ws = w * s
    clip = search_clip(x / s.astype(np.float32), ws, 4, 64)
    wq = quantize_rtn(ws, 4, 64, clip=clip, method="awq").dequantize() / s
    awq = _out_mse(x, w, wq)
    ratio = awq / rtn
    print(f"AWQ/RTN output MSE ratio {ratio:.3f} (alpha {alpha})")
    assert ratio < 0.6


def test_gptq_beats_rtn_on_outlier_channels():
    x, w = _outlier_layer(1)
    rtn = _out_mse(x, w, quantize_rtn(w, 4, 64).dequantize())
    h = Hessian(w.shape[1])
    for part in np.array_split(x, 4):  # running accumulation == one shot
        h.add(part)
    ref = 2 * x.astype(np.float64).T @ x / len(x)  # batch products are float32 (as GPTQ's)
    np.testing.assert_allclose(h.H, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    qt = gptq_quantize(w, h.H, 4, 64)
    gptq = _out_mse(x, w, qt.dequantize())
    qa = gptq_quantize(w, h.H, 4, 64, act_order=True)
    act = _out_mse(x, w, qa.dequantize())
    print(f"GPTQ/RTN {gptq / rtn:.3f}, act-order/RTN {act / rtn:.3f}")
    assert gptq / rtn < 0.6 and act / rtn < 0.6
    assert qt.method == "gptq" and qt.in_features == 256


def test_gptq_act_order_static_groups_are_contiguous():
    """act-order rule: group params come from the original contiguous groups (equal to RTN's)
    and the stored tensor needs no g_idx: column k uses group k // g."""
    x, w = _outlier_layer(2, n_in=128, n_out=16)
    h = Hessian(128)
    h.add(x)
    qa = gptq_quantize(w, h.H, 4, 32, act_order=True)
    r = quantize_rtn(w, 4, 32)
    assert np.array_equal(qa.scales, r.scales) and np.array_equal(qa.zeros, r.zeros)
    codes = qa.codes().astype(np.float64)
    ref = (codes - np.repeat(qa.zero_points(), 32, 1)) * np.repeat(qa.scales.astype(np.float64), 32, 1)
    np.testing.assert_allclose(qa.dequantize(), ref, rtol=0, atol=1e-6)
    assert not np.array_equal(qa.codes(), r.codes())  # error compensation changed codes


def test_gptq_dead_columns_padding_and_finite():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((512, 100)).astype(np.float32)
    x[:, 7] = 0.0  # a dead input channel
    w = rng.standard_normal((8, 100)).astype(np.float32)
    h = Hessian(100)
    h.add(x)
    qt = gptq_quantize(w, h.H, 4, 32)  # 100 -> padded to 128
    d = qt.dequantize()
    assert qt.in_padded == 128 and qt.in_features == 100 and np.isfinite(d).all()
    assert np.all(np.abs(d[:, 7]) <= qt.scales[:, 0].astype(np.float32) / 2 + 1e-6)
    assert _out_mse(x, w, d) < _out_mse(x, w, quantize_rtn(w, 4, 32).dequantize())


def _textbook_gptq(w, H, g, act_order, percdamp=0.01):
    """GPTQ column by column (Algorithm 1 without lazy batches), float64, for the oracle
    test: dequantized weight [out, in]."""
    W = np.array(w, np.float64)
    out, n = W.shape
    H = np.array(H, np.float64)
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    n_pad = -(-n // g) * g

    def params(cols):  # asymmetric, range including 0 (group_params' rule)
        return group_params(cols[:, None, :], 4, False)

    S, Z = np.zeros((out, n_pad // g)), np.zeros((out, n_pad // g))
    perm = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(n)
    if act_order:
        for gi in range(n_pad // g):
            s, z = params(W[:, gi * g:(gi + 1) * g])
            S[:, gi], Z[:, gi] = s[:, 0], z[:, 0]
    W, H = W[:, perm], H[np.ix_(perm, perm)]
    H += percdamp * np.mean(np.diag(H)) * np.eye(n)
    U = np.linalg.cholesky(np.linalg.inv(H)).T
    D = np.zeros_like(W)
    for j in range(n):
        gi = perm[j] // g
        if not act_order and j % g == 0:
            s, z = params(W[:, j:j + g])
            S[:, gi], Z[:, gi] = s[:, 0], z[:, 0]
        q = np.clip(np.round(W[:, j] / S[:, gi]) + Z[:, gi], 0, 15)
        D[:, j] = (q - Z[:, gi]) * S[:, gi]
        err = (W[:, j] - D[:, j]) / U[j, j]
        W[:, j:] -= np.outer(err, U[j, j:])
    return D[:, np.argsort(perm)]


@pytest.mark.parametrize("n_in,g,act_order", [(256, 64, False), (256, 64, True),
                                              (100, 32, False), (192, 96, True),
                                              (192, 96, False)])
def test_gptq_matches_the_textbook_column_loop(n_in, g, act_order):
    """The blocked float32 implementation is the column-by-column algorithm: the same codes
    up to float rounding, the same output error."""
    x, w = _outlier_layer(5, n_in=n_in, n_out=48)
    h = Hessian(n_in)
    h.add(x)
    ref = _textbook_gptq(w, h.H, g, act_order)
    qt = gptq_quantize(w, h.H, 4, g, act_order=act_order)
    d = qt.dequantize()
    same = np.isclose(d, ref, rtol=0, atol=1e-5 * np.abs(ref).max()).mean()
    print(f"same codes {same:.4f}")
    assert same > 0.99
    e_ref, e = _out_mse(x, w, ref), _out_mse(x, w, d)
    assert e == pytest.approx(e_ref, rel=0.02)
    assert e < 0.6 * _out_mse(x, w, quantize_rtn(w, 4, g).dequantize())  # control: not RTN


def _tiny_cfg(kind: str) -> ModelConfig:
    base = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
            "num_attention_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6}
    if kind == "gemma":
        return ModelConfig.from_hf_dict({**base, "model_type": "gemma3_text", "num_key_value_heads": 2,
                                         "hidden_activation": "gelu_pytorch_tanh"})
    if kind == "gqa":
        return ModelConfig.from_hf_dict({**base, "model_type": "llama", "num_key_value_heads": 1})
    return ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "num_key_value_heads": 2})


def _layer_out(cfg, lw, x):
    be = ReferenceBackend()
    names = layer_tensor_names(0)
    h = upload_layer(be, {names[k]: np.asarray(v, np.float32) for k, v in lw.items()}, 0)
    cos, sin = rope_tables(cfg, 8)
    cache = be.new_kv_cache(1, cfg.num_key_value_heads, cfg.head_dim, 8)
    return decoder_layer(be, cfg, h, x, np.arange(8, dtype=np.int32), (cos, sin), cache, 0, 0)


@pytest.mark.parametrize("kind", ["llama-qwen2-bias", "gemma", "gqa"])
def test_awq_fold_preserves_float_layer(kind):
    cfg = _tiny_cfg(kind.split("-")[0] if kind != "llama-qwen2-bias" else "qwen2")
    rng = np.random.default_rng(4)
    from edgeinfer.models.arch import tensor_specs
    lw = {}
    inv = {v: k for k, v in layer_tensor_names(0).items()}
    for spec in tensor_specs(cfg):
        if spec.name in inv:
            lw[inv[spec.name]] = rng.standard_normal(spec.shape(cfg)) * (0.3 if "norm" not in spec.name else 0.2)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    ref = _layer_out(cfg, lw, x)
    groups = [g for g in AWQ_SCALE_GROUPS[cfg.arch] if g.when(cfg)]
    assert (len(groups) == 3) == (kind == "gqa")  # v -> o skipped under GQA
    lw2 = {k: np.asarray(v, np.float64) for k, v in lw.items()}
    for g in groups:
        fold_scale(cfg, lw2, g, rng.uniform(0.3, 3.0, lw2[g.linears[0]].shape[1]))
    np.testing.assert_allclose(_layer_out(cfg, lw2, x), ref, rtol=1e-4, atol=1e-4)
    assert not np.allclose(lw2["q_proj"], lw["q_proj"])


def test_fast_search_helpers_match_the_float64_paths():
    """The float32 search quantizer equals RTN's dequantization (up to float32 rounding) and
    GPTQ's update factor is ``R / diag(R)`` with ``R = U⁻¹``, ``U = chol(H⁻¹)ᵀ`` (the
    reference implementation's factor), in any column order."""
    from edgeinfer.quant.awq import fake_quantize32
    from edgeinfer.quant.gptq import hessian_factor
    from edgeinfer.quant.rtn import fake_quantize

    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 200)).astype(np.float32)
    for sym in (False, True):
        ref = fake_quantize(w, 4, 64, sym)
        got = fake_quantize32(w, 4, 64, sym)
        assert got.shape == ref.shape
        assert np.mean(np.abs(got - ref) > 1e-4) < 0.002  # rare rounding ties may flip
    x = rng.standard_normal((600, 500)) * rng.uniform(0.1, 3, 500)
    H = 2 * x.T @ x / 600
    for perm in (np.arange(500), rng.permutation(500)):
        Rt = hessian_factor(H, perm, 0.01)
        Hd = (H + 0.01 * np.mean(np.diag(H)) * np.eye(500))[np.ix_(perm, perm)]
        R = np.linalg.inv(np.linalg.cholesky(np.linalg.inv(Hd)).T)
        ref = R / np.diag(R)[None, :]
        np.testing.assert_allclose(Rt, ref, atol=2e-4 * np.abs(ref).max())
        assert np.array_equal(Rt, np.triu(Rt)) and np.allclose(np.diag(Rt), 1.0)


def test_coarse_to_fine_grid_finds_the_full_grid_minimum():
    for seed in (0, 2, 5):
        x, w = _outlier_layer(seed)
        am = np.abs(x).mean(0)
        s1, a1, l1 = search_scale(x, am, w, 4, 64, coarse_to_fine=False)
        s2, a2, l2 = search_scale(x, am, w, 4, 64)
        assert a1 == a2 and np.array_equal(s1, s2)
        assert sum(np.isfinite(l2)) <= 12 and np.nanmin(l2) == min(l1)


def _skewed_layer(seed=6, n=2048, n_in=256, n_out=96):
    """Correlated inputs with outlier channels and weights with a one-sided heavy tail
    (groups whose max and min sides differ a lot, as real rows often have)."""
    x, w = _outlier_layer(seed, n, n_in, n_out)
    rng = np.random.default_rng(seed + 100)
    w = w + np.where(rng.random(w.shape) < 0.01, 6.0, 0.0).astype(np.float32)
    return x, w


def test_search_quantizer_matches_the_stored_one_with_clips():
    """What the clip searches score is exactly what is stored: the saturating max-abs clip
    (fake_quantize32's ``clip`` = quantize_rtn's) and the clamped range (clamp_groups)."""
    from edgeinfer.quant.awq import clamp_groups, fake_quantize32, search_clip_range

    x, w = _skewed_layer()
    c = search_clip(x, w, 4, 64)
    np.testing.assert_array_equal(quantize_rtn(w, 4, 64, clip=c).dequantize(),
                                  fake_quantize32(w, 4, 64, clip=c.astype(np.float32)))
    lo, hi = search_clip_range(x, w, 4, 64)
    wc = clamp_groups(w, lo, hi, 64)
    np.testing.assert_array_equal(quantize_rtn(wc, 4, 64).dequantize(),
                                  fake_quantize32(wc.astype(np.float32), 4, 64))


def test_clip_range_beats_the_max_abs_clip():
    """Separate lower / upper bounds (asymmetric format) lower the output error further than
    AutoAWQ's max-abs shrink, which already beats no clipping."""
    from edgeinfer.quant.awq import clamp_groups, search_clip_range

    x, w = _skewed_layer()
    none = _out_mse(x, w, quantize_rtn(w, 4, 64).dequantize())
    c = search_clip(x, w, 4, 64)
    maxabs = _out_mse(x, w, quantize_rtn(w, 4, 64, clip=c).dequantize())
    lo, hi = search_clip_range(x, w, 4, 64)
    assert np.all(lo <= 0) and np.all(hi >= 0)
    rng_ = _out_mse(x, w, quantize_rtn(clamp_groups(w, lo, hi, 64), 4, 64).dequantize())
    print(f"clip: none {none:.4g}, max-abs {maxabs:.4g}, range {rng_:.4g}")
    assert maxabs < 0.95 * none and rng_ < 0.95 * maxabs


def test_weight_mean_and_duo_scaling():
    from edgeinfer.quant.awq import weight_mean

    w = np.array([[1.0, -2.0, 0.5, 4.0], [2.0, 2.0, -1.0, 1.0]])
    np.testing.assert_allclose(weight_mean(w, 2), [0.75, 1.0, 0.5625, 1.0])
    x, w = _outlier_layer(7)
    rtn = _out_mse(x, w, quantize_rtn(w, 4, 64).dequantize())
    s, _, _ = search_scale(x, np.abs(x).mean(0), w, 4, 64, duo=True)
    duo = _out_mse(x, w, quantize_rtn(w * s, 4, 64).dequantize() / s)
    assert duo < 0.6 * rtn


def _glu_layer(seed=0, n=1024, d=128, inter=512):
    """A GLU MLP whose first token of every 64 is a 'sink' (as Qwen2.5's first token): a
    fixed input on every 16th channel that all gate/up rows weigh alike, so the GLU product
    and its quantization error are coherent across rows and add up through ``down``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    cols = np.arange(0, d, 16)
    sink = np.zeros(d, np.float32)
    sink[cols] = 8.0
    x[::64] = sink + 0.3 * rng.standard_normal((n // 64, d)).astype(np.float32)
    gate = (rng.standard_normal((inter, d)) * 0.1).astype(np.float32)
    up = (rng.standard_normal((inter, d)) * 0.1).astype(np.float32)
    gate[:, cols] = 0.35
    up[:, cols] = 0.35
    down = (np.abs(rng.standard_normal((d, inter))) * 0.05).astype(np.float32)
    return x, gate, up, down


def test_mlp_objective_matches_the_block_output():
    from edgeinfer.quant.awq import fake_quantize32, mlp_objective

    x, gate, up, down = _glu_layer()
    be = ReferenceBackend()
    wq = fake_quantize32(np.concatenate([gate, up]), 4, 64)
    ref = be.glu(x @ gate.T, x @ up.T) @ down.T
    got = be.glu(x @ wq[:512].T, x @ wq[512:].T) @ down.T
    f = mlp_objective(x, gate, up, down, max_tokens=len(x))
    assert f(wq) == pytest.approx(float(np.mean((got - ref) ** 2)), rel=1e-3)
    assert f(np.concatenate([gate, up])) == 0.0


def test_clip_gate_on_the_block_output():
    """With a coherent 'sink' token, gate/up's per-group clip search (blind to how row errors
    add up through ``down``) makes the quantized MLP ~13x worse than no clip; the clip gate
    (MLP-output objective) drops gate/up's clip and keeps down's (measured on the MLP with
    gate, up, down all INT4 and the folds applied)."""
    from edgeinfer.quant.awq import awq_quantize_layer

    x, gate, up, down = _glu_layer()
    be = ReferenceBackend()
    cfg = ModelConfig.from_hf_dict({"vocab_size": 32, "hidden_size": 128,
                                    "intermediate_size": 512, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "head_dim": 8,
                                    "rms_norm_eps": 1e-6, "model_type": "qwen2",
                                    "num_key_value_heads": 2})
    lw = {"post_attention_layernorm": np.ones(128), "gate_proj": gate, "up_proj": up,
          "down_proj": down}
    m = be.glu(x @ gate.T, x @ up.T)
    inputs = {"gate_proj": (x, np.abs(x).mean(0)), "down_proj": (m, np.abs(m).mean(0))}
    ref = m @ down.T
    errs, infos = {}, {}
    for name, kw in {"noclip": {"clip": False}, "clip": {"clip_gate": False},
                     "gate": {"clip_gate": True}}.items():
        q, infos[name] = awq_quantize_layer(cfg, lw, inputs, group_size=64, **kw)
        xs = x * q["post_attention_layernorm"]  # the folded norm
        out = be.glu(xs @ q["gate_proj"].dequantize().T, xs @ q["up_proj"].dequantize().T
                     ) @ q["down_proj"].dequantize().T
        errs[name] = float(np.mean((out - ref) ** 2))
    print(errs, infos["gate"])
    assert infos["gate"]["clip:gate_proj+up_proj"] == 0.0
    assert infos["gate"]["clip:down_proj"] == 1.0
    assert errs["clip"] > 3 * errs["noclip"] and errs["gate"] < 0.6 * errs["noclip"]


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0)])
def test_calibration_attention_equals_the_reference(window, softcap):
    """The calibration backend's batched attention (additive causal / sliding-window mask)
    is the reference attention on a fresh cache (GQA: 6 query heads over 2 KV heads)."""
    from edgeinfer.quant.calib_backend import CalibrationBackend

    rng = np.random.default_rng(6)
    t, hq, hkv, hd = 12, 6, 2, 8
    q, k, v = (rng.standard_normal((t, h, hd)).astype(np.float32) * 3 for h in (hq, hkv, hkv))
    ref_be = ReferenceBackend()
    ref = ref_be.attention(q, k, v, ref_be.new_kv_cache(1, hkv, hd, t), 0, 0, 0.3, window, softcap)
    got = CalibrationBackend().attention(q, k, v, None, 0, 0, 0.3, window, softcap)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    if window is not None:  # control: the window matters for these inputs
        full = CalibrationBackend().attention(q, k, v, None, 0, 0, 0.3, None, softcap)
        assert not np.allclose(full, ref, atol=1e-3)
