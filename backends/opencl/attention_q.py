"""Launch of ``attention_q.cl`` for :meth:`OpenCLBackend.attention` on a quantized cache.

int8 / int4 / k8v4 (:data:`.kvcache.KV_BITS`: the kernels' ``KBITS`` / ``VBITS``
variants): quantize the new keys and values on write (``kv_write_q``, the host cache's
codes), then attend over the codes (``attention_q``). A write at position 0 of a 4-bit-K
cache first fixes the layer's K channel statistics on the host (int4 only).
"""
from __future__ import annotations

from .kvcache import DeviceKVCache

_I, _F = int, float


def attention_q(be, out, q, k, v, cache: DeviceKVCache, layer: int, start_pos: int,
                scale: float, window, softcap, ring: int):
    """``be.attention()`` on a quantized cache whose write ``begin_write`` already
    validated (``ring`` = the layer's slots ``S``); fills and returns ``out`` [T, Hq, hd]."""
    t, hq, hd = q.shape
    hkv = cache.n_kv_heads
    kbits, vbits = cache.kv_bits
    b = cache.buffers
    rows0 = cache.layer_rows(layer)
    n_rows = t * hkv
    if kbits == 4 and start_pos == 0:  # a new sequence fixes int4's K channel statistics
        cache.fix_k_stats(layer, be.to_host(k))
    koff, kcs = cache.k_stat_buffers[layer]
    be._k("attention_q.cl", "kv_write_q", KBITS=kbits, VBITS=vbits)(
        be.queue, be._gsize(n_rows), be._ew, b["k_q"], b["k_scale"], b.get("k_min"),
        b["v_q"], b["v_scale"], b.get("v_min"), k.buf, v.buf, koff, kcs,
        _I(rows0), _I(start_pos), _I(ring), _I(n_rows), _I(hd), _I(cache.group_size),
        _I(hkv))
    lws = be.caps.lws
    be._k("attention_q.cl", "attention_q", KBITS=kbits, VBITS=vbits)(
        be.queue, (hq * lws, t), (lws, 1), out.buf, q.buf, b["k_q"], b["k_scale"],
        b.get("k_min"), b["v_q"], b["v_scale"], b.get("v_min"), koff, kcs, _I(rows0),
        _I(ring), _I(hq), _I(hkv), _I(hd), _I(cache.group_size), _I(start_pos),
        _I(window or 0), _F(scale), _F(softcap or 0.0))
    return out
