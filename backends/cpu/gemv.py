"""Decode GEMV (T = 1) on repacked 4-/5-/8-bit weights: 15-bit integer activations, integer dots.

Per call (one Numba dispatch, one parallel region):

1. quantize ``x`` per 32-column block to integers ``q`` in ``[-16256, 16256]``,
   ``dx[b] = max|x_b| / 16256``, stored as int16 in the row kernels' lane order
   (:func:`quantize_act`), and accumulate per group ``X[g] = sum_{b in g} dx[b] * sum(q_b)``;
2. for blocks of 4 rows in ``prange`` (serially for weights <= ``SERIAL_MAX_BYTES``):
   the SIMD row kernel of :mod:`._simd` computes
   ``sum_g sc[r, g] * sum_{b in g} dx[b] * (codes_r,b . q_b)``, each block's integer dot
   exact in int32 (``pmaddwd`` on int16 codes and activations), registers accumulating
   across all groups;
3. subtract the zero-point term ``sum_g sz[r, g] * X[g]`` and add the bias
   (:func:`_finish_rows`, strict float32; the term summed in 8 lanes by group mod 8 and
   one tree, :func:`._simd_ir.zero_term`, as the prefill kernels sum it).

Error vs. the float reference: the only approximation is the activation rounding, at
most half a step, ``max|x_b| / 32512`` per element: 128x finer than int8 activations
(llama.cpp's ``Q8_0``), whose KL cost on real text is ~0.003. The same steps run for
every row of a prefill (:mod:`.qgemm`), so decode and prefill agree bit for bit.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._blockdot import BLOCKDOT, BLOCKDOT_ROWS, BLOCKDOT_ROWS5
from ._simd_ir import (_I8, _I32, ACT_ORDER, _declare, zero_term)
from ._simd import (q4_rows1, q4_rows4, q5_rows1, q5_rows4, q8_rows1, q8_rows4)
from .repack import FIVE_BIT_ZERO, SYMMETRIC_ZERO_4BIT

if BLOCKDOT:  # AMX hosts: 4-, 5-, 8-bit weights in the block-dot numerics (._blockdot, ._amx)
    q4_rows4, q4_rows1 = BLOCKDOT_ROWS[4], BLOCKDOT_ROWS[1]
    q5_rows4, q5_rows1 = BLOCKDOT_ROWS5[4], BLOCKDOT_ROWS5[1]
    q8_rows4, q8_rows1 = BLOCKDOT_ROWS[4], BLOCKDOT_ROWS[1]

BLOCK = 32
#: Activation integer range per block: q in [-ACT_LEVELS, ACT_LEVELS] (15 bits).
ACT_LEVELS = 127 * 128
#: int16 entries of quantized activations per 32-column block.
XQ_PER_BLOCK = BLOCK
#: dtype of the quantized activations.
XQ_DTYPE = np.int16
#: Weights up to this many packed bytes run on one thread: a parallel region costs ~3 us
#: of fork/join on 2 quiet cores (one core streams ~30 KB meanwhile), far more under
#: load. 256 KiB keeps SmolLM2's 0.5 MB MLP weights and all of Qwen-0.5B's MLP parallel
#: (the runs behind it: benchmarks/MEASUREMENTS.md).
SERIAL_MAX_BYTES = 256 * 1024


@intrinsic
def _quant_block(typingctx, xq, dx, x, b):
    """One full 32-column block ``b`` of :func:`quantize_act` in vector IR: ``dx[b]`` and
    the block's ``xq`` (lane order :data:`._simd_ir.ACT_ORDER`) as its scalar loop computes
    them (the max of ``|x|`` is exact in any order; every other step is per element, in
    strict float32); returns ``sum(q)`` (int64). ``x`` needs ``32 b + 32`` columns."""
    sig = types.int64(xq, dx, x, b)

    def codegen(context, builder, signature, args):
        a_xq, a_dx, a_x = (context.make_array(signature.args[i])(context, builder, args[i])
                           for i in range(3))
        i64, f32 = ir.IntType(64), ir.FloatType()
        v32f, v32i, v32s = (ir.VectorType(f32, 32), ir.VectorType(_I32, 32),
                            ir.VectorType(ir.IntType(16), 32))
        mod = builder.module
        base = builder.mul(args[3], ir.Constant(i64, BLOCK))
        xs = cgutils.unpack_tuple(builder, a_x.strides, 1)[0]
        xp = builder.gep(builder.bitcast(a_x.data, _I8.as_pointer()), [builder.mul(base, xs)])
        v = builder.load(builder.bitcast(xp, v32f.as_pointer()), align=4)
        fabs = _declare(mod, "llvm.fabs.v32f32", v32f, [v32f])
        fmax = _declare(mod, "llvm.vector.reduce.fmax.v32f32", f32, [v32f])
        amax = builder.call(fmax, [builder.call(fabs, [v])])
        d = builder.fdiv(amax, ir.Constant(f32, float(ACT_LEVELS)))
        inv = builder.select(builder.fcmp_ordered(">", d, ir.Constant(f32, 0.0)),
                             builder.fdiv(ir.Constant(f32, 1.0), d), ir.Constant(f32, 0.0))
        inv_v = builder.shuffle_vector(
            builder.insert_element(ir.Constant(v32f, ir.Undefined), inv, ir.Constant(_I32, 0)),
            ir.Constant(v32f, ir.Undefined), ir.Constant(v32i, [0] * 32))
        rint = _declare(mod, "llvm.rint.v32f32", v32f, [v32f])
        q = builder.fptosi(builder.call(rint, [builder.fmul(v, inv_v)]), v32i)
        lim = ir.Constant(v32i, [ACT_LEVELS] * 32)
        nlim = ir.Constant(v32i, [-ACT_LEVELS] * 32)
        q = builder.select(builder.icmp_signed("<", q, nlim), nlim, q)
        q = builder.select(builder.icmp_signed(">", q, lim), lim, q)
        perm = builder.shuffle_vector(q, ir.Constant(v32i, ir.Undefined),
                                      ir.Constant(v32i, [int(j) for j in ACT_ORDER]))
        xqp = builder.gep(builder.bitcast(a_xq.data, ir.IntType(16).as_pointer()), [base])
        builder.store(builder.trunc(perm, v32s), builder.bitcast(xqp, v32s.as_pointer()), align=2)
        builder.store(d, builder.gep(a_dx.data, [args[3]]))
        radd = _declare(mod, "llvm.vector.reduce.add.v32i32", _I32, [v32i])
        return builder.sext(builder.call(radd, [q]), i64)

    return sig, codegen


@njit(cache=True, fastmath=False)
def quantize_act(xq, dx, xg, x, bmap):  # x[K] f32 -> xq[nb*32] i16, dx[nb] f32, xg[ng] f32
    """Quantize activations per 32-column block to integers of 15 bits and sum them per
    group.

    Block ``b``: ``dx[b] = max|x_b| / ACT_LEVELS``, ``q = rint(x / dx[b])`` in
    ``[-ACT_LEVELS, ACT_LEVELS]``, column ``j`` stored at ``xq[32 b + ACT_ORDER[j]]``
    (the row kernels' lane order); ``xg[g] = sum_{b in g} dx[b] * sum(q_b)``. ``x`` may be
    shorter than ``nb * 32``; the tail is zero. Strict float32: every caller quantizes a
    row alike (full blocks by :func:`_quant_block`, a partial last one by the loop).
    """
    k = x.shape[0]
    nb = dx.shape[0]
    xg[:] = 0.0
    lim = ACT_LEVELS
    for b in range(nb):
        base = b * BLOCK
        if base + BLOCK <= k and x.strides[0] == 4 and xq.strides[0] == 2 and dx.strides[0] == 4:
            s = _quant_block(xq, dx, x, b)
            xg[bmap[b]] += dx[b] * np.float32(s)
            continue
        amax = np.float32(0.0)
        for j in range(BLOCK):
            i = base + j
            if i < k:
                a = abs(x[i])
                amax = max(amax, a)
        d = amax / np.float32(ACT_LEVELS)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        s = 0
        for j in range(BLOCK):
            i = base + j
            q = 0
            if i < k:
                q = min(max(int(np.rint(x[i] * inv)), -lim), lim)
            xq[base + ACT_ORDER[j]] = q
            s += q
        dx[b] = d
        xg[bmap[b]] += d * np.float32(s)


@njit(parallel=True, cache=True)
def quantize_rows(xq, dx, xg, x, bmap, zmul):  # x[T, K] -> xq[T, nb*32], dx[T, nb], xg[T, ng]
    """:func:`quantize_act` of every row of ``x`` (across threads), the group sums times
    ``zmul`` (a weight's zero scale: a power of two, exact) when it is not 1."""
    for t in prange(x.shape[0]):
        quantize_act(xq[t], dx[t], xg[t], x[t], bmap)
        if zmul != 1.0:
            for g in range(xg.shape[1]):
                xg[t, g] *= zmul


@njit(cache=True, fastmath=True, inline="always")
def _q4_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg):  # row block i of W4 @ x
    nb = dx.shape[0]
    if i < nblk:
        r0, nr = i * 4, 4
        q4_rows4(y, r0, wp, sc, xq, dx, bmap, nb)
    else:
        r0, nr = nblk * 4 + (i - nblk), 1
        q4_rows1(y, r0, wp, sc, xq, dx, bmap, nb)
    _finish_rows(y, r0, nr, sz, xg, bias)


@njit(cache=True, fastmath=True, inline="always")
def _q5_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg):  # row block i of W5 @ x
    nb = dx.shape[0]
    if i < nblk:
        r0, nr = i * 4, 4
        q5_rows4(y, r0, wp, sc, xq, dx, bmap, nb)
    else:
        r0, nr = nblk * 4 + (i - nblk), 1
        q5_rows1(y, r0, wp, sc, xq, dx, bmap, nb)
    _finish_rows(y, r0, nr, sz, xg, bias)


@njit(cache=True, fastmath=True, inline="always")
def _q8_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg):  # row block i of W8 @ x
    nb = dx.shape[0]
    if i < nblk:
        r0, nr = i * 4, 4
        q8_rows4(y, r0, wp, sc, xq, dx, bmap, nb)
    else:
        r0, nr = nblk * 4 + (i - nblk), 1
        q8_rows1(y, r0, wp, sc, xq, dx, bmap, nb)
    _finish_rows(y, r0, nr, sz, xg, bias)


@njit(parallel=True, cache=True, fastmath=True)
def gemv_q4(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):  # W4[out, in] @ x[in] (+ b) -> y[out]
    """4-bit GEMV, row blocks of 4 split across threads; bias float32 [out] or [0]."""
    quantize_act(xq, dx, xg, x, bmap)
    out = y.shape[0]
    nblk = out // 4
    for i in prange(nblk + out - nblk * 4):
        _q4_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg)


@njit(cache=True, fastmath=True)
def gemv_q4_serial(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):  # W4[out, in] @ x[in] -> y[out]
    """As :func:`gemv_q4` on the calling thread (small weights: no fork/join)."""
    quantize_act(xq, dx, xg, x, bmap)
    out = y.shape[0]
    nblk = out // 4
    for i in range(nblk + out - nblk * 4):
        _q4_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg)


@njit(cache=True, fastmath=False)
def _times(xg, m):  # xg *= m, m a power of two (exact); nothing when m is 1
    if m != 1.0:
        for g in range(xg.shape[0]):
            xg[g] *= m


@njit(parallel=True, cache=True, fastmath=True)
def gemv_q4_sym(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):  # W4 @ x, sz = 8 sc implicitly
    """As :func:`gemv_q4` for a symmetric 4-bit weight whose ``sz`` is ``sc``
    (:attr:`.repack.CpuQuantWeight.zero_scale` 8): the group sums ``X`` are scaled by 8,
    which rounds as ``8 sc`` did."""
    quantize_act(xq, dx, xg, x, bmap)
    _times(xg, np.float32(SYMMETRIC_ZERO_4BIT))
    out = y.shape[0]
    nblk = out // 4
    for i in prange(nblk + out - nblk * 4):
        _q4_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg)


@njit(cache=True, fastmath=True)
def gemv_q4_sym_serial(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):
    """As :func:`gemv_q4_sym` on the calling thread."""
    quantize_act(xq, dx, xg, x, bmap)
    _times(xg, np.float32(SYMMETRIC_ZERO_4BIT))
    out = y.shape[0]
    nblk = out // 4
    for i in range(nblk + out - nblk * 4):
        _q4_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg)


@njit(parallel=True, cache=True, fastmath=True)
def gemv_q5(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):  # W5[out, in] @ x[in] (+ b) -> y[out]
    """5-bit GEMV (nibbles and fifth bits, :mod:`.repack`), row blocks across threads."""
    quantize_act(xq, dx, xg, x, bmap)
    out = y.shape[0]
    nblk = out // 4
    for i in prange(nblk + out - nblk * 4):
        _q5_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg)


@njit(cache=True, fastmath=True)
def gemv_q5_serial(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):  # W5[out, in] @ x[in] -> y[out]
    """As :func:`gemv_q5` on the calling thread."""
    quantize_act(xq, dx, xg, x, bmap)
    out = y.shape[0]
    nblk = out // 4
    for i in range(nblk + out - nblk * 4):
        _q5_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg)


@njit(parallel=True, cache=True, fastmath=True)
def gemv_q5_sym(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):  # W5 @ x, sz = 16 sc implicitly
    """As :func:`gemv_q5` for a symmetric 5-bit weight (``Q5_0``) whose ``sz`` is ``sc``
    (:attr:`.repack.CpuQuantWeight.zero_scale` 16): the group sums ``X`` are scaled by 16,
    which rounds as ``16 sc`` did."""
    quantize_act(xq, dx, xg, x, bmap)
    _times(xg, np.float32(FIVE_BIT_ZERO))
    out = y.shape[0]
    nblk = out // 4
    for i in prange(nblk + out - nblk * 4):
        _q5_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg)


@njit(cache=True, fastmath=True)
def gemv_q5_sym_serial(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):
    """As :func:`gemv_q5_sym` on the calling thread."""
    quantize_act(xq, dx, xg, x, bmap)
    _times(xg, np.float32(FIVE_BIT_ZERO))
    out = y.shape[0]
    nblk = out // 4
    for i in range(nblk + out - nblk * 4):
        _q5_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg)


@njit(parallel=True, cache=True, fastmath=True)
def gemv_q8(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):  # W8[out, in] @ x[in] (+ b) -> y[out]
    """8-bit GEMV (int8 codes widened to int16, integer dots), row blocks across threads."""
    quantize_act(xq, dx, xg, x, bmap)
    out = y.shape[0]
    nblk = out // 4
    for i in prange(nblk + out - nblk * 4):
        _q8_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg)


@njit(cache=True, fastmath=True)
def gemv_q8_serial(y, x, wp, sc, sz, bmap, bias, xq, dx, xg):  # W8[out, in] @ x[in] -> y[out]
    """As :func:`gemv_q8` on the calling thread."""
    quantize_act(xq, dx, xg, x, bmap)
    out = y.shape[0]
    nblk = out // 4
    for i in range(nblk + out - nblk * 4):
        _q8_block(i, nblk, y, wp, sc, sz, bmap, bias, xq, dx, xg)


@njit(cache=True, fastmath=False)  # strict order, not inlined: the same sums in every caller
def _finish_rows(y, r0, nr, sz, xg, bias):  # y[r] -= sz[r, :] . xg (+ bias[r])
    for r in range(r0, r0 + nr):
        v = y[r] - zero_term(sz, r, xg)
        if bias.shape[0] > 0:
            v += bias[r]
        y[r] = v


class ActScratch:
    """Per-backend scratch for activation quantization, keyed by (blocks, groups).

    Decode allocates nothing after the first step of each shape.
    """

    def __init__(self):
        self._bufs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def get(self, nb: int, ng: int):
        """(xq int16 [nb*32], dx float32 [nb], xg float32 [ng])."""
        key = (nb, ng)
        b = self._bufs.get(key)
        if b is None:
            b = (np.zeros(nb * XQ_PER_BLOCK, XQ_DTYPE), np.zeros(nb, np.float32),
                 np.zeros(ng, np.float32))
            self._bufs[key] = b
        return b


_NO_BIAS = np.zeros(0, np.float32)


def gemv_quant(y: np.ndarray, x: np.ndarray, w, bias: np.ndarray | None,
               scratch: ActScratch) -> np.ndarray:
    """y[out] = W[out, in] @ x[in] (+ bias) for a :class:`~.repack.CpuQuantWeight`.

    Args:
        y: float32 [out] output (written).
        x: float32 [in] contiguous.
        w: repacked 4-, 5- or 8-bit weight (lane-scaled ones run :mod:`.qlane`'s GEMV).
        bias: float32 [out] or None.
        scratch: activation buffers.
    """
    xq, dx, xg = scratch.get(w.n_blocks, w.n_groups)
    fn = w.__dict__.get("_gemv")
    if fn is None:  # chosen once per weight
        if w.lane_scales:  # a scale per 16 columns (Q6_K): .qlane (which imports this module)
            from .qlane import gemv_fn
            fn = gemv_fn(w)
        else:
            serial = w.nbytes <= SERIAL_MAX_BYTES
            plain = w.zero_scale == 1.0  # else sz is sc, the zero implicit (.repack)
            fn = {4: (gemv_q4, gemv_q4_serial) if plain else (gemv_q4_sym, gemv_q4_sym_serial),
                  5: (gemv_q5, gemv_q5_serial) if plain else (gemv_q5_sym, gemv_q5_sym_serial),
                  8: (gemv_q8, gemv_q8_serial)}[w.bits][serial]
        w._gemv = fn
    fn(y, x, w.wp, w.sc, w.sz, w.bmap, _NO_BIAS if bias is None else bias, xq, dx, xg)
    return y
