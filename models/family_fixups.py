"""Per-family config fixups named by :data:`edgeinfer.models.families.FAMILIES`.

``*_fixup(config_json, kw)`` functions adjust the :class:`ModelConfig` keyword arguments
built from an HF ``config.json`` dict where a family's HF config class does more than fill
a default; ``*_gguf(meta, d)`` functions add what a family's GGUF metadata says to the
HF-style dict built from it (``meta`` as described on ``Family``). All raise ValueError
on values they cannot honour.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np


def round_bf16(x: float) -> float:
    """``x`` rounded to the nearest bfloat16 (ties to even), as a Python float."""
    b = np.array([x], np.float32).view(np.uint32)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return float(b.view(np.float32)[0])


# ---- HF config.json ---------------------------------------------------------------------
def qwen2_sliding_window(d: dict, kw: dict) -> None:
    """Qwen2Config: ``sliding_window`` only counts with ``use_sliding_window`` (default
    false), and then only for layers ``i >= max_window_layers`` (default 28)."""
    if not d.get("use_sliding_window", False):
        kw["sliding_window"] = None
        return
    if kw.get("sliding_window") and kw.get("layer_types") is None:
        first = int(d.get("max_window_layers", 28))
        kw["layer_types"] = ["sliding_attention" if i >= first else "full_attention"
                             for i in range(int(d["num_hidden_layers"]))]


def gemma3_embed_scale(d: dict, kw: dict) -> None:
    """Gemma3: embeddings times sqrt(hidden), computed in the checkpoint dtype (bf16) by HF
    and the original implementation alike, so that rounded value is used
    (https://github.com/huggingface/transformers/pull/29402)."""
    if "embed_scale" not in d:
        kw["embed_scale"] = round_bf16(math.sqrt(d["hidden_size"]))


#: Phi3Config.original_max_position_embeddings default.
PHI3_ORIGINAL_MAX = 4096


def phi3_rope(d: dict, kw: dict) -> None:
    """Phi3Config's rope rules: the types "su" and "yarn" mean "longrope", and the
    top-level ``original_max_position_embeddings`` (default 4096) overrides the one in
    the rope dict (``standardize_rope_params``)."""
    rs = kw.get("rope_scaling")
    if not isinstance(rs, dict):
        return
    kind = rs.get("rope_type", rs.get("type"))
    if kind in ("su", "yarn", "longrope"):
        rs = {k: v for k, v in rs.items() if k != "type"}
        rs["rope_type"] = "longrope"
        rs["original_max_position_embeddings"] = int(
            d.get("original_max_position_embeddings", PHI3_ORIGINAL_MAX))
        kw["rope_scaling"] = rs


# ---- GGUF metadata ----------------------------------------------------------------------
def gemma3_gguf(meta: Any, d: dict) -> None:
    """What llama.cpp (``llama-model.cpp``, LLM_ARCH_GEMMA3) assumes beyond the metadata:
    a 6-layer sliding-window pattern (every 6th layer global) unless the file lists one
    bool per layer, local RoPE base 10000, attention scale ``1/sqrt(head_dim)`` (27B, 62
    layers: ``1/sqrt(hidden/heads)``, as gemma_pytorch's config), and the softcaps."""
    n_layers = d["num_hidden_layers"]
    window = meta.opt("attention.sliding_window")
    pattern = meta.raw("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer converters: one bool per layer (True = SWA)
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:  # llama.cpp set_swa_pattern(6): every 6th layer is global
        every = int(pattern)
        if every < 1:
            raise ValueError(f"attention.sliding_window_pattern = {pattern!r}; expected a "
                             f"positive integer or one bool per layer")
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(n_layers)]
    if window:
        d["sliding_window"] = int(window)
        d["layer_types"] = types
    d["rope_local_base_freq"] = float(meta.opt("rope.freq_base_swa", 10000.0))
    # an int, as HF's Gemma3TextConfig declares it (its strict config rejects 256.0)
    heads = d["num_attention_heads"]
    d["query_pre_attn_scalar"] = (d["hidden_size"] // heads if n_layers == 62
                                  else int(d["head_dim"]))
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        v = meta.opt(key)
        if v:
            d[key] = float(v)


def phi3_gguf(meta: Any, d: dict) -> None:
    """llama.cpp's phi3 metadata: ``attention.sliding_window``, and LongRoPE as the
    ``rope_factors_long`` / ``rope_factors_short`` tensors with
    ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``
    (convert_hf_to_gguf.py ``Phi3MiniModel``)."""
    window = meta.opt("attention.sliding_window")
    if window:
        d["sliding_window"] = int(window)
    long, short = meta.tensor("rope_factors_long.weight"), meta.tensor("rope_factors_short.weight")
    if long is None and short is None:
        if meta.opt("rope.scaling.type") == "longrope":
            raise ValueError("rope.scaling.type is longrope but the rope_factors_long/short "
                             "tensors are missing")
        return
    if long is None or short is None:
        raise ValueError("only one of rope_factors_long.weight / rope_factors_short.weight "
                         "is present; LongRoPE needs both")
    orig = meta.opt("rope.scaling.original_context_length")
    if not orig:
        raise ValueError("LongRoPE factors without rope.scaling.original_context_length")
    rs: dict[str, Any] = {
        "rope_type": "longrope", "original_max_position_embeddings": int(orig),
        "long_factor": [float(x) for x in np.asarray(long).reshape(-1)],
        "short_factor": [float(x) for x in np.asarray(short).reshape(-1)],
    }
    attn = meta.opt("rope.scaling.attn_factor")
    if attn:
        rs["attention_factor"] = float(attn)
    d["rope_scaling"] = rs
    d["original_max_position_embeddings"] = int(orig)
