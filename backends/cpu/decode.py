"""Decode (T = 1) of a whole plain pre-norm block in one or two Numba calls, allocation-free;
also the decode ends of a step (:func:`embed_step`, :func:`norm_logits`).

:meth:`CpuBackend.decoder_block` lands here. Per layer and step:

* f32 / f16 cache (linear): one call of :func:`block_f`: the fused ``rmsnorm + QKV GEMV +
  RoPE`` of :mod:`.fused`, the K/V append and GQA attention of :mod:`.attention`, then
  the fused ``Wo + residual + rmsnorm + gate/up + GLU + down + residual``.
* int8 / int4 / k8v4 cache (linear or ring): the fused QKV call, then numpy rotates K
  into scratch with the cache's own Hadamard product (``np.matmul(..., out=)``: the very
  BLAS call of ``cache.write``, so the codes stay bit-identical to the reference's; a
  Numba dot rounds differently), then one call of :func:`block_q_post`: the bit-exact
  KV write and the attention over the codes of :mod:`.kvquant`, then the MLP half.

Dense float32 weights take the same cache stages (:func:`attend_f` / :func:`attend_q`,
the K rotation) between the two halves of :mod:`.stepwise` (one op at a time on scratch:
BLAS GEMVs for dense linears), and so do blocks with QK-norm / sandwich norms (Gemma 3),
4-bit or dense.

Everything a step touches is preallocated: the per-layer QKV output (q/k/v views), the
rotated K and attention output (per backend), the attention work-item scratch (per
cache), the activation-quantization buffers (per backend). Python per call: identity
checks, two dict lookups, the calls. What neither path takes falls back to the contract's
composition (prefill, ``exact_decode``, weights that are neither 4-bit/8-bit repacked nor
dense float32, f32/f16 ring layers, int4 at position 0 (its K channel statistics are
fixed there by the cache), other caches).

The outer kernels are thin serial Numba functions calling the compiled kernels (each keeps
its own fast-math flags: the attention must keep infinities, the encoders no fast-math);
``par_*`` flags pick the parallel or serial twin of each stage.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..kvcache import HostKVCache, Int4KVCache
from . import stepwise as _stepwise
from .attention import attention as _attention
from .attention import attention_serial as _attention_serial
from .attention import decode_scratch
from .elementwise import dequant_rows_q4, dequant_rows_q8, rmsnorm_rows
from .fused import out_mlp_par, out_mlp_ser, qkv_rope_par, qkv_rope_ser
from .gemv import gemv_quant
from .kvquant import attention_q, attention_q_serial, decode_scratch_q, kv_write_q
from .repack import CpuQuantWeight

_NO_POS = np.zeros(0, np.int64)
_F32 = np.dtype(np.float32)


@njit(cache=True, inline="always")
def _qkv(x, pos, qkv):  # fused rmsnorm + QKV GEMV + RoPE into qkv's y; returns q, k, v views
    y, nw, eps, off, h, w, bias, act, cos, sin, nq, nk, hd, par = qkv
    if par:
        qkv_rope_par(y, x, nw, eps, off, h, w, bias, act, cos, sin, pos, nq, nk, hd)
    else:
        qkv_rope_ser(y, x, nw, eps, off, h, w, bias, act, cos, sin, pos, nq, nk, hd)
    q = y[:nq * hd].reshape((1, nq, hd))
    k = y[nq * hd:(nq + nk) * hd].reshape((1, nk, hd))
    v = y[(nq + nk) * hd:].reshape((1, nk, hd))
    return q, k, v


@njit(cache=True, inline="always")
def _mlp(x, mlp):  # xo = x + Wo a; xo += Wd act(Wg h, Wu h), h = rmsnorm(xo)
    xo, a, nw, eps, off, gelu, wo, wgu, wd, act_a, act_h, act_m, nob, bias0, par = mlp
    if par:
        out_mlp_par(xo, x, a, nw, eps, off, gelu, wo, wgu, wd, act_a, act_h, act_m, nob, bias0)
    else:
        out_mlp_ser(xo, x, a, nw, eps, off, gelu, wo, wgu, wd, act_a, act_h, act_m, nob, bias0)


@njit(cache=True)
def attend_f(q, k, v, pos, par_attn, att, a):
    """Append k, v at ``pos`` of an f32 / f16 cache and attend: ``a`` [1, Hq hd] float32
    (written). q [1, Hq, hd], k, v [1, Hkv, hd] float32; ``att`` as :func:`block_f`."""
    kc, vc, scr, nopos, scale, win, cap = att
    out = a.reshape((1, q.shape[1], q.shape[2]))
    if par_attn:
        _attention(out, q, k, v, kc, vc, nopos, True, pos, scale, win, cap, scr)
    else:
        _attention_serial(out, q, k, v, kc, vc, nopos, True, pos, scale, win, cap, scr)


@njit(cache=True)
def attend_q(q, kr, v, pos, par_attn, att, a):
    """The bit-exact KV write at ``pos`` of an int8 / int4 / k8v4 cache and the attention
    over its codes into ``a`` [1, Hq hd]; ``kr`` is the rotated K, ``att`` as
    :func:`block_q_post`."""
    kq, ks, kmin, vq, vs, vmin, kpos, hmat, koff, kcs, g, scr, scale, win, cap = att
    kv_write_q(kr, v, kq, ks, kmin, vq, vs, vmin, kpos, pos, g)
    out = a.reshape((1, q.shape[1], q.shape[2]))
    if par_attn:
        attention_q(out, q, hmat, kq, ks, kmin, vq, vs, vmin, koff, kcs, kpos, pos, scale, win,
                    cap, scr)
    else:
        attention_q_serial(out, q, hmat, kq, ks, kmin, vq, vs, vmin, koff, kcs, kpos, pos,
                           scale, win, cap, scr)


@njit(cache=True)
def block_f(x, pos, par_attn, qkv, att, mlp):
    """One decode step of a plain pre-norm block over an f32 / f16 (uint16 bits) cache.

    Args:
        x: float32 [1, D] residual stream (may be ``mlp``'s output buffer: in place).
        pos: the token's position (its cache row).
        par_attn: run the attention items across threads (long contexts).
        qkv: (y [(Hq + 2 Hkv) hd], input-norm w [D], eps, unit_offset, h [D], (wp, sc, sz,
            bmap) of the fused 4-bit QKV weight, bias [rows] or [0], (xq, dx, xg), cos, sin,
            Hq, Hkv, hd, parallel) as :func:`.fused.qkv_rope_par` takes them.
        att: (kc, vc [S, Hkv, hd] float32 or uint16, scratch (:func:`.attention.
            decode_scratch`), kpos int64 [0], scale, window (0 = none), softcap (0 = none)).
        mlp: (xo [1, D] output, a [1, Hq hd] attention output scratch, post-norm w, eps,
            unit_offset, gelu, wo, wgu, wd, act_a, act_h, act_m, (o, h, gu, m), bias0 [0],
            parallel) as :func:`.fused.out_mlp_par` takes them.
    """
    q, k, v = _qkv(x, pos, qkv)
    attend_f(q, k, v, pos, par_attn, att, mlp[1])
    _mlp(x, mlp)


@njit(cache=True)
def block_q_post(x, pos, par_attn, qkr, att, mlp):
    """The rest of a decode step over an int8 / int4 / k8v4 cache, after the QKV call and
    the K rotation: bit-exact KV write, attention over the codes, the MLP half.

    Args:
        x, pos, par_attn, mlp: as :func:`block_f`.
        qkr: (q [1, Hq, hd], rotated K (int4: also shifted/scaled) [1, Hkv, hd], v
            [1, Hkv, hd]) float32.
        att: (kq, ks, kmin, vq, vs, vmin, kpos (ring positions or [0]), hmat, koff, kcs,
            group size, scratch (:func:`.kvquant.decode_scratch_q`), scale, window,
            softcap) as :func:`.kvquant.kv_write_q` / :func:`.kvquant.attention_q` take them.
    """
    q, kr, v = qkr
    attend_q(q, kr, v, pos, par_attn, att, mlp[1])
    _mlp(x, mlp)


# ---- Python side: prepared arguments, identity checks, the calls -----------------------
def _prep_weights(be, blk, x):
    """(qkv tuple, mlp tuple, D, prepared QKV call, K view [1, Hkv, hd] of its output) for
    ``blk`` on backend ``be``, or False when its weights are not all 4-bit of one format
    (then :func:`.stepwise.prep` is tried)."""
    hq, hkv, hd = blk.heads
    e = be._dec.get(("qkv", id(blk.qkv[0])))
    if e is None:
        e = be._dec[("qkv", id(blk.qkv[0]))] = be._prep_qkv(x, blk.input_norm, blk.qkv,
                                                            blk.qkv_bias, blk.heads)
    m = be._dec.get(("mlp", id(blk.wo)))
    if m is None:
        m = be._dec[("mlp", id(blk.wo))] = be._prep_mlp(blk.wo, blk.w_gate, blk.w_up,
                                                        blk.w_down)
    if e is False or m is False or e[12][1] is not blk.qkv[1] or e[12][2] is not blk.qkv[2]:
        return False
    if m[7] is not blk.w_gate or m[8] is not blk.w_down or m[12] is not blk.w_up:
        return False
    if m[10] != hq * hd or e[10] != tuple(blk.heads):
        return False
    from . import _is_gelu
    qkv = (e[1], blk.input_norm, float(blk.eps), bool(blk.unit_offset), e[2], e[3], e[4],
           e[5], blk.cos, blk.sin, hq, hkv, hd, e[0] is qkv_rope_par)
    a = be._scratch("attn", (1, hq * hd))
    mlp = (m[1], a, blk.post_norm, float(blk.eps), bool(blk.unit_offset),
           _is_gelu(blk.act), m[2], m[3], m[4], m[5][0], m[5][1], m[5][2], m[6],
           np.zeros(0, np.float32), m[0] is out_mlp_par)
    return qkv, mlp, m[9], e, e[7]


def _prep_cache(be, blk, cache, layer, k):
    """Per (cache, layer): (kind, att tuple, keys up to which attention runs serially,
    extra) or False (composition). kind "f": f32/f16 linear; "q": int8/int4/k8v4.
    ``k`` is the layer's K [1, Hkv, hd] (scratch the QKV stage writes): "q" reads it."""
    from . import _ATTN_SERIAL_MAX
    hq, hkv, hd = blk.heads
    if not isinstance(cache, HostKVCache) or cache.n_kv_heads != hkv or cache.head_dim != hd:
        return False
    raw = cache.raw(layer)
    ring = cache.positions(layer) is not None
    win, cap = int(blk.window or 0), float(blk.softcap or 0.0)
    serial_keys = _ATTN_SERIAL_MAX // (hq * hd)
    scale = float(blk.scale)
    if "k_q" in raw and cache.rotate_k:
        def bits(name):
            arr = raw.get(name)
            return None if arr is None else arr.view(np.uint16)
        shp = (hkv, hd)  # int4's K channel m, c (8-bit K: 0, 1)
        pos = cache.positions(layer) if ring else _NO_POS
        hmat = np.ascontiguousarray(cache._h, np.float32)
        att = (raw["k_q"], bits("k_scale"), bits("k_min"), raw["v_q"], bits("v_scale"),
               bits("v_min"), pos, hmat, raw.get("k_off", np.zeros(shp, np.float32)),
               raw.get("k_cs", np.ones(shp, np.float32)), cache.group_size,
               decode_scratch_q(cache, hq, hd), scale, win, cap)
        g = cache.group_size
        kr = be._scratch("kr", (1, hkv, hd))
        int4 = type(cache) is Int4KVCache
        if not int4 and type(cache).k_input is not HostKVCache.k_input:
            return False  # a K transform this path does not know: the composition
        kin = be._scratch("kin", (1, hkv, hd)) if int4 else None
        if ring:  # the attention reads every slot of a ring
            serial_keys = -1 if cache.slots[layer] > serial_keys else 1 << 62
        src = kin if int4 else k  # what the rotation reads: int4 (k - m) / c, else k
        extra = (kr, kr.reshape(1, hkv, hd // g, g), hmat, int4, kin,
                 src.reshape(1, hkv, hd // g, g), raw.get("k_off"), raw.get("k_cs"), k)
        return "q", att, serial_keys, extra
    kc, vc = raw.get("k"), raw.get("v")
    if ring or kc is None or kc.dtype not in (np.float32, np.float16):
        return False
    if kc.dtype == np.float16:  # the kernel converts (and saturates) bits itself
        kc, vc = kc.view(np.uint16), vc.view(np.uint16)
    att = (kc, vc, decode_scratch(cache, hq, hd), _NO_POS, scale, win, cap)
    return "f", att, serial_keys, None


def _rotate_k(extra):
    """The cache's ``_rotate(k_input(k))`` of this step's K into scratch (returned)."""
    kr, kr4, hmat, int4, kin, src4, koff, kcs, k = extra
    if int4:  # cache.k_input's (k - m) / c, elementwise as there
        np.subtract(k, koff, out=kin)
        np.divide(kin, kcs, out=kin)
    np.matmul(src4, hmat, out=kr4)  # the cache's _rotate, into scratch
    return kr


def decoder_block(be, x, blk, positions, cache, layer):
    """:meth:`CpuBackend.decoder_block`: the fused decode path (a plain block, 4-bit
    weights of one format) or the step-wise one (dense or mixed weights, optional norms:
    :mod:`.stepwise`), or None when neither applies (the caller then runs the contract's
    composition).

    Raises:
        ValueError: the position does not fit in the cache.
    """
    p = blk.__dict__.get("_cpu_prep")
    if p is None or p[0] is not be:
        p = (be, ((blk.plain and _prep_weights(be, blk, x)) or _stepwise.prep(be, blk))
             if positions.shape[0] == 1 else None)
        if p[1] is not None:
            blk._cpu_prep = p
    w = p[1]
    if (w is None or w is False or positions.shape[0] != 1 or be.exact_decode
            or x.__class__ is not np.ndarray or x.dtype is not _F32 or x.shape != (1, w[2])):
        return None
    cd = cache.__dict__.get("_cpu_dec")
    if cd is None:
        cd = cache._cpu_dec = {}
    c = cd.get(layer)
    if c is None or c[0] is not blk:
        c = cd[layer] = (blk, _prep_cache(be, blk, cache, layer, w[4]))
    c = c[1]
    if c is False:
        return None
    start = int(positions[0])
    if start >= cache.max_tokens or start < 0:
        cache.check_room(start, 1)  # raises
    kind, att, serial_keys, extra = c
    if kind == "q" and extra[3] and start == 0:  # the cache fixes int4's K channel
        return None  # statistics at position 0
    par = start >= serial_keys
    if w[0] is None:  # dense float32 weights or optional norms: kernels on scratch
        dp = w[1]
        q, k, v = _stepwise.qkv(x, positions, dp)
        if kind == "f":
            attend_f(q, k, v, start, par, att, dp.a)
        else:
            attend_q(q, _rotate_k(extra), v, start, par, att, dp.a)
        return _stepwise.mlp(x, dp)
    qkv, mlp, _, e, _ = w
    if kind == "f":
        block_f(x, start, par, qkv, att, mlp)
        return mlp[0]
    # e: the prepared fused QKV call (CpuBackend._prep_qkv)
    e[0](e[1], x, qkv[1], qkv[2], qkv[3], e[2], e[3], e[4], e[5], qkv[8], qkv[9], start,
         qkv[10], qkv[11], qkv[12])
    block_q_post(x, start, par, (e[6], _rotate_k(extra), e[8]), att, mlp)
    return mlp[0]


def embed_step(be, table, ids, scale):
    """:meth:`CpuBackend.embed_step` for one id: the row (dequantized for a 4-/8-bit
    table) times ``scale`` into the backend's [1, D] scratch; None for other inputs.

    Raises:
        IndexError: the id is outside the table.
    """
    if ids.shape[0] != 1 or ids.ndim != 1:
        return None
    i = int(ids[0])
    if table.__class__ is CpuQuantWeight:
        if not 0 <= i < table.out_features:
            raise IndexError(f"token id out of range 0..{table.out_features - 1}")
        out = be._scratch("emb", (1, table.in_features))
        be._ids1[0] = i
        fn = dequant_rows_q4 if table.bits == 4 else dequant_rows_q8
        fn(out, table.wp, table.sc, table.sz, table.bmap, be._ids1, np.float32(scale))
        return out
    if not isinstance(table, np.ndarray) or table.ndim != 2:
        return None
    out = be._scratch("emb", (1, table.shape[1]))
    out[0] = table[i]  # a row view, copied (IndexError as numpy's for a bad id)
    if scale != 1.0:  # as embed's x * float32(scale); a scalar operand would allocate
        s = be._scratch("emb_scale", (1,))
        s[0] = scale
        np.multiply(out, s, out=out)
    return out


def norm_logits(be, x, norm_w, eps, unit_offset, head, softcap, out):
    """:meth:`CpuBackend.norm_logits` for a [1, D] float32 ``x`` and a 4-/8-bit or dense
    head: the norm into scratch, the head GEMV straight into ``out`` (float32 C [1, V];
    a new array when None), softcap in place; None for other inputs."""
    v = head.shape[0]
    if (x.__class__ is not np.ndarray or x.ndim != 2 or x.shape[0] != 1
            or x.dtype is not _F32 or be.exact_decode
            or (out is not None and (out.shape != (1, v) or out.dtype is not _F32
                                     or not out.flags.c_contiguous))):
        return None
    h = be._scratch("fnorm", x.shape)
    if head.__class__ is CpuQuantWeight:
        if head.in_features != x.shape[1]:
            return None
        rmsnorm_rows(h, x, norm_w, eps, unit_offset)
        y = np.empty((1, v), np.float32) if out is None else out
        gemv_quant(y[0], h[0], head, None, be._act)
    elif isinstance(head, np.ndarray) and head.ndim == 2 and head.shape[1] == x.shape[1]:
        rmsnorm_rows(h, x, norm_w, eps, unit_offset)
        y = np.matmul(h, head.T, out=out)
    else:
        return None
    if softcap:  # as Backend.logits: tanh(y / c) * c, c as a float32 array (a scalar
        c = be._scratch("softcap", (1,))  # operand would allocate a 0-d array)
        c[0] = softcap
        np.divide(y, c, out=y)
        np.tanh(y, out=y)
        np.multiply(y, c, out=y)
    return y
