"""SIMD row kernels for 8-bit codes with one scale per 16 columns (llama.cpp ``Q6_K``).

The integer part is :mod:`._simd`'s 8-bit kernel: a 32-column block's int8 codes are
sign-extended to int16 by the in-lane byte unpacks and two ``pmaddwd`` against the
block's int16 activations (:data:`._simd_ir.ACT_ORDER` lane order) plus one add give an
``<8 x i32>`` of exact partial dots (``|code * q| <= 128 * 16256``, 4 terms a lane: inside
float32's 24-bit integers). In that lane order lanes 0-3 hold columns 0-15 and lanes
4-7 columns 16-31 of the block, so the block's two weight scales apply per lane: one
float multiply by the splat activation scale ``dx_b`` and one FMA by the vector
``[s_2b x4, s_2b+1 x4]`` (two scales loaded as ``<2 x float>`` and shuffled) into the
row's ``<8 x float>`` accumulator; the horizontal sum happens once per row.

Layout consumed (built by :func:`.repack.repack` for a weight with lane scales): ``wp``
int8 ``[rows, nb * 32]``, ``sc`` float32 ``[rows, 2 * nb]`` (column ``16 j .. 16 j + 15``
scaled by ``sc[r, j]``), ``xq`` int16 ``[nb * 32]``, ``dx`` float32 ``[nb]``.

Kernels ``k(y, r0, wp, sc, xq, dx, nb)`` write, for R rows from ``r0``:
``y[r] = sum_b sum_{h < 2} (dx[b] * sc[r, 2 b + h]) * sum_{k in half h of b} code[r, k] * q[k]``.
The AVX2 intrinsics are used where the host has AVX2 (:data:`._simd_ir.HAVE_AVX2`), else
portable Numba loops with the same sums (float rounding order aside).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._simd_ir import (HAVE_AVX2, STRICT, _declare, _gep, _hsum8, _splat_f32, token_rows,
                       widen_signed)

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V32I8 = ir.VectorType(_I8, 32)
_V16I16 = ir.VectorType(_I16, 16)
_V8I32 = ir.VectorType(_I32, 8)
_V8F32 = ir.VectorType(_F32, 8)
_V2F32 = ir.VectorType(_F32, 2)
#: Row blocks ahead that each code load prefetches (as :mod:`._simd`'s kernels).
PREFETCH_BLOCKS = 1


def _make_lane_rows_kernel(n_rows: int):
    """An intrinsic ``k(y, r0, wp, sc, xq, dx, nb)`` over ``n_rows`` rows (module docstring).

    ``y`` float32 [rows], ``r0`` int64, ``wp`` int8 2-D C-contiguous, ``sc`` float32 2-D
    C-contiguous ``[rows, 2 * nb]``, ``xq`` int16 [nb * 32], ``dx`` float32 [nb], ``nb`` int64.
    """

    @intrinsic
    def kernel(typingctx, y, r0, wp, sc, xq, dx, nb):
        sig = types.void(y, r0, wp, sc, xq, dx, nb)

        def codegen(context, builder, signature, args):
            ty_y, _, ty_wp, ty_sc, ty_xq, ty_dx, _ = signature.args
            a_y = context.make_array(ty_y)(context, builder, args[0])
            a_wp = context.make_array(ty_wp)(context, builder, args[2])
            a_sc = context.make_array(ty_sc)(context, builder, args[3])
            a_xq = context.make_array(ty_xq)(context, builder, args[4])
            a_dx = context.make_array(ty_dx)(context, builder, args[5])
            i64 = ir.IntType(64)
            r0v, nbv = args[1], args[6]
            wrow = cgutils.unpack_tuple(builder, a_wp.strides, 2)[0]  # bytes per code row
            srow = cgutils.unpack_tuple(builder, a_sc.shape, 2)[1]    # scales per row
            mod = builder.module
            pmaddwd = _declare(mod, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
            fmuladd = _declare(mod, "llvm.fmuladd.v8f32", _V8F32, [_V8F32, _V8F32, _V8F32])
            prefetch = _declare(mod, "llvm.prefetch.p0i8", ir.VoidType(),
                                [_I8.as_pointer(), _I32, _I32, _I32])
            wbase = builder.bitcast(a_wp.data, _I8.as_pointer())
            xbase = builder.bitcast(a_xq.data, _I16.as_pointer())
            ahead = builder.mul(wrow, ir.Constant(i64, n_rows * PREFETCH_BLOCKS))
            zero8 = ir.Constant(_V8F32, [0.0] * 8)
            halves = ir.Constant(ir.VectorType(_I32, 8), [0, 0, 0, 0, 1, 1, 1, 1])
            accs, wrows, srows = [], [], []
            for r in range(n_rows):
                acc = cgutils.alloca_once(builder, _V8F32)
                builder.store(zero8, acc)
                accs.append(acc)
                row = builder.add(r0v, ir.Constant(i64, r))
                wrows.append(_gep(builder, wbase, builder.mul(row, wrow)))
                srows.append(_gep(builder, a_sc.data, builder.mul(row, srow)))

            with cgutils.for_range(builder, nbv) as loop:
                b = loop.index
                off = builder.mul(b, ir.Constant(i64, 32))
                xa = builder.load(builder.bitcast(_gep(builder, xbase, off),
                                                  _V16I16.as_pointer()), align=2)
                xb = builder.load(builder.bitcast(_gep(builder, xbase, builder.add(
                    off, ir.Constant(i64, 16))), _V16I16.as_pointer()), align=2)
                f = _splat_f32(builder, builder.load(_gep(builder, a_dx.data, b)))
                soff = builder.mul(b, ir.Constant(i64, 2))
                for r in range(n_rows):
                    wv = builder.load(builder.bitcast(_gep(builder, wrows[r], off),
                                                      _V32I8.as_pointer()), align=1)
                    builder.call(prefetch, [_gep(builder, wrows[r], builder.add(off, ahead)),
                                            ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                            ir.Constant(_I32, 1)])
                    la, lb = widen_signed(builder, wv)
                    p32 = builder.add(builder.call(pmaddwd, [la, xa]),
                                      builder.call(pmaddwd, [lb, xb]))
                    s2 = builder.load(builder.bitcast(_gep(builder, srows[r], soff),
                                                      _V2F32.as_pointer()), align=4)
                    s8 = builder.shuffle_vector(s2, ir.Constant(_V2F32, ir.Undefined), halves)
                    t = builder.fmul(builder.sitofp(p32, _V8F32), f, flags=STRICT)
                    builder.store(builder.call(fmuladd, [t, s8, builder.load(accs[r])]),
                                  accs[r])
            for r in range(n_rows):
                tot = _hsum8(builder, builder.load(accs[r]))
                builder.store(tot, _gep(builder, a_y.data, builder.add(r0v, ir.Constant(i64, r))))
            return context.get_dummy_value()

        return sig, codegen

    return kernel


_V4I64 = ir.VectorType(ir.IntType(64), 4)


def _high_crumbs(builder, row, at):
    """<32 x i8>: byte ``8 g + k`` = bits ``2 g``, ``2 g + 1`` of byte ``k`` of the 8 bytes
    at ``at`` of ``row``, shifted to bits 4 and 5 (a 6-bit block's high code bits)."""
    i64 = ir.IntType(64)
    h = builder.load(builder.bitcast(_gep(builder, row, at), i64.as_pointer()), align=1)
    v = builder.shuffle_vector(builder.insert_element(ir.Constant(_V4I64, ir.Undefined), h,
                                                      ir.Constant(_I32, 0)),
                               ir.Constant(_V4I64, ir.Undefined),
                               ir.Constant(ir.VectorType(_I32, 4), [0, 0, 0, 0]))
    v = builder.lshr(v, ir.Constant(_V4I64, [0, 2, 4, 6]))  # vpsrlvq
    v = builder.and_(v, ir.Constant(_V4I64, [0x0303030303030303] * 4))
    return builder.bitcast(builder.shl(v, ir.Constant(_V4I64, [4] * 4)), _V32I8)


def _lane6_codes(builder, wv, row, off, h):
    """Half ``h`` (block ``2c + h``) of a 6-bit chunk as two ``<16 x i16>`` code vectors
    (:data:`._simd_ir.ACT_ORDER`'s lane order): ``wv`` the chunk's 32 nibble bytes, ``row``
    the row's i8*, ``off`` the chunk's byte offset; codes ``nibble | crumb << 4`` minus 32."""
    i64 = ir.IntType(64)
    nib = (builder.and_(wv, ir.Constant(_V32I8, [15] * 32)) if h == 0 else
           builder.lshr(wv, ir.Constant(_V32I8, [4] * 32)))
    u = builder.or_(nib, _high_crumbs(builder, row, builder.add(off, ir.Constant(i64, 32 + 8 * h))))
    return widen_signed(builder, builder.sub(u, ir.Constant(_V32I8, [32] * 32)))


def _lane6_scales(builder, srow, b, dat):
    """``<8 x float>``: block ``b``'s two lane scales ``float(q) * d`` (exact, :data:`STRICT`)
    of a 6-bit weight's packed scale row ``srow`` (i8*; super-block scales from byte
    ``dat``), each repeated over its four lanes."""
    i64 = ir.IntType(64)
    q2 = builder.load(builder.bitcast(_gep(builder, srow, builder.mul(b, ir.Constant(i64, 2))),
                                      ir.VectorType(_I8, 2).as_pointer()), align=1)
    dp = _gep(builder, srow, builder.add(dat, builder.mul(builder.ashr(b, ir.Constant(i64, 3)),
                                                          ir.Constant(i64, 4))))
    dv = builder.load(builder.bitcast(dp, _F32.as_pointer()), align=1)
    d2 = builder.shuffle_vector(
        builder.insert_element(ir.Constant(_V2F32, ir.Undefined), dv, ir.Constant(_I32, 0)),
        ir.Constant(_V2F32, ir.Undefined), ir.Constant(ir.VectorType(_I32, 2), [0, 0]))
    s2 = builder.fmul(builder.sitofp(q2, _V2F32), d2, flags=STRICT)
    return builder.shuffle_vector(s2, ir.Constant(_V2F32, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, 8), [0, 0, 0, 0, 1, 1, 1, 1]))


def _make_lane6_rows_kernel(n_rows: int, n_tok: int = 0):
    """As :func:`_make_lane_rows_kernel` on a 6-bit weight (:mod:`.repack`, ``bits`` 6):
    ``wp`` uint8 ``[rows, nb * 24]`` (48-byte chunks: nibbles, then the high-bit crumbs
    of block ``2c``, then of ``2c + 1``), ``sc`` uint8 ``[rows, A + 4 nsb]`` (int8 lane scales,
    float32 super-block scales from byte ``A``, :func:`.repack.lane6_scale_offset`); ``nb``
    even. Each block's codes are built in bytes (nibble | high crumb << 4, minus 32),
    then run as the 8-bit kernel; its two lane scales are ``float(q) * d`` (exact).

    With ``n_tok`` > 0 the kernel is ``k(y, r0, wp, sc, xq, dx, nb, t0)`` over ``n_tok``
    token rows from ``t0`` of ``y`` float32 [T, rows], ``xq`` int16 [T, nb * 32], ``dx``
    float32 [T, nb]: each block's codes and scales are built once for all of them, and
    each (row, token) runs the single-token kernel's steps in its order (the same bits).
    """

    def codegen(context, builder, signature, args):
        ty_y, _, ty_wp, ty_sc, ty_xq, ty_dx = signature.args[:6]
        a_y = context.make_array(ty_y)(context, builder, args[0])
        a_wp = context.make_array(ty_wp)(context, builder, args[2])
        a_sc = context.make_array(ty_sc)(context, builder, args[3])
        a_xq = context.make_array(ty_xq)(context, builder, args[4])
        a_dx = context.make_array(ty_dx)(context, builder, args[5])
        i64 = ir.IntType(64)
        r0v, nbv = args[1], args[6]
        wrow = cgutils.unpack_tuple(builder, a_wp.strides, 2)[0]  # bytes per code row
        srow = cgutils.unpack_tuple(builder, a_sc.strides, 2)[0]  # bytes per scale row
        mod = builder.module
        pmaddwd = _declare(mod, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
        fmuladd = _declare(mod, "llvm.fmuladd.v8f32", _V8F32, [_V8F32, _V8F32, _V8F32])
        prefetch = _declare(mod, "llvm.prefetch.p0i8", ir.VoidType(),
                            [_I8.as_pointer(), _I32, _I32, _I32])
        wbase = builder.bitcast(a_wp.data, _I8.as_pointer())
        sbase = builder.bitcast(a_sc.data, _I8.as_pointer())
        ahead = builder.mul(wrow, ir.Constant(i64, n_rows * PREFETCH_BLOCKS))
        # byte offset of the float32 super-block scales: (2 nb + 3) & ~3
        dat = builder.and_(builder.add(builder.mul(nbv, ir.Constant(i64, 2)),
                                       ir.Constant(i64, 3)), ir.Constant(i64, -4))
        n_t = max(n_tok, 1)

        t0 = args[7] if n_tok else None
        xbases, dbases, ybases = (token_rows(builder, a_xq, _I16, t0, n_tok),
                                  token_rows(builder, a_dx, _F32, t0, n_tok),
                                  token_rows(builder, a_y, _F32, t0, n_tok))
        zero8 = ir.Constant(_V8F32, [0.0] * 8)
        accs, wrows, srows = [], [], []
        for r in range(n_rows):
            row_accs = []
            for _ in range(n_t):
                acc = cgutils.alloca_once(builder, _V8F32)
                builder.store(zero8, acc)
                row_accs.append(acc)
            accs.append(row_accs)
            row = builder.add(r0v, ir.Constant(i64, r))
            wrows.append(_gep(builder, wbase, builder.mul(row, wrow)))
            srows.append(_gep(builder, sbase, builder.mul(row, srow)))

        nch = builder.sdiv(nbv, ir.Constant(i64, 2))
        with cgutils.for_range(builder, nch) as loop:
            c = loop.index
            off = builder.mul(c, ir.Constant(i64, 48))
            xs, fs = [], []  # [token][half]: the activations and their block's dx
            for j in range(n_t):
                xs.append([])
                fs.append([])
                for h in range(2):
                    b = builder.add(builder.mul(c, ir.Constant(i64, 2)), ir.Constant(i64, h))
                    xo = builder.mul(b, ir.Constant(i64, 32))
                    xs[j].append([builder.load(builder.bitcast(_gep(
                        builder, xbases[j], builder.add(xo, ir.Constant(i64, k))),
                        _V16I16.as_pointer()), align=2) for k in (0, 16)])
                    fs[j].append(_splat_f32(builder, builder.load(_gep(builder, dbases[j], b))))
            for r in range(n_rows):
                wv = builder.load(builder.bitcast(_gep(builder, wrows[r], off),
                                                  _V32I8.as_pointer()), align=1)
                builder.call(prefetch, [_gep(builder, wrows[r], builder.add(off, ahead)),
                                        ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                        ir.Constant(_I32, 1)])
                for h in range(2):
                    b = builder.add(builder.mul(c, ir.Constant(i64, 2)), ir.Constant(i64, h))
                    lo, hi = _lane6_codes(builder, wv, wrows[r], off, h)
                    s8v = _lane6_scales(builder, srows[r], b, dat)
                    for j in range(n_t):
                        p32 = builder.add(builder.call(pmaddwd, [lo, xs[j][h][0]]),
                                          builder.call(pmaddwd, [hi, xs[j][h][1]]))
                        t = builder.fmul(builder.sitofp(p32, _V8F32), fs[j][h], flags=STRICT)
                        builder.store(builder.call(fmuladd, [t, s8v, builder.load(accs[r][j])]),
                                      accs[r][j])
        for r in range(n_rows):
            for j in range(n_t):
                tot = _hsum8(builder, builder.load(accs[r][j]))
                builder.store(tot, _gep(builder, ybases[j],
                                        builder.add(r0v, ir.Constant(i64, r))))
        return context.get_dummy_value()

    if n_tok:
        @intrinsic
        def kernel_tokens(typingctx, y, r0, wp, sc, xq, dx, nb, t0):
            return types.void(y, r0, wp, sc, xq, dx, nb, t0), codegen

        return kernel_tokens

    @intrinsic
    def kernel(typingctx, y, r0, wp, sc, xq, dx, nb):
        return types.void(y, r0, wp, sc, xq, dx, nb), codegen

    return kernel


@njit(cache=True, fastmath=False, inline="always")
def lane6_scale(sc, r, b, h, nb):  # the float32 scale of half h of block b, row r (6-bit)
    """``float32(q) * d`` from a 6-bit weight's packed ``sc`` uint8 (:mod:`.repack`):
    exact, the scale the weight was given."""
    v = np.int32(sc[r, 2 * b + h])
    if v > 127:
        v -= 256
    at = (2 * nb + 3) // 4 * 4 + 4 * (b >> 3)  # .repack.lane6_scale_offset
    return np.float32(v) * sc[r, at:at + 4].view(np.float32)[0]


@njit(cache=True, fastmath=False, inline="always")
def lane6_code(wp, r, k):  # the signed 6-bit code of column k, row r (-32..31)
    """Column ``k``'s code ``u - 32`` of a 6-bit row (48-byte chunks, :mod:`.repack`)."""
    c0 = (k >> 6) * 48
    hb = (k >> 5) & 1
    j = k & 31
    u = (np.int32(wp[r, c0 + j]) >> (4 * hb)) & 15
    u |= ((np.int32(wp[r, c0 + 32 + 8 * hb + (j & 7)]) >> (2 * (j >> 3))) & 3) << 4
    return u - 32


@njit(cache=True, fastmath=True)
def _lane6_rows_portable(y, r0, nr, wp, sc, xq, dx, nb):  # same sums, plain loops
    for r in range(r0, r0 + nr):
        acc = np.float32(0.0)
        for b in range(nb):
            for h in range(2):
                s = np.int32(0)
                for j in range(16 * h, 16 * h + 16):
                    q = np.int32(xq[b * 32 + ((j & 7) | ((j >> 4) << 3) | (((j >> 3) & 1) << 4))])
                    s += np.int32(lane6_code(wp, r, b * 32 + j)) * q
                acc += np.float32(s) * dx[b] * lane6_scale(sc, r, b, h, nb)
        y[r] = acc


@njit(cache=True)
def _p_lane6_rows4(y, r0, wp, sc, xq, dx, nb):
    _lane6_rows_portable(y, r0, 4, wp, sc, xq, dx, nb)


@njit(cache=True)
def _p_lane6_rows1(y, r0, wp, sc, xq, dx, nb):
    _lane6_rows_portable(y, r0, 1, wp, sc, xq, dx, nb)


@njit(cache=True, fastmath=True)
def _lane_rows_portable(y, r0, nr, wp, sc, xq, dx, nb):  # same sums, plain loops
    for r in range(r0, r0 + nr):
        acc = np.float32(0.0)
        for b in range(nb):
            for h in range(2):
                s = np.int32(0)
                for j in range(16 * h, 16 * h + 16):
                    q = np.int32(xq[b * 32 + ((j & 7) | ((j >> 4) << 3) | (((j >> 3) & 1) << 4))])
                    s += np.int32(wp[r, b * 32 + j]) * q
                acc += np.float32(s) * dx[b] * sc[r, 2 * b + h]
        y[r] = acc


@njit(cache=True)
def _p_lane_rows4(y, r0, wp, sc, xq, dx, nb):
    _lane_rows_portable(y, r0, 4, wp, sc, xq, dx, nb)


@njit(cache=True)
def _p_lane_rows1(y, r0, wp, sc, xq, dx, nb):
    _lane_rows_portable(y, r0, 1, wp, sc, xq, dx, nb)


#: Row kernels ``k(y, r0, wp, sc, xq, dx, nb)`` for 4 or 1 rows: the AVX2 intrinsics
#: (``SIMD_LANE_ROWS``, built regardless) where the host has AVX2, else the portable loops.
SIMD_LANE_ROWS = {4: _make_lane_rows_kernel(4), 1: _make_lane_rows_kernel(1)}
PORTABLE_LANE_ROWS = {4: _p_lane_rows4, 1: _p_lane_rows1}
_ROWS = SIMD_LANE_ROWS if HAVE_AVX2 else PORTABLE_LANE_ROWS
q8l_rows4, q8l_rows1 = _ROWS[4], _ROWS[1]

#: The same for 6-bit weights (``bits`` 6, :func:`_make_lane6_rows_kernel`).
SIMD_LANE6_ROWS = {4: _make_lane6_rows_kernel(4), 1: _make_lane6_rows_kernel(1)}
PORTABLE_LANE6_ROWS = {4: _p_lane6_rows4, 1: _p_lane6_rows1}
_ROWS6 = SIMD_LANE6_ROWS if HAVE_AVX2 else PORTABLE_LANE6_ROWS
q6l_rows4, q6l_rows1 = _ROWS6[4], _ROWS6[1]
#: Token rows per call of the multi-token 6-bit kernel (:func:`_make_lane6_rows_kernel`
#: with ``n_tok``; 1 row: its 4 accumulators stay in registers on AVX2's 16).
LANE6_TOKENS = 4


@njit(cache=True)
def _p_lane6_row_tokens(y, r, wp, sc, xq, dx, nb, t0):  # the portable loops, token by token
    for j in range(t0, t0 + LANE6_TOKENS):
        _lane6_rows_portable(y[j], r, 1, wp, sc, xq[j], dx[j], nb)


#: ``k(y, r0, wp, sc, xq, dx, nb, t0)``: 1 row x :data:`LANE6_TOKENS` tokens (the AVX2
#: intrinsic where the host has AVX2, else the portable loops token by token).
q6l_row_tokens = (_make_lane6_rows_kernel(1, LANE6_TOKENS) if HAVE_AVX2
                  else _p_lane6_row_tokens)
