"""Tiny random models for tests that need an architecture's shape, not its weights."""
from __future__ import annotations

import numpy as np
from edgeinfer.models.arch import tensor_specs
from edgeinfer.models.config import ModelConfig


def tiny_gemma(vocab_size: int = 64, hidden_size: int = 32, intermediate_size: int = 48,
               num_attention_heads: int = 2) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A 3-layer Gemma-3-like model (two sliding-window layers of 6, one global; QK-norm,
    sandwich norms, (1 + w) norms, GELU-tanh, tied head, one KV head of 16): its config
    and float32 tensors (N(0, 0.4²), seed 1)."""
    cfg = ModelConfig.from_hf_dict({
        "model_type": "gemma3_text", "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": 3,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": 1, "head_dim": 16,
        "sliding_window": 6, "query_pre_attn_scalar": 16, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True})
    rng = np.random.default_rng(1)
    tensors = {s.name: (rng.standard_normal(s.shape(cfg)) * 0.4).astype(np.float32)
               for s in tensor_specs(cfg)}
    return cfg, tensors
