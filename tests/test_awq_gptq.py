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
from edgeinfer.quant.rtn import quantize_rtn


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
    GPTQ's factor U (via a reversed Cholesky's triangular inverse) equals chol(H⁻¹)ᵀ."""
    from edgeinfer.quant.awq import fake_quantize32
    from edgeinfer.quant.gptq import _inverse_cholesky_upper
    from edgeinfer.quant.rtn import fake_quantize

    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 200)).astype(np.float32)
    for sym in (False, True):
        ref = fake_quantize(w, 4, 64, sym)
        got = fake_quantize32(w, 4, 64, sym)
        assert got.shape == ref.shape
        assert np.mean(np.abs(got - ref) > 1e-4) < 0.002  # rare rounding ties may flip
    x = rng.standard_normal((600, 300))
    H = 2 * x.T @ x / 600
    U = _inverse_cholesky_upper(H, 0.01)
    Hd = H + 0.01 * np.mean(np.diag(H)) * np.eye(300)
    ref = np.linalg.cholesky(np.linalg.inv(Hd)).T
    np.testing.assert_allclose(U, ref, atol=1e-4 * np.abs(ref).max())
    assert np.allclose(U, np.triu(U))


def test_coarse_to_fine_grid_finds_the_full_grid_minimum():
    for seed in (0, 2, 5):
        x, w = _outlier_layer(seed)
        am = np.abs(x).mean(0)
        s1, a1, l1 = search_scale(x, am, w, 4, 64, coarse_to_fine=False)
        s2, a2, l2 = search_scale(x, am, w, 4, 64)
        assert a1 == a2 and np.array_equal(s1, s2)
        assert sum(np.isfinite(l2)) <= 12 and np.nanmin(l2) == min(l1)
