"""Attention inner loops over dequantized K / V tiles, emitted as LLVM IR (llvmlite) and
called from Numba (:mod:`.kvquant`).

Both kernels fix the float order of every output value, whatever the number of queries
or keys a call covers, so a decode step (one token's query heads in the lanes) and a
prefill item (8 tokens of one head in the lanes) compute the same floats:

* :func:`scores8`: ``s[l, m] = sum_i qT[i, l] * kt[m, i]``, one FMA chain per (query
  lane ``l``, key ``m``) over ``i = 0 .. hdp-1`` in order, starting from 0. Eight keys
  at a time: eight ``<8 x float>`` accumulators (lanes = the 8 queries), one load of
  ``qT[i]`` and eight broadcast key values per ``i``, then an 8x8 transpose to store
  each query's 8 scores contiguously.
* :func:`vaccum`: ``acc[d] = fma(p[m], vt[m, d], acc[d])`` for ``m = 0 .. nk-1`` in
  order (lanes = channels ``d``, up to 64 channels held in registers across the keys).

FMA: ``llvm.fma`` where the host has FMA3 (one rounding per step on every path), else
``llvm.fmuladd`` (multiply then add on such hosts, the same on every path there).
Generic vector IR: any target. Arrays: float32, C-contiguous rows (the row stride is
read from the array, so row and column slices of a larger array are fine).
"""
from __future__ import annotations

import llvmlite.binding as llb
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

try:
    _FEATURES = dict(llb.get_host_cpu_features())
except RuntimeError:
    _FEATURES = {}

_I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
_V8F32 = ir.VectorType(_F32, 8)
_FMA_NAME = "llvm.fma.v8f32" if _FEATURES.get("fma", False) else "llvm.fmuladd.v8f32"
#: Lanes (queries) of one :func:`scores8` call, and keys per inner block.
LANES = 8
#: Flags on order-sensitive adds (see :data:`._simd_ir.STRICT`: Numba's fastmath pass leaves
#: flagged instructions alone, so these sums are never reassociated).
_STRICT = ("arcp",)


def _fma(builder):
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V8F32, [_V8F32] * 3), _FMA_NAME)


def _splat(builder, v):
    vec = builder.insert_element(ir.Constant(_V8F32, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, ir.Constant(_V8F32, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, 8), [0] * 8))


def _shuf(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 8), idx))


def _transpose8(builder, rows):
    """8x8 transpose of eight <8 x float> (unpacks, 64-bit shuffles, 128-bit halves)."""
    lo, hi = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    a = []
    for r in range(0, 8, 2):
        a += [_shuf(builder, rows[r], rows[r + 1], lo), _shuf(builder, rows[r], rows[r + 1], hi)]
    p0, p1 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    b = []
    for base in (0, 4):  # a[base..base+3] come from rows base..base+3
        b += [_shuf(builder, a[base], a[base + 2], p0), _shuf(builder, a[base], a[base + 2], p1),
              _shuf(builder, a[base + 1], a[base + 3], p0),
              _shuf(builder, a[base + 1], a[base + 3], p1)]
    h0, h1 = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    out = [None] * 8
    for c in range(4):  # b[c]: column c (lanes 0-3) and c + 4 (lanes 4-7) of rows 0-3
        out[c] = _shuf(builder, b[c], b[c + 4], h0)
        out[c + 4] = _shuf(builder, b[c], b[c + 4], h1)
    return out


def _rows(context, builder, ty, val):
    """(float* data, row stride in floats, rows, cols) of a 2-D float32 array."""
    a = context.make_array(ty)(context, builder, val)
    shape = cgutils.unpack_tuple(builder, a.shape, 2)
    stride = cgutils.unpack_tuple(builder, a.strides, 2)[0]
    return a.data, builder.sdiv(stride, ir.Constant(_I64, 4)), shape[0], shape[1]


def _operands(context, builder, signature, args):
    """The three 2-D arrays of a (3 arrays, count) intrinsic as :func:`_rows` tuples, and
    the count as i64."""
    arrs = [_rows(context, builder, signature.args[i], args[i]) for i in range(3)]
    n = args[3] if args[3].type == _I64 else builder.sext(args[3], _I64)
    return arrs, n


def _vptr(builder, base, off):
    return builder.bitcast(builder.gep(base, [off]), _V8F32.as_pointer())


def _is_f32_2d(t):
    return isinstance(t, types.Array) and t.ndim == 2 and t.dtype == types.float32


@intrinsic
def scores8(typingctx, s, qt, kt, nk):
    """``s[l, m] = sum_i qt[i, l] * kt[m, i]`` for ``l < 8``, ``m < ceil8(nk)``.

    Args:
        s: float32 [8, >= ceil8(nk)] (rows may be strided; written).
        qt: float32 [hdp, 8] C-contiguous, the 8 queries' channels (pad lanes 0).
        kt: float32 [>= ceil8(nk), hdp] dequantized keys (rows past nk finite).
        nk: keys.
    """
    if not (_is_f32_2d(s) and _is_f32_2d(qt) and _is_f32_2d(kt)):
        return None
    sig = types.void(s, qt, kt, nk)

    def codegen(context, builder, signature, args):
        ((sp, sld, _, _), (qp, _, hdp, _), (kp, kld, _, _)), nkv = _operands(
            context, builder, signature, args)
        fma = _fma(builder)
        nblk = builder.sdiv(builder.add(nkv, ir.Constant(_I64, 7)), ir.Constant(_I64, 8))
        zero = ir.Constant(_V8F32, [0.0] * 8)
        accs = [cgutils.alloca_once(builder, _V8F32) for _ in range(8)]
        with cgutils.for_range(builder, nblk) as blk:
            m0 = builder.mul(blk.index, ir.Constant(_I64, 8))
            for acc in accs:
                builder.store(zero, acc)
            krows = [builder.gep(kp, [builder.mul(builder.add(m0, ir.Constant(_I64, m)), kld)])
                     for m in range(8)]
            with cgutils.for_range(builder, hdp) as it:
                i = it.index
                qv = builder.load(_vptr(builder, qp, builder.mul(i, ir.Constant(_I64, 8))),
                                  align=4)
                for m in range(8):
                    kv = _splat(builder, builder.load(builder.gep(krows[m], [i])))
                    builder.store(builder.call(fma, [qv, kv, builder.load(accs[m])]), accs[m])
            cols = _transpose8(builder, [builder.load(a) for a in accs])
            for lane in range(8):
                dst = _vptr(builder, sp, builder.add(builder.mul(ir.Constant(_I64, lane), sld), m0))
                builder.store(cols[lane], dst, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def vaccum(typingctx, acc, p, vt, nk):
    """``acc[d] = fma(p[m], vt[m, d], acc[d])`` for ``m = 0 .. nk-1`` in order.

    Args:
        acc: float32 [1, hdp] (hdp a multiple of 8; read and written).
        p: float32 [1, >= nk] weights.
        vt: float32 [>= nk, hdp] dequantized values.
        nk: keys.
    """
    if not (_is_f32_2d(acc) and _is_f32_2d(p) and _is_f32_2d(vt)):
        return None
    sig = types.void(acc, p, vt, nk)

    def codegen(context, builder, signature, args):
        ((ap, _, _, hdp), (pp, _, _, _), (vp, vld, _, _)), nkv = _operands(
            context, builder, signature, args)
        fma = _fma(builder)
        nvec = builder.sdiv(hdp, ir.Constant(_I64, 8))
        full = builder.sdiv(nvec, ir.Constant(_I64, 8))  # passes of 8 vectors

        def one_pass(c0, width):  # vectors c0 .. c0 + width - 1 over all keys
            regs = [cgutils.alloca_once(builder, _V8F32) for _ in range(width)]
            for w in range(width):
                off = builder.mul(builder.add(c0, ir.Constant(_I64, w)), ir.Constant(_I64, 8))
                builder.store(builder.load(_vptr(builder, ap, off), align=4), regs[w])
            with cgutils.for_range(builder, nkv) as km:
                pv = _splat(builder, builder.load(builder.gep(pp, [km.index])))
                row = builder.gep(vp, [builder.mul(km.index, vld)])
                for w in range(width):
                    off = builder.mul(builder.add(c0, ir.Constant(_I64, w)), ir.Constant(_I64, 8))
                    vv = builder.load(_vptr(builder, row, off), align=4)
                    builder.store(builder.call(fma, [pv, vv, builder.load(regs[w])]), regs[w])
            for w in range(width):
                off = builder.mul(builder.add(c0, ir.Constant(_I64, w)), ir.Constant(_I64, 8))
                builder.store(builder.load(regs[w]), _vptr(builder, ap, off), align=4)

        with cgutils.for_range(builder, full) as ch:
            one_pass(builder.mul(ch.index, ir.Constant(_I64, 8)), 8)
        with cgutils.for_range(builder, builder.sub(nvec, builder.mul(full, ir.Constant(_I64, 8)))) as r:
            one_pass(builder.add(builder.mul(full, ir.Constant(_I64, 8)), r.index), 1)
        return context.get_dummy_value()

    return sig, codegen


def _is_f32_1d_c(x):
    return (isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32
            and x.layout == "C")


def _lane_fold(context, builder, ty, val, init, vop, sop):
    """Fold a C-contiguous float32 [n]: 8 lanes over the full vectors (``vop``, lane
    ``l`` takes ``x[8 i + l]`` in order), the lanes by the tree ((0+1)+(2+3))+((4+5)+(6+7))
    (``sop``), then the tail in order (``sop``); ``init`` the identity."""
    a = context.make_array(ty)(context, builder, val)
    n = cgutils.unpack_tuple(builder, a.shape, 1)[0]
    acc = cgutils.alloca_once_value(builder, ir.Constant(_V8F32, [init] * 8))
    nv = builder.sdiv(n, ir.Constant(_I64, 8))
    with cgutils.for_range(builder, nv) as it:
        v = builder.load(_vptr(builder, a.data, builder.mul(it.index, ir.Constant(_I64, 8))),
                         align=4)
        builder.store(vop(builder.load(acc), v), acc)
    av = builder.load(acc)
    lanes = [builder.extract_element(av, ir.Constant(_I32, i)) for i in range(8)]
    while len(lanes) > 1:
        lanes = [sop(lanes[i], lanes[i + 1]) for i in range(0, len(lanes), 2)]
    out = cgutils.alloca_once_value(builder, lanes[0])
    tail0 = builder.mul(nv, ir.Constant(_I64, 8))
    with cgutils.for_range(builder, builder.sub(n, tail0)) as it:
        v = builder.load(builder.gep(a.data, [builder.add(tail0, it.index)]))
        builder.store(sop(builder.load(out), v), out)
    return builder.load(out)


@intrinsic
def row_max(typingctx, x):
    """float32 max of a C-contiguous float32 [n] (n >= 1) by ``llvm.maxnum``
    (:func:`_lane_fold`): exact in any order (-inf entries allowed)."""
    if not _is_f32_1d_c(x):
        return None

    def codegen(context, builder, signature, args):
        mod = builder.module
        vmax = cgutils.get_or_insert_function(
            mod, ir.FunctionType(_V8F32, [_V8F32, _V8F32]), "llvm.maxnum.v8f32")
        smax = cgutils.get_or_insert_function(
            mod, ir.FunctionType(_F32, [_F32, _F32]), "llvm.maxnum.f32")
        return _lane_fold(context, builder, signature.args[0], args[0], float("-inf"),
                          lambda a, b: builder.call(vmax, [a, b]),
                          lambda a, b: builder.call(smax, [a, b]))

    return types.float32(x), codegen


@intrinsic
def row_sum(typingctx, x):
    """float32 sum of a C-contiguous float32 [n] in the fixed order of :func:`_lane_fold`
    whatever the caller (adds flagged :data:`_STRICT`: never reassociated)."""
    if not _is_f32_1d_c(x):
        return None

    def codegen(context, builder, signature, args):
        def add(a, b):
            return builder.fadd(a, b, flags=_STRICT)
        return _lane_fold(context, builder, signature.args[0], args[0], 0.0, add, add)

    return types.float32(x), codegen
