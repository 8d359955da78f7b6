"""edgeinfer.selfcheck: the tiny synthetic model through the real Transformer on a backend
vs. the reference backend; a broken kernel or a driver error is flagged, not raised."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from edgeinfer.backends.quantized import QuantizedTensor
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.models.arch import tensor_specs
from edgeinfer.models.config import ModelConfig
from edgeinfer.selfcheck import self_check, synthetic_tensors, tiny_config

GEMMA_LIKE = {"model_type": "gemma3_text", "vocab_size": 1000, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 1, "head_dim": 64, "sliding_window": 16,
              "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                              "full_attention"],
              "rope_local_base_freq": 10000.0, "rope_theta": 1e6, "query_pre_attn_scalar": 64,
              "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
              "hidden_activation": "gelu_pytorch_tanh"}
QWEN_LIKE = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 128,
             "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def stories(stories_dir):
    from safetensors.numpy import load_file

    cfg = ModelConfig.from_hf_dict(json.loads((stories_dir / "config.json").read_text()))
    return cfg, load_file(str(stories_dir / "model.safetensors"))


def _rtn(tensors, group_size=32):
    from edgeinfer.models.transformer import LINEAR_KEYS
    from edgeinfer.quant.rtn import quantize_rtn

    out = {}
    for name, t in tensors.items():
        short = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if short in LINEAR_KEYS:
            out[name] = quantize_rtn(t, 4, group_size, name=name)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = quantize_rtn(t, 8, -1, name=name)
        else:
            out[name] = t
    return out


def test_tiny_config_keeps_switches_and_synthetic_tensors_are_complete():
    cfg = ModelConfig.from_hf_dict(GEMMA_LIKE)
    tc = tiny_config(cfg)
    assert (tc.hidden_size, tc.num_hidden_layers, tc.vocab_size) == (64, 2, 96)
    for f in ("qk_norm", "sandwich_norms", "norm_unit_offset", "hidden_act",
              "final_logit_softcapping", "attn_logit_softcapping", "rope_local_base_freq"):
        assert getattr(tc, f) == getattr(cfg, f), f
    assert tc.sliding_window == 4 and set(tc.layer_types) == set(cfg.layer_types)
    w = synthetic_tensors(tc, None)
    assert set(w) == {s.name for s in tensor_specs(tc)}
    for s in tensor_specs(tc):
        assert tuple(np.shape(w[s.name])) == s.shape(tc), s.name


def test_weight_formats_are_copied():
    cfg = ModelConfig.from_hf_dict(QWEN_LIKE)
    rng = np.random.default_rng(0)
    from edgeinfer.quant.rtn import quantize_rtn

    real = {"model.layers.0.self_attn.q_proj.weight":
            quantize_rtn(rng.standard_normal((128, 128)).astype(np.float32), 4, 64, True),
            "lm_head.weight": quantize_rtn(rng.standard_normal((1000, 128)).astype(np.float32), 8, -1)}
    w = synthetic_tensors(tiny_config(cfg), real)
    q = w["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(q, QuantizedTensor) and (q.bits, q.group_size, q.zeros) == (4, 64, None)
    h = w["lm_head.weight"]
    assert isinstance(h, QuantizedTensor) and h.bits == 8 and h.n_groups == 1
    assert "model.layers.0.self_attn.q_proj.bias" in w  # qwen2 biases
    assert isinstance(w["model.embed_tokens.weight"], np.ndarray)


def test_reference_against_itself_is_exact():
    ok, err = self_check(ModelConfig.from_hf_dict(GEMMA_LIKE), None, ReferenceBackend())
    assert ok and err == 0.0


def test_a_backend_that_raises_is_reported_not_raised():
    class Exploding(ReferenceBackend):
        def attention(self, *a, **k):
            raise RuntimeError("CL_OUT_OF_RESOURCES")

    with pytest.warns(RuntimeWarning, match="could not run.*CL_OUT_OF_RESOURCES"):
        ok, err = self_check(ModelConfig.from_hf_dict(QWEN_LIKE), None, Exploding())
    assert not ok and math.isinf(err)


# ---- on the OpenCL device ----------------------------------------------------------------

@pytest.fixture(scope="module")
def ocl():
    pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'edgeinfer[opencl]')")
    from edgeinfer.backends.opencl import OpenCLBackend, OpenCLUnavailableError

    try:
        OpenCLBackend()
    except OpenCLUnavailableError as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"no usable OpenCL device: {e}")
    return OpenCLBackend


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_opencl_passes_and_flags_a_broken_kernel(ocl, stories, fused):
    cfg, tensors = stories
    be = ocl()
    be.caps = dataclasses.replace(be.caps, fused=fused)
    ok, err = self_check(cfg, _rtn(tensors), be)
    assert ok and err < 1e-4
    for kv in ("f16", "int8", "int4"):
        ok, err = self_check(cfg, tensors, be, kv_dtype=kv)
        assert ok, (kv, err)
    for hf in (GEMMA_LIKE, QWEN_LIKE):  # every switch of the tiny model's families
        ok, err = self_check(ModelConfig.from_hf_dict(hf), None, be)
        assert ok and err < 1e-4, (hf["model_type"], err)

    # a device that splits long KV ranges (GPU default): the check exercises that path
    sb = ocl()
    sb.caps = dataclasses.replace(sb.caps, split_kv_chunk=512, fused=fused)
    ok, err = self_check(cfg, tensors, sb)
    assert ok and err < 1e-4 and sb.caps.split_kv_chunk == 512
    assert any(key[1] == "attention_split" for key in sb._dc._kernels)

    class Broken(ocl):
        def glu(self, gate, up, act="silu"):
            return super().glu(up, gate, act)  # swapped operands: plausible, wrong

    bb = Broken()
    bb.caps = dataclasses.replace(bb.caps, fused=fused)
    with pytest.warns(RuntimeWarning, match="self-check failed"):
        ok, err = self_check(cfg, tensors, bb)
    assert not ok and err > 0.1
