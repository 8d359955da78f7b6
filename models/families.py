"""Architecture families as data: the one table readers, config, transformer and quant read.

Every family maps its checkpoints onto one canonical tensor set (:data:`LAYER_TENSORS`, HF
Llama names) and one config (:class:`~edgeinfer.models.config.ModelConfig` switches), so
the forward pass never branches on the family. A :class:`Family` entry holds:

* ``model_types`` (HF ``model_type`` values) and ``architectures`` (HF class names, for
  configs without a ``model_type``);
* ``defaults``: config values the family's HF config class implies when ``config.json``
  omits the key, and ``hf_fixup`` for rules that are more than a default;
* ``fused``: checkpoint tensors that stack several canonical ones by rows (Phi-3's
  ``qkv_proj``, ``gate_up_proj``), split at load by the readers;
* the GGUF side: ``gguf_arch`` (``general.architecture``), tensor-name overrides, the
  converter conventions to undo (Llama's Q/K row permutation, Gemma's ``1 + w`` norms),
  metadata fixups, and tensors that carry config rather than weights;
* ``awq_groups``: which op feeds which linears (AWQ's scale groups).

Adding a family is one entry here plus fixup functions (:mod:`.family_fixups`) where its
checkpoints differ, and a tiny model checked against HF transformers.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from . import family_fixups as fx


def _always(c: Any) -> bool:
    return True


# ---- activations ------------------------------------------------------------------------
#: HF activation names (``hidden_act`` / ``hidden_activation``) -> the backends' GLU name.
#: "gelu_new" and "gelu_pytorch_tanh" are both the tanh approximation in HF's ACT2FN.
ACTIVATIONS = MappingProxyType({
    "silu": "silu", "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh",
})


def activation(name: str) -> str:
    """The backend activation ("silu" or "gelu_tanh") of an HF activation name.

    Raises:
        ValueError: an activation the backends do not implement (e.g. exact-erf "gelu").
    """
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"activation {name!r} is not supported (supported: "
                         f"{', '.join(sorted(ACTIVATIONS))})") from None


# ---- the canonical tensor table ---------------------------------------------------------
@dataclass(frozen=True)
class LayerTensor:
    """One canonical tensor: ``short`` (the transformer's and quant's handle name),
    ``name`` (checkpoint name; ``{i}`` = layer index), shape rule, whether the config
    uses it, and whether it is a quantizable ``[out, in]`` matmul weight."""

    short: str
    name: str
    shape: Callable[[Any], tuple[int, ...]]
    when: Callable[[Any], bool] = _always
    linear: bool = False


def _d(c):
    return (c.hidden_size,)


def _q(c):
    return c.num_attention_heads * c.head_dim


def _kv(c):
    return c.num_key_value_heads * c.head_dim


GLOBAL_TENSORS = (
    LayerTensor("embed_tokens", "model.embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size)),
    LayerTensor("norm", "model.norm.weight", _d),
    LayerTensor("lm_head", "lm_head.weight", lambda c: (c.vocab_size, c.hidden_size),
                when=lambda c: not c.tie_word_embeddings, linear=True),
)
_L = "model.layers.{i}."
#: Per-layer tensors, in validation order.
LAYER_TENSORS = (
    LayerTensor("input_layernorm", _L + "input_layernorm.weight", _d),
    LayerTensor("post_attention_layernorm", _L + "post_attention_layernorm.weight", _d),
    LayerTensor("q_proj", _L + "self_attn.q_proj.weight", lambda c: (_q(c), c.hidden_size),
                linear=True),
    LayerTensor("k_proj", _L + "self_attn.k_proj.weight", lambda c: (_kv(c), c.hidden_size),
                linear=True),
    LayerTensor("v_proj", _L + "self_attn.v_proj.weight", lambda c: (_kv(c), c.hidden_size),
                linear=True),
    LayerTensor("o_proj", _L + "self_attn.o_proj.weight", lambda c: (c.hidden_size, _q(c)),
                linear=True),
    LayerTensor("q_bias", _L + "self_attn.q_proj.bias", lambda c: (_q(c),),
                when=lambda c: c.attention_bias),
    LayerTensor("k_bias", _L + "self_attn.k_proj.bias", lambda c: (_kv(c),),
                when=lambda c: c.attention_bias),
    LayerTensor("v_bias", _L + "self_attn.v_proj.bias", lambda c: (_kv(c),),
                when=lambda c: c.attention_bias),
    LayerTensor("q_norm", _L + "self_attn.q_norm.weight", lambda c: (c.head_dim,),
                when=lambda c: c.qk_norm),
    LayerTensor("k_norm", _L + "self_attn.k_norm.weight", lambda c: (c.head_dim,),
                when=lambda c: c.qk_norm),
    LayerTensor("pre_feedforward_layernorm", _L + "pre_feedforward_layernorm.weight", _d,
                when=lambda c: c.sandwich_norms),
    LayerTensor("post_feedforward_layernorm", _L + "post_feedforward_layernorm.weight", _d,
                when=lambda c: c.sandwich_norms),
    LayerTensor("gate_proj", _L + "mlp.gate_proj.weight",
                lambda c: (c.intermediate_size, c.hidden_size), linear=True),
    LayerTensor("up_proj", _L + "mlp.up_proj.weight",
                lambda c: (c.intermediate_size, c.hidden_size), linear=True),
    LayerTensor("down_proj", _L + "mlp.down_proj.weight",
                lambda c: (c.hidden_size, c.intermediate_size), linear=True),
)
LAYER = MappingProxyType({t.short: t for t in LAYER_TENSORS})
#: Short names of the quantizable per-layer linears.
LINEAR_KEYS = tuple(t.short for t in LAYER_TENSORS if t.linear)
#: Linears sharing one input, keyed by the block's calibration-capture key (rows stacked
#: for GPTQ's shared Hessian; AWQ's groups name the same keys).
CAPTURE_GROUPS = MappingProxyType({
    "q_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
})


def layer_tensor_names(i: int) -> dict[str, str]:
    """Short name -> canonical name of every per-layer tensor of layer ``i``."""
    return {t.short: t.name.format(i=i) for t in LAYER_TENSORS}


# ---- per-family pieces ------------------------------------------------------------------
@dataclass(frozen=True)
class ScaleGroup:
    """AWQ scale group: ``prev`` op (short layer-tensor name) feeding ``linears`` whose
    shared input is the block's capture ``capture`` (a key of :data:`CAPTURE_GROUPS`)."""

    prev: str
    linears: tuple[str, ...]
    capture: str
    when: Callable[[Any], bool] = _always


@dataclass(frozen=True)
class FusedTensor:
    """A checkpoint tensor stacking the canonical tensors ``parts`` (short names) by rows,
    in that order; ``name`` uses ``{i}`` for the layer. Each part's row count is its
    :data:`LAYER_TENSORS` shape, so the fused shape is checked before it is split."""

    name: str
    parts: tuple[str, ...]


def _mha(c) -> bool:  # v_proj rows map 1:1 on o_proj columns only without GQA
    return c.num_key_value_heads == c.num_attention_heads


def _groups(mlp_norm: str) -> tuple[ScaleGroup, ...]:
    return (
        ScaleGroup("input_layernorm", ("q_proj", "k_proj", "v_proj"), "q_proj"),
        ScaleGroup("v_proj", ("o_proj",), "o_proj", when=_mha),
        ScaleGroup(mlp_norm, ("gate_proj", "up_proj"), "gate_proj"),
        ScaleGroup("up_proj", ("down_proj",), "down_proj"),
    )


@dataclass(frozen=True)
class Family:
    """One architecture family (module docstring). Fixup signatures:
    ``hf_fixup(config_json: dict, kw: dict)`` edits the ModelConfig keyword arguments;
    ``gguf_fixup(meta, d: dict)`` edits the HF-style dict built from GGUF metadata, with
    ``meta.opt(key, default)`` (``{arch}.key``, uniform per layer), ``meta.raw(key,
    default)`` and ``meta.tensor(name)`` (float32 array or None). Both raise ValueError."""

    name: str
    model_types: tuple[str, ...]
    architectures: Mapping[str, str]
    awq_groups: tuple[ScaleGroup, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    hf_fixup: Callable[[dict, dict], None] | None = None
    fused: tuple[FusedTensor, ...] = ()
    gguf_arch: str | None = None
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    gguf_permute_qk: bool = False
    gguf_norm_plus_one: bool = False
    gguf_fixup: Callable[[Any, dict], None] | None = None
    gguf_config_tensors: tuple[str, ...] = ()

    @property
    def gguf_model_type(self) -> str:
        return self.model_types[0]


FAMILIES: tuple[Family, ...] = (
    Family(
        "llama", ("llama", "mistral", "smollm"),
        {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"},
        _groups("post_attention_layernorm"),
        gguf_arch="llama",
        # convert_hf_to_gguf.py LlamaModel.permute: rotate-half -> interleaved Q/K rows
        gguf_permute_qk=True),
    Family(
        "qwen2", ("qwen2",), {"Qwen2ForCausalLM": "qwen2"},
        _groups("post_attention_layernorm"),
        defaults={"attention_bias": True},  # Qwen2 always has q/k/v biases
        hf_fixup=fx.qwen2_sliding_window,
        gguf_arch="qwen2"),
    Family(
        "gemma3", ("gemma3_text", "gemma3"), {"Gemma3ForCausalLM": "gemma3_text"},
        _groups("pre_feedforward_layernorm"),
        defaults={"hidden_act": "gelu_pytorch_tanh", "norm_unit_offset": True,
                  "qk_norm": True, "sandwich_norms": True},
        hf_fixup=fx.gemma3_embed_scale,
        gguf_arch="gemma3",
        # gguf-py tensor_mapping.py: FFN_PRE_NORM and FFN_NORM share the name "ffn_norm"
        gguf_layer_names={"ffn_norm": "pre_feedforward_layernorm"},
        # convert_hf_to_gguf.py Gemma3Model.modify_tensors stores 1 + w for *norm.weight
        gguf_norm_plus_one=True,
        gguf_fixup=fx.gemma3_gguf),
    Family(
        "phi3", ("phi3",), {"Phi3ForCausalLM": "phi3"},
        _groups("post_attention_layernorm"),
        # Phi3Config's defaults where they differ from ModelConfig's
        defaults={"tie_word_embeddings": False, "max_position_embeddings": 4096,
                  "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000},
        hf_fixup=fx.phi3_rope,
        fused=(FusedTensor(_L + "self_attn.qkv_proj.weight", ("q_proj", "k_proj", "v_proj")),
               FusedTensor(_L + "mlp.gate_up_proj.weight", ("gate_proj", "up_proj"))),
        gguf_arch="phi3",
        # llama.cpp's phi3 graph: fused attn_qkv, and ffn_up holding gate then up rows
        gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
        gguf_fixup=fx.phi3_gguf,
        gguf_config_tensors=("rope_factors_long.weight", "rope_factors_short.weight")),
)

#: HF model_type -> family.
BY_MODEL_TYPE = MappingProxyType({mt: f for f in FAMILIES for mt in f.model_types})
#: HF architecture class -> model_type (configs without a model_type).
BY_ARCHITECTURE = MappingProxyType({a: mt for f in FAMILIES for a, mt in f.architectures.items()})
#: GGUF general.architecture -> family.
BY_GGUF_ARCH = MappingProxyType({f.gguf_arch: f for f in FAMILIES if f.gguf_arch})
#: Family name -> family.
BY_NAME = MappingProxyType({f.name: f for f in FAMILIES})

#: GGUF per-layer tensor name -> canonical suffix without ``.weight`` / ``.bias``
#: (``blk.N.x`` -> ``model.layers.N.<suffix>``); families override entries.
GGUF_LAYER_NAMES = MappingProxyType({
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # gemma3 sandwich norms
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
})
GGUF_GLOBAL_NAMES = MappingProxyType({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
})


def family(model_type: str) -> Family:
    """The family of an HF ``model_type``.

    Raises:
        KeyError: an unsupported model type.
    """
    return BY_MODEL_TYPE[model_type]
