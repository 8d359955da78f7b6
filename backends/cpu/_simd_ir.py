"""LLVM IR building blocks of the SIMD kernels (llvmlite, called from Numba): vector types,
the activation lane order, splats and horizontal sums, row and token pointers, code
widening (4-, 5- and 8-bit chunks), group scales in their three storages, masked loads and
stores, the zero-point term's float sequence, and scalar bit intrinsics (fp16 <-> float32,
int32 bits as float32). The row kernels of :mod:`._simd` and the kernels of
:mod:`._simd_k`, :mod:`._simd_tokens`, :mod:`._blockdot`, :mod:`._amx` and
:mod:`._amx_few` are assembled from these, so a helper changed here changes them all the
same way (the float sequences the tests hold equal across kernels live here once).

Host features: :data:`HAVE_AVX2` from LLVM's host CPU feature list (empty where LLVM
cannot list them: the portable kernels run).
"""
from __future__ import annotations

import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

try:
    _FEATURES = dict(llb.get_host_cpu_features())
except RuntimeError:  # LLVM cannot list features on some hosts: use the portable kernels
    _FEATURES = {}
#: True when the host CPU supports AVX2 (``vpmaddwd`` and byte unpacks on 256-bit vectors).
HAVE_AVX2 = bool(_FEATURES.get("avx2", False))

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V32I8 = ir.VectorType(_I8, 32)
_V16I16 = ir.VectorType(_I16, 16)
_V8I32 = ir.VectorType(_I32, 8)
_V8F32 = ir.VectorType(_F32, 8)

#: Lane of column ``j`` of a 32-column block in the int16 activation vector: columns
#: 0-7 and 16-23 fill lanes 0-15 (what ``vpunpcklbw`` widens), 8-15 and 24-31 lanes
#: 16-31 (``vpunpckhbw``).
ACT_ORDER = np.array([(j & 7) | ((j >> 4) << 3) | (((j >> 3) & 1) << 4) for j in range(32)],
                     np.int64)
#: Bytes per 64-column chunk (two blocks) of a packed row: 4-bit 32 (nibbles); 5-bit 40
#: (the nibbles, then per block a little-endian u32 whose bit j is bit 4 of column j).
CHUNK_BYTES = {4: 32, 5: 40}
#: Row blocks ahead that each weight load prefetches (the same offset, R rows per block).
PREFETCH_BLOCKS = 1
# byte shuffles equal to the in-lane unpacks of (v, other): lo = bytes 0-7, 16-23
_UNPACK_LO = [i for k in (0, 16) for j in range(8) for i in (k + j, 32 + k + j)]
_UNPACK_HI = [i for k in (8, 24) for j in range(8) for i in (k + j, 32 + k + j)]


def _declare(module, name, ret, args):
    return cgutils.get_or_insert_function(module, ir.FunctionType(ret, args), name)


_V4F32 = ir.VectorType(_F32, 4)


def splat(builder, v, n):
    """``<n x T>`` with every lane ``v`` (a scalar of type T)."""
    vt = ir.VectorType(v.type, n)
    vec = builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, ir.Constant(vt, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _splat4(builder, v):  # float -> <4 x float>
    return splat(builder, v, 4)


def _splat_f32(builder, v):  # float -> <8 x float>
    return splat(builder, v, 8)


#: Flags on the kernels' order-sensitive float adds: a no-op for fadd/fmul (``arcp``
#: only licenses reciprocals), but flagged instructions are left alone by Numba's
#: fastmath pass (``numba/core/fastmathpass.py`` flags only unflagged ones), so the
#: backend never reassociates these sums: every kernel that computes a row sums it in
#: the same order, the condition for decode and prefill agreeing bit for bit.
STRICT = ("arcp",)


def _hsum8(builder, v):
    """Horizontal sum of an <8 x float> (tree of 7 adds, ((0+1)+(2+3))+((4+5)+(6+7)),
    never reassociated: :data:`STRICT`; once per row)."""
    lanes = [builder.extract_element(v, ir.Constant(_I32, i)) for i in range(8)]
    while len(lanes) > 1:
        lanes = [builder.fadd(lanes[i], lanes[i + 1], flags=STRICT)
                 for i in range(0, len(lanes), 2)]
    return lanes[0]


def _gep(builder, ptr, idx):
    return builder.gep(ptr, [idx])


def row_ptr(builder, arr, row, elem):
    """Pointer to element 0 of row ``row`` (i64) of a 2-D array (any row stride), as
    ``elem*``."""
    stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
    base = builder.bitcast(arr.data, _I8.as_pointer())
    return builder.bitcast(builder.gep(base, [builder.mul(row, stride)]), elem.as_pointer())


def token_rows(builder, a, elem, t0, n_tok):
    """Pointers (``elem``*) to the rows ``t0 .. t0 + n_tok - 1`` of the 2-D array ``a``
    (a multi-token kernel's activations, scales or outputs); ``n_tok`` 0: one pointer to
    the 1-D array ``a`` itself (the single-token kernels)."""
    if not n_tok:
        return [builder.bitcast(a.data, elem.as_pointer())]
    return [row_ptr(builder, a, builder.add(t0, ir.Constant(t0.type, j)), elem)
            for j in range(n_tok)]


def widen_signed(builder, v):
    """<32 x i8> signed codes in column order -> two <16 x i16> in :data:`ACT_ORDER`
    lanes (the in-lane byte unpacks against their sign bytes)."""
    sign = builder.sext(builder.icmp_signed("<", v, ir.Constant(_V32I8, [0] * 32)), _V32I8)
    return tuple(builder.bitcast(builder.shuffle_vector(
        v, sign, ir.Constant(ir.VectorType(_I32, 32), idx)), _V16I16)
        for idx in (_UNPACK_LO, _UNPACK_HI))


def group_scale(builder, row, g, nbv, factored):
    """The float32 scale of group ``g`` (i64) of a scale row: ``row[g]`` (``row`` float*),
    its fp16 value widened (``row`` i16*: binary16 bits, exact), or from a factored row
    (``row`` i8*, ``nbv`` blocks): ``float32(q[g]) * d[g >> 3]``."""
    if row.type.pointee == _I16:
        return _half_bits_to_f32(builder, builder.load(_gep(builder, row, g)))
    if not factored:
        return builder.load(_gep(builder, row, g))
    i64 = ir.IntType(64)
    q = builder.load(_gep(builder, row, g))
    at = builder.add(builder.and_(builder.add(nbv, ir.Constant(i64, 3)), ir.Constant(i64, -4)),
                     builder.mul(builder.ashr(g, ir.Constant(i64, 3)), ir.Constant(i64, 4)))
    d = builder.load(builder.bitcast(_gep(builder, row, at), _F32.as_pointer()), align=1)
    return builder.fmul(builder.sitofp(q, _F32), d, flags=STRICT)


def _half_bits_to_f32(builder, v):
    """binary16 bits (i16 or <n x i16>) -> float (<n x float>): ``fpext half``, exact
    (``vcvtph2ps`` on F16C hosts)."""
    if isinstance(v.type, ir.VectorType):
        n = v.type.count
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), n)),
                             ir.VectorType(_F32, n))
    return builder.fpext(builder.bitcast(v, ir.HalfType()), _F32)


def scale_row_type(dtype):
    """The LLVM element type of a scale row of Numba dtype ``dtype``: float (float32),
    i16 (uint16: fp16 bits), i8 (uint8: factored)."""
    return {types.float32: _F32, types.uint16: _I16}.get(dtype, _I8)


def group_value(a, r, g, nb):
    """``a[r, g]`` of a float32 scale (or zero-point term) array, of a uint16 one (fp16
    bits) widened, or ``float32(q) * d`` of a factored uint8 one (module docstring): the
    same float32. Numba-only (overloaded)."""
    raise NotImplementedError("call group_value from Numba-compiled code")


@intrinsic
def mul_strict(typingctx, a, b):
    """float32 ``a * b`` that Numba's fastmath pass leaves unflagged-for-reassociation
    (:data:`STRICT`): a caller compiled with fastmath cannot fold it into other products."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fmul(args[0], args[1], flags=STRICT)

    return sig, codegen


@overload(group_value, inline="always")
def _group_value(a, r, g, nb):
    if isinstance(a, types.Array) and a.dtype == types.uint8:
        def factored(a, r, g, nb):
            u = np.int32(a[r, g])
            v = u - ((u >> 7) << 8)  # the byte as int8
            at = (nb + 3) // 4 * 4 + 4 * (g >> 3)
            d = (np.int32(a[r, at]) | (np.int32(a[r, at + 1]) << 8)
                 | (np.int32(a[r, at + 2]) << 16) | (np.int32(a[r, at + 3]) << 24))
            return mul_strict(np.float32(v), i32_as_f32(d))  # little-endian float32 bytes
        return factored
    if isinstance(a, types.Array) and a.dtype == types.uint16:
        return lambda a, r, g, nb: half_to_f32(a[r, g])
    return lambda a, r, g, nb: a[r, g]


def _masked_load(builder, ptr, vty, mask):
    """``vty`` load of the lanes of ``ptr`` (element pointer) where ``mask`` is set, zero
    elsewhere (``llvm.masked.load``: the other lanes' memory is not touched)."""
    n, elt = vty.count, vty.element
    sfx = {_F32: "f32", _I8: "i8", _I16: "i16"}[elt]
    fn = _declare(builder.module, f"llvm.masked.load.v{n}{sfx}.p0", vty,
                  [vty.as_pointer(), _I32, ir.VectorType(ir.IntType(1), n), vty])
    zero = ir.Constant(vty, [0.0 if elt == _F32 else 0] * n)
    return builder.call(fn, [builder.bitcast(ptr, vty.as_pointer()), ir.Constant(_I32, 1),
                             mask, zero])


def _masked_store(builder, v, ptr, mask):
    """Store the lanes of vector ``v`` where ``mask`` is set to ``ptr`` (element pointer;
    ``llvm.masked.store``: the other lanes' memory is not touched)."""
    vty = v.type
    sfx = {_F32: "f32", _I8: "i8", _I16: "i16", _I32: "i32"}[vty.element]
    fn = _declare(builder.module, f"llvm.masked.store.v{vty.count}{sfx}.p0", ir.VoidType(),
                  [vty, vty.as_pointer(), _I32, ir.VectorType(ir.IntType(1), vty.count)])
    builder.call(fn, [v, builder.bitcast(ptr, vty.as_pointer()), ir.Constant(_I32, 1), mask])


def zero_accs_ir(builder, szrow, xgps, ngv, factored):
    """The <8 x float> accumulators of ``sum_g sz[g] * xg[g]`` for each activation row in
    ``xgps`` (float*), over ``ngv`` groups of one zero-point row (``szrow`` float*, i16* of
    fp16 bits, or i8* of a factored row, :func:`group_scale`): group ``g`` in lane
    ``g % 8``, in group order;
    the last ``ngv % 8`` groups by masked loads (the other lanes add +0.0). Each sz vector
    is loaded once for every row. Every operation :data:`STRICT`."""
    i64 = ir.IntType(64)
    zero8 = ir.Constant(_V8F32, [0.0] * 8)
    accs = [cgutils.alloca_once_value(builder, zero8) for _ in xgps]
    n8 = builder.lshr(ngv, ir.Constant(i64, 3))
    v8i8 = ir.VectorType(_I8, 8)

    half = szrow.type.pointee == _I16  # fp16 bits (uint16 rows), widened exactly

    def sz8(g, mask):  # <8 x float> sz[g .. g + 8] (the masked lanes 0)
        if half:
            v8i16 = ir.VectorType(_I16, 8)
            if mask is None:
                h = builder.load(builder.bitcast(_gep(builder, szrow, g), v8i16.as_pointer()),
                                 align=2)
            else:
                h = _masked_load(builder, _gep(builder, szrow, g), v8i16, mask)
            return _half_bits_to_f32(builder, h)
        if not factored:
            if mask is None:
                return builder.load(builder.bitcast(_gep(builder, szrow, g), _V8F32.as_pointer()),
                                    align=4)
            return _masked_load(builder, _gep(builder, szrow, g), _V8F32, mask)
        at = builder.add(builder.and_(builder.add(ngv, ir.Constant(i64, 3)),
                                      ir.Constant(i64, -4)),
                         builder.mul(builder.ashr(g, ir.Constant(i64, 3)), ir.Constant(i64, 4)))
        d = builder.load(builder.bitcast(_gep(builder, szrow, at), _F32.as_pointer()), align=1)
        if mask is None:
            q = builder.load(builder.bitcast(_gep(builder, szrow, g), v8i8.as_pointer()), align=1)
        else:
            q = _masked_load(builder, _gep(builder, szrow, g), v8i8, mask)
        return builder.fmul(builder.sitofp(q, _V8F32), _splat_f32(builder, d), flags=STRICT)

    with cgutils.for_range(builder, n8) as loop:
        g = builder.mul(loop.index, ir.Constant(i64, 8))
        s = sz8(g, None)
        for acc, xgp in zip(accs, xgps):
            xv = builder.load(builder.bitcast(_gep(builder, xgp, g), _V8F32.as_pointer()), align=4)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(s, xv, flags=STRICT),
                                       flags=STRICT), acc)
    g0 = builder.mul(n8, ir.Constant(i64, 8))
    rem = builder.trunc(builder.sub(ngv, g0), _I32)
    with builder.if_then(builder.icmp_signed(">", rem, ir.Constant(_I32, 0)), likely=False):
        lanes = ir.Constant(_V8I32, list(range(8)))
        splat = builder.shuffle_vector(
            builder.insert_element(ir.Constant(_V8I32, ir.Undefined), rem, ir.Constant(_I32, 0)),
            ir.Constant(_V8I32, ir.Undefined), ir.Constant(_V8I32, [0] * 8))
        mask = builder.icmp_signed("<", lanes, splat)
        s = sz8(g0, mask)
        for acc, xgp in zip(accs, xgps):
            xv = _masked_load(builder, _gep(builder, xgp, g0), _V8F32, mask)
            t = builder.select(mask, builder.fmul(s, xv, flags=STRICT), zero8)
            builder.store(builder.fadd(builder.load(acc), t, flags=STRICT), acc)
    return [builder.load(acc) for acc in accs]


def zero_term_ir(builder, szrow, xgp, ngv, factored):
    """float ``sum_g sz[g] * xg[g]`` of one zero-point row and one activation row
    (:func:`zero_accs_ir`), then the :func:`_hsum8` tree; every operation :data:`STRICT`,
    so every caller gets the same float. Generic vector IR: any target."""
    return _hsum8(builder, zero_accs_ir(builder, szrow, [xgp], ngv, factored)[0])


@intrinsic
def zero_term(typingctx, sz, r, xg):
    """float32 ``sum_g sz[r, g] * xg[g]`` (:func:`zero_term_ir`) of a float32 or uint16
    (fp16 bits) ``sz`` ``[rows, ng]`` (``ng`` may be 0) or a factored uint8 one (``ng`` =
    ``xg.shape[0]``);
    ``xg`` float32 [ng] C-contiguous."""
    if not (isinstance(xg, types.Array) and xg.ndim == 1 and xg.layout == "C"):
        return None
    sig = types.float32(sz, r, xg)

    def codegen(context, builder, signature, args):
        ty_sz, _, ty_xg = signature.args
        a_sz = context.make_array(ty_sz)(context, builder, args[0])
        a_xg = context.make_array(ty_xg)(context, builder, args[2])
        factored = ty_sz.dtype == types.uint8
        ngv = (cgutils.unpack_tuple(builder, a_xg.shape, 1)[0] if factored
               else cgutils.unpack_tuple(builder, a_sz.shape, 2)[1])
        stride = cgutils.unpack_tuple(builder, a_sz.strides, 2)[0]
        row = builder.gep(builder.bitcast(a_sz.data, _I8.as_pointer()),
                          [builder.mul(args[1], stride)])
        row = builder.bitcast(row, scale_row_type(ty_sz.dtype).as_pointer())
        return zero_term_ir(builder, row, a_xg.data, ngv, factored)

    return sig, codegen


def _fifth_bits(builder, row, at):
    """<32 x i8>: byte j = 16 if bit j of the u32 at byte ``at`` of ``row`` is set, else 0."""
    h = builder.load(builder.bitcast(_gep(builder, row, at), _I32.as_pointer()), align=1)
    v4 = ir.VectorType(_I8, 4)
    hb = builder.shuffle_vector(builder.bitcast(h, v4), ir.Constant(v4, ir.Undefined),
                                ir.Constant(ir.VectorType(_I32, 32), [j >> 3 for j in range(32)]))
    bit = ir.Constant(_V32I8, [1 << (j & 7) for j in range(32)])
    return builder.select(builder.icmp_unsigned("==", builder.and_(hb, bit), bit),
                          ir.Constant(_V32I8, [16] * 32), ir.Constant(_V32I8, [0] * 32))


def chunk_codes(builder, bits, wv, row, off):
    """The codes of a 64-column chunk as four <16 x i16> in :data:`ACT_ORDER` lanes:
    block 2c's two halves, then block 2c + 1's. ``wv`` the chunk's 32 nibble bytes (4 or
    5 bits); 5 bits: OR-ed with the fifth bits at ``off + 32`` / ``off + 36`` of ``row``."""
    zero32 = ir.Constant(_V32I8, [0] * 32)
    lo_idx = ir.Constant(ir.VectorType(_I32, 32), _UNPACK_LO)
    hi_idx = ir.Constant(ir.VectorType(_I32, 32), _UNPACK_HI)

    def widen(v):
        return [builder.bitcast(builder.shuffle_vector(v, zero32, idx), _V16I16)
                for idx in (lo_idx, hi_idx)]

    if bits == 5:  # in bytes: nibble | fifth bit, then widen
        i64 = ir.IntType(64)
        lo8 = builder.or_(builder.and_(wv, ir.Constant(_V32I8, [15] * 32)),
                          _fifth_bits(builder, row, builder.add(off, ir.Constant(i64, 32))))
        hi8 = builder.or_(builder.lshr(wv, ir.Constant(_V32I8, [4] * 32)),
                          _fifth_bits(builder, row, builder.add(off, ir.Constant(i64, 36))))
        return widen(lo8) + widen(hi8)
    ua, ub = widen(wv)
    m15, four = ir.Constant(_V16I16, [15] * 16), ir.Constant(_V16I16, [4] * 16)
    return [builder.and_(ua, m15), builder.and_(ub, m15), builder.lshr(ua, four),
            builder.lshr(ub, four)]


@intrinsic
def half_to_f32(typingctx, h):
    """uint16 IEEE binary16 bits -> float32 (LLVM ``fpext half``; portable)."""
    sig = types.float32(h)

    def codegen(context, builder, signature, args):
        v = builder.trunc(args[0], ir.IntType(16)) if args[0].type.width != 16 else args[0]
        return builder.fpext(builder.bitcast(v, ir.HalfType()), _F32)

    return sig, codegen


@intrinsic
def f32_to_half(typingctx, f):
    """float32 -> uint16 binary16 bits, round to nearest even (LLVM ``fptrunc``; portable)."""
    sig = types.uint16(f)

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type != _F32:
            v = builder.fptrunc(v, _F32)
        return builder.bitcast(builder.fptrunc(v, ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def i32_as_f32(typingctx, i):
    """Reinterpret int32 bits as float32 (LLVM ``bitcast``; vectorizes)."""
    sig = types.float32(i)

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width != 32:
            v = builder.trunc(v, _I32) if v.type.width > 32 else builder.sext(v, _I32)
        return builder.bitcast(v, _F32)

    return sig, codegen
