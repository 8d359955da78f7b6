"""Multi-token row kernels (prefill, batched decode, speculative verify) in LLVM IR.

The decode kernels of :mod:`._simd` compute R rows for one token; called once per
(row block, token), a T-token GEMM widens every weight chunk T times and pays a call,
a setup and a group flush per token. The kernels here take one row at a time and
``n_tok`` tokens at once: each 32-byte weight chunk is loaded and widened to int16 once
and multiplied (``pmaddwd``) with the activations of every token, the ``n_tok`` pairs of
8-float accumulators (group and row) staying in registers; a call covers ``nr``
consecutive rows (contiguous in memory: one sequential stream for the hardware
prefetcher).

Numerics: for every (row, token) the sequence of operations is exactly that of the
decode kernels (same integer dot per block, same FMA into the group accumulator in block
order, same group flush, same horizontal sum), so a row's output is bit-identical to its
decode GEMV whatever ``n_tok`` or the tiling. Arguments: ``y`` float32 [T, out]
(written at rows ``r0 .. r0 + nr - 1`` of tokens ``t0 .. t0 + n_tok - 1``), ``wp`` and
``sc`` as in :mod:`._simd` (4, 5 or 8 bits), ``xq`` int16 [T, nb * 32], ``dx`` float32 [T, nb] (2-D,
rows of any stride), ``bmap`` int32 [nb], ``nb`` blocks per row. No zero-point term (the
caller subtracts it as for decode).
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._simd_ir import (_F32, _I8, _I16, _I32, _V8F32, _V8I32, _V16I16, _V32I8, CHUNK_BYTES,
                       HAVE_AVX2, STRICT, _declare, _gep, _splat4, _splat_f32, chunk_codes,
                       group_scale, row_ptr, widen_signed, zero_accs_ir)
from ._simd import _rows_portable
from .gemv import _finish_rows

#: Token counts with a kernel of their own (a T-token call is split into these).
TOKEN_BLOCK = 4


def _pair_add(builder, a, b):  # vhaddps: [a01 a23 b01 b23 | a45 a67 b45 b67]
    ev = ir.Constant(ir.VectorType(_I32, 8), [0, 2, 8, 10, 4, 6, 12, 14])
    od = ir.Constant(ir.VectorType(_I32, 8), [1, 3, 9, 11, 5, 7, 13, 15])
    return builder.fadd(builder.shuffle_vector(a, b, ev), builder.shuffle_vector(a, b, od),
                        flags=STRICT)


def _hsum4(builder, vs):
    """Horizontal sums of up to 4 <8 x float> as one <4 x float>, each by the tree of
    :func:`._simd_ir._hsum8` (((0+1)+(2+3))+((4+5)+(6+7))): the same float result."""
    zero = ir.Constant(_V8F32, [0.0] * 8)
    vs = list(vs) + [zero] * (4 - len(vs))
    h = _pair_add(builder, _pair_add(builder, vs[0], vs[1]), _pair_add(builder, vs[2], vs[3]))
    lo = builder.shuffle_vector(h, h, ir.Constant(ir.VectorType(_I32, 4), [0, 1, 2, 3]))
    hi = builder.shuffle_vector(h, h, ir.Constant(ir.VectorType(_I32, 4), [4, 5, 6, 7]))
    return builder.fadd(lo, hi, flags=STRICT)


def _make_tokens_kernel(n_tok: int, bits: int):
    """Intrinsic ``k(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)`` for
    ``n_tok`` tokens (``sz`` float32 [rows, ng] or factored uint8, ``xg`` float32 [T, ng]
    C-contiguous the activation group sums times the weight's zero scale, ``bias``
    float32 [rows] or [0])."""

    @intrinsic
    def kernel(typingctx, y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
        sig = types.void(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb)

        def codegen(context, builder, signature, args):
            (ty_y, _, _, _, ty_wp, ty_sc, ty_sz, ty_xg, ty_b, ty_xq, ty_dx, ty_bm,
             _) = signature.args
            a_y = context.make_array(ty_y)(context, builder, args[0])
            a_wp = context.make_array(ty_wp)(context, builder, args[4])
            a_sc = context.make_array(ty_sc)(context, builder, args[5])
            a_sz = context.make_array(ty_sz)(context, builder, args[6])
            a_xg = context.make_array(ty_xg)(context, builder, args[7])
            a_b = context.make_array(ty_b)(context, builder, args[8])
            a_xq = context.make_array(ty_xq)(context, builder, args[9])
            a_dx = context.make_array(ty_dx)(context, builder, args[10])
            a_bm = context.make_array(ty_bm)(context, builder, args[11])
            i64 = ir.IntType(64)
            t0v, r0v, nrv, nbv = args[1], args[2], args[3], args[12]
            szw = cgutils.unpack_tuple(builder, a_sz.shape, 2)[1]  # elements per sz row
            sc_fac, sz_fac = ty_sc.dtype == types.uint8, ty_sz.dtype == types.uint8
            ngv = nbv if sz_fac else szw  # a factored term has one group per block
            has_bias = builder.icmp_signed(
                ">", cgutils.unpack_tuple(builder, a_b.shape, 1)[0], ir.Constant(i64, 0))
            wrow = cgutils.unpack_tuple(builder, a_wp.strides, 2)[0]
            srow = cgutils.unpack_tuple(builder, a_sc.shape, 2)[1]
            mod = builder.module
            pmaddwd = _declare(mod, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
            fmuladd = _declare(mod, "llvm.fmuladd.v8f32", _V8F32, [_V8F32, _V8F32, _V8F32])
            wbase = builder.bitcast(a_wp.data, _I8.as_pointer())
            zero8 = ir.Constant(_V8F32, [0.0] * 8)
            toks = [builder.add(t0v, ir.Constant(i64, t)) for t in range(n_tok)]
            xrows = [row_ptr(builder, a_xq, t, _I16) for t in toks]
            drows = [row_ptr(builder, a_dx, t, _F32) for t in toks]
            yrows = [row_ptr(builder, a_y, t, _F32) for t in toks]
            xgrows = [row_ptr(builder, a_xg, t, _F32) for t in toks]
            accs = [cgutils.alloca_once(builder, _V8F32) for _ in range(n_tok)]
            gaccs = [cgutils.alloca_once(builder, _V8F32) for _ in range(n_tok)]
            cur_g = cgutils.alloca_once(builder, i64)

            def group_of(bidx):
                return builder.sext(builder.load(_gep(builder, a_bm.data, bidx)), i64)

            with cgutils.for_range(builder, nrv) as rloop:
                row = builder.add(r0v, rloop.index)
                wr = _gep(builder, wbase, builder.mul(row, wrow))
                sr = _gep(builder, a_sc.data, builder.mul(row, srow))
                for t in range(n_tok):
                    builder.store(zero8, accs[t])
                    builder.store(zero8, gaccs[t])
                builder.store(group_of(ir.Constant(i64, 0)), cur_g)

                def flush_all(g):  # acc_t += gacc_t * sc[row, g]; gacc_t = 0
                    f = _splat_f32(builder, group_scale(builder, sr, g, nbv, sc_fac))
                    for t in range(n_tok):
                        builder.store(builder.call(fmuladd, [builder.load(gaccs[t]), f,
                                                             builder.load(accs[t])]), accs[t])
                        builder.store(zero8, gaccs[t])

                def enter_group(g):
                    with builder.if_then(builder.icmp_signed("!=", g, builder.load(cur_g)),
                                         likely=False):
                        flush_all(builder.load(cur_g))
                        builder.store(g, cur_g)

                def dot_all(wa, wb, bidx):  # gacc_t += cvt(wa . xa_t + wb . xb_t) * dx_t[b]
                    xoff = builder.mul(bidx, ir.Constant(i64, 32))
                    for t in range(n_tok):
                        pa = builder.bitcast(_gep(builder, xrows[t], xoff), _V16I16.as_pointer())
                        pb = builder.bitcast(_gep(builder, xrows[t], builder.add(
                            xoff, ir.Constant(i64, 16))), _V16I16.as_pointer())
                        xa = builder.load(pa, align=2)
                        xb = builder.load(pb, align=2)
                        f = _splat_f32(builder, builder.load(_gep(builder, drows[t], bidx)))
                        p32 = builder.add(builder.call(pmaddwd, [wa, xa]),
                                          builder.call(pmaddwd, [wb, xb]))
                        builder.store(builder.call(fmuladd, [builder.sitofp(p32, _V8F32), f,
                                                             builder.load(gaccs[t])]), gaccs[t])

                if bits in (4, 5):
                    with cgutils.for_range(builder, builder.udiv(nbv, ir.Constant(i64, 2))) as cl:
                        c = cl.index
                        off = builder.mul(c, ir.Constant(i64, CHUNK_BYTES[bits]))
                        b0 = builder.mul(c, ir.Constant(i64, 2))
                        b1 = builder.add(b0, ir.Constant(i64, 1))
                        g0, g1 = group_of(b0), group_of(b1)
                        enter_group(g0)
                        wv = builder.load(builder.bitcast(_gep(builder, wr, off),
                                                          _V32I8.as_pointer()), align=1)
                        la, lb, ha, hb = chunk_codes(builder, bits, wv, wr, off)
                        dot_all(la, lb, b0)
                        with builder.if_then(builder.icmp_signed("!=", g1, g0), likely=False):
                            flush_all(g0)
                        dot_all(ha, hb, b1)
                        builder.store(g1, cur_g)
                else:
                    with cgutils.for_range(builder, nbv) as bl:
                        b = bl.index
                        off = builder.mul(b, ir.Constant(i64, 32))
                        enter_group(group_of(b))
                        wv = builder.load(builder.bitcast(_gep(builder, wr, off),
                                                          _V32I8.as_pointer()), align=1)
                        dot_all(*widen_signed(builder, wv), b)
                flush_all(builder.load(cur_g))
                tot = _hsum4(builder, [builder.load(a) for a in accs])
                # zero-point term per token: _finish_rows' (zero_term_ir) lane sums, then
                # the same tree (_hsum4 is _hsum8 per vector)
                szr = _gep(builder, a_sz.data, builder.mul(row, szw))
                zp = _hsum4(builder, zero_accs_ir(builder, szr, xgrows, ngv, sz_fac))
                v = cgutils.alloca_once_value(builder, builder.fsub(tot, zp, flags=STRICT))
                with builder.if_then(has_bias):
                    bv = _splat4(builder, builder.load(_gep(builder, a_b.data, row)))
                    builder.store(builder.fadd(builder.load(v), bv, flags=STRICT), v)
                vv = builder.load(v)
                for t in range(n_tok):
                    builder.store(builder.extract_element(vv, ir.Constant(_I32, t)),
                                  _gep(builder, yrows[t], row))
            return context.get_dummy_value()

        return sig, codegen

    return kernel


@njit(cache=True)  # per token: the decode kernels' portable rows, then gemv._finish_rows
def _tok_portable(y, t0, n_tok, r0, nr, bits, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    for t in range(t0, t0 + n_tok):
        _rows_portable(y[t], r0, nr, bits, wp, sc, xq[t], dx[t], bmap, nb)
        _finish_rows(y[t], r0, nr, sz, xg[t], bias)


@njit(cache=True)
def _p_q4_tok1(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    _tok_portable(y, t0, 1, r0, nr, 4, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q4_tok2(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    _tok_portable(y, t0, 2, r0, nr, 4, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q4_tok3(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    _tok_portable(y, t0, 3, r0, nr, 4, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q4_tok4(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    _tok_portable(y, t0, 4, r0, nr, 4, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q5_tok1(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    _tok_portable(y, t0, 1, r0, nr, 5, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q5_tok2(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    _tok_portable(y, t0, 2, r0, nr, 5, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q5_tok3(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    _tok_portable(y, t0, 3, r0, nr, 5, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q5_tok4(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    _tok_portable(y, t0, 4, r0, nr, 5, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q8_tok1(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    _tok_portable(y, t0, 1, r0, nr, 8, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q8_tok2(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    _tok_portable(y, t0, 2, r0, nr, 8, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q8_tok3(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    _tok_portable(y, t0, 3, r0, nr, 8, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


@njit(cache=True)
def _p_q8_tok4(y, t0, r0, nr, wp, sc, sz, xg, bias, xq, dx, bmap, nb):
    _tok_portable(y, t0, 4, r0, nr, 8, wp, sc, sz, xg, bias, xq, dx, bmap, nb)


#: ``{(n_tok, bits): kernel}`` for n_tok in 1..TOKEN_BLOCK: the AVX2 IR intrinsics where
#: the host has AVX2, else portable loops with the decode kernels' portable math.
#: ``SIMD_TOKENS`` holds the intrinsics regardless (tests compare the two when possible).
SIMD_TOKENS = {(n, b): _make_tokens_kernel(n, b) for n in range(1, TOKEN_BLOCK + 1)
               for b in (4, 5, 8)}
PORTABLE_TOKENS = {(1, 4): _p_q4_tok1, (2, 4): _p_q4_tok2, (3, 4): _p_q4_tok3,
                   (4, 4): _p_q4_tok4, (1, 5): _p_q5_tok1, (2, 5): _p_q5_tok2,
                   (3, 5): _p_q5_tok3, (4, 5): _p_q5_tok4, (1, 8): _p_q8_tok1,
                   (2, 8): _p_q8_tok2, (3, 8): _p_q8_tok3, (4, 8): _p_q8_tok4}
_TOK = SIMD_TOKENS if HAVE_AVX2 else PORTABLE_TOKENS
q4_tok1, q4_tok2, q4_tok3, q4_tok4 = (_TOK[(n, 4)] for n in range(1, 5))
q5_tok1, q5_tok2, q5_tok3, q5_tok4 = (_TOK[(n, 5)] for n in range(1, 5))
q8_tok1, q8_tok2, q8_tok3, q8_tok4 = (_TOK[(n, 8)] for n in range(1, 5))
