"""GPTQ with asymmetric calibration (GPTAQ): the target against its closed form, the layer
pass against its definition (each group's target from the float layer's and the
quantized layer's inputs), and its purpose: the quantized model nearer the float one."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.models.families import CAPTURE_GROUPS, LINEAR_KEYS, layer_tensor_names
from edgeinfer.models.rope import rope_tables
from edgeinfer.quant import calibrate as cal
from edgeinfer.quant.gptq import Hessian, gptq_quantize
from edgeinfer.quant.gptq_sequential import (ASYM_ALPHA, ASYM_DAMP, HESSIAN_ROWS,
                                             asymmetric_target, gptq_layer)
from edgeinfer.quant.rtn import effective_group
from test_gptq_sequential import _capture, layer_problem


@pytest.fixture(scope="module")
def pool():
    p = cal._solver_pool()
    yield p
    p.close()


def _target_oracle(w, xq, xf, alpha, damp):
    """float64: W + alpha · W ΔXᵀ X̃ (X̃ᵀX̃ + λI)⁻¹, λ = damp · mean diag(X̃ᵀX̃)."""
    w, xq, xf = (a.astype(np.float64) for a in (w, xq, xf))
    A = xq.T @ xq
    A += damp * np.mean(np.diag(A)) * np.eye(A.shape[0])
    return w + alpha * np.linalg.solve(A, (w @ (xf - xq).T @ xq).T).T


def _problem(seed, n, d_in, out):
    rng = np.random.default_rng(seed)
    xf = (rng.normal(size=(n, d_in)) * rng.uniform(0.3, 2, d_in)).astype(np.float32)
    # the quantized model's input: each channel shrunk (an error the layer can absorb) plus noise
    xq = (xf * rng.uniform(0.7, 1.0, d_in)
          + 0.1 * rng.normal(size=(n, d_in)) * np.abs(xf).mean(0)).astype(np.float32)
    w = rng.normal(0, 0.05, (out, d_in)).astype(np.float32)
    h = Hessian(d_in, batch_rows=HESSIAN_ROWS)
    h.add(xq)
    return w, xq, xf, h.H


# out ≪ in: (ΔX Wᵀ)ᵀ X̃; out ≳ in: W (ΔXᵀ X̃); rows over several Hessian batches
@pytest.mark.parametrize("out,d_in", [(24, 256), (300, 96)])
def test_target_equals_its_closed_form(out, d_in):
    w, xq, xf, H = _problem(1, HESSIAN_ROWS + 700, d_in, out)
    for alpha, damp in ((ASYM_ALPHA, ASYM_DAMP), (1.0, 1e-4)):
        got = asymmetric_target(w, xq, xf, H, alpha, damp)
        ref = _target_oracle(w, xq, xf, alpha, damp)
        assert got.dtype == np.float32 and got.shape == w.shape
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref - w).max())
        assert np.abs(ref - w).max() > 0.01 * np.abs(w).max()  # a real correction


def test_target_fits_the_float_outputs():
    """At alpha 1 and a tiny ridge the target is the least-squares fit of the float
    outputs from the quantized inputs: its residual is smaller than W's and orthogonal
    to the inputs; with equal inputs the target is W itself."""
    w, xq, xf, H = _problem(2, 3000, 64, 40)
    t = asymmetric_target(w, xq, xf, H, alpha=1.0, damp=1e-7).astype(np.float64)
    r_t = xf.astype(np.float64) @ w.T - xq.astype(np.float64) @ t.T
    r_w = (xf - xq).astype(np.float64) @ w.T
    assert np.linalg.norm(r_t) < 0.5 * np.linalg.norm(r_w)
    grad = xq.astype(np.float64).T @ r_t
    assert np.abs(grad).max() < 1e-3 * np.abs(xq.astype(np.float64).T @ r_w).max()
    np.testing.assert_array_equal(asymmetric_target(w, xq, xq.copy(), H), w)


def test_layer_pass_is_its_definition(stories_dir, pool):
    """With the float model's input, each group is GPTQ on asymmetric_target(W, X̃, X, H(X̃))
    where X̃ is its input with the earlier groups quantized (from the quantized stream)
    and X its input in the float layer (from the float stream); the float output is the
    float layer's."""
    n, L, i = 4, 40, 1
    cfg, x_float, lw, rope, be = layer_problem(stories_dir, n, L, i, True, pool)
    rng = np.random.default_rng(0)
    x = (x_float + 0.05 * rng.normal(size=x_float.shape) * np.abs(x_float).mean()).astype(
        np.float32)  # the quantized stream, already off the float one
    y, q, y_float = gptq_layer(be, cfg, lw, i, x, rope, x_float)
    assert all(type(q[k]).__name__ == "QuantizedTensor" for k in LINEAR_KEYS)

    pos = np.tile(np.arange(L, dtype=np.int32), n)
    cap_f, y_ref = _capture(cfg, lw, i, x_float.reshape(-1, x.shape[2]), pos, rope, L)
    np.testing.assert_allclose(y_float.reshape(y_ref.shape), y_ref, rtol=1e-5,
                               atol=1e-5 * np.abs(y_ref).max())
    done = dict(lw)
    plain_differs = 0
    for key, members in CAPTURE_GROUPS.items():
        cap, _ = _capture(cfg, done, i, x.reshape(-1, x.shape[2]), pos, rope, L)
        h = Hessian(lw[key].shape[1], batch_rows=HESSIAN_ROWS)
        h.add(cap[key])
        w = np.concatenate([lw[m] for m in members])
        t = asymmetric_target(w, np.asarray(cap[key], np.float32),
                              np.asarray(cap_f[key], np.float32), h.H)
        ref = gptq_quantize(t, h.H, 4, effective_group(w.shape[1], 32), False, act_order=True)
        got = np.concatenate([q[m].codes() for m in members])
        np.testing.assert_array_equal(got, ref.codes(), err_msg=key)
        np.testing.assert_array_equal(np.concatenate([q[m].scales for m in members]),
                                      ref.scales, err_msg=key)
        plain = gptq_quantize(w, h.H, 4, effective_group(w.shape[1], 32), False, act_order=True)
        plain_differs += (plain.codes() != got).mean() > 0.01
        done.update({m: q[m] for m in members})
    assert plain_differs == len(CAPTURE_GROUPS)  # control: the targets are not W


def test_gptaq_brings_the_quantized_model_nearer_the_float_one(stories_dir):
    """Over all layers of the tiny llama, on its calibration tokens: the last layer's
    output of the GPTAQ model is nearer the float model's than plain GPTQ's."""
    from edgeinfer.readers import read_model

    src = read_model(str(stories_dir))
    cfg = src.config
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (6, 64)).astype(np.int32)
    err = {}
    for gptaq in (False, True):
        q, _ = cal.quantize_layers(src, ids, "gptq", group_size=32, act_order=True,
                                   gptaq=gptaq)
        err[gptaq] = _last_hidden_error(src, q, ids)
    assert err[True] < 0.9 * err[False], err


def _last_hidden_error(src, q, ids):
    cfg = src.config
    n, L = ids.shape
    x0 = np.asarray(src.tensors["model.embed_tokens.weight"], np.float32)[ids].reshape(n * L, -1)
    pos = np.tile(np.arange(L, dtype=np.int32), n)
    xf, xq = x0, x0
    for i in range(cfg.num_hidden_layers):
        cos, sin = rope_tables(cfg, L, cfg.layer_rope_theta(i))
        rope = (cos.astype(np.float32), sin.astype(np.float32))
        lw = cal.load_layer(src, i)
        names = layer_tensor_names(i)
        _, xf = _capture(cfg, lw, i, xf, pos, rope, L)
        _, xq = _capture(cfg, {k: q[names[k]] for k in lw}, i, xq, pos, rope, L)
    xf, xq = np.asarray(xf), np.asarray(xq)
    return float(np.linalg.norm(xf - xq) / np.linalg.norm(xf))


def test_gptaq_needs_true_sequential_gptq(stories_dir):
    from edgeinfer.readers import read_model

    src = read_model(str(stories_dir))
    ids = np.zeros((2, 16), np.int32)
    for kw in ({"true_sequential": False}, {"method": "awq"}):
        with pytest.raises(ValueError, match="true-sequential GPTQ"):
            cal.quantize_layers(src, ids, kw.pop("method", "gptq"), gptaq=True, **kw)
