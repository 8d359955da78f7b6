"""SIMD integer-dot row kernels emitted as LLVM IR (llvmlite) and called from Numba.

Why IR and not plain Numba loops: a Numba loop over nibbles widens ``uint8 & 15`` to
int64, reduces horizontally once per group and converts per element. Here one 32-byte
load yields 64 4-bit codes; activations are 15-bit integers ``q`` in
``[-ACT_LEVELS, ACT_LEVELS]`` stored as int16 per 32-column block in the
:data:`._simd_ir.ACT_ORDER` lane order (:func:`.gemv.quantize_act`); the codes are widened to int16
by in-lane byte unpacks (``vpunpcklbw`` / ``vpunpckhbw``, whose lane order
:data:`._simd_ir.ACT_ORDER` matches) and ``pmaddwd`` (s16 x s16 -> pairwise s32) twice plus one add
form 8 partial exact integer dot products per block (``|code * q| <= 128 * 16256``, 32
terms: far inside int32); one float FMA per block applies the activation scale
``dx_b`` to a per-group accumulator, and one FMA per group applies the weight scale (so
a g128 row costs one scale load per 4 blocks, not per block). The 8-float accumulators
of R rows stay in registers across the whole row; the horizontal sum happens once per
row. The 4-bit loop walks one 64-column chunk (two blocks) at a time, row by row, so a
row's widened codes are dead before the next row's load. Each load also prefetches the
same offset of the next R-row block (``llvm.prefetch``): a decode GEMV's rows are
short streams (a few hundred bytes each, R interleaved), which the hardware prefetchers
pick up late; the next block is what this thread reads next.

Layouts consumed (built by :mod:`.repack`):

* 4-bit: ``wp`` uint8 ``[rows, nb * 16]``; 32-byte chunk ``c`` holds block ``2c`` in the
  low nibbles and block ``2c + 1`` in the high nibbles, each in natural column order.
* 5-bit: ``wp`` uint8 ``[rows, nb * 20]``; 40-byte chunk ``c``: the 4-bit chunk's 32
  bytes (bits 0-3 of the codes), then one u32 per block (bit ``j``: bit 4 of column
  ``j``), OR-ed into the nibble bytes before widening (llama.cpp ``Q5_0`` / ``Q5_1``
  codes 0..31; :func:`._simd_ir.chunk_codes`).
* 8-bit: ``wp`` int8 ``[rows, nb * 32]``, the codes as stored, sign-extended to int16.

Activations: ``xq`` int16 ``[nb * 32]`` (block ``b`` at ``32 b``, column ``j`` at lane
``ACT_ORDER[j]``) and ``dx`` float32 ``[nb]`` (per-block scale).
Scales: ``sc`` float32 ``[rows, ng]``, uint16 ``[rows, ng]`` (fp16 bits, widened exactly),
or (``ng == nb``) uint8 factored: int8 ``q`` per
block, then from byte ``A = (nb + 3) & ~3`` a float32 ``d`` per 8 blocks, the scale
``float32(q) * d`` (exact, :func:`.repack.factor_group_terms`; the kernels are built for
either from the array's dtype, :func:`._simd_ir.group_scale`); ``bmap`` int32 ``[nb]`` maps block
-> group.

The kernels compute, for each of R rows starting at ``r0``:
``y[r] = sum_g sc[r, g] * sum_{b: bmap[b] = g} dx[b] * sum_{k in b} code[r, k] * q[k]``
(no zero-point term; the caller subtracts it; ``bmap`` must be non-decreasing). Only emitted when the host has AVX2 (:data:`._simd_ir.HAVE_AVX2`);
otherwise :mod:`.gemv` uses a portable Numba loop with the same result.

The IR building blocks (types, lane order, widening, scales, the zero-point term) are in
:mod:`._simd_ir`, shared with the other kernel modules.

Caching: a caller's on-disk Numba cache entry (e.g. ``gemv_q4``'s) holds this IR's
machine code; :mod:`._numba_cache` keys every kernel's entry on all files of this
directory, so an edit here recompiles the callers.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._simd_ir import (CHUNK_BYTES, HAVE_AVX2, PREFETCH_BLOCKS, _I16, _I32, _I8, _V16I16,
                       _V32I8, _V8F32, _V8I32, _declare, _gep, _hsum8, _splat_f32, chunk_codes,
                       group_scale, group_value, widen_signed)


def _make_rows_kernel(n_rows: int, bits: int):
    """Build an intrinsic ``k(y, r0, wp, sc, xq, dx, bmap, nb)`` for ``n_rows`` rows.

    ``y`` float32 [rows] (written at r0..r0+n_rows-1), ``r0`` int64 first row, ``wp``
    uint8 2-D packed weights (``bits`` 4, 5 or 8), ``sc`` float32 2-D scales, ``xq`` int16
    [nb*32], ``dx`` float32 [nb], ``bmap`` int32 [nb], ``nb`` int64 blocks per row (even for
    4 and 5 bits).
    """

    @intrinsic
    def kernel(typingctx, y, r0, wp, sc, xq, dx, bmap, nb):
        sig = types.void(y, r0, wp, sc, xq, dx, bmap, nb)

        def codegen(context, builder, signature, args):
            ty_y, _, ty_wp, ty_sc, ty_xq, ty_dx, ty_bm, _ = signature.args
            a_y = context.make_array(ty_y)(context, builder, args[0])
            a_wp = context.make_array(ty_wp)(context, builder, args[2])
            a_sc = context.make_array(ty_sc)(context, builder, args[3])
            a_xq = context.make_array(ty_xq)(context, builder, args[4])
            a_dx = context.make_array(ty_dx)(context, builder, args[5])
            a_bm = context.make_array(ty_bm)(context, builder, args[6])
            i64 = ir.IntType(64)
            r0v, nbv = args[1], args[7]
            wrow = cgutils.unpack_tuple(builder, a_wp.strides, 2)[0]  # bytes per packed row
            srow = cgutils.unpack_tuple(builder, a_sc.shape, 2)[1]    # groups per row
            mod = builder.module
            pmaddwd = _declare(mod, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
            fmuladd = _declare(mod, "llvm.fmuladd.v8f32", _V8F32, [_V8F32, _V8F32, _V8F32])
            prefetch = _declare(mod, "llvm.prefetch.p0i8", ir.VoidType(),
                                [_I8.as_pointer(), _I32, _I32, _I32])
            wbase = builder.bitcast(a_wp.data, _I8.as_pointer())
            xbase = builder.bitcast(a_xq.data, _I16.as_pointer())
            ahead = builder.mul(wrow, ir.Constant(i64, n_rows * PREFETCH_BLOCKS))
            zero8 = ir.Constant(_V8F32, [0.0] * 8)
            accs, gaccs, wrows, srows = [], [], [], []
            for r in range(n_rows):
                acc = cgutils.alloca_once(builder, _V8F32)
                builder.store(zero8, acc)
                accs.append(acc)
                gacc = cgutils.alloca_once(builder, _V8F32)
                builder.store(zero8, gacc)
                gaccs.append(gacc)
                row = builder.add(r0v, ir.Constant(i64, r))
                wrows.append(_gep(builder, wbase, builder.mul(row, wrow)))
                srows.append(_gep(builder, a_sc.data, builder.mul(row, srow)))
            cur_g = cgutils.alloca_once(builder, i64)  # group of the blocks in gaccs
            builder.store(builder.sext(builder.load(a_bm.data), i64), cur_g)

            factored = ty_sc.dtype == types.uint8

            def flush_row(r, g):  # acc_r += gacc_r * sc[r, g]; gacc_r = 0
                f = _splat_f32(builder, group_scale(builder, srows[r], g, nbv, factored))
                builder.store(builder.call(fmuladd, [builder.load(gaccs[r]), f,
                                                     builder.load(accs[r])]), accs[r])
                builder.store(zero8, gaccs[r])

            def enter_group(g):  # flush every row when block group g starts a new group
                with builder.if_then(builder.icmp_signed("!=", g, builder.load(cur_g)),
                                     likely=False):
                    old = builder.load(cur_g)
                    for r in range(n_rows):
                        flush_row(r, old)
                    builder.store(g, cur_g)

            def act(bidx):  # the block's two <16 x i16> activation halves, and dx_b splat
                xoff = builder.mul(bidx, ir.Constant(i64, 32))
                xa = builder.load(builder.bitcast(_gep(builder, xbase, xoff),
                                                  _V16I16.as_pointer()), align=2)
                xb = builder.load(builder.bitcast(_gep(builder, xbase, builder.add(
                    xoff, ir.Constant(i64, 16))), _V16I16.as_pointer()), align=2)
                f = _splat_f32(builder, builder.load(_gep(builder, a_dx.data, bidx)))
                return xa, xb, f

            def dot_into(r, wa, wb, x):  # gacc_r += cvt(wa . xa + wb . xb) * dx_b
                xa, xb, f = x
                p32 = builder.add(builder.call(pmaddwd, [wa, xa]),
                                  builder.call(pmaddwd, [wb, xb]))
                builder.store(builder.call(fmuladd, [builder.sitofp(p32, _V8F32), f,
                                                     builder.load(gaccs[r])]), gaccs[r])

            def fetch_next(r, off):  # prefetch off in row r + R * PREFETCH_BLOCKS (never faults)
                builder.call(prefetch, [_gep(builder, wrows[r], builder.add(off, ahead)),
                                        ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                        ir.Constant(_I32, 1)])

            def group_of(bidx):
                return builder.sext(builder.load(_gep(builder, a_bm.data, bidx)), i64)

            if bits in (4, 5):
                n_chunks = builder.udiv(nbv, ir.Constant(i64, 2))
                with cgutils.for_range(builder, n_chunks) as loop:
                    c = loop.index
                    off = builder.mul(c, ir.Constant(i64, CHUNK_BYTES[bits]))
                    b0 = builder.mul(c, ir.Constant(i64, 2))
                    b1 = builder.add(b0, ir.Constant(i64, 1))
                    x0, x1 = act(b0), act(b1)
                    g0, g1 = group_of(b0), group_of(b1)
                    enter_group(g0)
                    split = builder.icmp_signed("!=", g1, g0)  # g32: the blocks' groups differ
                    for r in range(n_rows):
                        wv = builder.load(builder.bitcast(_gep(builder, wrows[r], off),
                                                          _V32I8.as_pointer()), align=1)
                        fetch_next(r, off)
                        la, lb, ha, hb = chunk_codes(builder, bits, wv, wrows[r], off)
                        dot_into(r, la, lb, x0)
                        with builder.if_then(split, likely=False):
                            flush_row(r, g0)
                        dot_into(r, ha, hb, x1)
                    builder.store(g1, cur_g)
            else:
                with cgutils.for_range(builder, nbv) as loop:
                    b = loop.index
                    off = builder.mul(b, ir.Constant(i64, 32))
                    x = act(b)
                    enter_group(group_of(b))
                    for r in range(n_rows):
                        wv = builder.load(builder.bitcast(_gep(builder, wrows[r], off),
                                                          _V32I8.as_pointer()), align=1)
                        fetch_next(r, off)
                        dot_into(r, *widen_signed(builder, wv), x)
            g = builder.load(cur_g)
            for r in range(n_rows):
                flush_row(r, g)
                tot = _hsum8(builder, builder.load(accs[r]))
                dst = _gep(builder, a_y.data, builder.add(r0v, ir.Constant(i64, r)))
                builder.store(tot, dst)
            return context.get_dummy_value()

        return sig, codegen

    return kernel


@njit(cache=True, fastmath=True)
def _rows_portable(y, r0, nr, bits, wp, sc, xq, dx, bmap, nb):  # same math, plain loops
    for r in range(r0, r0 + nr):
        acc = np.float32(0.0)
        gacc = np.float32(0.0)  # this group's sum of dx_b * idot_b (scaled once per group)
        for b in range(nb):
            if b > 0 and bmap[b] != bmap[b - 1]:
                acc += gacc * group_value(sc, r, bmap[b - 1], nb)
                gacc = np.float32(0.0)
            s = np.int32(0)
            for j in range(32):
                q = np.int32(xq[b * 32 + ((j & 7) | ((j >> 4) << 3) | (((j >> 3) & 1) << 4))])
                if bits == 4:
                    sh = np.int32(4 * (b % 2))
                    code = (np.int32(wp[r, (b // 2) * 32 + j]) >> sh) & np.int32(15)
                elif bits == 5:
                    c0 = (b // 2) * 40
                    sh = np.int32(4 * (b % 2))
                    code = (np.int32(wp[r, c0 + j]) >> sh) & np.int32(15)
                    hbyte = np.int32(wp[r, c0 + 32 + 4 * (b % 2) + (j >> 3)])
                    code |= ((hbyte >> np.int32(j & 7)) & np.int32(1)) << np.int32(4)
                else:  # wp is int8 here
                    code = np.int32(wp[r, b * 32 + j])
                s += code * q
            gacc += dx[b] * np.float32(s)
        y[r] = acc + gacc * group_value(sc, r, bmap[nb - 1], nb)


@njit(cache=True)
def _p_q4_rows4(y, r0, wp, sc, xq, dx, bmap, nb):
    _rows_portable(y, r0, 4, 4, wp, sc, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q4_rows1(y, r0, wp, sc, xq, dx, bmap, nb):
    _rows_portable(y, r0, 1, 4, wp, sc, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q5_rows4(y, r0, wp, sc, xq, dx, bmap, nb):
    _rows_portable(y, r0, 4, 5, wp, sc, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q5_rows1(y, r0, wp, sc, xq, dx, bmap, nb):
    _rows_portable(y, r0, 1, 5, wp, sc, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q8_rows4(y, r0, wp, sc, xq, dx, bmap, nb):
    _rows_portable(y, r0, 4, 8, wp, sc, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q8_rows1(y, r0, wp, sc, xq, dx, bmap, nb):
    _rows_portable(y, r0, 1, 8, wp, sc, xq, dx, bmap, nb)


#: Row kernels ``k(y, r0, wp, sc, xq, dx, bmap, nb)`` for 4 or 1 rows: the AVX2 IR
#: intrinsics where the host has AVX2, else portable Numba loops with identical math.
#: ``SIMD_ROWS`` holds the intrinsics regardless (tests compare the two when possible).
SIMD_ROWS = {(n, b): _make_rows_kernel(n, b) for b in (4, 5, 8) for n in (4, 1)}
PORTABLE_ROWS = {(4, 4): _p_q4_rows4, (1, 4): _p_q4_rows1, (4, 5): _p_q5_rows4,
                 (1, 5): _p_q5_rows1, (4, 8): _p_q8_rows4, (1, 8): _p_q8_rows1}
_ROWS = SIMD_ROWS if HAVE_AVX2 else PORTABLE_ROWS
q4_rows4, q4_rows1 = _ROWS[(4, 4)], _ROWS[(1, 4)]
q5_rows4, q5_rows1 = _ROWS[(4, 5)], _ROWS[(1, 5)]
q8_rows4, q8_rows1 = _ROWS[(4, 8)], _ROWS[(1, 8)]
