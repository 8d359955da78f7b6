"""Start-up self-check: a tiny synthetic model run on the device and on the reference.

Drivers and compilers differ (a miscompiled kernel gives fluent garbage, not an error),
so the engine calls :func:`self_check` once when it opens an OpenCL device and falls back
to the CPU backend when it fails. The tiny model copies the real one's switches (GQA
ratio, partial rotary, QK-norm, sandwich norms, (1 + w) norms, biases, activation,
sliding window, soft-capping) and weight formats (bits, group size, symmetric, scale
dtype), with small random dimensions, so it exercises the same kernel variants in a
fraction of a second.

The forward below follows :func:`edgeinfer.models.transformer.decoder_layer` op for op;
it is restated here because ``backends`` may not import ``models`` (the layer above).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..quantized import QuantizedTensor, pack_nibbles
from ..reference import ReferenceBackend
from .device import cl

# What a broken driver / compiler / device may raise while building or running kernels.
_FAILURES = (RuntimeError, ValueError, TypeError, MemoryError, OSError) + (
    (cl.Error,) if cl is not None else ())
_TINY = {"vocab": 96, "hidden": 64, "inter": 96, "layers": 2, "max_pos": 64}


def _weight_format(tensors: Mapping[str, Any], pred) -> dict | None:
    for name, t in tensors.items():
        if pred(name) and isinstance(t, QuantizedTensor):
            pc = t.n_groups == 1
            return {"bits": t.bits, "group": -1 if pc else t.group_size,
                    "symmetric": t.zeros is None, "scale_dtype": np.asarray(t.scales).dtype}
    return None


def _synth(rng, out: int, n_in: int, fmt: dict | None, std: float):
    """A random weight [out, n_in]: dense float32 or a QuantizedTensor of ``fmt``."""
    if fmt is None:
        return (rng.standard_normal((out, n_in)) * std).astype(np.float32)
    bits = fmt["bits"]
    g = fmt["group"]
    if g == -1:
        g = n_in + (n_in % 2 if bits == 4 else 0)
    in_pad = -(-n_in // g) * g
    ng = in_pad // g
    if bits == 4:
        codes = pack_nibbles(rng.integers(0, 16, (out, in_pad)))
        zeros = None if fmt["symmetric"] else pack_nibbles(rng.integers(4, 12, (out, ng)))
        s = std / 4.6  # std of a uniform code 0..15 around its zero point
    else:
        codes = rng.integers(-127, 128, (out, in_pad)).astype(np.int8)
        zeros = None
        s = std / 73.0
    scales = (s * (0.5 + rng.random((out, ng)))).astype(fmt["scale_dtype"])
    return QuantizedTensor(codes, scales, zeros, bits, g, n_in, method="selfcheck")


def tiny_config(cfg):
    """A small copy of ``cfg`` (a ModelConfig dataclass) with the same switches."""
    hkv = min(cfg.num_key_value_heads, 2)
    hq = hkv * min(cfg.num_attention_heads // cfg.num_key_value_heads, 2)
    hd = min(cfg.head_dim, 32)
    kw = {"vocab_size": _TINY["vocab"], "hidden_size": _TINY["hidden"],
          "intermediate_size": _TINY["inter"], "num_hidden_layers": _TINY["layers"],
          "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": hd,
          "max_position_embeddings": _TINY["max_pos"]}
    if getattr(cfg, "query_pre_attn_scalar", None):
        kw["query_pre_attn_scalar"] = hd
    if getattr(cfg, "sliding_window", None):
        kw["sliding_window"] = min(cfg.sliding_window, 4)
    if getattr(cfg, "layer_types", None):
        kinds = list(dict.fromkeys(cfg.layer_types))
        kw["layer_types"] = (kinds * 2)[:2]
    return dataclasses.replace(cfg, **kw)


def synthetic_tensors(cfg, tensors: Mapping[str, Any] | None, seed: int = 0) -> dict:
    """Random weights (short names per layer) for the tiny ``cfg``, in ``tensors``' formats."""
    rng = np.random.default_rng(seed)
    tensors = tensors or {}
    lin = _weight_format(tensors, lambda n: "proj" in n)
    emb = _weight_format(tensors, lambda n: "embed_tokens" in n)
    head = _weight_format(tensors, lambda n: n.startswith("lm_head"))
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def norm(n):
        base = 0.0 if cfg.norm_unit_offset else 1.0
        return (base + 0.1 * rng.standard_normal(n)).astype(np.float32)

    out: dict[str, Any] = {"embed": _synth(rng, v, d, emb, 1.0), "norm": norm(d)}
    out["head"] = out["embed"] if cfg.tie_word_embeddings else _synth(rng, v, d, head or emb, d ** -0.5)
    out["layers"] = []
    for _ in range(cfg.num_hidden_layers):
        lw = {n: norm(d) for n in ("input_layernorm", "post_attention_layernorm",
                                   "pre_feedforward_layernorm", "post_feedforward_layernorm")}
        shapes = {"q_proj": (hq * hd, d), "k_proj": (hkv * hd, d), "v_proj": (hkv * hd, d),
                  "o_proj": (d, hq * hd), "gate_proj": (f, d), "up_proj": (f, d),
                  "down_proj": (d, f)}
        for n, (o, i) in shapes.items():
            lw[n] = _synth(rng, o, i, lin, i ** -0.5)
        if cfg.attention_bias:
            for n, o in (("q_bias", hq * hd), ("k_bias", hkv * hd), ("v_bias", hkv * hd)):
                lw[n] = (0.1 * rng.standard_normal(o)).astype(np.float32)
        if cfg.qk_norm:
            lw["q_norm"], lw["k_norm"] = norm(hd), norm(hd)
        out["layers"].append(lw)
    return out


def _rope_tables(cfg, n: int):
    r = int(cfg.head_dim * cfg.partial_rotary_factor)
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, r, 2, dtype=np.float64) / r))
    ang = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class _TinyModel:
    """The synthetic weights uploaded to one backend, with the transformer forward."""

    _LIN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, be, cfg, w):
        self.be, self.cfg = be, cfg
        self.embed = be.upload_embedding(w["embed"])
        self.head = self.embed if w["head"] is w["embed"] else be.upload_weight(w["head"])
        self.norm = be.upload(w["norm"])
        self.layers = [{k: (be.upload_weight(t) if k in self._LIN else be.upload(t))
                        for k, t in lw.items()} for lw in w["layers"]]
        cos, sin = _rope_tables(cfg, cfg.max_position_embeddings)
        self.rope = (be.upload(cos), be.upload(sin))

    def forward(self, ids: np.ndarray, cache) -> np.ndarray:
        be, cfg = self.be, self.cfg
        t = len(ids)
        pos = np.arange(cache.length, cache.length + t, dtype=np.int32)
        eps, off = cfg.rms_norm_eps, cfg.norm_unit_offset
        hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        x = be.embed(self.embed, ids, cfg.embed_scale)
        for i, lw in enumerate(self.layers):
            h = be.rmsnorm(x, lw["input_layernorm"], eps, off)
            q = be.reshape(be.linear(h, lw["q_proj"], lw.get("q_bias")), (t, hq, hd))
            k = be.reshape(be.linear(h, lw["k_proj"], lw.get("k_bias")), (t, hkv, hd))
            v = be.reshape(be.linear(h, lw["v_proj"], lw.get("v_bias")), (t, hkv, hd))
            if cfg.qk_norm:
                q = be.rmsnorm(q, lw["q_norm"], eps, off)
                k = be.rmsnorm(k, lw["k_norm"], eps, off)
            q = be.rope(q, *self.rope, pos)
            k = be.rope(k, *self.rope, pos)
            a = be.attention(q, k, v, cache, i, int(pos[0]), cfg.attn_scale, cfg.layer_window(i),
                             cfg.attn_logit_softcapping)
            o = be.linear(be.reshape(a, (t, hq * hd)), lw["o_proj"])
            if cfg.sandwich_norms:
                x = be.add(x, be.rmsnorm(o, lw["post_attention_layernorm"], eps, off))
                h = be.rmsnorm(x, lw["pre_feedforward_layernorm"], eps, off)
            else:
                x = be.add(x, o)
                h = be.rmsnorm(x, lw["post_attention_layernorm"], eps, off)
            act = "silu" if cfg.hidden_act == "silu" else "gelu_tanh"
            m = be.glu(be.linear(h, lw["gate_proj"]), be.linear(h, lw["up_proj"]), act)
            d = be.linear(m, lw["down_proj"])
            if cfg.sandwich_norms:
                d = be.rmsnorm(d, lw["post_feedforward_layernorm"], eps, off)
            x = be.add(x, d)
        cache.length += t
        x = be.rmsnorm(be.select_rows(x, slice(t - 1, t)), self.norm, eps, off)
        return be.logits(x, self.head, cfg.final_logit_softcapping)


def self_check(model_cfg, tensors: Mapping[str, Any] | None = None, backend=None, *,
               steps: int = 4, prompt_len: int = 6, kv_dtype: str = "f32",
               tol: float | None = None, seed: int = 0) -> tuple[bool, float]:
    """Compare a tiny synthetic model on the OpenCL backend with the reference backend.

    Args:
        model_cfg: the real model's config (a ``ModelConfig`` dataclass): its switches and
            GQA ratio are copied into a tiny config (64 hidden, 2 layers, 96 vocab).
        tensors: the real model's tensors (name -> array / QuantizedTensor), only
            inspected for weight formats; ``None`` means dense float32.
        backend: an ``OpenCLBackend`` (default: a new one on the default device).
        steps: decode steps after a ``prompt_len``-token prefill (same token ids on both
            backends: the reference's greedy choice).
        kv_dtype: cache storage to check ("f32", "f16", "int8", "int4").
        tol: bound on ``max|logits - ref| / max(max|ref|, 1)`` over every step
            (default 1e-4 for f32, 5e-3 for f16, 3e-2 for int8/int4 storage).

    Returns:
        (ok, max_err). When not ok a ``RuntimeWarning`` names the device and the error;
        the caller should fall back to the CPU backend. A failure to build or run the
        kernels also returns ``(False, inf)`` with a warning instead of raising.
    """
    if tol is None:  # quantized caches: a 1e-7 difference can move a code by one step
        tol = {"f32": 1e-4, "f16": 5e-3}.get(kv_dtype, 3e-2)
    saved_caps = None
    try:
        if backend is None:
            from .backend import OpenCLBackend
            backend = OpenCLBackend()
        if getattr(backend.caps, "split_kv_chunk", 0):
            # the tiny context never reaches the split-KV threshold: force tiny chunks so
            # decode steps run attention_split/combine (prefill still runs attention)
            saved_caps = backend.caps
            backend.caps = dataclasses.replace(saved_caps, split_kv_chunk=2)
        cfg = tiny_config(model_cfg)
        w = synthetic_tensors(cfg, tensors, seed)
        ref, dev = _TinyModel(ReferenceBackend(), cfg, w), _TinyModel(backend, cfg, w)
        n = prompt_len + steps + 1
        rc = ReferenceBackend().new_kv_cache(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                             cfg.head_dim, n, kv_dtype)
        dc = backend.new_kv_cache(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                  cfg.head_dim, n, kv_dtype)
        ids = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, prompt_len).astype(np.int32)
        worst = 0.0
        for _ in range(steps + 1):
            a, b = ref.forward(ids, rc), dev.forward(ids, dc)
            if not np.isfinite(b).all():
                worst = math.inf
                break
            worst = max(worst, float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1.0)))
            ids = np.array([int(np.argmax(a[-1]))], np.int32)
    except _FAILURES as e:  # a driver that cannot build or run the kernels: fall back
        warnings.warn(f"OpenCL self-check could not run ({type(e).__name__}: {e}); "
                      "use the CPU backend", RuntimeWarning, stacklevel=2)
        return False, math.inf
    finally:
        if saved_caps is not None:
            backend.caps = saved_caps
    ok = worst <= tol
    if not ok:
        name = getattr(backend, "device_info", {}).get("name", "?")
        warnings.warn(f"OpenCL self-check failed on {name!r}: max normalized logit error "
                      f"{worst:.3g} > {tol:.1g} against the reference backend; this device's "
                      "results are not trusted, use the CPU backend", RuntimeWarning, stacklevel=2)
    return ok, worst
