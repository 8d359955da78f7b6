"""The CPU backend's compiled decode step (:meth:`CpuBackend.compile_decode`).

A :class:`CpuDecodePlan` is built once per (model, KV cache): every argument a step
passes and every scratch array it writes is prepared there, so a step allocates nothing
and its Python is the calls below. Per layer, chosen once:

* a plain block with 4-bit weights of one format: the fused halves of :mod:`.fused`
  around the attention, one Numba call per layer (f32 / f16 cache, :func:`block_f`) or
  two (int8 / int4 / k8v4: the fused QKV call, numpy rotates K with the cache's own
  Hadamard product (``np.matmul(..., out=)``, the BLAS call of ``cache.write``, so the
  codes are bit-identical to the reference's), then :func:`block_q_post`);
* any other block (dense float32 or mixed weights, QK-norm, sandwich norms): the halves
  of :mod:`.stepwise` around the same attention kernels;
* f32 / f16 ring layers (no in-place kernel), and int4 at position 0 (the cache fixes its
  K statistics there): the backend's attention op between the halves.

The embedding row and the logits (final norm, head GEMV into the caller's buffer,
softcap in place) are stages of the plan too. The outer kernels are thin serial Numba
functions calling the compiled kernels (each keeps its own fast-math flags: the attention
must keep infinities); ``par`` flags pick the parallel or serial twin of a stage.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numba import njit

from ..base import DecodePlan
from ..blockrows import BlockRows
from ..kvcache import HostKVCache, Int4KVCache
from . import stepwise
from .attention import ATTN_SERIAL_MAX, decode_scratch_shape
from .attention import attention as _attention
from .attention import attention_serial as _attention_serial
from .blockrows import dequant_block_rows
from .elementwise import is_gelu, rmsnorm_rows
from .fused import out_mlp_par, out_mlp_ser, qkv_rope_par, qkv_rope_ser
from .gemv import SERIAL_MAX_BYTES, gemv_quant
from .kvquant import (
    attention_q,
    attention_q_serial,
    decode_scratch_q_shape,
    kv_write_q,
    layer_arrays,
)
from .qlane import row_dequant
from .repack import CpuQuantWeight

_NO_POS = np.zeros(0, np.int64)
_NO_BIAS = np.zeros(0, np.float32)
_F32 = np.dtype(np.float32)


# ---- outer kernels ----------------------------------------------------------------------
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
        qkv: (y [(Hq + 2 Hkv) hd] output, input-norm w [D], eps, unit_offset, h [D]
            scratch, (wp, sc, sz, bmap) of the fused 4-bit q/k/v weight, bias [rows] or
            [0], (xq, dx, xg) activation scratch, cos, sin, Hq, Hkv, hd, parallel) as
            :func:`.fused.qkv_rope_par` takes them.
        att: (kc, vc [S, Hkv, hd] float32 or uint16, item scratch, kpos int64 [0],
            scale, window (0 = none), softcap (0 = none)).
        mlp: (xo [1, D] output, a [1, Hq hd] attention output, pre-MLP norm w, eps,
            unit_offset, gelu, wo, wgu, wd (wp, sc, sz, bmap), act_a, act_h, act_m,
            (o, h, gu, m) scratch, bias0 [0], parallel) as :func:`.fused.out_mlp_par`.
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
        att: (:func:`.kvquant.layer_arrays`' ten arrays, group size, item scratch,
            scale, window, softcap) as :func:`.kvquant.kv_write_q` /
            :func:`.kvquant.attention_q` take them.
    """
    q, kr, v = qkr
    attend_q(q, kr, v, pos, par_attn, att, mlp[1])
    _mlp(x, mlp)


# ---- the plan's parts (kernel argument tuples as :func:`block_f` documents them) --------
class Fused(NamedTuple):
    """A fused half: :func:`.fused.qkv_rope_par` / ``_ser`` (``args`` as :func:`block_f`'s
    ``qkv``; ``out`` the q, k, v views of its output) or :func:`.fused.out_mlp_par` /
    ``_ser`` (``args`` as ``mlp``; ``out`` the [1, D] block output)."""

    fn: Any
    args: tuple
    out: Any


class KRotation(NamedTuple):
    """What ``cache.write`` does to this step's K ``k`` (a view of the q/k/v scratch)
    before quantizing, into ``kr``: int4's ``(k - m) / c`` (into ``kin``), then the
    Hadamard product of each group of G channels (``src_groups @ hmat`` into
    ``kr_groups``, both viewed [1, Hkv, hd / G, G])."""

    kr: np.ndarray
    kr_groups: np.ndarray
    hmat: np.ndarray
    int4: bool
    kin: Any
    src_groups: np.ndarray
    k_off: Any
    k_cs: Any
    k: np.ndarray


class KernelAttention(NamedTuple):
    """K/V append and attention of one (cache, layer) in a kernel: ``args`` as
    :func:`attend_f`'s (f32 / f16) or :func:`attend_q`'s (quantized) ``att``."""

    quantized: bool
    args: tuple
    serial_keys: int  # positions below this attend on one thread
    rot: KRotation | None  # quantized: the K transform
    int4: bool  # position 0 takes the attention op (the cache fixes K statistics)


class LayerPlan(NamedTuple):
    """One layer of a decode plan: its fused halves (None where they do not apply), the
    step-wise halves (None when both halves are fused) and its attention (None: the
    backend's attention op)."""

    blk: Any  # the DecoderBlock
    qkv: Fused | None
    mlp: Fused | None
    steps: stepwise.StepwiseBlock | None
    attn: KernelAttention | None
    max_tokens: int  # the cache's positions


class EmbedStage(NamedTuple):
    """``out[0] = table[id] * scale``: the row dequantized (4-/8-bit table, ``dequant`` the
    kernel; a BlockRows table, ``dequant`` None and ``row`` set) or copied (dense)."""

    table: Any
    out: np.ndarray  # [1, D]
    dequant: Any  # the table's row dequantizer (.qlane.row_dequant), or None (dense)
    row: np.ndarray  # int64 [1]: the id, for the dequant kernel
    scale: Any  # np.float32 (dequant) / float32 [1] array (dense) / None (1.0)
    vocab: int


class LogitsStage(NamedTuple):
    """``softcap(rmsnorm(x) @ head.T)`` into the caller's [1, V] buffer."""

    norm: np.ndarray
    eps: float
    unit_offset: bool
    head: Any  # CpuQuantWeight, or the dense table's transpose view [D, V]
    h: np.ndarray  # [1, D] scratch
    cap: Any  # float32 [1] softcap, or None
    act: Any  # the backend's ActScratch
    vocab: int


# ---- building -------------------------------------------------------------------------------
def weight_arrays(w: CpuQuantWeight) -> tuple:
    """``(wp, sc, sz, bmap, zero_scale)``: a 4-bit weight as :mod:`.fused`'s kernels take it."""
    return (w.wp, w.sc, w.sz, w.bmap, np.float32(w.zero_scale))


def _fused_weight(group, bits=4):
    """The group's fused weight if it has one of ``bits`` bits, else None."""
    w = getattr(group, "weight", None)
    return w if w is not None and w.bits == bits else None


def _fused_qkv(be, blk, y2) -> Fused | None:
    hq, hkv, hd = blk.heads
    w = _fused_weight(blk.qkv)
    if w is None or w.out_features != (hq + 2 * hkv) * hd:
        return None
    y = y2[0]
    fn = qkv_rope_ser if w.nbytes <= SERIAL_MAX_BYTES else qkv_rope_par
    bias = _NO_BIAS if blk.qkv.bias is None else blk.qkv.bias
    args = (y, blk.input_norm, float(blk.eps), bool(blk.unit_offset),
            be.scratch("h", (w.in_features,)), weight_arrays(w), bias,
            be.act_scratch.get(w.n_blocks, w.n_groups), blk.cos, blk.sin, hq, hkv, hd,
            fn is qkv_rope_par)
    return Fused(fn, args, (y[:hq * hd].reshape(1, hq, hd),
                            y[hq * hd:(hq + hkv) * hd].reshape(1, hkv, hd),
                            y[(hq + hkv) * hd:].reshape(1, hkv, hd)))


def _fused_mlp(be, blk) -> Fused | None:
    hq, _, hd = blk.heads
    wgu, wo, wd = _fused_weight(blk.gate_up), blk.wo, blk.w_down
    ff = blk.gate_up.weights[0].out_features if wgu is not None else 0
    if not (wgu is not None and all(w.__class__ is CpuQuantWeight and w.bits == 4
                                    for w in (wo, wd))
            and wo.out_features == wd.out_features == wgu.in_features
            and wd.in_features == ff and 2 * ff == wgu.out_features
            and wo.in_features == hq * hd):
        return None
    d = wo.out_features
    nob = (be.scratch("o", (d,)), be.scratch("h", (d,)), be.scratch("gu", (2 * ff,)),
           be.scratch("m", (ff,)))
    fn = out_mlp_ser if wgu.nbytes <= SERIAL_MAX_BYTES else out_mlp_par
    xo = be.scratch("xo", (1, d))
    args = (xo, be.scratch("attn", (1, hq * hd)), blk.mlp_norm, float(blk.eps),
            bool(blk.unit_offset), is_gelu(blk.act),
            weight_arrays(wo), weight_arrays(wgu), weight_arrays(wd),
            *(be.act_scratch.get(w.n_blocks, w.n_groups) for w in (wo, wgu, wd)), nob,
            _NO_BIAS, fn is out_mlp_par)
    return Fused(fn, args, xo)


def _kernel_attention(be, blk, cache: HostKVCache, layer: int,
                      k: np.ndarray) -> KernelAttention | None:
    """The in-place attention of (cache, layer), or None where it has none (f32 / f16
    rings, a K transform this plan does not know). ``k`` is the step's K view."""
    hq, hkv, hd = blk.heads
    raw = cache.raw(layer)
    ring = cache.positions(layer) is not None
    win, cap, scale = int(blk.window or 0), float(blk.softcap or 0.0), float(blk.scale)
    serial_keys = ATTN_SERIAL_MAX // (hq * hd)
    if "k_q" in raw and cache.rotation is not None:
        int4 = type(cache) is Int4KVCache
        if not int4 and type(cache).k_input is not HostKVCache.k_input:
            return None
        kq, ks, kmin, vq, vs, vmin, kpos, hmat, koff, kcs = layer_arrays(cache, layer)
        g = cache.group_size
        args = (kq, ks, kmin, vq, vs, vmin, kpos, hmat, koff, kcs, g,
                be.scratch("attn_items_q", decode_scratch_q_shape(cache, hq, hd)), scale, win,
                cap)
        kr = be.scratch("kr", (1, hkv, hd))
        kin = be.scratch("kin", (1, hkv, hd)) if int4 else None
        src = kin if int4 else k  # what the rotation reads: int4 (k - m) / c, else k
        rot = KRotation(kr, kr.reshape(1, hkv, hd // g, g), hmat, int4, kin,
                        src.reshape(1, hkv, hd // g, g), raw.get("k_off"), raw.get("k_cs"), k)
        if ring:  # the attention reads every slot of a ring
            serial_keys = -1 if cache.slots[layer] > serial_keys else 1 << 62
        return KernelAttention(True, args, serial_keys, rot, int4)
    kc, vc = raw.get("k"), raw.get("v")
    if ring or kc is None or kc.dtype not in (np.float32, np.float16):
        return None
    if kc.dtype == np.float16:  # the kernel converts (and saturates) bits itself
        kc, vc = kc.view(np.uint16), vc.view(np.uint16)
    scr = be.scratch("attn_items", decode_scratch_shape(cache, hq, hd))
    return KernelAttention(False, (kc, vc, scr, _NO_POS, scale, win, cap), serial_keys, None,
                           False)


def layer_plan(be, blk, cache: HostKVCache, layer: int) -> LayerPlan | None:
    """The plan of DecoderBlock ``blk`` as layer ``layer`` of ``cache``, or None when a
    weight is neither dense float32 nor repacked, or the cache's geometry differs."""
    hq, hkv, hd = blk.heads
    if cache.n_kv_heads != hkv or cache.head_dim != hd:
        return None
    y2 = be.scratch("qkv", (1, (hq + 2 * hkv) * hd))
    qkv = _fused_qkv(be, blk, y2) if blk.plain else None
    mlp = _fused_mlp(be, blk) if blk.plain else None
    steps = None
    if qkv is None or mlp is None:
        steps = stepwise.prepare(be, blk, y2)
        if steps is None:
            return None
    k = y2[:, hq * hd:(hq + hkv) * hd].reshape(1, hkv, hd)
    return LayerPlan(blk, qkv, mlp, steps, _kernel_attention(be, blk, cache, layer, k),
                     cache.max_tokens)


def _embed_stage(be, table, scale) -> EmbedStage | None:
    if table.__class__ is BlockRows:
        return EmbedStage(table, be.scratch("emb", (1, table.in_features)), None,
                          np.zeros(1, np.int64), np.float32(scale), table.out_features)
    if table.__class__ is CpuQuantWeight:
        return EmbedStage(table, be.scratch("emb", (1, table.in_features)),
                          row_dequant(table),
                          np.zeros(1, np.int64), np.float32(scale), table.out_features)
    if not isinstance(table, np.ndarray) or table.ndim != 2:
        return None
    s = None
    if scale != 1.0:  # as embed's x * float32(scale); a scalar operand would allocate
        s = np.full(1, scale, np.float32)
    return EmbedStage(table, be.scratch("emb", (1, table.shape[1])), None, None, s,
                      table.shape[0])


def _logits_stage(be, step) -> LogitsStage | None:
    head, d = step.head, step.norm.shape[0]
    if head.__class__ is CpuQuantWeight:
        if head.in_features != d:
            return None
        w, v = head, head.out_features
    elif isinstance(head, np.ndarray) and head.ndim == 2 and head.shape[1] == d:
        w, v = head.T, head.shape[0]
    else:
        return None
    cap = None if not step.softcap else np.full(1, step.softcap, np.float32)
    return LogitsStage(step.norm, step.eps, step.unit_offset, w, be.scratch("fnorm", (1, d)),
                       cap, be.act_scratch, v)


def compile_decode(be, step, cache) -> CpuDecodePlan | None:
    """The plan of ``step`` (a DecodeStep) over ``cache`` on CPU backend ``be``, or None
    (``exact_decode``, a cache or weights the plan does not take: the model composes)."""
    if be.exact_decode or not isinstance(cache, HostKVCache):
        return None
    embed = _embed_stage(be, step.embed, step.embed_scale)
    logits = _logits_stage(be, step)
    layers = tuple(layer_plan(be, blk, cache, i) for i, blk in enumerate(step.blocks))
    if embed is None or logits is None or None in layers:
        return None
    return CpuDecodePlan(be, embed, layers, logits)


# ---- running ----------------------------------------------------------------------------------
def _embed(e: EmbedStage, ids) -> np.ndarray:
    i = int(ids[0])
    out = e.out
    if e.row is not None and e.dequant is None:  # a BlockRows table
        if not 0 <= i < e.vocab:
            raise IndexError(f"token id out of range 0..{e.vocab - 1}")
        e.row[0] = i
        dequant_block_rows(out, e.table.raw, e.row, e.table.kind, e.scale)
        return out
    if e.dequant is not None:
        if not 0 <= i < e.vocab:
            raise IndexError(f"token id out of range 0..{e.vocab - 1}")
        e.row[0] = i
        t = e.table
        e.dequant(out, t.wp, t.sc, t.sz, t.bmap, e.row, e.scale)
        return out
    out[0] = e.table[i]  # a row view, copied (IndexError as numpy's for a bad id)
    if e.scale is not None:
        np.multiply(out, e.scale, out=out)
    return out


def _rotate_k(r: KRotation) -> np.ndarray:
    """The cache's ``_rotate(k_input(k))`` of this step's K into scratch (returned)."""
    if r.int4:  # cache.k_input's (k - m) / c, elementwise as there
        np.subtract(r.k, r.k_off, out=r.kin)
        np.divide(r.kin, r.k_cs, out=r.kin)
    np.matmul(r.src_groups, r.hmat, out=r.kr_groups)  # the cache's _rotate, into scratch
    return r.kr


def _qkv_call(f: Fused, x, start: int):
    """The fused first half called from Python (the quantized-cache and attention-op
    paths); returns its q, k, v views."""
    y, nw, eps, off, h, w, bias, act, cos, sin, nq, nk, hd, _ = f.args
    f.fn(y, x, nw, eps, off, h, w, bias, act, cos, sin, start, nq, nk, hd)
    return f.out


def run_layer(be, lp: LayerPlan, x, positions, start: int, cache, layer: int) -> np.ndarray:
    """One layer of a decode step: x float32 [1, D] -> the shared [1, D] output scratch
    (``x`` may be that scratch: in place), K/V appended at ``start`` (= ``positions[0]``).

    Raises:
        ValueError: the position does not fit in the cache.
    """
    if start >= lp.max_tokens or start < 0:
        cache.check_room(start, 1)  # raises
    at, f, m, p = lp.attn, lp.qkv, lp.mlp, lp.steps
    if at is not None and not (at.int4 and start == 0):
        par = start >= at.serial_keys
        if p is None:  # the fused halves
            if not at.quantized:
                block_f(x, start, par, f.args, at.args, m.args)
            else:
                q, _, v = _qkv_call(f, x, start)
                block_q_post(x, start, par, (q, _rotate_k(at.rot), v), at.args, m.args)
            return m.out
        q, k, v = stepwise.qkv(x, positions, p)
        if at.quantized:
            attend_q(q, _rotate_k(at.rot), v, start, par, at.args, p.a)
        else:
            attend_f(q, k, v, start, par, at.args, p.a)
        return stepwise.mlp(x, p)
    # the backend's attention op between the halves (each fused where it can be)
    blk = lp.blk
    q, k, v = stepwise.qkv(x, positions, p) if f is None else _qkv_call(f, x, start)
    a = be.attention(q, k, v, cache, layer, start, blk.scale, blk.window, blk.softcap)
    a = a.reshape(1, a.shape[1] * a.shape[2])
    if m is None:
        np.copyto(p.a, a)
        return stepwise.mlp(x, p)
    xo, _, nw, eps, off, gelu, wo, wgu, wd, act_a, act_h, act_m, nob, bias0, _ = m.args
    m.fn(xo, x, a, nw, eps, off, gelu, wo, wgu, wd, act_a, act_h, act_m, nob, bias0)
    return xo


def _logits(s: LogitsStage, x, out) -> np.ndarray:
    h = s.h
    rmsnorm_rows(h, x, s.norm, s.eps, s.unit_offset)
    if s.head.__class__ is CpuQuantWeight:
        y = np.empty((1, s.vocab), np.float32) if out is None else out
        gemv_quant(y[0], h[0], s.head, None, s.act)
    else:
        y = np.matmul(h, s.head, out=out)
    c = s.cap
    if c is not None:  # as Backend.logits: tanh(y / c) * c
        np.divide(y, c, out=y)
        np.tanh(y, out=y)
        np.multiply(y, c, out=y)
    return y


class CpuDecodePlan(DecodePlan):
    """A compiled decode step (module docstring); build with :func:`compile_decode`.

    Attributes:
        layers: one :class:`LayerPlan` per decoder block.
    """

    def __init__(self, be, embed: EmbedStage, layers: tuple, logits: LogitsStage):
        self.backend, self.embed, self.layers, self.logits = be, embed, layers, logits

    def run(self, ids, positions, cache, out):
        """See :meth:`DecodePlan.run`. ``out`` must be float32 C-contiguous [1, V] to be
        written directly; another buffer is filled by a copy.

        Raises:
            ValueError: the position does not fit in the cache. IndexError: a bad id.
        """
        start = int(positions[0])
        x = _embed(self.embed, ids)
        be = self.backend
        for i, lp in enumerate(self.layers):
            x = run_layer(be, lp, x, positions, start, cache, i)
        lg = self.logits
        if out is None or (out.shape == (1, lg.vocab) and out.dtype is _F32
                           and out.flags.c_contiguous):
            y = _logits(lg, x, out)
        else:
            out[...] = _logits(lg, x, None)
            y = out
        rel = be.releaser
        if rel.due:  # the first forwards give memory back (see CpuBackend.logits)
            rel.after_forward()
        return y
