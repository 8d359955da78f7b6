"""The numpy reference backend: float32, obviously correct, the oracle.

Every fast backend is tested against these ops. Quantized weights are dequantized
once at upload (:meth:`QuantizedTensor.dequantize`), so the reference computes with
exactly the weights the format defines.
"""
from __future__ import annotations

import numpy as np

from ..base import Backend
from ..kvcache import HostKVCache
from ..quantized import QuantizedTensor


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


class ReferenceBackend(Backend):
    """numpy float32 implementation of the backend contract (see :mod:`..base`)."""

    name = "reference"

    def __init__(self, **_options):
        pass

    # ---- memory ----------------------------------------------------------------------
    def upload(self, a):
        return _f32(a)

    def upload_weight(self, w):
        return w.dequantize() if isinstance(w, QuantizedTensor) else _f32(w)

    def to_host(self, t):
        return np.asarray(t)

    def new_kv_cache(self, n_layers, n_kv_heads, head_dim, max_tokens, dtype="f32",
                     window_sizes=None, max_chunk=512):
        return HostKVCache(n_layers, n_kv_heads, head_dim, max_tokens, dtype,
                           window_sizes=window_sizes, max_chunk=max_chunk)

    # ---- ops -------------------------------------------------------------------------
    def embed(self, table, ids, scale=1.0):
        x = table[np.asarray(ids)]
        return x * np.float32(scale) if scale != 1.0 else x.copy()

    def rmsnorm(self, x, w, eps, unit_offset=False):
        x64 = x.astype(np.float32)
        ms = np.mean(x64 * x64, axis=-1, keepdims=True)
        y = x64 / np.sqrt(ms + np.float32(eps))
        return (y * ((1.0 + w) if unit_offset else w)).astype(np.float32)

    def linear(self, x, w, bias=None):
        if self.rows_alone and x.ndim == 2 and x.shape[0] > 1:  # a batched decode step
            y = np.concatenate([x[i:i + 1] @ w.T for i in range(x.shape[0])])
        else:
            y = x @ w.T
        return y + bias if bias is not None else y

    def rope(self, x, cos, sin, positions):
        r2 = cos.shape[1]
        c = cos[positions][:, None, :]  # [T, 1, r/2]
        s = sin[positions][:, None, :]
        out = x.copy()
        a, b = x[..., :r2], x[..., r2:2 * r2]
        out[..., :r2] = a * c - b * s
        out[..., r2:2 * r2] = b * c + a * s
        return out

    def attention(self, q, k, v, cache, layer, start_pos, scale, window=None, softcap=None):
        t, hq, hd = q.shape
        hkv = k.shape[1]
        cache.write(layer, start_pos, k, v)
        end = start_pos + t
        kk, vv = cache.read(layer, end)  # [S, Hkv, hd]
        g = hq // hkv
        qg = q.reshape(t, hkv, g, hd)
        scores = np.einsum("tkgd,skd->kgts", qg, kk) * np.float32(scale)  # [Hkv, g, T, S]
        if softcap:
            scores = np.tanh(scores / softcap) * softcap
        qpos = np.arange(start_pos, end)[:, None]
        kpos = np.arange(end)[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= kpos > qpos - window
        scores = np.where(visible, scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out = np.einsum("kgts,skd->tkgd", p, vv)
        return out.reshape(t, hq, hd).astype(np.float32)

    def glu(self, gate, up, act="silu"):
        if act == "silu":
            a = gate * (0.5 * (1.0 + np.tanh(0.5 * gate)))  # x*sigmoid(x), no exp overflow
        elif act == "gelu_tanh":
            a = 0.5 * gate * (1.0 + np.tanh(np.float32(0.7978845608028654) * (gate + 0.044715 * gate ** 3)))
        else:
            raise ValueError(f"unsupported activation {act!r}")
        return (a * up).astype(np.float32)

    def add(self, a, b):
        return a + b
