"""Per-architecture tensor-name tables: architectures are data.

Canonical tensor names are the Hugging Face checkpoint names (``model.layers.{i}...``).
Every reader maps its own names onto these; the transformer only ever asks for the
canonical ones. Each entry says whether the tensor is required and its expected shape
as a function of the config, so loading is strict: every key present, every shape
checked, optional and tied tensors declared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .config import ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: canonical name pattern, shape rule, and whether optional."""

    name: str  # may contain "{i}" for the layer index
    shape: Callable[[ModelConfig], tuple[int, ...]]
    when: Callable[[ModelConfig], bool] = lambda c: True  # present for this config?
    linear: bool = False  # a [out, in] matmul weight (quantizable)


def _d(c):  # hidden
    return c.hidden_size


_GLOBAL = [
    TensorSpec("model.embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size)),
    TensorSpec("model.norm.weight", lambda c: (c.hidden_size,)),
    TensorSpec("lm_head.weight", lambda c: (c.vocab_size, c.hidden_size),
               when=lambda c: not c.tie_word_embeddings, linear=True),
]

_LAYER = [
    TensorSpec("model.layers.{i}.input_layernorm.weight", lambda c: (c.hidden_size,)),
    TensorSpec("model.layers.{i}.post_attention_layernorm.weight", lambda c: (c.hidden_size,)),
    TensorSpec("model.layers.{i}.self_attn.q_proj.weight",
               lambda c: (c.num_attention_heads * c.head_dim, c.hidden_size), linear=True),
    TensorSpec("model.layers.{i}.self_attn.k_proj.weight",
               lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size), linear=True),
    TensorSpec("model.layers.{i}.self_attn.v_proj.weight",
               lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size), linear=True),
    TensorSpec("model.layers.{i}.self_attn.o_proj.weight",
               lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim), linear=True),
    TensorSpec("model.layers.{i}.self_attn.q_proj.bias",
               lambda c: (c.num_attention_heads * c.head_dim,), when=lambda c: c.attention_bias),
    TensorSpec("model.layers.{i}.self_attn.k_proj.bias",
               lambda c: (c.num_key_value_heads * c.head_dim,), when=lambda c: c.attention_bias),
    TensorSpec("model.layers.{i}.self_attn.v_proj.bias",
               lambda c: (c.num_key_value_heads * c.head_dim,), when=lambda c: c.attention_bias),
    TensorSpec("model.layers.{i}.self_attn.q_norm.weight", lambda c: (c.head_dim,),
               when=lambda c: c.qk_norm),
    TensorSpec("model.layers.{i}.self_attn.k_norm.weight", lambda c: (c.head_dim,),
               when=lambda c: c.qk_norm),
    TensorSpec("model.layers.{i}.pre_feedforward_layernorm.weight", lambda c: (c.hidden_size,),
               when=lambda c: c.sandwich_norms),
    TensorSpec("model.layers.{i}.post_feedforward_layernorm.weight", lambda c: (c.hidden_size,),
               when=lambda c: c.sandwich_norms),
    TensorSpec("model.layers.{i}.mlp.gate_proj.weight",
               lambda c: (c.intermediate_size, c.hidden_size), linear=True),
    TensorSpec("model.layers.{i}.mlp.up_proj.weight",
               lambda c: (c.intermediate_size, c.hidden_size), linear=True),
    TensorSpec("model.layers.{i}.mlp.down_proj.weight",
               lambda c: (c.hidden_size, c.intermediate_size), linear=True),
]


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor this config needs, with layer indices expanded."""
    out = [s for s in _GLOBAL if s.when(cfg)]
    for i in range(cfg.num_hidden_layers):
        for s in _LAYER:
            if s.when(cfg):
                out.append(TensorSpec(s.name.format(i=i), s.shape, s.when, s.linear))
    return out


def is_linear(name: str) -> bool:
    """Whether a canonical tensor name is a quantizable matmul weight."""
    return name.endswith("_proj.weight") or name == "lm_head.weight"
