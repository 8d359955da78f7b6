"""A windowed (Gemma-3-like) model on every backend: ring KV caches, QK-norm, (1 + w)
norms, GELU-tanh. Each backend's greedy tokens equal the reference backend's after the
sliding window wraps, with chunked prefill."""
from __future__ import annotations

import numpy as np
import pytest
from edgeinfer.backends import get_backend
from edgeinfer.models.arch import tensor_specs
from edgeinfer.models.config import ModelConfig
from edgeinfer.models.transformer import Transformer
from greedy import greedy


def _tiny_gemma():
    cfg = ModelConfig.from_hf_dict(dict(
        model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        sliding_window=6, query_pre_attn_scalar=16, rope_theta=1e6, rope_local_base_freq=1e4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True))
    rng = np.random.default_rng(1)
    tensors = {s.name: (rng.standard_normal(s.shape(cfg)) * 0.4).astype(np.float32)
               for s in tensor_specs(cfg)}
    return cfg, tensors


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_windowed_model_matches_reference_after_the_window_wraps(backend):
    if backend == "opencl":
        pytest.importorskip("pyopencl", reason="pyopencl[pocl] is needed for the OpenCL backend")
    cfg, tensors = _tiny_gemma()
    prompt = list(np.random.default_rng(2).integers(0, 64, 13))
    ref = greedy(Transformer(cfg, tensors, get_backend("reference")), prompt, 12, "int8", chunk=4,
                 cache_tokens=64)
    try:
        be = get_backend(backend)
    except Exception as e:  # no OpenCL platform here
        pytest.skip(f"{backend} backend unavailable: {e}")
    got = greedy(Transformer(cfg, tensors, be), prompt, 12, "int8", chunk=4, cache_tokens=64)
    assert got == ref
