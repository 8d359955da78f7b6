"""Rotary position embedding tables (Su et al., 2021, "RoFormer").

Tables are computed once per (theta, rotary dim, scaling) on the host in float64 and
handed to the backend as float32 ``cos``/``sin`` ``[max_pos, rotary_dim // 2]``. The
pairing is HF's NeoX/rotate-half convention (dim i with i + r/2); readers undo
llama.cpp's interleaved Q/K row permutation so every model uses this one variant.

Scaling variants follow transformers' ``modeling_rope_utils``: "linear" (positions
divided by ``factor``) and "llama3" (frequency-dependent wavelength scaling).
"""
from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


def inv_frequencies(rotary_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Inverse frequencies ``theta ** (-2i / rotary_dim)``, i < rotary_dim/2, float64.

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
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
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3)")


def rope_tables(cfg: ModelConfig, max_pos: int, theta: float | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 ``[max_pos, rotary_dim // 2]`` for positions 0..max_pos-1."""
    theta = cfg.rope_theta if theta is None else theta
    scaling = cfg.rope_scaling
    if theta != cfg.rope_theta:  # local (sliding-window) layers of gemma3 use no scaling
        scaling = None
    inv = inv_frequencies(cfg.rotary_dim, theta, scaling)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
