"""AMX-INT8 GEMM for 4- and 5-bit weights (prefill, batched decode, speculative verify).

On a CPU with AMX (Intel Sapphire Rapids and later) 4-bit weights use the block-dot
numerics of :mod:`._blockdot` in decode and here alike, so every (token, row) output is
bit-identical to its decode GEMV. The exact integer block dots come from the tile unit:

* activations are quantized as for decode (:func:`.gemv.quantize_act`: 15-bit integers
  ``q`` per 32-column block) and split as ``q = 128 h + l`` with ``h`` in [-127, 127] and
  ``l`` in [-64, 63], both int8, in tiles of 16 tokens x 32 columns (zero rows past T);
* a panel of 16 weight rows is unpacked once per call into int8 B tiles (8 rows of
  16 x 4 codes, the VNNI order of ``tdpbssd``) and its scales into ``[ng, 16]``; a
  token tile runs over two panels at a time (:func:`_make_amx_panels`);
* per block two ``tdpbssd`` give ``C_h`` and ``C_l``, and ``D = 128 C_h + C_l`` is the
  exact dot of every (token, row) of the tile; then the float steps of :mod:`._blockdot`
  on 16 rows at a time, and the zero-point term and bias in :func:`.gemv._finish_rows`'
  float order, 16 rows per vector, stored straight to ``y``.

The kernel is LLVM IR inlined into Numba (``llvm.x86.ldtilecfg``, ``tileloadd64``,
``tdpbssd``, ``tilestored64``: Intel SDM vol. 1 ch. 18). Linux grants the tile state to
a process on request (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``,
``Documentation/arch/x86/xstate.rst``): :data:`HAVE_AMX` is true only when it did. Fewer
than :data:`AMX_MIN_TOKENS` tokens take the few-token tiles (:mod:`._amx_few`) or, as a
refused request does, :func:`gemm_rows` (the block-dot row kernels, every token over
each 4 rows): the same floats.
"""
from __future__ import annotations

import ctypes
import os
import platform

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._blockdot import BLOCKDOT, BLOCKDOT_ROWS, BLOCKDOT_ROWS4_TOKENS, BLOCKDOT_ROWS5, ROWS_TOKENS
from ._simd_ir import (_I8, _I32, ACT_ORDER, STRICT, _declare, _gep, _masked_load,
                       _masked_store, group_value, splat)
from .gemv import XQ_DTYPE, XQ_PER_BLOCK, _finish_rows, quantize_rows


def _request_amx() -> bool:
    """Ask Linux for the AMX tile data state (process-wide); True when granted."""
    if not BLOCKDOT or platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    if os.environ.get("EDGEINFER_CPU_AMX", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(158, 0x1023, 18) != 0:  # arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
            return False
        mask = ctypes.c_uint64(0)
        if libc.syscall(158, 0x1022, ctypes.byref(mask)) != 0:  # ARCH_GET_XCOMP_PERM
            return False
        return bool(mask.value & (1 << 18))
    except (OSError, AttributeError):
        return False


#: AMX tiles may run in this process (:data:`BLOCKDOT` and the OS's permission).
HAVE_AMX = _request_amx()
#: Tokens and weight rows per tile.
TILE = 16
#: Fewest tokens that go to these tiles, by the weight's bits (fewer: the few-token tiles
#: of :mod:`._amx_few`, or :func:`gemm_rows`). 5-bit from 32: at 16 tokens the few-token
#: tiles were faster, from 64 these (1.07-1.66x; the README).
AMX_MIN_TOKENS = {4: 16, 5: 32}


def _tile_config() -> np.ndarray:
    """Palette-1 config: tiles 0, 1, 5, 6 int32 C (16 x 64 B); 2, 3 int8 A (16 x 32 B);
    4, 7 int8 B (8 x 64 B)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb = cfg[16:48].view(np.uint16)
    for t, (rows, cols) in enumerate([(16, 64), (16, 64), (16, 32), (16, 32), (8, 64),
                                      (16, 64), (16, 64), (8, 64)]):
        colsb[t] = cols
        cfg[48 + t] = rows
    return cfg


_CFG = _tile_config()
_V16I32 = ir.VectorType(_I32, 16)
_V16F32 = ir.VectorType(ir.FloatType(), 16)


def tile_ops(mod) -> tuple:
    """LLVM declarations in ``mod`` of the tile instructions the kernels use: ``ldtilecfg``,
    ``tilerelease``, ``tilezero``, ``tileloadd64``, ``tilestored64``, ``tdpbssd``, and
    ``llvm.fmuladd.v16f32`` (their float steps)."""
    i8p, i64, void = _I8.as_pointer(), ir.IntType(64), ir.VoidType()
    return (_declare(mod, "llvm.x86.ldtilecfg", void, [i8p]),
            _declare(mod, "llvm.x86.tilerelease", void, []),
            _declare(mod, "llvm.x86.tilezero", void, [_I8]),
            _declare(mod, "llvm.x86.tileloadd64", void, [_I8, i8p, i64]),
            _declare(mod, "llvm.x86.tilestored64", void, [_I8, i8p, i64]),
            _declare(mod, "llvm.x86.tdpbssd", void, [_I8, _I8, _I8]),
            _declare(mod, "llvm.fmuladd.v16f32", _V16F32, [_V16F32, _V16F32, _V16F32]))


def _zero_term_rows(builder, szt, xgrow, ngv):
    """<16 x float> ``sum_g sz[g, rows] * xg[g]`` of 16 rows (lanes) and one activation
    row: for each row the float sequence of :func:`._simd_ir.zero_term_ir` (group ``g`` in
    class ``g % 8`` from +0.0, in group order; the last ``ngv % 8`` groups' missing
    classes add +0.0; then the :func:`._simd_ir._hsum8` tree), so every lane equals
    :func:`.gemv._finish_rows`'s term bit for bit. ``szt`` <16 x float>* [ng],
    ``xgrow`` float*, ``ngv`` i64."""
    i64 = ir.IntType(64)
    c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
    zero16 = ir.Constant(_V16F32, [0.0] * 16)
    cls = [cgutils.alloca_once_value(builder, zero16) for _ in range(8)]

    def term(g):
        x = builder.load(_gep(builder, xgrow, g))
        return builder.fmul(builder.load(_gep(builder, szt, g), align=4), splat(builder, x, 16),
                            flags=STRICT)

    n8 = builder.lshr(ngv, c64(3))
    with cgutils.for_range(builder, n8) as loop:
        g0 = builder.mul(loop.index, c64(8))
        for j in range(8):
            builder.store(builder.fadd(builder.load(cls[j]), term(builder.add(g0, c64(j))),
                                       flags=STRICT), cls[j])
    g0 = builder.mul(n8, c64(8))
    rem = builder.sub(ngv, g0)
    with builder.if_then(builder.icmp_signed(">", rem, c64(0)), likely=False):
        for j in range(8):
            live = builder.icmp_signed(">", rem, c64(j))
            t = builder.select(live, term(builder.select(live, builder.add(g0, c64(j)), g0)),
                               zero16)
            builder.store(builder.fadd(builder.load(cls[j]), t, flags=STRICT), cls[j])
    lanes = [builder.load(c) for c in cls]
    while len(lanes) > 1:
        lanes = [builder.fadd(lanes[i], lanes[i + 1], flags=STRICT)
                 for i in range(0, len(lanes), 2)]
    return lanes[0]


def _make_amx_panels(n_panels: int):
    """An intrinsic ``k(cfg, ah, al, bt, dxt, sct, szt, xg, bias, bmap, y, t0, nt, r0, nr,
    cbuf, accs)``: ``n_panels`` (1 or 2) 16-row panels from ``r0`` x one 16-token tile:
    ``y[t0 + t, r0 + n]`` = the :mod:`._blockdot` float steps over the exact tile dots,
    minus the zero-point term, plus the bias (the float sequence of
    :func:`.gemv._finish_rows`), for t < nt, n < nr (``nr`` <= 16 ``n_panels``).

    ``cfg`` uint8 [64] (:func:`_tile_config`), ``ah`` / ``al`` int8 [nb, 16, 32] the
    token tile's split activations, ``bt`` [P, nb, 8, 64] bytes (:func:`_pack_panel`) the
    panels' B tiles, ``dxt`` float32 [nb, 16] activation scales, ``sct`` / ``szt``
    float32 [P, ng, 16] / [P, ngz, 16] the panels' scales and zero-point terms, ``xg``
    float32 [T, ng] the activation group sums, ``bias`` float32 [out] or [0], ``bmap``
    int32 [nb], ``y`` float32 [T, out] C-contiguous, ``cbuf`` int32 [P, 2, 16, 16] and
    ``accs`` float32 [P, 16, 16] scratch. Two panels share the activation tiles and
    give the tile unit two independent chains of block dots (tiles 0, 1 / 5, 6).
    """
    c_tiles = [(0, 1), (5, 6)][:n_panels]
    b_tiles = [4, 7][:n_panels]

    @intrinsic
    def amx_panels(typingctx, cfg, ah, al, bt, dxt, sct, szt, xg, bias, bmap, y, t0, nt, r0,
                   nr, cbuf, accs):
        sig = types.void(cfg, ah, al, bt, dxt, sct, szt, xg, bias, bmap, y, t0, nt, r0, nr,
                         cbuf, accs)

        def codegen(context, builder, signature, args):
            (a_cfg, a_ah, a_al, a_bt, a_dxt, a_sct, a_szt, a_xg, a_bias, a_bm, a_y,
             _, _, _, _, a_cb, a_acc) = (
                context.make_array(signature.args[i])(context, builder, args[i])
                if isinstance(signature.args[i], types.Array) else None for i in range(17))
            t0v, ntv, r0v, nrv = args[11], args[12], args[13], args[14]
            i64 = ir.IntType(64)
            c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
            i8p = _I8.as_pointer()
            ldcfg, release, tzero, tload, tstore, dpb, fmuladd = tile_ops(builder.module)
            t8 = lambda v: ir.Constant(_I8, v)  # noqa: E731
            nb = cgutils.unpack_tuple(builder, a_ah.shape, 3)[0]
            ng = cgutils.unpack_tuple(builder, a_sct.shape, 3)[1]
            ngz = cgutils.unpack_tuple(builder, a_szt.shape, 3)[1]
            ahp = builder.bitcast(a_ah.data, i8p)
            alp = builder.bitcast(a_al.data, i8p)
            btp = [_gep(builder, builder.bitcast(a_bt.data, i8p), builder.mul(c64(p * 512), nb))
                   for p in range(n_panels)]
            cbp = [_gep(builder, builder.bitcast(a_cb.data, i8p), c64(p * 2048))
                   for p in range(n_panels)]
            cvec = [builder.bitcast(c, _V16I32.as_pointer()) for c in cbp]
            accv = [_gep(builder, builder.bitcast(a_acc.data, _V16F32.as_pointer()),
                         c64(p * TILE)) for p in range(n_panels)]
            sctv = [_gep(builder, builder.bitcast(a_sct.data, _V16F32.as_pointer()),
                         builder.mul(c64(p), ng)) for p in range(n_panels)]
            sztv = [_gep(builder, builder.bitcast(a_szt.data, _V16F32.as_pointer()),
                         builder.mul(c64(p), ngz)) for p in range(n_panels)]
            zero16 = ir.Constant(_V16F32, [0.0] * 16)
            seven = ir.Constant(_V16I32, [7] * 16)
            gaccs = [[cgutils.alloca_once_value(builder, zero16) for _ in range(TILE)]
                     for _ in range(n_panels)]
            for p in range(n_panels):
                for t in range(TILE):
                    builder.store(zero16, _gep(builder, accv[p], c64(t)), align=4)
            cur_g = cgutils.alloca_once_value(
                builder, builder.sext(builder.load(a_bm.data), i64))
            builder.call(ldcfg, [builder.bitcast(a_cfg.data, i8p)])

            def flush(g):  # acc[t] += gacc[t] * sc[g, rows]; gacc[t] = 0
                for p in range(n_panels):
                    s = builder.load(_gep(builder, sctv[p], g), align=4)
                    for t in range(TILE):
                        at = _gep(builder, accv[p], c64(t))
                        builder.store(builder.call(fmuladd, [builder.load(gaccs[p][t]), s,
                                                             builder.load(at, align=4)]),
                                      at, align=4)
                        builder.store(zero16, gaccs[p][t])

            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                g = builder.sext(builder.load(_gep(builder, a_bm.data, b)), i64)
                with builder.if_then(builder.icmp_signed("!=", g, builder.load(cur_g)),
                                     likely=False):
                    flush(builder.load(cur_g))
                    builder.store(g, cur_g)
                off = builder.mul(b, c64(512))
                for ch, cl in c_tiles:
                    builder.call(tzero, [t8(ch)])
                    builder.call(tzero, [t8(cl)])
                builder.call(tload, [t8(2), _gep(builder, ahp, off), c64(32)])
                builder.call(tload, [t8(3), _gep(builder, alp, off), c64(32)])
                for p in range(n_panels):
                    builder.call(tload, [t8(b_tiles[p]), _gep(builder, btp[p], off), c64(64)])
                for p in range(n_panels):
                    builder.call(dpb, [t8(c_tiles[p][0]), t8(2), t8(b_tiles[p])])
                    builder.call(dpb, [t8(c_tiles[p][1]), t8(3), t8(b_tiles[p])])
                for p in range(n_panels):
                    builder.call(tstore, [t8(c_tiles[p][0]), cbp[p], c64(64)])
                    builder.call(tstore, [t8(c_tiles[p][1]), _gep(builder, cbp[p], c64(1024)),
                                          c64(64)])
                dxrow = builder.mul(b, c64(TILE))
                for p in range(n_panels):
                    for t in range(TILE):  # gacc[t] += float(128 C_h + C_l) * dx[t, b]
                        ch = builder.load(_gep(builder, cvec[p], c64(t)), align=4)
                        cl = builder.load(_gep(builder, cvec[p], c64(TILE + t)), align=4)
                        d = builder.sitofp(builder.add(builder.shl(ch, seven), cl), _V16F32)
                        f = builder.load(_gep(builder, a_dxt.data, builder.add(dxrow, c64(t))))
                        builder.store(builder.call(fmuladd, [d, splat(builder, f, 16),
                                                             builder.load(gaccs[p][t])]),
                                      gaccs[p][t])
            flush(builder.load(cur_g))
            builder.call(release, [])
            # y = acc - zero term (+ bias): _finish_rows' float sequence, 16 rows per vector
            ystride = cgutils.unpack_tuple(builder, a_y.strides, 2)[0]
            xstride = cgutils.unpack_tuple(builder, a_xg.strides, 2)[0]
            nbias = cgutils.unpack_tuple(builder, a_bias.shape, 1)[0]
            ybase = builder.bitcast(a_y.data, i8p)
            xgbase = builder.bitcast(a_xg.data, i8p)
            v16p = _V16F32.as_pointer()
            fp = ir.FloatType().as_pointer()
            for p in range(n_panels):
                rp = builder.add(r0v, c64(p * TILE))
                mask = builder.icmp_signed("<", ir.Constant(_V16I32, list(range(16))),
                                           splat(builder, builder.trunc(
                                               builder.sub(nrv, c64(p * TILE)), _I32), 16))
                bvec = cgutils.alloca_once_value(builder, zero16)
                with builder.if_then(builder.icmp_signed(">", nbias, c64(0))):
                    bp = _gep(builder, builder.bitcast(a_bias.data, fp), rp)
                    builder.store(_masked_load(builder, bp, _V16F32, mask), bvec)
                with cgutils.for_range(builder, ntv) as tl:
                    tok = builder.add(t0v, tl.index)
                    xgrow = builder.bitcast(_gep(builder, xgbase, builder.mul(tok, xstride)), fp)
                    v = builder.fsub(builder.load(_gep(builder, accv[p], tl.index), align=4),
                                     _zero_term_rows(builder, sztv[p], xgrow, ngz))
                    v = builder.select(builder.icmp_signed(">", nbias, c64(0)),
                                       builder.fadd(v, builder.load(bvec)), v)
                    rowp = _gep(builder, ybase, builder.mul(tok, ystride))
                    rowp = _gep(builder, builder.bitcast(rowp, fp), rp)
                    _masked_store(builder, v, builder.bitcast(rowp, v16p), mask)
            return context.get_dummy_value()

        return sig, codegen

    return amx_panels


#: One and two 16-row panels a call (:func:`_make_amx_panels`).
amx_panel, amx_panel2 = _make_amx_panels(1), _make_amx_panels(2)


#: Word (4 codes) of a block's packed 32-byte chunk half that holds activation positions
#: 4k .. 4k + 3 (:data:`._simd_ir.ACT_ORDER` keeps runs of 4 columns together).
_POS_WORD = np.array([int(np.argsort(ACT_ORDER)[4 * k]) // 4 for k in range(8)], np.int64)


#: ``_SPREAD[v]``: bit i of the 4-bit ``v`` moved to bit 4 of byte i (fifth bits -> codes).
_SPREAD = np.array([sum(((v >> i) & 1) << (8 * i + 4) for i in range(4)) for v in range(16)],
                   np.uint32)


@njit(cache=True)
def _pack_panel(bt, sct, szt, wp32, sc, sz, r0, nr, nb, ng, five):
    """The 16-row panel at ``r0`` (``nr`` real rows) of a 4-bit (or, ``five``, 5-bit)
    weight: its codes as B tiles ``bt`` uint32 [nb, 8, 16] (word ``[b, k, n]``: row n's
    codes at activation positions 4k .. 4k + 3, one byte each: the VNNI order of
    ``tdpbssd``), its scales and zero-point terms as ``sct`` float32 [ng, 16] and ``szt``
    [ngz, 16]; rows past ``nr`` zero. ``wp32`` is ``wp`` as uint32 words (a 5-bit chunk:
    8 nibble words, then the fifth bits of its two blocks)."""
    bt[:] = 0
    sct[:] = 0
    szt[:] = 0
    m = np.uint32(0x0F0F0F0F)
    cw = 10 if five else 8  # words per 64-column chunk
    for c in range((nb + 1) // 2):  # a word of the chunk: block 2c's codes low, 2c + 1's high
        for k in range(8):
            col = c * cw + _POS_WORD[k]
            lo = bt[2 * c, k]
            if five:  # columns 4 _POS_WORD[k] .. + 3 of the chunk: their fifth bits
                sh = np.uint32(4 * _POS_WORD[k])
                hi = bt[2 * c + 1, k]
                for n in range(nr):
                    w = wp32[r0 + n, col]
                    f0 = (wp32[r0 + n, c * cw + 8] >> sh) & np.uint32(15)
                    f1 = (wp32[r0 + n, c * cw + 9] >> sh) & np.uint32(15)
                    lo[n] = (w & m) | _SPREAD[f0]
                    hi[n] = ((w >> np.uint32(4)) & m) | _SPREAD[f1]
            elif 2 * c + 1 < nb:
                hi = bt[2 * c + 1, k]
                for n in range(nr):
                    w = wp32[r0 + n, col]
                    lo[n] = w & m
                    hi[n] = (w >> np.uint32(4)) & m
            else:
                for n in range(nr):
                    lo[n] = wp32[r0 + n, col] & m
    for n in range(nr):
        r = r0 + n
        for g in range(ng):
            sct[g, n] = group_value(sc, r, g, nb)
        for g in range(szt.shape[0]):
            szt[g, n] = group_value(sz, r, g, ng)


@njit(parallel=True, cache=True)
def _gemm_amx(y, x, wp32, sc, sz, bmap, bias, xq, dx, xg, ah, al, dxt, ng, ngz, zmul, cfg,
              five):
    t_n = x.shape[0]
    nb = dx.shape[1]
    quantize_rows(xq, dx, xg, x, bmap, zmul)
    n_tt = ah.shape[0]
    for it in prange(n_tt * nb):  # q = 128 h + l, token tiles padded with zeros
        tt = it // nb
        b = it - tt * nb
        for t in range(TILE):
            tok = tt * TILE + t
            if tok < t_n:
                for p in range(32):
                    v = np.int32(xq[tok, b * 32 + p])
                    h = (v + 64) >> 7
                    ah[tt, b, t, p] = h
                    al[tt, b, t, p] = v - (h << 7)
                dxt[tt, b, t] = dx[tok, b]
            else:
                ah[tt, b, t, :] = 0
                al[tt, b, t, :] = 0
                dxt[tt, b, t] = 0
    out = y.shape[1]
    for pn in prange((out + 2 * TILE - 1) // (2 * TILE)):  # two 16-row panels at a time
        r0 = pn * 2 * TILE
        nr = min(2 * TILE, out - r0)
        bt = np.empty((2, nb, 8, TILE), np.uint32)
        sct = np.empty((2, ng, TILE), np.float32)
        szt = np.empty((2, ngz, TILE), np.float32)
        cbuf = np.empty((2, 2, TILE, TILE), np.int32)
        accs = np.empty((2, TILE, TILE), np.float32)
        for p in range(2 if nr > TILE else 1):
            _pack_panel(bt[p], sct[p], szt[p], wp32, sc, sz, r0 + p * TILE,
                        min(TILE, nr - p * TILE), nb, ng, five)
        for tt in range(n_tt):
            t0 = tt * TILE
            if nr > TILE:
                amx_panel2(cfg, ah[tt], al[tt], bt, dxt[tt], sct, szt, xg, bias, bmap, y, t0,
                           min(TILE, t_n - t0), r0, nr, cbuf, accs)
            else:
                amx_panel(cfg, ah[tt], al[tt], bt[:1], dxt[tt], sct[:1], szt[:1], xg, bias,
                          bmap, y, t0, min(TILE, t_n - t0), r0, nr, cbuf[:1], accs[:1])


_NO_BIAS = np.zeros(0, np.float32)


def _zero_groups(w) -> int:
    """Groups of ``w``'s zero-point terms (0: none; a factored array has one per group)."""
    return w.n_groups if w.sz.dtype == np.uint8 else w.sz.shape[1]


def _words(wp: np.ndarray) -> np.ndarray:
    """A 4-bit weight's packed rows (uint8 [rows, nb * 16]) as uint32 words."""
    return np.ascontiguousarray(wp).view(np.uint32)


def gemm_amx(x: np.ndarray, w, bias: np.ndarray | None) -> np.ndarray:
    """y[T, out] = x[T, in] @ W[out, in].T (+ bias) for a 4- or 5-bit weight on AMX, each
    row bit-identical to its block-dot decode GEMV.

    Args:
        x: float32 [T, in] C-contiguous; w: 4- or 5-bit ``CpuQuantWeight``; bias: float32
            [out] or None.

    Returns:
        float32 [T, out].
    """
    t = x.shape[0]
    n_tt = -(-t // TILE)
    nb = w.n_blocks
    y = np.empty((t, w.out_features), np.float32)
    xq = np.empty((t, nb * XQ_PER_BLOCK), XQ_DTYPE)
    dx = np.empty((t, nb), np.float32)
    xg = np.empty((t, w.n_groups), np.float32)
    ah = np.empty((n_tt, nb, TILE, 32), np.int8)
    al = np.empty((n_tt, nb, TILE, 32), np.int8)
    dxt = np.empty((n_tt, nb, TILE), np.float32)
    _gemm_amx(y, x, _words(w.wp), w.sc, w.sz, w.bmap, _NO_BIAS if bias is None else bias,
              xq, dx, xg, ah, al, dxt, w.n_groups, _zero_groups(w), np.float32(w.zero_scale),
              _CFG, w.bits == 5)
    return y


@njit(parallel=True, cache=True)
def _gemm_rows(y, x, wp, sc, sz, bmap, bias, xq, dx, xg, zmul, five):
    t_n = x.shape[0]
    out = y.shape[1]
    nb = dx.shape[1]
    quantize_rows(xq, dx, xg, x, bmap, zmul)
    nblk = out // 4
    for i in prange(nblk + out - nblk * 4):  # 4 rows (then single rows) for every token:
        if i < nblk:                         # the rows come from memory once, then L1
            t = 0
            while t + ROWS_TOKENS <= t_n:  # token pairs: the codes unpacked once
                if five:
                    _ROWS4_5_TOK(y, i * 4, wp, sc, xq, dx, bmap, nb, t)
                else:
                    _ROWS4_TOK(y, i * 4, wp, sc, xq, dx, bmap, nb, t)
                t += ROWS_TOKENS
            for j in range(t, t_n):
                blockdot_rows(True, five, y[j], i * 4, wp, sc, xq[j], dx[j], bmap, nb)
        else:
            for t in range(t_n):
                blockdot_rows(False, five, y[t], nblk * 4 + (i - nblk), wp, sc, xq[t], dx[t],
                              bmap, nb)
    for t in prange(t_n):
        _finish_rows(y[t], 0, out, sz, xg[t], bias)


_ROWS4, _ROWS1 = BLOCKDOT_ROWS[4], BLOCKDOT_ROWS[1]
_ROWS4_TOK, _ROWS4_5_TOK = BLOCKDOT_ROWS4_TOKENS[False], BLOCKDOT_ROWS4_TOKENS[True]
_ROWS4_5, _ROWS1_5 = BLOCKDOT_ROWS5[4], BLOCKDOT_ROWS5[1]


@njit(cache=True, inline="always")
def blockdot_rows(four, five, y, r0, wp, sc, xq, dx, bmap, nb):
    """The block-dot row kernel for rows ``r0 .. r0 + 3`` (``four``) or row ``r0``: 5-bit
    when ``five``, else 4- or 8-bit by ``wp``'s dtype (:data:`._blockdot.BLOCKDOT_ROWS`)."""
    if four and five:
        _ROWS4_5(y, r0, wp, sc, xq, dx, bmap, nb)
    elif four:
        _ROWS4(y, r0, wp, sc, xq, dx, bmap, nb)
    elif five:
        _ROWS1_5(y, r0, wp, sc, xq, dx, bmap, nb)
    else:
        _ROWS1(y, r0, wp, sc, xq, dx, bmap, nb)


def gemm_rows(x: np.ndarray, w, bias: np.ndarray | None) -> np.ndarray:
    """As :func:`gemm_amx` by the block-dot row kernels (4-, 5- or 8-bit weights), every
    token over each 4 rows in turn (two tokens a call on the codes unpacked once,
    :data:`._blockdot.BLOCKDOT_ROWS4_TOKENS`): for fewer tokens than the tiles take
    (:func:`.qgemm.blockdot_path`), and where the OS refused the tile state. The same
    floats."""
    t = x.shape[0]
    y = np.empty((t, w.out_features), np.float32)
    _gemm_rows(y, x, w.wp, w.sc, w.sz, w.bmap, _NO_BIAS if bias is None else bias,
               np.empty((t, w.n_blocks * XQ_PER_BLOCK), XQ_DTYPE),
               np.empty((t, w.n_blocks), np.float32), np.empty((t, w.n_groups), np.float32),
               np.float32(w.zero_scale), w.bits == 5)
    return y
