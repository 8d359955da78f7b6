"""Block-dot numerics for 4-, 5- and 8-bit weights: one exact int32 per (row, 32-column
block).

The row kernels of :mod:`._simd` keep 8 int32 lane sums per block and apply the
activation scale per lane (8 float FMAs per row and block, summed across lanes at the end
of the row). Here the 8 lane sums are first added (integers: exact) into the block's dot
``D[r, b] = sum_k code[r, k] * q[k]``, and every float operation is scalar per row:

    gacc = fma(float(D[r, b]), dx[b], gacc)      for the blocks b of group g, in order
    acc  = fma(gacc, sc[r, g], acc); gacc = 0    when the group ends
    y[r] = acc                                   (the caller subtracts the zero-point term)

A GEMM can compute ``D`` any way it likes (AMX tiles: :mod:`._amx`) and still give these
floats bit for bit, because no float operation depends on how the integer dot was
summed. The 4 rows of a call are reduced together (a tree of pairwise adds across rows,
what ``vphaddd`` does) into one <4 x i32>, and the float steps run on the 4 rows' lanes.
Used for 4- and 5-bit weights and 8-bit ones with a scale per 32 or more columns where
the CPU has AMX-INT8 (:data:`BLOCKDOT`), decode and prefill alike, whether or not the OS
grants the tiles (:data:`._amx.HAVE_AMX`); elsewhere the lane numerics of :mod:`._simd`
stay.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._simd_ir import (_FEATURES, _I8, _I16, _I32, _V4F32, _V8I32, _V16I16, _V32I8, CHUNK_BYTES,
                       PREFETCH_BLOCKS, _declare, _gep, _splat4, chunk_codes, group_scale,
                       token_rows, widen_signed)

#: The CPU has AMX-INT8 (LLVM's host features; part of every Numba cache key): its
#: 4-, 5- and 8-bit weights use these numerics in decode and prefill.
BLOCKDOT = bool(_FEATURES.get("amx-int8", False) and _FEATURES.get("amx-tile", False))


def _idx(vals):
    return ir.Constant(ir.VectorType(_I32, len(vals)), list(vals))


def block_dots4(builder, vs):
    """Up to 4 <8 x i32> lane-sum vectors -> <4 x i32>, lane r the sum of ``vs[r]``'s
    lanes (zero past ``len(vs)``); integer adds, so any order gives the same value."""
    zero = ir.Constant(_V8I32, [0] * 8)
    vs = list(vs) + [zero] * (4 - len(vs))

    def hadd(a, b):  # vphaddd: in each 128-bit half, pairs of a then pairs of b
        ev = _idx([0, 2, 8, 10, 4, 6, 12, 14])
        od = _idx([1, 3, 9, 11, 5, 7, 13, 15])
        return builder.add(builder.shuffle_vector(a, b, ev), builder.shuffle_vector(a, b, od))

    h = hadd(hadd(vs[0], vs[1]), hadd(vs[2], vs[3]))
    return builder.add(builder.shuffle_vector(h, h, _idx([0, 1, 2, 3])),
                       builder.shuffle_vector(h, h, _idx([4, 5, 6, 7])))


def _make_rows_kernel(n_rows: int, five: bool = False, n_tok: int = 0):
    """Intrinsic ``k(y, r0, wp, sc, xq, dx, bmap, nb)`` for ``n_rows`` (1..4) rows of a
    4-bit (``wp`` uint8, nibbles), 5-bit (``five``: nibbles and fifth bits, 40-byte
    chunks) or 8-bit (``wp`` int8, codes in column order) weight, arguments as
    :func:`._simd._make_rows_kernel`; writes ``y[r] = acc`` of the module docstring.

    With ``n_tok`` > 0: ``k(y, r0, wp, sc, xq, dx, bmap, nb, t0)`` over the ``n_tok`` token
    rows from ``t0`` of ``y`` float32 [T, out], ``xq`` int16 [T, nb * 32], ``dx`` float32
    [T, nb]: each chunk's codes are unpacked once for all of them, and every token runs
    the single-token steps in their order (the same floats)."""
    bits = 5 if five else 4
    n_t = max(n_tok, 1)

    def codegen(context, builder, signature, args):
        ty_sc = signature.args[3]
        eight = signature.args[2].dtype == types.int8
        a_y, a_wp, a_sc, a_xq, a_dx, a_bm = (
            context.make_array(signature.args[i])(context, builder, args[i])
            for i in (0, 2, 3, 4, 5, 6))
        i64 = ir.IntType(64)
        c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
        r0v, nbv = args[1], args[7]
        wrow = cgutils.unpack_tuple(builder, a_wp.strides, 2)[0]
        srow = cgutils.unpack_tuple(builder, a_sc.shape, 2)[1]
        mod = builder.module
        pmaddwd = _declare(mod, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
        fmuladd = _declare(mod, "llvm.fmuladd.v4f32", _V4F32, [_V4F32, _V4F32, _V4F32])
        prefetch = _declare(mod, "llvm.prefetch.p0i8", ir.VoidType(),
                            [_I8.as_pointer(), _I32, _I32, _I32])
        wbase = builder.bitcast(a_wp.data, _I8.as_pointer())

        t0 = args[8] if n_tok else None
        xbases, dbases, ybases = (token_rows(builder, a_xq, _I16, t0, n_tok),
                                  token_rows(builder, a_dx, ir.FloatType(), t0, n_tok),
                                  token_rows(builder, a_y, ir.FloatType(), t0, n_tok))
        ahead = builder.mul(wrow, c64(n_rows * PREFETCH_BLOCKS))
        zero4 = ir.Constant(_V4F32, [0.0] * 4)
        factored = ty_sc.dtype == types.uint8
        rows = [builder.add(r0v, c64(r)) for r in range(n_rows)]
        wrows = [_gep(builder, wbase, builder.mul(r, wrow)) for r in rows]
        srows = [_gep(builder, a_sc.data, builder.mul(r, srow)) for r in rows]
        accs = [cgutils.alloca_once_value(builder, zero4) for _ in range(n_t)]
        gaccs = [cgutils.alloca_once_value(builder, zero4) for _ in range(n_t)]
        cur_g = cgutils.alloca_once(builder, i64)
        builder.store(builder.sext(builder.load(a_bm.data), i64), cur_g)

        def flush(g):  # acc += gacc * sc[rows, g]; gacc = 0 (every token)
            s = zero4
            for r in range(n_rows):
                s = builder.insert_element(s, group_scale(builder, srows[r], g, nbv, factored),
                                           ir.Constant(_I32, r))
            for j in range(n_t):
                builder.store(builder.call(fmuladd, [builder.load(gaccs[j]), s,
                                                     builder.load(accs[j])]), accs[j])
                builder.store(zero4, gaccs[j])

        def act(j, bidx):  # token j's activations and scale of block bidx
            xoff = builder.mul(bidx, c64(32))
            xa = builder.load(builder.bitcast(_gep(builder, xbases[j], xoff),
                                              _V16I16.as_pointer()), align=2)
            xb = builder.load(builder.bitcast(_gep(builder, xbases[j], builder.add(
                xoff, c64(16))), _V16I16.as_pointer()), align=2)
            return xa, xb, _splat4(builder, builder.load(_gep(builder, dbases[j], bidx)))

        def accumulate(j, p32s, x):  # gacc += float(D) * dx_b, D the rows' block dots
            d = builder.sitofp(block_dots4(builder, p32s), _V4F32)
            builder.store(builder.call(fmuladd, [d, x[2], builder.load(gaccs[j])]), gaccs[j])

        def group_of(bidx):
            return builder.sext(builder.load(_gep(builder, a_bm.data, bidx)), i64)

        def enter_group(g):  # flush when block group g starts a new group
            with builder.if_then(builder.icmp_signed("!=", g, builder.load(cur_g)),
                                 likely=False):
                flush(builder.load(cur_g))
                builder.store(g, cur_g)

        def row_chunk(r, off):  # the row's bytes at off, the next ones prefetched
            wv = builder.load(builder.bitcast(_gep(builder, wrows[r], off),
                                              _V32I8.as_pointer()), align=1)
            builder.call(prefetch, [_gep(builder, wrows[r], builder.add(off, ahead)),
                                    ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                    ir.Constant(_I32, 1)])
            return wv

        def dot(a, b, x):  # <8 x i32> lane sums of codes (a, b) against activations x
            return builder.add(builder.call(pmaddwd, [a, x[0]]), builder.call(pmaddwd, [b, x[1]]))

        def single_blocks():  # 8-bit: a block per step, codes sign-widened to ACT_ORDER
            with cgutils.for_range(builder, nbv) as loop:
                b = loop.index
                off = builder.mul(b, c64(32))
                xs = [act(j, b) for j in range(n_t)]
                enter_group(group_of(b))
                ps = [[] for _ in range(n_t)]
                for r in range(n_rows):
                    wv = row_chunk(r, off)
                    la, lb = widen_signed(builder, wv)
                    for j in range(n_t):
                        ps[j].append(dot(la, lb, xs[j]))
                for j in range(n_t):
                    accumulate(j, ps[j], xs[j])

        def chunk_blocks():  # 4-/5-bit: the two blocks of a 64-column chunk per step
            with cgutils.for_range(builder, builder.udiv(nbv, c64(2))) as loop:
                c = loop.index
                off = builder.mul(c, c64(CHUNK_BYTES[bits]))
                b0 = builder.mul(c, c64(2))
                b1 = builder.add(b0, c64(1))
                x0s = [act(j, b0) for j in range(n_t)]
                x1s = [act(j, b1) for j in range(n_t)]
                g0, g1 = group_of(b0), group_of(b1)
                enter_group(g0)
                lo, hi = [[] for _ in range(n_t)], [[] for _ in range(n_t)]
                for r in range(n_rows):
                    wv = row_chunk(r, off)
                    la, lb, ha, hb = chunk_codes(builder, bits, wv, wrows[r], off)
                    for j in range(n_t):
                        lo[j].append(dot(la, lb, x0s[j]))
                        hi[j].append(dot(ha, hb, x1s[j]))
                for j in range(n_t):
                    accumulate(j, lo[j], x0s[j])
                with builder.if_then(builder.icmp_signed("!=", g1, g0), likely=False):
                    flush(g0)
                for j in range(n_t):
                    accumulate(j, hi[j], x1s[j])
                builder.store(g1, cur_g)

        (single_blocks if eight else chunk_blocks)()
        flush(builder.load(cur_g))
        for j in range(n_t):
            v = builder.load(accs[j])
            for r in range(n_rows):
                builder.store(builder.extract_element(v, ir.Constant(_I32, r)),
                              _gep(builder, ybases[j], rows[r]))
        return context.get_dummy_value()

    if n_tok:
        @intrinsic
        def kernel_tokens(typingctx, y, r0, wp, sc, xq, dx, bmap, nb, t0):
            return types.void(y, r0, wp, sc, xq, dx, bmap, nb, t0), codegen

        return kernel_tokens

    @intrinsic
    def kernel(typingctx, y, r0, wp, sc, xq, dx, bmap, nb):
        return types.void(y, r0, wp, sc, xq, dx, bmap, nb), codegen

    return kernel


#: Row kernels of the block-dot numerics, ``{n_rows: kernel}`` for 4 and 1 rows (4- or
#: 8-bit by ``wp``'s dtype); ``BLOCKDOT_ROWS5`` the 5-bit ones.
BLOCKDOT_ROWS = {n: _make_rows_kernel(n) for n in (4, 1)}
BLOCKDOT_ROWS5 = {n: _make_rows_kernel(n, five=True) for n in (4, 1)}
#: Token rows per call of the multi-token row kernels (4 rows x 2 tokens: the codes
#: unpacked once for both; a GEMM's 2 or 3 tokens, where the few-token tiles do not pay).
ROWS_TOKENS = 2
BLOCKDOT_ROWS4_TOKENS = {five: _make_rows_kernel(4, five, ROWS_TOKENS) for five in (False, True)}
