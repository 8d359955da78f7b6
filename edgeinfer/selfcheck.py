"""Start-up self-check of a compute backend: a tiny synthetic model run on it and on the
numpy reference backend, through the one transformer forward.

Drivers and compilers differ (a miscompiled kernel gives fluent garbage, not an error),
so :class:`edgeinfer.api.Model` calls :func:`self_check` once when it opens an OpenCL
device and falls back to the CPU backend when it fails. The tiny model copies the real
one's switches (GQA ratio, partial rotary, RoPE scaling, QK-norm, sandwich norms,
(1 + w) norms, biases, activation, sliding window, soft-capping) and weight formats
(bits, group size, symmetric, scale dtype) into small random dimensions, so it exercises
the same kernel variants in a fraction of a second.

The model is :class:`edgeinfer.models.transformer.Transformer` itself (this module sits
on the floor above ``models`` and ``backends``), so there is no second copy of the
decoder layer to keep in step with the real one.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from .backends.quantized import QuantizedTensor, pack_nibbles
from .backends.reference import ReferenceBackend
from .models.arch import tensor_specs
from .models.config import ModelConfig
from .models.transformer import Transformer

_TINY = {"vocab": 96, "hidden": 64, "inter": 96, "layers": 2, "max_pos": 64}


def _failures() -> tuple[type[BaseException], ...]:
    """What a broken driver / compiler / device may raise while building or running kernels."""
    out: tuple[type[BaseException], ...] = (RuntimeError, ValueError, TypeError, MemoryError,
                                            OSError)
    try:  # only if the backend module already pulled pyopencl in (never import it here)
        import sys
        cl = sys.modules.get("pyopencl")
        if cl is not None:
            out += (cl.Error,)
    except Exception:  # pragma: no cover - defensive
        pass
    return out


def _weight_format(tensors: Mapping[str, Any], pred) -> dict | None:
    """The format of the first quantized tensor whose name satisfies ``pred`` (None: dense)."""
    for name, t in tensors.items():
        if pred(name) and isinstance(t, QuantizedTensor):
            pc = t.n_groups == 1
            return {"bits": t.bits, "group": -1 if pc else t.group_size,
                    "symmetric": t.zeros is None, "scale_dtype": np.asarray(t.scales).dtype,
                    "mins": t.mins is not None}
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
    if fmt.get("mins") and in_pad == n_in:  # a GGUF's w = q * s + m (unsigned codes)
        top = 16 if bits == 4 else 32
        if bits == 8:
            codes = rng.integers(0, top, (out, in_pad)).astype(np.int8)
            scales = (std / 9.2 * (0.5 + rng.random((out, ng)))).astype(fmt["scale_dtype"])
        mins = (-scales.astype(np.float32) * (top / 2) * (0.8 + 0.4 * rng.random((out, ng))))
        return QuantizedTensor(codes, scales, None, bits, g, n_in, method="selfcheck",
                               mins=mins.astype(fmt["scale_dtype"]))
    return QuantizedTensor(codes, scales, zeros, bits, g, n_in, method="selfcheck")


def tiny_config(cfg: ModelConfig) -> ModelConfig:
    """A small copy of ``cfg`` with the same switches (64 hidden, 2 layers, 96 vocab)."""
    hkv = min(cfg.num_key_value_heads, 2)
    hq = hkv * min(cfg.num_attention_heads // cfg.num_key_value_heads, 2)
    hd = min(cfg.head_dim, 32)
    kw = {"vocab_size": _TINY["vocab"], "hidden_size": _TINY["hidden"],
          "intermediate_size": _TINY["inter"], "num_hidden_layers": _TINY["layers"],
          "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": hd,
          "max_position_embeddings": _TINY["max_pos"]}
    if cfg.query_pre_attn_scalar:
        kw["query_pre_attn_scalar"] = hd
    if cfg.sliding_window:
        kw["sliding_window"] = min(cfg.sliding_window, 4)
    if cfg.layer_types:
        kinds = list(dict.fromkeys(cfg.layer_types))
        kw["layer_types"] = (kinds * 2)[:2]
    return dataclasses.replace(cfg, **kw)


def synthetic_tensors(cfg: ModelConfig, tensors: Mapping[str, Any] | None,
                      seed: int = 0) -> dict[str, Any]:
    """Random canonical tensors for the tiny ``cfg``, linears in ``tensors``' formats.

    Every tensor :func:`edgeinfer.models.arch.tensor_specs` asks for is present, so the
    real loader path (:class:`Transformer`) uploads them exactly as for a real model.
    """
    rng = np.random.default_rng(seed)
    tensors = tensors or {}
    lin = _weight_format(tensors, lambda n: "proj" in n)
    emb = _weight_format(tensors, lambda n: "embed_tokens" in n)
    head = _weight_format(tensors, lambda n: n.startswith("lm_head"))
    base = 0.0 if cfg.norm_unit_offset else 1.0
    out: dict[str, Any] = {}
    for spec in tensor_specs(cfg):
        shape = spec.shape(cfg)
        name = spec.name
        if name == "model.embed_tokens.weight":
            out[name] = _synth(rng, *shape, emb, 1.0)
        elif name == "lm_head.weight":
            out[name] = _synth(rng, *shape, head or emb, shape[1] ** -0.5)
        elif spec.linear:
            out[name] = _synth(rng, *shape, lin, shape[1] ** -0.5)
        elif name.endswith(".bias"):
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:  # norm weights
            out[name] = (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return out


def self_check(model_cfg: ModelConfig, tensors: Mapping[str, Any] | None = None,
               backend=None, *, steps: int = 4, prompt_len: int = 6, kv_dtype: str = "f32",
               tol: float | None = None, seed: int = 0) -> tuple[bool, float]:
    """Compare a tiny synthetic model on ``backend`` with the reference backend.

    Args:
        model_cfg: the real model's config: its switches and GQA ratio are copied into a
            tiny config (:func:`tiny_config`).
        tensors: the real model's tensors (name -> array / QuantizedTensor), only
            inspected for weight formats; ``None`` means dense float32.
        backend: the backend under test (default: a new ``OpenCLBackend`` on the default
            device).
        steps: decode steps after a ``prompt_len``-token prefill (same token ids on both
            backends: the reference's greedy choice).
        kv_dtype: cache storage to check ("f32", "f16", "int8", "int4").
        tol: bound on ``max|logits - ref| / max(max|ref|, 1)`` over every step
            (default 1e-4 for f32, 5e-3 for f16, 3e-2 for int8/int4 storage).
        seed: seeds the synthetic weights and the prompt.

    Returns:
        (ok, max_err). When not ok a ``RuntimeWarning`` names the device and the error;
        the caller should fall back to the CPU backend. A failure to build or run the
        kernels also returns ``(False, inf)`` with a warning instead of raising.
    """
    if tol is None:  # quantized caches: a 1e-7 difference can move a code by one step
        tol = {"f32": 1e-4, "f16": 5e-3}.get(kv_dtype, 3e-2)
    saved_caps = None
    caught = _failures()
    try:
        if backend is None:
            from .backends import get_backend
            backend = get_backend("opencl")
        caught = _failures()
        caps = getattr(backend, "caps", None)
        if getattr(caps, "split_kv_chunk", 0):
            # the tiny context never reaches the split-KV threshold: force tiny chunks so
            # decode steps run attention_split/combine (prefill still runs attention)
            saved_caps = caps
            backend.caps = dataclasses.replace(caps, split_kv_chunk=2)
        cfg = tiny_config(model_cfg)
        w = synthetic_tensors(cfg, tensors, seed)
        n = prompt_len + steps + 1
        ref = Transformer(cfg, w, ReferenceBackend(), max_positions=n)
        dev = Transformer(cfg, w, backend, max_positions=n)
        rc, dc = ref.new_cache(n, kv_dtype), dev.new_cache(n, kv_dtype)
        ids = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, prompt_len).astype(np.int32)
        worst = 0.0
        for _ in range(steps + 1):
            a, b = ref.forward(ids, rc), dev.forward(ids, dc)
            if not np.isfinite(b).all():
                worst = math.inf
                break
            worst = max(worst, float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1.0)))
            ids = np.array([int(np.argmax(a[-1]))], np.int32)
    except caught as e:  # a driver that cannot build or run the kernels: fall back
        warnings.warn(f"{getattr(backend, 'name', 'backend')} self-check could not run "
                      f"({type(e).__name__}: {e}); use the CPU backend", RuntimeWarning,
                      stacklevel=2)
        return False, math.inf
    finally:
        if saved_caps is not None:
            backend.caps = saved_caps
    ok = worst <= tol
    if not ok:
        name = getattr(backend, "device_info", {}).get("name", getattr(backend, "name", "?"))
        warnings.warn(f"self-check failed on {name!r}: max normalized logit error "
                      f"{worst:.3g} > {tol:.1g} against the reference backend; this device's "
                      "results are not trusted, use the CPU backend", RuntimeWarning, stacklevel=2)
    return ok, worst


def cpu_kernel_cache_cold() -> bool | None:
    """Whether the CPU backend's Numba kernels still have to be compiled (cheap: no compile).

    Numba keeps compiled kernels on disk (``__pycache__`` beside the sources, or
    ``$NUMBA_CACHE_DIR``); on a fresh install the first call compiles them, which takes
    30-90 s on 2 cores. This reads each ``@njit(cache=True)`` kernel's index file (a small
    pickle, checked against the source's time stamp exactly as Numba will) and reports
    cold when no kernel has cached machine code: a fresh install or an upgrade. Each
    model uses only some kernels (a dense float32 model: 6 of 28), so once any model ran,
    another kind of model may still compile its own few without this saying so (seconds
    to tens of seconds, once).

    Returns:
        True (cold: expect a long first call), False (warm), or None when it cannot be
        told (Numba internals changed, or the CPU backend cannot be imported).
    """
    try:
        import sys

        from numba.core.registry import CPUDispatcher

        import edgeinfer.backends.cpu  # noqa: F401  (imports its kernel modules)

        total = cached = 0
        mods = [m for n, m in list(sys.modules.items())
                if n.startswith("edgeinfer.backends.cpu.") and m is not None]
        for mod in mods:
            for obj in vars(mod).values():
                if not isinstance(obj, CPUDispatcher) or obj.__module__ != mod.__name__:
                    continue
                if obj.targetoptions.get("inline", "never") != "never":
                    continue  # compiled into its callers, never cached on its own
                cache_file = getattr(getattr(obj, "_cache", None), "_cache_file", None)
                if cache_file is None:
                    continue  # not cache=True
                total += 1
                cached += bool(cache_file._load_index())  # {} if missing or stale
        return None if total == 0 else cached == 0
    except Exception:  # noqa: BLE001  a heuristic: never let it break a start-up
        return None
