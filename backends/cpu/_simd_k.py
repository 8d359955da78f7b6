"""SIMD row kernels for 8-bit codes with one scale per 16 columns (llama.cpp ``Q6_K``).

The integer part is :mod:`._simd`'s 8-bit kernel: a 32-column block's int8 codes are
sign-extended to int16 by the in-lane byte unpacks and two ``pmaddwd`` against the
block's int16 activations (:data:`._simd.ACT_ORDER` lane order) plus one add give an
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
The AVX2 intrinsics are used where the host has AVX2 (:data:`._simd.HAVE_AVX2`), else
portable Numba loops with the same sums (float rounding order aside).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._simd import HAVE_AVX2, _UNPACK_HI, _UNPACK_LO, _declare, _gep, _hsum8, _splat_f32

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
            zero32 = ir.Constant(_V32I8, [0] * 32)
            lo_idx = ir.Constant(ir.VectorType(_I32, 32), _UNPACK_LO)
            hi_idx = ir.Constant(ir.VectorType(_I32, 32), _UNPACK_HI)
            halves = ir.Constant(ir.VectorType(_I32, 8), [0, 0, 0, 0, 1, 1, 1, 1])
            accs, wrows, srows = [], [], []
            for r in range(n_rows):
                acc = cgutils.alloca_once(builder, _V8F32)
                builder.store(zero8, acc)
                accs.append(acc)
                row = builder.add(r0v, ir.Constant(i64, r))
                wrows.append(_gep(builder, wbase, builder.mul(row, wrow)))
                srows.append(_gep(builder, a_sc.data, builder.mul(row, srow)))

            def widen(v, idx, other):  # in-lane byte unpack of (v, other) -> <16 x i16>
                return builder.bitcast(builder.shuffle_vector(v, other, idx), _V16I16)

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
                    sign = builder.sext(builder.icmp_signed("<", wv, zero32), _V32I8)
                    p32 = builder.add(
                        builder.call(pmaddwd, [widen(wv, lo_idx, sign), xa]),
                        builder.call(pmaddwd, [widen(wv, hi_idx, sign), xb]))
                    s2 = builder.load(builder.bitcast(_gep(builder, srows[r], soff),
                                                      _V2F32.as_pointer()), align=4)
                    s8 = builder.shuffle_vector(s2, ir.Constant(_V2F32, ir.Undefined), halves)
                    t = builder.fmul(builder.sitofp(p32, _V8F32), f)
                    builder.store(builder.call(fmuladd, [t, s8, builder.load(accs[r])]),
                                  accs[r])
            for r in range(n_rows):
                tot = _hsum8(builder, builder.load(accs[r]))
                builder.store(tot, _gep(builder, a_y.data, builder.add(r0v, ir.Constant(i64, r))))
            return context.get_dummy_value()

        return sig, codegen

    return kernel


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
