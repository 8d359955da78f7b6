"""Rotary position embedding tables (Su et al., 2021, "RoFormer").

Tables are computed once per (theta, rotary dim, scaling) on the host in float64 and
handed to the backend as float32 ``cos``/``sin`` ``[max_pos, rotary_dim // 2]``. The
pairing is HF's NeoX/rotate-half convention (dim i with i + r/2); readers undo
llama.cpp's interleaved Q/K row permutation so every model uses this one variant.

Scaling variants follow transformers' ``modeling_rope_utils``: "linear" (positions
divided by ``factor``), "llama3" (frequency-dependent wavelength scaling) and "longrope"
(Phi-3; Ding et al., 2024, "LongRoPE", arXiv:2402.13753).

LongRoPE policy (transformers' Phi-3 behaviour is the reference): a sequence of length
``n <= L0 = original_max_position_embeddings`` is rotated with the short factors, a longer
one with the long factors, and both with the same attention factor on cos/sin (default
``sqrt(1 + ln(s) / ln(L0))``, ``s = max_position_embeddings / L0``, 1 when ``s <= 1``).
HF's ``Phi3ForCausalLM.prepare_inputs_for_generation`` drops its KV cache and re-prefills
the whole sequence the first time it grows past ``L0``; this runtime does the same
(:meth:`edgeinfer.engine.Engine.decode_one`), so every step's logits equal a
from-scratch forward over the current sequence. Re-rotating the cached keys alone would
not do: the cached K/V of every layer above the first depend on the attention outputs
below, which used the short factors.
"""
from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


def _kind(scaling: dict | None) -> str | None:
    return scaling.get("rope_type", scaling.get("type")) if scaling else None


def rope_switch(cfg: ModelConfig) -> int | None:
    """LongRoPE's switch length ``L0`` (sequences longer than it use the long factors), or
    None for every other RoPE."""
    if _kind(cfg.rope_scaling) != "longrope":
        return None
    return int(cfg.rope_scaling.get("original_max_position_embeddings")
               or cfg.max_position_embeddings)


def attention_factor(cfg: ModelConfig) -> float:
    """The factor LongRoPE multiplies cos and sin by (1.0 for every other RoPE)."""
    rs = cfg.rope_scaling
    if _kind(rs) != "longrope":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    orig = rope_switch(cfg)
    factor = float(rs.get("factor") or cfg.max_position_embeddings / orig)
    return 1.0 if factor <= 1.0 else math.sqrt(1.0 + math.log(factor) / math.log(orig))


def inv_frequencies(rotary_dim: int, theta: float, scaling: dict | None,
                    long: bool = False) -> np.ndarray:
    """Inverse frequencies ``theta ** (-2i / rotary_dim)``, i < rotary_dim/2, float64;
    ``long`` picks LongRoPE's long factors (else its short ones).

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    if not scaling:
        return inv
    kind = _kind(scaling)
    if kind == "longrope":
        ext = np.asarray(scaling["long_factor" if long else "short_factor"], np.float64)
        return inv / ext
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3, longrope)")


def rope_tables(cfg: ModelConfig, max_pos: int, theta: float | None = None, long: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 ``[max_pos, rotary_dim // 2]`` for positions 0..max_pos-1;
    ``long``: LongRoPE's long-sequence tables (ignored by other RoPEs)."""
    theta = cfg.rope_theta if theta is None else theta
    scaling = cfg.rope_scaling
    if theta != cfg.rope_theta:  # local (sliding-window) layers of gemma3 use no scaling
        scaling = None
    inv = inv_frequencies(cfg.rotary_dim, theta, scaling, long)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    mscale = attention_factor(cfg) if scaling is not None else 1.0
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    return cos.astype(np.float32), sin.astype(np.float32)
