"""Rotate a model's residual stream before quantization: the same function in float,
weights with fewer outliers per group.

Computational invariance (SliceGPT, Ashkboos et al., ICLR 2024, §3; QuaRot, Ashkboos et
al., NeurIPS 2024, §4): for an orthogonal ``Q [D, D]``, ``RMSNorm(x Q) = RMSNorm(x) Q``
once a norm's scale ``w`` is folded into the linears that read it. With the residual
stream ``h`` carried as ``h Q`` (row vectors):

* embedding rows ``E Q``; q/k/v/gate/up ``W diag(w_norm) Q``; o/down ``Qᵀ W``;
* the head ``head diag(w_final) Q``: a tied head becomes its own tensor (``lm_head``,
  stored as the embedding is); every RMSNorm scale becomes ones;
* per KV head, the value rows ``R W_v`` (and bias ``R b_v``) and the o_proj columns of
  every query head reading that KV head ``W_o Rᵀ`` (QuaRot's offline value rotation,
  ``R [head_dim, head_dim]``): attention mixes whole value vectors, so ``R`` passes
  through it.

``Q`` and ``R`` are random orthogonal matrices (QR of a seeded Gaussian, column signs
fixed so the draw is Haar; QuaRot's random orthogonal option). Only plain pre-norm blocks
qualify: a ``1 + w`` norm (Gemma) has no scale to fold into ones without changing the
norm, and sandwich norms act on the block outputs inside the residual stream.

Every rotated tensor is computed on access (one tensor at a time, as
:class:`~edgeinfer.source.LazyTensors` gives them) in float32 (the vocabulary tables in
blocks of rows): a product's rounding, ~1e-7 of a weight, is far below INT4's steps.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import UnsupportedModelError
from ..models.families import layer_tensor_names
from ..source import LazyTensors, ModelSource

#: rows of a vocabulary table rotated per float64 product (bounded temporaries)
TABLE_ROWS = 8192


def random_orthogonal(n: int, seed: int) -> np.ndarray:
    """A Haar-random orthogonal float64 ``[n, n]`` (QR of a seeded standard Gaussian,
    columns signed by ``diag(R)``; Mezzadri, "How to generate random matrices from the
    classical compact groups", 2007)."""
    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def rotation_refusal(cfg) -> str | None:
    """Why ``cfg``'s architecture cannot be rotated offline, or None when it can."""
    if cfg.norm_unit_offset:
        return "its RMSNorm scales by (1 + w), which cannot be folded into the linears"
    if cfg.sandwich_norms:
        return "its post-attention / post-feed-forward norms act inside the residual stream"
    return None


def rotate_source(source: ModelSource, seed: int = 0) -> ModelSource:
    """``source`` with its residual stream and value heads rotated (module docstring).

    Args:
        source: a float model (tensors float32 on access, lazily welcome).
        seed: seeds ``Q`` (``seed``) and ``R`` (``seed + 1``).

    Returns:
        a ModelSource over the rotated tensors (lazy), ``tie_word_embeddings`` false.

    Raises:
        UnsupportedModelError: an architecture :func:`rotation_refusal` refuses (the reason
            and the fix named).
    """
    cfg = source.config
    why = rotation_refusal(cfg)
    if why is not None:
        raise UnsupportedModelError(f"{source.path}: cannot rotate a {cfg.model_type} model: "
                                    f"{why}; convert it without rotation (--no-rotate)")
    D, hd = cfg.hidden_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    Q = random_orthogonal(D, seed).astype(np.float32)
    R = random_orthogonal(hd, seed + 1).astype(np.float32)
    T = source.tensors

    def f32(name):
        return np.asarray(T[name], np.float32)

    def table(name, scale=None):
        def load():
            w = T[name]
            out = np.empty(w.shape, np.float32)
            sc = None if scale is None else scale()
            for r in range(0, w.shape[0], TABLE_ROWS):
                b = np.asarray(w[r:r + TABLE_ROWS], np.float32)
                np.matmul(b if sc is None else b * sc, Q, out=out[r:r + TABLE_ROWS])
            return out
        return load

    def reads(name, norm):  # a linear reading the normed residual stream
        return lambda: (f32(name) * f32(norm)[None, :]) @ Q

    def writes(name, value_cols=False):  # a linear adding to the residual stream
        def load():
            w = Q.T @ f32(name)
            if value_cols:  # o_proj: its input columns are the query heads' value vectors
                w = (w.reshape(D, nh, hd) @ R.T).reshape(D, nh * hd)
            return np.ascontiguousarray(w)
        return load

    def values(name, norm):  # v_proj: read as the others, then each KV head's rows by R
        read = reads(name, norm)
        return lambda: np.ascontiguousarray((R @ read().reshape(nkv, hd, D)).reshape(nkv * hd, D))

    def value_bias(name):
        return lambda: np.ascontiguousarray((f32(name).reshape(nkv, hd) @ R.T).reshape(-1))

    def ones():
        return np.ones(D, np.float32)

    loaders = {k: (lambda k=k: T[k]) for k in T}
    loaders["model.embed_tokens.weight"] = table("model.embed_tokens.weight")
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    loaders["lm_head.weight"] = table(head, lambda: f32("model.norm.weight")[None, :])
    loaders["model.norm.weight"] = ones
    for i in range(cfg.num_hidden_layers):
        n = layer_tensor_names(i)
        loaders[n["q_proj"]] = reads(n["q_proj"], n["input_layernorm"])
        loaders[n["k_proj"]] = reads(n["k_proj"], n["input_layernorm"])
        loaders[n["v_proj"]] = values(n["v_proj"], n["input_layernorm"])
        if n["v_bias"] in T:
            loaders[n["v_bias"]] = value_bias(n["v_bias"])
        loaders[n["o_proj"]] = writes(n["o_proj"], value_cols=True)
        loaders[n["gate_proj"]] = reads(n["gate_proj"], n["post_attention_layernorm"])
        loaders[n["up_proj"]] = reads(n["up_proj"], n["post_attention_layernorm"])
        loaders[n["down_proj"]] = writes(n["down_proj"])
        loaders[n["input_layernorm"]] = ones
        loaders[n["post_attention_layernorm"]] = ones
    shapes = dict(source.shapes)
    shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return replace(source, config=replace(cfg, tie_word_embeddings=False),
                   tensors=LazyTensors(loaders), shapes=shapes, row_tables={})
