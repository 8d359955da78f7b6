"""The error-minimising grid (quant/mse.py): never worse than RTN per group (RTN's grid is
one of its candidates), importance moves error away from important columns, and the stored
tensor is the ordinary layout (padding, symmetric, fp16 scales)."""
from __future__ import annotations

import numpy as np
import pytest
from edgeinfer.quant.mse import quantize_mse, search_group_params, search_group_params_reference
from edgeinfer.quant.rtn import quantize_rtn


def _group_err(w, d, g):
    return ((w - d) ** 2).reshape(w.shape[0], -1, g).sum(-1)


@pytest.mark.parametrize("symmetric", [False, True])
def test_never_worse_than_rtn_per_group_and_better_overall(symmetric):
    rng = np.random.default_rng(0)
    w = rng.standard_t(4, (64, 256)).astype(np.float32)  # heavy tails: clipping pays
    g = 64
    rtn = quantize_rtn(w, 4, g, symmetric).dequantize()
    m = quantize_mse(w, g, symmetric)
    d = m.dequantize()
    e_rtn, e = _group_err(w, rtn, g), _group_err(w, d, g)
    assert np.all(e <= e_rtn * (1 + 1e-5) + 1e-12)
    assert e.sum() < (0.9 if symmetric else 0.97) * e_rtn.sum()
    assert m.method == "mse" and (m.zeros is None) == symmetric and m.scales.dtype == np.float16


def test_hand_made_outlier_group():
    """One outlier in a group of 8: RTN spreads 16 levels over [0, 100]; the search clips
    (or places the grid) so the seven small weights are kept, a lower total error."""
    wg = np.array([[[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0]]], np.float32)
    s, z, q = search_group_params(wg, None)
    d = (q - z[..., None]) * s[..., None]
    rtn = quantize_rtn(wg[0], 4, 8).dequantize()
    assert ((d - wg) ** 2).sum() < ((rtn - wg[0]) ** 2).sum()
    assert float(z[0, 0]) == float(np.clip(np.rint(0.0 / s[0, 0]), 0, 15))  # min 0 -> code 0


def test_importance_moves_the_error():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 128)).astype(np.float32)
    imp = np.ones(128, np.float32)
    imp[:16] = 100.0
    plain = quantize_mse(w, 64).dequantize()
    weighted = quantize_mse(w, 64, importance=imp).dequantize()
    e = lambda d: float(((w - d)[:, :16] ** 2).sum())
    assert e(weighted) < e(plain)
    assert float((((w - weighted) ** 2) * imp).sum()) < float((((w - plain) ** 2) * imp).sum())


def test_layout_padding_and_errors():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((5, 100)).astype(np.float32)
    m = quantize_mse(w, 32, rows=2)  # 100 -> padded to 128; row blocks of 2
    assert m.in_features == 100 and m.in_padded == 128 and m.group_size == 32
    codes = m.codes().astype(np.float32)
    ref = (codes - np.repeat(m.zero_points(), 32, 1)) * np.repeat(m.scales.astype(np.float32), 32, 1)
    np.testing.assert_array_equal(m.dequantize(), ref[:, :100])
    assert np.all(ref[:, 100:] == 0)
    assert np.array_equal(m.qweight, quantize_mse(w, 32, rows=512).qweight)  # blocks don't matter
    bad = w.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        quantize_mse(bad, 32, name="x")
    with pytest.raises(ValueError, match="importance"):
        quantize_mse(w, 32, importance=-np.ones(100))


@pytest.mark.parametrize("symmetric,weighted", [(False, True), (True, True), (False, False)])
def test_compiled_search_equals_the_numpy_oracle(symmetric, weighted):
    """Same candidates, same order, first best kept: identical choices except near-ties
    that float64 sums resolve otherwise (then the error differs by under 1e-5)."""
    rng = np.random.default_rng(3)
    wg = (rng.standard_t(4, (300, 5, 64)) * 0.05).astype(np.float32)
    wg[0, 0] = 0.0  # a zero group
    wg[1, 1] = np.abs(wg[1, 1])  # one sign only
    a = rng.uniform(0, 2, (1, 5, 64)).astype(np.float32) if weighted else None
    a_ = 1.0 if a is None else a
    s, z, q = search_group_params(wg, a, symmetric)
    s0, z0, q0 = search_group_params_reference(wg, a, symmetric)
    assert s.dtype == s0.dtype == np.float32 and q.shape == q0.shape == wg.shape
    same = (s == s0) & (z == z0)
    assert same.mean() > 0.99
    np.testing.assert_array_equal(q[same], q0[same])
    err = lambda s, z, q: (((q - z[..., None]) * s[..., None] - wg) ** 2 * a_).sum(-1)
    e, e0 = err(s, z, q), err(s0, z0, q0)
    np.testing.assert_allclose(e[~same], e0[~same], rtol=1e-5)
    rtn_refit = err(*search_group_params(wg, a, symmetric, deltas=())).sum()  # RTN's grid alone
    assert e.sum() < (0.9 if symmetric else 0.99) * rtn_refit
