"""The residual-stream rotation before GPTQ (quant/rotate.py) and GPTQ's searched group
parameters (quant/gptq.py ``grid="mse"``): the rotated model computes the same logits in
float, refusals name their reason, and the search is the one of quant/mse.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.container import describe_eif, read_eif
from edgeinfer.errors import UnsupportedModelError
from edgeinfer.models.config import ModelConfig
from edgeinfer.models.arch import tensor_specs
from edgeinfer.models.transformer import Transformer
from edgeinfer.quant import calibrate as cal
from edgeinfer.quant.convert import convert
from edgeinfer.quant.gptq import Hessian, gptq_quantize
from edgeinfer.quant.mse import search_group_params
from edgeinfer.quant.rotate import random_orthogonal, rotate_source, rotation_refusal
from edgeinfer.source import ModelSource

TOKENIZER = json.dumps({"model": {"type": "WordLevel", "unk_token": "t0",
                                  "vocab": {f"t{i}": i for i in range(48)}}})


def tiny(model_type="llama", tie=True, **extra) -> ModelSource:
    """3 layers, hidden 32, 4 query heads / 2 KV heads of 8, vocab 48; norms ≠ 1."""
    d = {"model_type": model_type, "vocab_size": 48, "hidden_size": 32, "intermediate_size": 40,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "tie_word_embeddings": tie, **extra}
    cfg = ModelConfig.from_hf_dict(d)
    rng = np.random.default_rng(5)
    t = {}
    for s in tensor_specs(cfg):
        if "norm" in s.name:
            t[s.name] = (1.0 + 0.4 * rng.standard_normal(s.shape(cfg))).astype(np.float32)
        else:
            t[s.name] = (0.2 * rng.standard_normal(s.shape(cfg))).astype(np.float32)
    t["model.embed_tokens.weight"] *= 5.0
    return ModelSource("tiny", "hf", cfg, t, {k: v.shape for k, v in t.items()}, TOKENIZER)


def logits(src: ModelSource, ids) -> np.ndarray:
    tensors = dict(src.tensors)
    if src.config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    m = Transformer(src.config, tensors, ReferenceBackend(), max_positions=32)
    return m.forward(np.asarray(ids, np.int32), m.new_cache(32), all_logits=True)


def test_random_orthogonal_is_orthogonal_and_seeded():
    q = random_orthogonal(24, 3)
    np.testing.assert_allclose(q @ q.T, np.eye(24), atol=1e-12)
    np.testing.assert_array_equal(q, random_orthogonal(24, 3))
    assert np.abs(q - random_orthogonal(24, 4)).max() > 0.1


@pytest.mark.parametrize("model_type,tie,extra", [
    ("llama", True, {}),
    ("qwen2", False, {}),  # q/k/v biases (the value bias turns with its heads)
    ("phi3", False, {"partial_rotary_factor": 0.5}),  # RoPE on half of each head
])
def test_rotated_model_computes_the_same_logits(model_type, tie, extra):
    src = tiny(model_type, tie, **extra)
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    ref = logits(src, ids)
    rot = rotate_source(src, seed=7)
    assert not rot.config.tie_word_embeddings and "lm_head.weight" in rot.tensors
    got = logits(rot, ids)
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()
    # the weights did change: every norm is ones, the linears are rotated
    assert np.all(rot.tensors["model.layers.1.input_layernorm.weight"] == 1.0)
    assert np.all(rot.tensors["model.norm.weight"] == 1.0)
    q0 = src.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert np.abs(rot.tensors["model.layers.0.self_attn.q_proj.weight"] - q0).max() > 0.1
    # a norm's scale is folded in: each row keeps its length times the scale, not more
    w1 = src.tensors["model.layers.0.input_layernorm.weight"]
    np.testing.assert_allclose(np.linalg.norm(rot.tensors["model.layers.0.self_attn.q_proj.weight"], axis=1),
                               np.linalg.norm(q0 * w1, axis=1), rtol=1e-5)


def test_rotation_refusals_name_the_reason(tmp_path):
    gemma = ModelConfig.from_hf_dict({
        "model_type": "gemma3_text", "vocab_size": 48, "hidden_size": 32, "intermediate_size": 40,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8})
    assert "(1 + w)" in rotation_refusal(gemma)
    src = tiny()
    with pytest.raises(UnsupportedModelError,
                       match="cannot rotate a gemma3_text model: its RMSNorm.*--no-rotate"):
        rotate_source(ModelSource("g", "hf", gemma, {}, {}, TOKENIZER))
    for opt in ({"rotate": True}, {"gptq_grid": "minmax"}):
        with pytest.raises(ValueError, match="apply to methods 'gptq' and 'gptaq' only.*not 'rtn'"):
            convert(src, str(tmp_path / "x.eif"), method="rtn", progress=False, **opt)
    with pytest.raises(ValueError, match="gptaq needs true_sequential"):
        convert(src, str(tmp_path / "x.eif"), method="gptaq", true_sequential=False,
                progress=False)
    with pytest.raises(ValueError, match="unknown GPTQ grid 'best'"):
        convert(src, str(tmp_path / "x.eif"), method="gptq", gptq_grid="best", progress=False)
    assert not (tmp_path / "x.eif").exists()
    assert rotation_refusal(src.config) is None


def _problem(seed, out, n_in):
    rng = np.random.default_rng(seed)
    X = (rng.normal(size=(2000, n_in)) * rng.uniform(0.2, 3, n_in)).astype(np.float32)
    h = Hessian(n_in)
    h.add(X)
    w = rng.standard_t(3, size=(out, n_in)).astype(np.float32) * 0.05  # heavy tails
    return w, h.H, X


def test_gptq_mse_grid_is_the_weighted_search_on_the_original_groups():
    """act-order's static groups: the scales and zeros are quant/mse.py's search over the
    original weights with diag(H) as the columns' weights (codes then follow GPTQ)."""
    w, H, _ = _problem(1, 24, 96)
    qt = gptq_quantize(w, H, 4, 32, act_order=True, grid="mse")
    s, z, _ = search_group_params(w.reshape(24, 3, 32), np.diag(H).astype(np.float32)
                                  .reshape(1, 3, 32))
    np.testing.assert_array_equal(np.asarray(qt.scales, np.float32), s)
    np.testing.assert_array_equal(qt.zero_points(), z)
    minmax = gptq_quantize(w, H, 4, 32, act_order=True)
    assert not np.array_equal(np.asarray(minmax.scales, np.float32), s)  # the search moved them


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_mse_grid_lowers_the_output_error(act_order):
    w, H, X = _problem(2, 64, 128)
    errs = {}
    for grid in ("minmax", "mse"):
        qt = gptq_quantize(w, H, 4, 32, act_order=act_order, grid=grid)
        errs[grid] = float(np.square(X @ (qt.dequantize() - w).T).mean())
    assert errs["mse"] < 0.9 * errs["minmax"], errs


def test_gptq_mse_search_split_over_workers_equals_one_call():
    w, H, _ = _problem(3, 97, 128)
    pool = cal._solver_pool()
    try:
        a = gptq_quantize(w, H, 4, 32, act_order=True, grid="mse")
        b = gptq_quantize(w, H, 4, 32, act_order=True, grid="mse", pool=pool)
    finally:
        pool.close()
    np.testing.assert_array_equal(a.qweight, b.qweight)
    np.testing.assert_array_equal(a.scales, b.scales)
    np.testing.assert_array_equal(a.zero_points(), b.zero_points())


def test_gptq_unknown_grid_is_refused():
    w, H, _ = _problem(4, 8, 32)
    with pytest.raises(ValueError, match="unknown grid 'best'"):
        gptq_quantize(w, H, 4, 32, grid="best")


def test_convert_gptq_rotates_by_default_and_records_it(tmp_path):
    src = tiny()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    out = tmp_path / "r.eif"
    convert(src, str(out), method="gptq", group_size=16, calib_path=None, n_calib=4,
            calib_len=32, act_order=True, progress=False)
    prov = describe_eif(out)["provenance"]
    assert prov["rotation"]["seed"] == 0 and prov["gptq_grid"] == "mse"
    q = read_eif(out)
    assert not q.config.tie_word_embeddings and "lm_head.weight" in describe_eif(out)["quantization"]
    ref, got = logits(src, ids), logits(q, ids)
    # 4-bit groups of 16 on a random 3-layer model, calibrated on its own text: near, not equal
    assert np.abs(got - ref).max() < 0.4 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
    plain = tmp_path / "p.eif"
    convert(src, str(plain), method="gptq", group_size=16, n_calib=4, calib_len=32,
            act_order=True, progress=False, rotate=False, gptq_grid="minmax")
    prov = describe_eif(plain)["provenance"]
    assert prov["rotation"] is None and prov["gptq_grid"] == "minmax"
    assert read_eif(plain).config.tie_word_embeddings
