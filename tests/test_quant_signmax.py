"""The data-free default "signmax" (quant/signmax.py, ``convert`` without --calib and
``NAME:int4``): each group's signed largest weight exact on hand-made groups (sign, ties,
an all-zero group, fp16 rounding of the scale, fp16 overflow), llama.cpp's Q4_0 rule as
its ``c = -8`` case (against gguf-py's independent Q4_0 quantizer), lower error than RTN
on the same layout, better logits than RTN on stories260K (with controls), the default
wiring, and the fast CPU kernels agree with the numpy oracle on its negative scales."""
from __future__ import annotations

from conftest import SHARED  # the shared folder (models, data) beside the checkout
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.backends.quantized import QuantizedTensor
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.container import describe_eif, read_eif
from edgeinfer.models.transformer import Transformer
from edgeinfer.quant.convert import METHOD_LAYOUT, convert
from edgeinfer.quant.rtn import SCALE_EPS, quantize_rtn
from edgeinfer.quant.signmax import quantize_signmax, signed_extreme, signmax_params

STORIES = SHARED / "models" / "stories260K"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = np.array([1, 400, 35, 22, 7, 301, 88, 12], np.int32)


def _one(values, **kw):
    """quantize_signmax of one row holding ``values`` (one group of len(values))."""
    w = np.asarray([values], np.float32)
    return quantize_signmax(w, len(values), **kw)


def test_positive_extreme_exact_on_code_0_with_a_negative_scale():
    t = _one([0.1, -0.2, 0.3, 0.05, -0.15, 0.25, -0.3, 3.0])
    assert t.scales.dtype == np.float16 and float(t.scales[0, 0]) == -0.375  # 3.0 / -8
    assert int(t.codes()[0, 7]) == 0  # the extreme on code 0: (0 - 8) * -0.375 = 3.0
    d = t.dequantize()[0]
    assert d[7] == 3.0
    # every other weight on its nearest code of the stored scale
    assert np.all(np.abs(d - np.float32([0.1, -0.2, 0.3, 0.05, -0.15, 0.25, -0.3, 3.0]))
                  <= 0.375 / 2 + 1e-7)


def test_negative_extreme_exact_with_a_positive_scale():
    t = _one([0.1, -3.0, 0.3, 0.05, -0.15, 0.25, -0.3, 1.0])
    assert float(t.scales[0, 0]) == 0.375 and int(t.codes()[0, 1]) == 0
    assert t.dequantize()[0, 1] == -3.0


def test_both_signs_at_the_extreme_take_code_7():
    """+1.75 and -1.75: on code -8 one of them would clip to 7/8 of itself (error 0.22);
    on +7 (scale 1.75 / 7 = 0.25) both are exact, and that candidate wins."""
    t = _one([1.75, 0.5, -1.75, 0.25, 0.0, -0.5, 1.0, -1.0])
    assert float(t.scales[0, 0]) == 0.25
    d = t.dequantize()[0]
    np.testing.assert_array_equal(d, [1.75, 0.5, -1.75, 0.25, 0.0, -0.5, 1.0, -1.0])
    only8 = _one([1.75, 0.5, -1.75, 0.25, 0.0, -0.5, 1.0, -1.0], edge_codes=(-8,))
    assert float(only8.scales[0, 0]) == -0.21875 and only8.dequantize()[0, 2] == -1.53125


def test_ties_keep_the_first_extreme_and_code_minus_8_wins_ties():
    wg = np.float32([[[-2.0, 2.0, 0.0, 0.0]]])
    assert float(signed_extreme(wg)[0, 0]) == -2.0
    s, q = signmax_params(np.float32([[[0.0, 0.0, 0.0, 0.0]]]), None)
    # all-zero group: both candidates have error 0; the first (-8) is kept, floored scale
    assert float(s[0, 0]) == SCALE_EPS and np.all(q == 8)


def test_all_zero_group_dequantizes_to_exact_zero_and_is_finite():
    w = np.zeros((2, 64), np.float32)
    w[1, 32:] = np.repeat(np.arange(-8, 8) * 0.5, 2)  # -4 on code 0, scale 0.5: all exact
    t = quantize_signmax(w, 32)
    assert np.all(np.isfinite(t.scales.astype(np.float32)))
    assert float(t.scales[0, 0]) == float(t.scales[0, 1]) == float(t.scales[1, 0]) == SCALE_EPS
    d = t.dequantize()
    assert np.all(d[0] == 0) and np.all(d[1, :32] == 0)
    assert float(t.scales[1, 1]) == 0.5 and np.array_equal(d[1, 32:], w[1, 32:])


def test_fp16_rounding_of_the_scale():
    """1.0001 / -8 is not an fp16 value: the stored scale is its nearest fp16 (-0.125), the
    codes are those of the stored scale, and the extreme is off by at most 8 half-ulps."""
    t = _one([1.0001, 0.2, -0.3, 0.124, 0.5, -0.6, 0.7, 0.0])
    s = float(t.scales[0, 0])
    assert s == float(np.float16(1.0001 / -8)) == -0.125
    d = t.dequantize()[0]
    ulp = float(np.spacing(np.float16(0.125)))
    assert abs(d[0] - 1.0001) <= 8 * ulp / 2 + 1e-7 and d[0] == 1.0
    w = np.float32([1.0001, 0.2, -0.3, 0.124, 0.5, -0.6, 0.7, 0.0])
    np.testing.assert_array_equal(t.codes()[0], np.clip(np.rint(w / np.float32(s)) + 8, 0, 15))


def test_scale_beyond_fp16_keeps_float32_and_tiny_groups_stay_finite():
    w = np.float32([[6.0e5, 1.0, -2.0e5, 3.0], [1e-7, -3e-7, 0.0, 2e-7]])
    t = quantize_signmax(w, 4)
    assert t.scales.dtype == np.float32
    assert float(t.scales[0, 0]) == pytest.approx(6.0e5 / -8, rel=1e-6)
    assert t.dequantize()[0, 0] == pytest.approx(6.0e5, rel=1e-6)
    # a scale below fp16's normals is floored (sign kept): no inf/NaN, error below the floor
    assert abs(float(t.scales[1, 0])) == SCALE_EPS
    assert np.all(np.abs(t.dequantize()[1] - w[1]) <= SCALE_EPS)


def test_padding_errors_and_layout():
    w = np.random.default_rng(3).standard_normal((7, 100)).astype(np.float32)
    t = quantize_signmax(w, 32, rows=3)
    assert (t.method, t.group_size, t.in_features, t.in_padded) == ("signmax", 32, 100, 128)
    assert t.zeros is None and t.scales.dtype == np.float16
    np.testing.assert_array_equal(t.codes()[:, 100:], 8)
    assert np.array_equal(t.qweight, quantize_signmax(w, 32, rows=512).qweight)
    # every group's largest weight exact up to the fp16 rounding of its scale
    wp = np.zeros((7, 128), np.float32)
    wp[:, :100] = w
    wg = wp.reshape(7, 4, 32)
    idx = np.abs(wg).argmax(-1)
    dg = np.zeros_like(wp)
    dg[:, :100] = t.dequantize()
    got = np.take_along_axis(dg.reshape(7, 4, 32), idx[..., None], -1)[..., 0]
    ext = signed_extreme(wg)
    assert np.all(np.abs(got - ext) <= 8 * 2.0 ** -11 * np.abs(ext))
    bad = w.copy()
    bad[2, 3] = np.nan
    with pytest.raises(ValueError, match="w7: contains NaN or inf"):
        quantize_signmax(bad, name="w7")
    with pytest.raises(ValueError, match="symmetric only"):
        quantize_signmax(w, 32, symmetric=False)
    with pytest.raises(ValueError, match="unknown importance"):
        quantize_signmax(w, importance="abs")


def test_minus_8_alone_is_llama_cpp_q4_0():
    """``edge_codes=(-8,)`` is llama.cpp's Q4_0 rule: the same fp16 scale per block as
    gguf-py's independent Q4_0 quantizer (``gguf.quants.quantize``), the same codes except
    where its codes, computed from the unrounded scale, round the other way."""
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType
    w = np.random.default_rng(0).standard_t(4, (64, 256)).astype(np.float32)
    ours = quantize_signmax(w, 32, edge_codes=(-8,))
    raw = gq.quantize(w, GGMLQuantizationType.Q4_0).reshape(64, 8, 18)
    d = raw[..., :2].copy().view(np.float16)[..., 0]
    np.testing.assert_array_equal(ours.scales, d)
    ref = gq.dequantize(gq.quantize(w, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    mine = ours.dequantize()
    assert np.mean(mine == ref.reshape(mine.shape)) > 0.99
    # where they differ ours is the nearer code of the stored scale
    e_ours, e_ref = np.abs(mine - w), np.abs(ref.reshape(w.shape) - w)
    assert np.all(e_ours <= e_ref + 1e-7)


def test_lower_error_than_rtn_on_the_same_layout():
    """Random heavy-tailed and stories260K weights: total squared error below symmetric
    RTN g32's (2 absmax / 15, which rounds the extreme by up to half a step) and the
    extreme exact; control: RTN's own extremes are not exact."""
    from safetensors.numpy import load_file
    mats = [np.random.default_rng(1).standard_t(5, (48, 256)).astype(np.float32)]
    mats += [v for k, v in load_file(str(STORIES / "model.safetensors")).items()
             if v.ndim == 2 and "embed" not in k and v.shape[1] % 32 == 0]
    e, e_rtn = 0.0, 0.0
    for w in mats:
        e += float(((quantize_signmax(w, 32).dequantize() - w) ** 2).sum())
        r = quantize_rtn(w, 4, 32, True).dequantize()
        e_rtn += float(((r - w) ** 2).sum())
    assert e < 0.85 * e_rtn
    w = mats[0]
    wg = w.reshape(48, 8, 32)
    idx = np.abs(wg).argmax(-1)[..., None]
    r = np.take_along_axis(quantize_rtn(w, 4, 32, True).dequantize().reshape(wg.shape), idx, -1)
    assert np.mean(r[..., 0] != np.take_along_axis(wg, idx, -1)[..., 0]) > 0.5


def _kl_vs_float(src_q, src_f, ids) -> float:
    """Mean KL(float || quantized) of the next-token distributions over ``ids``."""
    out = []
    for src in (src_f, src_q):
        m = Transformer(src.config, src.tensors, ReferenceBackend(), max_positions=len(ids))
        lg = m.forward(ids, m.new_cache(len(ids)), all_logits=True).astype(np.float64)
        lg -= lg.max(1, keepdims=True)
        out.append(lg - np.log(np.exp(lg).sum(1, keepdims=True)))
    p, q = out
    return float((np.exp(p) * (p - q)).sum(1).mean())


@pytest.fixture(scope="module")
def signmax_eif(tmp_path_factory):
    out = tmp_path_factory.mktemp("signmax") / "stories.signmax.eif"
    rep = convert(str(STORIES), str(out), method="signmax", progress=False)
    return out, rep


def test_stories_closer_to_float_than_rtn(signmax_eif, tmp_path):
    """stories260K, 128 tokens of its own greedy text: KL from the float model below RTN's
    on the same layout (symmetric g32; a positive control that the measure separates
    methods: RTN is well above 0), and far below a broken file (every scale doubled)."""
    from test_convert import stories_source
    out, _ = signmax_eif
    rtn = tmp_path / "rtn.eif"
    convert(str(STORIES), str(rtn), method="rtn", group_size=32, symmetric=True, progress=False)
    src_f = stories_source()
    m = Transformer(src_f.config, src_f.tensors, ReferenceBackend(), max_positions=160)
    cache, ids = m.new_cache(160), [1, 400, 35]
    lg = m.forward(np.array(ids, np.int32), cache)
    while len(ids) < 128:
        ids.append(int(lg[-1].argmax()))
        lg = m.forward(np.array(ids[-1:], np.int32), cache)
    ids = np.array(ids, np.int32)
    kl_sm = _kl_vs_float(read_eif(out), src_f, ids)
    kl_rtn = _kl_vs_float(read_eif(rtn), src_f, ids)
    assert kl_rtn > 1e-3  # the control: RTN g32 is measurably off
    assert kl_sm < 0.92 * kl_rtn, (kl_sm, kl_rtn)
    broken = read_eif(out)
    for k, t in broken.tensors.items():
        if isinstance(t, QuantizedTensor) and t.bits == 4:
            broken.tensors[k] = QuantizedTensor(t.qweight, (t.scales.astype(np.float32) * 2)
                                                .astype(np.float16), None, 4, 32,
                                                t.in_features, t.method)
    assert _kl_vs_float(broken, src_f, ids) > 10 * kl_sm


def test_convert_is_the_default_layout_and_file(signmax_eif):
    out, rep = signmax_eif
    assert METHOD_LAYOUT["signmax"] == (32, True)
    assert rep["method"] == "signmax" and rep["group_size"] == 32
    assert rep["calibration"] == "none (signmax needs no calibration)"
    d = describe_eif(out)
    assert d["bits_per_weight_by_kind"]["attention"] == pytest.approx(4.5, abs=1e-9)
    assert d["provenance"]["method"] == "signmax" and d["provenance"]["symmetric"] is True
    src = read_eif(out)
    from safetensors.numpy import load_file
    n_neg = 0
    for name, w in load_file(str(STORIES / "model.safetensors")).items():
        if w.ndim != 2 or "embed" in name or "lm_head" in name:
            continue
        t = src.tensors[name]
        ref = quantize_signmax(w, 32, name=name)
        assert (t.method, t.bits, t.group_size, t.zeros) == ("signmax", 4, 32, None)
        assert np.array_equal(np.asarray(t.qweight), ref.qweight), name
        assert np.array_equal(np.asarray(t.scales), ref.scales), name
        n_neg += int((np.asarray(t.scales) < 0).sum())
    assert n_neg > 0  # negative scales are stored as such (the sign carries the rule)
    with pytest.raises(ValueError, match="symmetric only"):
        convert(str(STORIES), str(out) + ".x", method="signmax", symmetric=False,
                progress=False)


def test_fast_cpu_kernels_match_the_oracle_with_negative_scales(signmax_eif):
    out, _ = signmax_eif
    src = read_eif(out)
    ref = Transformer(src.config, src.tensors, ReferenceBackend(), max_positions=64)
    cpu = Transformer(src.config, src.tensors, CpuBackend(), max_positions=64)
    rc, cc = ref.new_cache(32), cpu.new_cache(32)
    lr, lc = ref.forward(PROMPT, rc), cpu.forward(PROMPT, cc)  # prefill
    np.testing.assert_allclose(lc, lr, atol=2e-3 * np.abs(lr).max())
    tok = int(lr[-1].argmax())
    assert int(lc[-1].argmax()) == tok
    for _ in range(6):  # decode steps
        lr, lc = ref.forward(np.array([tok], np.int32), rc), cpu.forward(np.array([tok], np.int32), cc)
        np.testing.assert_allclose(lc, lr, atol=2e-3 * np.abs(lr).max())
        assert int(lc[-1].argmax()) == int(lr[-1].argmax())
        tok = int(lr[-1].argmax())


def test_runs_on_opencl_vs_oracle(signmax_eif, opencl_backend):
    out, _ = signmax_eif
    src = read_eif(out)
    ref = Transformer(src.config, src.tensors, ReferenceBackend(), max_positions=64)
    ocl = Transformer(src.config, src.tensors, opencl_backend, max_positions=64)
    rc, oc = ref.new_cache(32), ocl.new_cache(32)
    lr, lo = ref.forward(PROMPT, rc), ocl.forward(PROMPT, oc)
    np.testing.assert_allclose(lo, lr, atol=1e-3 * np.abs(lr).max())
    for _ in range(4):
        tok = int(lr[-1].argmax())
        assert int(lo[-1].argmax()) == tok
        lr, lo = ref.forward(np.array([tok], np.int32), rc), ocl.forward(np.array([tok], np.int32), oc)
        np.testing.assert_allclose(lo, lr, atol=1e-3 * np.abs(lr).max())


def test_cli_default_without_calib_is_signmax_and_grid_still_works(tmp_path):
    out = tmp_path / "m.eif"
    r = subprocess.run([sys.executable, "-m", "cli", "convert", str(STORIES), "-o", str(out),
                        "-q", "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["method"] == "signmax" and rep["group_size"] == 32
    r = subprocess.run([sys.executable, "-m", "cli", "convert", str(STORIES), "-o",
                        str(tmp_path / "g.eif"), "--method", "grid", "-q", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["method"] == "grid"
