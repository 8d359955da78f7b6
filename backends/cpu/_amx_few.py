"""AMX-INT8 GEMM for a few tokens (a batched decode step, a speculative verify, a short
chat turn) on 4-bit weights (4 to 15 tokens) and 5- and 8-bit ones (from 3 tokens, any
count), straight from their row layout.

Each (token, row) output is the block-dot GEMV's (:mod:`._blockdot`), bit for bit: the
tile unit gives the exact integer dot of every 32-column block and the float steps are
the documented ones, per (row, token) lane. Unlike :func:`._amx.gemm_amx` (16-token
tiles, weights unpacked into B tiles once per call), the weights are the A operand:

* 4- and 5-bit: per pair of blocks and panel of 16 rows, the packed row bytes (low
  nibbles: block ``2c``, high: ``2c + 1``; 5-bit: OR-ed with the blocks' fifth bits) are
  split into two 16 x 32 int8 tiles in a ring of stack slots filled :data:`AHEAD` pairs
  before the tiles load them (a tile load right after the vector stores to its lines
  waits for them: ~2x slower here); 8-bit: the tile loads a block's 16 x 32 codes from
  the rows themselves (stride: the row);
* each pair step prefetches the next panel's bytes at its offset (one line a row): in a
  model the weights come from memory, not L2 (a 4- or 8-row SmolLM2 step 7-17% faster);
* activations (15-bit, :func:`.gemv.quantize_act`) are split as ``q = 128 h + l`` as in
  :mod:`._amx`, and a block's B tile holds ``h`` of ``nt`` tokens then their ``l``
  (``8 x 8 nt`` bytes, VNNI order, natural column order);
* ``C = A B`` is ``[16 rows, 2 nt]`` int32; ``D = 128 C_h + C_l`` is gathered into
  lanes (row, token), 16 per vector, for the FMAs ``gacc = fma(float(D), dx, gacc)`` and
  ``acc = fma(gacc, sc, acc)``.

Tokens go in groups of ``nt`` in {4, 8} (a group's missing tokens are zero rows).
Against the row kernels (``benchmarks/MEASUREMENTS.md``, the README): 4-bit 1.1-1.7x at
4 tokens, 1.4-2.3x from 8, no gain at 2-3; 8-bit 1.0-1.4x at 3 tokens, 1.3-2.2x at 4;
5-bit 1.3-1.6x at 3 tokens, 1.6-3.7x at 4-64 (:data:`FEW_MIN_TOKENS`).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._amx import blockdot_rows, tile_ops
from ._simd_ir import (_I8, _I32, ACT_ORDER, CHUNK_BYTES, _declare, _fifth_bits, _gep,
                       group_scale)
from .gemv import XQ_DTYPE, XQ_PER_BLOCK, _finish_rows, quantize_rows

#: Weight rows per panel (the A tile's rows).
PANEL = 16
#: Fewest tokens that take this path (fewer: the row kernels), by the weight's bits.
FEW_MIN_TOKENS = {4: 4, 5: 3, 8: 3}
#: Unpack slots (1 KB each; a power of two) and how many pairs ahead they are filled.
RING, AHEAD = 8, 4
_V16I32 = ir.VectorType(_I32, 16)
_V16F32 = ir.VectorType(ir.FloatType(), 16)
_V32I8 = ir.VectorType(_I8, 32)


def _make_kernel(nt: int, five: bool = False):
    """Intrinsic ``k(y, t0, tn, r0, npan, wp, sc, bact, dxp, bmap, nb)``: ``y[t0 + t, r]``
    = the block-dot ``acc`` (before the zero-point term) for the ``npan`` panels of 16
    rows from ``r0`` and tokens ``t < tn <= nt``. ``wp`` uint8 [out, nb * 16] (4-bit) or
    int8 [out, nb * 32] (8-bit) and ``sc`` as :class:`~.repack.CpuQuantWeight`'s; ``bact``
    int8 [nb, 8, 8 nt] and ``dxp`` float32 [nb, nt] from :func:`split_tokens`; ``y``
    float32 [T, out]; ``five``: 5-bit codes (uint8 [out, nb * 20]: 40-byte chunks, the
    nibbles then a u32 of fifth bits per block)."""
    ncol = 2 * nt   # C columns: h of each token, then l
    pair_bytes = CHUNK_BYTES[5] if five else CHUNK_BYTES[4]
    per = PANEL // nt  # rows per float vector (lanes (row, token), row-major)

    @intrinsic
    def kernel(typingctx, y, t0, tn, r0, npan, wp, sc, bact, dxp, bmap, nb):
        sig = types.void(y, t0, tn, r0, npan, wp, sc, bact, dxp, bmap, nb)

        def codegen(context, builder, signature, args):
            factored = signature.args[6].dtype == types.uint8
            eight = signature.args[5].dtype == types.int8  # 8-bit codes, else nibbles
            a_y, a_wp, a_sc, a_ba, a_dx, a_bm = (
                context.make_array(signature.args[i])(context, builder, args[i])
                for i in (0, 5, 6, 7, 8, 9))
            t0v, tnv, r0v, npv, nbv = args[1], args[2], args[3], args[4], args[10]
            i64, i16, f32 = ir.IntType(64), ir.IntType(16), ir.FloatType()
            c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
            t8 = lambda v: ir.Constant(_I8, v)  # noqa: E731
            i8p = _I8.as_pointer()
            ldcfg, release, tzero, tload, tstore, dpb, fmuladd = tile_ops(builder.module)
            wrow = cgutils.unpack_tuple(builder, a_wp.strides, 2)[0]
            ahead = builder.mul(wrow, c64(PANEL))  # the next panel's rows
            prefetch = _declare(builder.module, "llvm.prefetch.p0i8", ir.VoidType(),
                                [i8p, _I32, _I32, _I32])
            srow = cgutils.unpack_tuple(builder, a_sc.shape, 2)[1]
            ystride = cgutils.unpack_tuple(builder, a_y.strides, 2)[0]
            bstride, brow = cgutils.unpack_tuple(builder, a_ba.strides, 3)[:2]
            dstride = cgutils.unpack_tuple(builder, a_dx.strides, 2)[0]

            def scratch(n):
                a = cgutils.alloca_once(builder, ir.ArrayType(_I8, n))
                a.align = 64
                return builder.bitcast(a, i8p)
            cfgp = scratch(64)
            ring = scratch(1024 * RING)
            cbs = [scratch(64 * ncol), scratch(64 * ncol)]
            outp = builder.bitcast(scratch(64 * nt), f32.as_pointer())
            zero16 = ir.Constant(_V16F32, [0.0] * 16)
            gaccs = [cgutils.alloca_once_value(builder, zero16) for _ in range(nt)]
            accs = [cgutils.alloca_once_value(builder, zero16) for _ in range(nt)]
            cur_g = cgutils.alloca_once(builder, i64)
            builder.store(ir.Constant(ir.ArrayType(_I8, 64), [0] * 64),
                          builder.bitcast(cfgp, ir.ArrayType(_I8, 64).as_pointer()))
            builder.store(t8(1), cfgp)  # palette 1
            colsb = builder.bitcast(_gep(builder, cfgp, c64(16)), i16.as_pointer())
            # tiles 0, 1: C [16 x 2nt] int32; 2, 3: A codes [16 x 32]; 4, 5: B acts [8 x 8nt]
            for t, (rows, cols) in enumerate([(16, 4 * ncol)] * 2 + [(16, 32)] * 2
                                             + [(8, 4 * ncol)] * 2):
                builder.store(ir.Constant(i16, cols), _gep(builder, colsb, c64(t)))
                builder.store(t8(rows), _gep(builder, cfgp, c64(48 + t)))
            builder.call(ldcfg, [cfgp])
            wbase = builder.bitcast(a_wp.data, i8p)
            abase = builder.bitcast(a_ba.data, i8p)
            dbase = builder.bitcast(a_dx.data, i8p)
            yb = builder.bitcast(a_y.data, i8p)
            lo_mask = ir.Constant(_V32I8, [0x0F] * 32)
            four = ir.Constant(_V32I8, [4] * 32)
            seven = ir.Constant(_V16I32, [7] * 16)
            npairs = builder.udiv(nbv, c64(2))
            vrows = ir.VectorType(_I32, per * ncol)  # the C entries of one float vector's rows
            hsel = ir.Constant(_V16I32, [m * ncol + t for m in range(per) for t in range(nt)])
            lsel = ir.Constant(_V16I32, [m * ncol + nt + t for m in range(per) for t in range(nt)])
            dsel = ir.Constant(_V16I32, [t for _ in range(per) for t in range(nt)])

            def group_of(bidx):
                return builder.sext(builder.load(_gep(builder, a_bm.data, bidx)), i64)

            with cgutils.for_range(builder, npv) as pl:
                p0 = builder.add(r0v, builder.mul(pl.index, c64(PANEL)))
                rows = [builder.add(p0, c64(m)) for m in range(PANEL)]
                wrows = [_gep(builder, wbase, builder.mul(r, wrow)) for r in rows]
                srows = [_gep(builder, a_sc.data, builder.mul(r, srow)) for r in rows]
                for j in range(nt):
                    builder.store(zero16, gaccs[j])
                    builder.store(zero16, accs[j])
                builder.store(group_of(c64(0)), cur_g)

                def slot(cidx):
                    return _gep(builder, ring, builder.mul(builder.and_(cidx, c64(RING - 1)),
                                                           c64(1024)))

                def unpack(cidx):  # pair cidx: codes of block 2c -> slot[:512], 2c+1 -> [512:]
                    off = builder.mul(cidx, c64(pair_bytes))
                    dst = slot(cidx)
                    for m in range(PANEL):
                        v = builder.load(builder.bitcast(_gep(builder, wrows[m], off),
                                                         _V32I8.as_pointer()), align=1)
                        lo, hi = builder.and_(v, lo_mask), builder.lshr(v, four)
                        if five:  # | 16 where the block's fifth bit of the column is set
                            lo = builder.or_(lo, _fifth_bits(builder, wrows[m],
                                                             builder.add(off, c64(32))))
                            hi = builder.or_(hi, _fifth_bits(builder, wrows[m],
                                                             builder.add(off, c64(36))))
                        builder.store(lo, builder.bitcast(
                            _gep(builder, dst, c64(32 * m)), _V32I8.as_pointer()), align=32)
                        builder.store(hi, builder.bitcast(
                            _gep(builder, dst, c64(512 + 32 * m)), _V32I8.as_pointer()),
                            align=32)

                def fetch_next_panel(off):  # the next panel's bytes at off, one line a row
                    for m in range(PANEL):
                        builder.call(prefetch, [_gep(builder, wrows[m], builder.add(off, ahead)),
                                                ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                                ir.Constant(_I32, 1)])

                def flush(g):  # acc += gacc * sc[row, g]; gacc = 0
                    s = zero16
                    for m in range(PANEL):
                        s = builder.insert_element(
                            s, group_scale(builder, srows[m], g, nbv, factored),
                            ir.Constant(_I32, m))
                    for j in range(nt):
                        sj = builder.shuffle_vector(s, s, ir.Constant(
                            _V16I32, [j * per + m for m in range(per) for _ in range(nt)]))
                        builder.store(builder.call(fmuladd, [builder.load(gaccs[j]), sj,
                                                             builder.load(accs[j])]), accs[j])
                        builder.store(zero16, gaccs[j])

                def block(k, bidx):  # gacc += float(D) * dx for block bidx (C in cbs[k])
                    dv = builder.load(builder.bitcast(
                        _gep(builder, dbase, builder.mul(bidx, dstride)),
                        ir.VectorType(f32, nt).as_pointer()), align=4)
                    dx16 = builder.shuffle_vector(dv, dv, dsel)
                    cv = builder.bitcast(cbs[k], vrows.as_pointer())
                    for j in range(nt):
                        c = builder.load(_gep(builder, cv, c64(j)), align=64)
                        d = builder.add(builder.shl(builder.shuffle_vector(c, c, hsel), seven),
                                        builder.shuffle_vector(c, c, lsel))
                        builder.store(builder.call(fmuladd, [builder.sitofp(d, _V16F32), dx16,
                                                             builder.load(gaccs[j])]), gaccs[j])

                def dots(*tiles):  # C tile k = A (codes at a_src) x B (block bidx), k = 0, 1
                    for k, _ in enumerate(tiles):
                        builder.call(tzero, [t8(k)])
                    for k, (a_src, a_stride, _) in enumerate(tiles):
                        builder.call(tload, [t8(2 + k), a_src, a_stride])
                    for k, (_, _, bidx) in enumerate(tiles):
                        builder.call(tload, [t8(4 + k), _gep(builder, abase,
                                                             builder.mul(bidx, bstride)), brow])
                    for k, _ in enumerate(tiles):
                        builder.call(dpb, [t8(k), t8(2 + k), t8(4 + k)])
                    for k, _ in enumerate(tiles):
                        builder.call(tstore, [t8(k), cbs[k], c64(4 * ncol)])

                def enter_group(g):
                    with builder.if_then(builder.icmp_signed("!=", g, builder.load(cur_g)),
                                         likely=False):
                        flush(builder.load(cur_g))
                        builder.store(g, cur_g)

                if not eight:
                    for u in range(AHEAD):
                        with builder.if_then(builder.icmp_signed(">", npairs, c64(u))):
                            unpack(c64(u))
                with cgutils.for_range(builder, npairs) as loop:
                    cidx = loop.index
                    b0 = builder.mul(cidx, c64(2))
                    b1 = builder.add(b0, c64(1))
                    fetch_next_panel(builder.mul(cidx, c64(64 if eight else pair_bytes)))
                    if eight:  # the codes straight from the rows: 16 x 32 bytes, row stride
                        dots((_gep(builder, wrows[0], builder.mul(b0, c64(32))), wrow, b0),
                             (_gep(builder, wrows[0], builder.mul(b1, c64(32))), wrow, b1))
                    else:
                        nxt = builder.add(cidx, c64(AHEAD))
                        with builder.if_then(builder.icmp_signed("<", nxt, npairs)):
                            unpack(nxt)
                        src = slot(cidx)
                        dots((src, c64(32), b0), (_gep(builder, src, c64(512)), c64(32), b1))
                    g0, g1 = group_of(b0), group_of(b1)
                    enter_group(g0)
                    block(0, b0)
                    with builder.if_then(builder.icmp_signed("!=", g1, g0), likely=False):
                        flush(g0)
                    block(1, b1)
                    builder.store(g1, cur_g)
                if eight:  # an odd last block
                    blast = builder.sub(nbv, c64(1))
                    with builder.if_then(builder.icmp_signed(
                            "!=", builder.mul(npairs, c64(2)), nbv)):
                        dots((_gep(builder, wrows[0], builder.mul(blast, c64(32))), wrow, blast))
                        enter_group(group_of(blast))
                        block(0, blast)
                flush(builder.load(cur_g))
                ov = builder.bitcast(outp, _V16F32.as_pointer())
                for j in range(nt):
                    builder.store(builder.load(accs[j]), _gep(builder, ov, c64(j)), align=64)
                with cgutils.for_range(builder, tnv) as tl:  # y[t0 + t, p0 + m] = out[m, t]
                    rowp = builder.bitcast(
                        _gep(builder, yb, builder.mul(builder.add(t0v, tl.index), ystride)),
                        f32.as_pointer())
                    for m in range(PANEL):
                        v = builder.load(_gep(builder, outp, builder.add(c64(m * nt), tl.index)))
                        builder.store(v, _gep(builder, rowp, builder.add(p0, c64(m))))
            builder.call(release, [])
            return context.get_dummy_value()

        return sig, codegen

    return kernel


_K4, _K8 = (_make_kernel(n) for n in (4, 8))
_K4_5, _K8_5 = (_make_kernel(n, five=True) for n in (4, 8))
_POS = np.array(ACT_ORDER, np.int64)  # column k of a block is xq[32 b + ACT_ORDER[k]]


@njit(cache=True, inline="always")
def split_tokens(bact, dxp, xq, dx, b, t0, nt, tn):
    """Block ``b`` of tokens ``t0 .. t0 + tn`` (of ``nt``; the rest zero): its B tile
    ``bact[b]`` int8 [8, 8 nt] (row ``k // 4``, column ``t``: ``h`` of token t's column
    k, column ``nt + t``: its ``l``, byte ``k % 4``) and ``dxp[b, :nt]``."""
    for t in range(nt):
        for k in range(32):
            v = np.int32(xq[t0 + t, 32 * b + _POS[k]]) if t < tn else np.int32(0)
            h = (v + 64) >> 7
            bact[b, k // 4, 4 * t + k % 4] = h
            bact[b, k // 4, 4 * (nt + t) + k % 4] = v - (h << 7)
        dxp[b, t] = dx[t0 + t, b] if t < tn else np.float32(0)


@njit(parallel=True, cache=True)
def _gemm_few(y, x, wp, sc, sz, bmap, bias, xq, dx, xg, zmul, bact, dxp, nts, t0s, chunk, five):
    t_n = x.shape[0]
    out = y.shape[1]
    nb = dx.shape[1]
    n_grp = nts.shape[0]
    quantize_rows(xq, dx, xg, x, bmap, zmul)
    for it in prange(n_grp * nb):
        g = it // nb
        split_tokens(bact[g], dxp[g], xq, dx, it - g * nb, t0s[g], nts[g],
                     min(nts[g], t_n - t0s[g]))
    npan = out // PANEL
    n_items = max(1, -(-npan // chunk))  # one item (the tail rows) when out < 16
    for it in prange(n_items):
        p0 = it * chunk
        n = min(chunk, npan - p0)
        for g in range(n_grp):
            t0 = t0s[g]
            tn = min(nts[g], t_n - t0)
            if nts[g] == 4 and five:
                _K4_5(y, t0, tn, p0 * PANEL, n, wp, sc, bact[g, :, :, :32], dxp[g, :, :4],
                      bmap, nb)
            elif nts[g] == 4:
                _K4(y, t0, tn, p0 * PANEL, n, wp, sc, bact[g, :, :, :32], dxp[g, :, :4], bmap, nb)
            elif five:
                _K8_5(y, t0, tn, p0 * PANEL, n, wp, sc, bact[g], dxp[g], bmap, nb)
            else:
                _K8(y, t0, tn, p0 * PANEL, n, wp, sc, bact[g], dxp[g], bmap, nb)
        r1 = out if it == n_items - 1 else (p0 + n) * PANEL
        for t in range(t_n):
            for r in range(npan * PANEL, r1):  # rows past the last full panel: the last item
                blockdot_rows(False, five, y[t], r, wp, sc, xq[t], dx[t], bmap, nb)
            _finish_rows(y[t], p0 * PANEL, r1 - p0 * PANEL, sz, xg[t], bias)


def token_groups(t: int) -> list[int]:
    """Group sizes (4 or 8) for ``t`` tokens: 8 while more than 4 remain."""
    groups = []
    while t > 0:
        n = 8 if t > 4 else 4
        groups.append(n)
        t -= min(n, t)
    return groups


_NO_BIAS = np.zeros(0, np.float32)


def gemm_few(x: np.ndarray, w, bias: np.ndarray | None) -> np.ndarray:
    """y[T, out] = x[T, in] @ W[out, in].T (+ bias) for a 4-, 5- or 8-bit weight on AMX,
    each row bit-identical to its block-dot decode GEMV; for a few tokens (module docstring).

    Args:
        x: float32 [T, in] C-contiguous; w: 4-, 5- or 8-bit (not lane-scaled)
            ``CpuQuantWeight``; bias: float32 [out] or None. The panels are cut into 4
            ranges per Numba thread.

    Returns:
        float32 [T, out].
    """
    t = x.shape[0]
    nb = w.n_blocks
    nts = np.array(token_groups(t), np.int64)
    t0s = np.concatenate([[0], np.cumsum(nts)[:-1]]).astype(np.int64)
    y = np.empty((t, w.out_features), np.float32)
    chunk = max(1, -(-(w.out_features // PANEL) // (4 * get_num_threads())))
    _gemm_few(y, x, w.wp, w.sc, w.sz, w.bmap, _NO_BIAS if bias is None else bias,
              np.empty((t, nb * XQ_PER_BLOCK), XQ_DTYPE), np.empty((t, nb), np.float32),
              np.empty((t, w.n_groups), np.float32), np.float32(w.zero_scale),
              np.empty((len(nts), nb, 8, 64), np.int8), np.empty((len(nts), nb, 8), np.float32),
              nts, t0s, chunk, w.bits == 5)
    return y
