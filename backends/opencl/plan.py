"""The OpenCL backend's compiled decode step on CPU devices (``caps.fused``, e.g. PoCL).

Every launch costs tens of microseconds there, so a step fuses what it can into the row
kernels of ``fused.cl``; the launches and their arguments are fixed once per (model, KV
cache), on buffers the plan holds. Per layer of a plain block (6 launches):

1. ``gemv_rows``: the input RMSNorm in the prologue, then q, k, v (and biases) on one
   input (weights of one format share a launch, up to three);
2. ``rope_kv_write``: RoPE of q and k, k and v into the cache (f32 / f16); a quantized
   cache takes RoPE launches, the quantizing write and its attention (:mod:`.attention_q`);
3. the attention (split over the keys for a long context, where the device asks for it);
4. ``gemv_rows``: Wo with the residual added in the epilogue;
5. ``gemv_rows``: the pre-MLP norm, gate and up, GLU in the epilogue;
6. ``gemv_rows``: Wd with the residual.

QK-norm and sandwich norms (Gemma 3) add an RMSNorm launch each, and a branch with an
output norm adds its residual with the ``add`` kernel. The embedding and the final norm
+ head (one launch, then the logits read) end the step. The plan applies when every
linear takes the row kernels and the hidden size fits their local memory (``kmax``);
otherwise the model composes the single ops.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..base import DecodePlan
from .attention_q import attention_q
from .device import cl
from .memory import DeviceTensor, DeviceWeight

_I, _F = int, float


class Launch(NamedTuple):
    """One kernel launch whose arguments never change: ``kernel(queue, gsize, lsize, *args)``."""

    kernel: Any
    gsize: tuple
    lsize: tuple
    args: tuple


class LayerPlan(NamedTuple):
    """One decoder layer: the launches before the attention (q/k/v, QK-norm), what the
    attention needs, and the launches after it (output projection, MLP)."""

    layer: int
    before: tuple  # Launch: q/k/v (input norm fused), QK-norm
    q_src: DeviceTensor  # [1, Hq, hd] RoPE inputs (q/k/v outputs or their norms)
    k_src: DeviceTensor  # [1, Hkv, hd]
    v: DeviceTensor  # [1, Hkv, hd]
    q_rot: DeviceTensor  # [1, Hq, hd] rotated q
    k_rot: DeviceTensor  # [1, Hkv, hd] rotated k (quantized cache)
    a: DeviceTensor  # [1, Hq, hd] attention output
    cos: DeviceTensor
    sin: DeviceTensor
    scale: float
    window: int | None
    softcap: float | None
    after: tuple  # Launch: Wo (+ residual or out-norm, add), MLP, Wd (+ residual ...)


class _Buffers:
    """The plan's activation buffers by name, from the backend's pool (held while the
    plan lives; layers share them: each is consumed within its layer)."""

    def __init__(self, be):
        self.be, self.t = be, {}

    def get(self, name: str, shape: tuple, dtype=np.float32) -> DeviceTensor:
        t = self.t.get(name)
        if t is None or t.shape != shape:
            t = self.t[name] = self.be._new(shape, dtype)
        return t


def _groups(ws: tuple, compatible) -> list[list[int]]:
    """Members of one input grouped into shared launches: consecutive compatible weights,
    at most three per launch."""
    out = []
    for i, w in enumerate(ws):
        g = out[-1] if out else None
        if g is None or len(g) >= 3 or not compatible(ws[g[0]], w):
            out.append([i])
        else:
            g.append(i)
    return out


def _norm_launch(be, out: DeviceTensor, x: DeviceTensor, w, eps, off) -> Launch:
    n = x.shape[-1]
    rows = x.size // n
    lws = be.caps.lws
    return Launch(be._dc.kernel("dense.cl", "rmsnorm"), (rows * lws,), (lws,),
                  (out.buf, x.buf, w.buf, _I(n), _F(eps), _I(bool(off))))


def _add_launch(be, out: DeviceTensor, a: DeviceTensor, b: DeviceTensor) -> Launch:
    n = a.size
    return Launch(be._dc.kernel("dense.cl", "add"), be._gsize(n), be._ew,
                  (out.buf, a.buf, b.buf, _I(n)))


def _branch_out(be, bufs, x_in, w, out_norm, res, eps, off, out, tag) -> list[Launch]:
    """``out = res + out_norm(x_in @ W.T)``: the residual in the GEMV's epilogue, or with
    an output norm the GEMV, the norm and the ``add`` kernel."""
    if out_norm is None:
        return [Launch(*be.rows_launch(x_in, [(out.buf, w, None)], res=res))]
    y = bufs.get(tag, (1, w.out_features))
    yn = bufs.get(tag + "_n", (1, w.out_features))
    return [Launch(*be.rows_launch(x_in, [(y.buf, w, None)])),
            _norm_launch(be, yn, y, out_norm, eps, off), _add_launch(be, out, res, yn)]


def _layer_plan(be, blk, layer: int, bufs: _Buffers, x: DeviceTensor,
                x1: DeviceTensor) -> LayerPlan:
    hq, hkv, hd = blk.heads
    eps, off = blk.eps, blk.unit_offset
    norm = (blk.input_norm, eps, off)
    ws, bs = blk.qkv.weights, blk.qkv.biases
    outs = [bufs.get(n, (1, h, hd)) for n, h in (("q", hq), ("k", hkv), ("v", hkv))]
    before = [Launch(*be.rows_launch(x, [(outs[i].buf, ws[i], bs[i]) for i in g], norm=norm))
              for g in _groups(ws, be._compatible)]
    q_src, k_src, v = outs
    if blk.q_norm is not None:
        qn = bufs.get("qn", (1, hq, hd))
        before.append(_norm_launch(be, qn, q_src, blk.q_norm, eps, off))
        q_src = qn
    if blk.k_norm is not None:
        kn = bufs.get("kn", (1, hkv, hd))
        before.append(_norm_launch(be, kn, k_src, blk.k_norm, eps, off))
        k_src = kn
    a = bufs.get("a", (1, hq, hd))
    after = _branch_out(be, bufs, a.reshape((1, hq * hd)), blk.wo, blk.attn_out_norm, x, eps,
                        off, x1, "o")
    wg, wu = blk.gate_up.weights
    bg, bu = blk.gate_up.biases
    act = be.activation_code(blk.act)
    m = bufs.get("m", (1, wg.out_features))
    mnorm = (blk.mlp_norm, eps, off)
    if be._compatible(wg, wu) and wg.out_features == wu.out_features:
        after.append(Launch(*be.rows_launch(x1, [(m.buf, wg, bg), (None, wu, bu)], glu=act,
                                            norm=mnorm)))
    else:  # two launches (each normalizing its input), then the GLU kernel
        g, u = bufs.get("gate", m.shape), bufs.get("up", (1, wu.out_features))
        for grp in _groups((wg, wu), be._compatible):
            after.append(Launch(*be.rows_launch(
                x1, [((g, u)[i].buf, (wg, wu)[i], (bg, bu)[i]) for i in grp], norm=mnorm)))
        n = m.size
        after.append(Launch(be._dc.kernel("dense.cl", "glu"), be._gsize(n), be._ew,
                            (m.buf, g.buf, u.buf, _I(n), _I(act))))
    after += _branch_out(be, bufs, m, blk.w_down, blk.mlp_out_norm, x1, eps, off, x, "d")
    return LayerPlan(layer, tuple(before), q_src, k_src, v, bufs.get("qr", (1, hq, hd)),
                     bufs.get("kr", (1, hkv, hd)), a, blk.cos, blk.sin, blk.scale, blk.window,
                     blk.softcap, tuple(after))


def _takes(be, step) -> bool:
    """Whether every linear runs the row kernels and the hidden size fits them."""
    ws = [step.head]
    for b in step.blocks:
        ws += [*b.qkv.weights, b.wo, *b.gate_up.weights, b.w_down]
    return (isinstance(step.embed, DeviceWeight) and step.norm.size <= be.caps.kmax
            and all(isinstance(w, DeviceWeight) and be._row_ok(w) for w in ws))


def compile_decode(be, step, cache) -> OpenCLDecodePlan | None:
    """The plan of ``step`` (a DecodeStep) over ``cache`` on backend ``be``, or None."""
    if not _takes(be, step):
        return None
    d = step.norm.size
    bufs = _Buffers(be)
    x, x1 = bufs.get("x", (1, d)), bufs.get("x1", (1, d))
    layers = tuple(_layer_plan(be, blk, i, bufs, x, x1) for i, blk in enumerate(step.blocks))
    v = step.head.out_features
    logits = bufs.get("logits", (1, v))
    head = Launch(*be.rows_launch(x, [(logits.buf, step.head, None)],
                                  norm=(step.norm, step.eps, step.unit_offset)))
    return OpenCLDecodePlan(be, step, bufs, layers, head, logits)


def _attend(be, lp: LayerPlan, cache, start: int) -> None:
    """K/V append at ``start`` and the attention of one layer into ``lp.a``."""
    hq, hd = lp.q_rot.shape[1], lp.q_rot.shape[2]
    hkv = lp.v.shape[1]
    ring = cache.begin_write(lp.layer, start, 1, lp.window)  # slots S: position p -> p % S
    if cache.quantized:
        be._rope_into(lp.k_rot.buf, lp.k_src, lp.cos, lp.sin, start, None)
        be._rope_into(lp.q_rot.buf, lp.q_src, lp.cos, lp.sin, start, None)
        attention_q(be, lp.a, lp.q_rot, lp.k_rot, lp.v, cache, lp.layer, start, lp.scale,
                    lp.window, lp.softcap, ring)
        return
    off = cache.layer_offset(lp.layer)
    be._k("attention.cl", "rope_kv_write", KV_HALF=int(cache.dtype == "f16"))(
        be.queue, be._gsize((hq + 2 * hkv) * hd), be._ew, lp.q_rot.buf, cache.k, cache.v,
        lp.q_src.buf, lp.k_src.buf, lp.v.buf, lp.cos.buf, lp.sin.buf, _I(start), _I(hq),
        _I(hkv), _I(hd), _I(lp.cos.shape[1]), _I(off + start % ring * hkv * hd))
    be._attend(lp.a, lp.q_rot, cache, lp.layer, start, ring, lp.scale, lp.window, lp.softcap)


class OpenCLDecodePlan(DecodePlan):
    """A compiled decode step (module docstring); build with :func:`compile_decode`.

    Attributes:
        layers: one :class:`LayerPlan` per decoder block.
    """

    def __init__(self, be, step, bufs: _Buffers, layers: tuple, head: Launch,
                 logits: DeviceTensor):
        self.backend, self.layers, self.head, self.logits = be, layers, head, logits
        self.embed, self.embed_scale, self.softcap = step.embed, step.embed_scale, step.softcap
        self.x = bufs.get("x", (1, step.norm.size))
        self.ids = bufs.get("ids", (1,), np.int32)
        self.ids_host = np.zeros(1, np.int32)
        self._bufs = bufs
        self.static_launches = 1 + sum(len(lp.before) + len(lp.after) for lp in layers)

    def run(self, ids, positions, cache, out):
        """See :class:`~edgeinfer.backends.base.DecodePlan`.

        Raises:
            ValueError: a bad id; the position does not fit in the cache.
        """
        be = self.backend
        q = be.queue
        v = self.embed.shape[0]
        i = int(ids[0])
        if not 0 <= i < v:
            raise ValueError(f"token id out of range 0..{v - 1}: {i}..{i}")
        start = int(positions[0])
        cache.check_room(start, 1)
        self.ids_host[0] = i
        cl.enqueue_copy(q, self.ids.buf, self.ids_host, is_blocking=True)
        be._embed_into(self.x, self.ids, self.embed, self.embed_scale)
        for lp in self.layers:
            for k in lp.before:
                k.kernel(q, k.gsize, k.lsize, *k.args)
            _attend(be, lp, cache, start)
            for k in lp.after:
                k.kernel(q, k.gsize, k.lsize, *k.args)
        h = self.head
        h.kernel(q, h.gsize, h.lsize, *h.args)
        be.launches += self.static_launches
        y = self.logits
        host = out if (out is not None and out.shape == y.shape and out.dtype == np.float32
                       and out.flags.c_contiguous and not self.softcap) else np.empty(
                           y.shape, np.float32)
        cl.enqueue_copy(q, host, y.buf, is_blocking=True)
        if self.softcap:  # as Backend.logits
            host = np.tanh(host / self.softcap) * self.softcap
        if out is None or out is host:
            return host
        out[...] = host
        return out
