"""The pre-norm decoder block, written once as calls of the backend's single ops.

Check it against HF ``modeling_llama.py`` (``LlamaDecoderLayer``, also SmolLM2 and
Mistral), ``modeling_qwen2.py`` (the same with q/k/v biases) and ``modeling_gemma3.py``
(``Gemma3DecoderLayer``: QK-norm before RoPE, sandwich norms on both branch outputs,
``(1 + w)`` RMSNorm, GELU-tanh gating, attention softcap, sliding window):
https://github.com/huggingface/transformers/tree/main/src/transformers/models

    h = rmsnorm(x)                          input_layernorm
    q, k, v = h Wq + bq, h Wk + bk, h Wv + bv
    q, k = qk_norm(q), qk_norm(k)           Gemma 3 (per head)
    q, k = rope(q), rope(k)
    a = attention(q, k, v | KV cache) Wo    causal GQA, window, softcap
    x = x + out_norm(a)                     post_attention_layernorm (Gemma 3)
    h = rmsnorm(x)                          post_attention / pre_feedforward_layernorm
    x = x + mlp_out_norm(act(h Wg) * (h Wu) Wd)

Which switches apply is the :class:`~edgeinfer.backends.base.DecoderBlock` the model
builds from its config. A backend may replace decode steps by a compiled plan
(:meth:`~edgeinfer.backends.base.Backend.compile_decode`) that passes the same tests.

A batched decode step (continuous batching) runs the same block over B rows, one token
of each of B sequences: ``cache`` is then a :class:`RowCaches` (one KV cache per row)
and ``positions`` each row's own position. Every op but the attention is row-wise, so
the linears see M = B rows (each weight read once per step); the attention runs per
row over that row's cache.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backends.base import Backend, DecoderBlock


class RowCaches(tuple):
    """One KV cache per row of a batched decode step (row i appends at ``positions[i]``
    of cache i); the caches are distinct objects."""


def _attend(be: Backend, blk: DecoderBlock, q: Any, k: Any, v: Any, cache: Any, layer: int,
            positions: np.ndarray) -> Any:
    """The block's attention: over one cache from ``positions[0]`` on, or (a
    :class:`RowCaches`) row i over cache i at ``positions[i]``; returns [T, Hq, hd]."""
    if not isinstance(cache, RowCaches):
        return be.attention(q, k, v, cache, layer, int(positions[0]), blk.scale, blk.window,
                            blk.softcap)
    rows = []
    for i, c in enumerate(cache):
        r = slice(i, i + 1)
        rows.append(be.attention(be.select_rows(q, r), be.select_rows(k, r),
                                 be.select_rows(v, r), c, layer, int(positions[i]), blk.scale,
                                 blk.window, blk.softcap))
    return be.concat_rows(rows)


def block_forward(be: Backend, blk: DecoderBlock, x: Any, positions: np.ndarray, cache: Any,
                  layer: int, capture: dict[str, Any] | None = None,
                  capture_only: bool = False) -> Any:
    """One decoder block: x [T, D] -> [T, D], appending K/V at ``positions`` of layer
    ``layer`` of ``cache``.

    Args:
        be: the backend running the ops; ``blk`` its uploaded tensors and switches.
        x: residual stream [T, D] (a backend handle; not modified).
        positions: int32 [T] absolute positions, consecutive (the first is the cache
            row the chunk starts at); with a :class:`RowCaches`, row i's own position.
        cache: KV cache from ``be.new_kv_cache``, or a :class:`RowCaches` of T caches
            (a batched decode step: one token of each of T sequences).
        capture: if given, filled with the *input* of each linear group ("q_proj"
            (shared by q/k/v), "o_proj", "gate_proj" (shared by gate/up), "down_proj")
            for the AWQ/GPTQ calibration of ``edgeinfer.quant``.
        capture_only: with ``capture``, stop once the last input is captured (the down
            projection is not run) and return None.
    """
    t = positions.shape[0]
    hq, hkv, hd = blk.heads
    eps, off = blk.eps, blk.unit_offset
    h = be.rmsnorm(x, blk.input_norm, eps, off)
    if capture is not None:
        capture["q_proj"] = h
    q, k, v = be.linear_many(h, blk.qkv)
    q = be.reshape(q, (t, hq, hd))
    k = be.reshape(k, (t, hkv, hd))
    v = be.reshape(v, (t, hkv, hd))
    if blk.q_norm is not None:
        q = be.rmsnorm(q, blk.q_norm, eps, off)
    if blk.k_norm is not None:
        k = be.rmsnorm(k, blk.k_norm, eps, off)
    q = be.rope(q, blk.cos, blk.sin, positions)
    k = be.rope(k, blk.cos, blk.sin, positions)
    a = _attend(be, blk, q, k, v, cache, layer, positions)
    a = be.reshape(a, (t, hq * hd))
    if capture is not None:
        capture["o_proj"] = a
    o = be.linear(a, blk.wo)
    if blk.attn_out_norm is not None:
        o = be.rmsnorm(o, blk.attn_out_norm, eps, off)
    x = be.add(x, o)
    h = be.rmsnorm(x, blk.mlp_norm, eps, off)
    if capture is not None:
        capture["gate_proj"] = h
    gate, up = be.linear_many(h, blk.gate_up)
    m = be.glu(gate, up, blk.act)
    if capture is not None:
        capture["down_proj"] = m
        if capture_only:
            return None
    d = be.linear(m, blk.w_down)
    if blk.mlp_out_norm is not None:
        d = be.rmsnorm(d, blk.mlp_out_norm, eps, off)
    return be.add(x, d)
