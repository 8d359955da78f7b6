"""Upload-time repacking of :class:`~edgeinfer.backends.quantized.QuantizedTensor` for the CPU kernels.

The on-disk layout (sequential nibbles, fp16 scales, packed zeros) is the format's; the
CPU kernels want (see :mod:`._simd`):

* 4-bit codes regrouped so that one 32-byte load holds two 32-column blocks, block
  ``2c`` in the low nibbles and ``2c + 1`` in the high nibbles;
* 8-bit codes kept as int8 (symmetric, zero point 0);
* scales ``sc[out, ng]`` and the zero-point term ``sz = s * z`` (z = stored zero,
  8 for symmetric 4-bit; ``sz = -m`` for a weight with float mins, ``w = q * s + m``;
  symmetric 8-bit weights have none: ``sz`` ``[out, 0]``, the kernels skip the term), so that
  ``W @ x = sum_g sc * (codes . x)_g - sum_g sz * sum(x)_g``; each held as uint16 fp16 bits
  where all its values are fp16 values (GGUF ``d`` and ``m``, ``.eif`` scales:
  :func:`half_if_exact`; the kernels widen them exactly), else float32;
* the input dimension padded with zero codes to a multiple of 64 (4-bit) or 32 (8-bit);
  padded activations are zero, so padded columns contribute nothing.

8-bit weights whose codes are 5-bit ones (llama.cpp ``Q5_0`` / ``Q5_1`` re-laid by
:mod:`edgeinfer.readers.gguf_blocks`, :func:`five_bit_codes`) run at 5 bits: the 4-bit
chunk layout plus a u32 of fifth bits per block (``wp`` uint8 ``[out, nb * 20]``,
:data:`._simd_ir.CHUNK_BYTES`), unsigned codes 0..31 with ``sz = 16 s`` (``Q5_0``) or
``-m`` (``Q5_1``): 5 bits per weight plus ``sc`` (and ``sz`` for ``Q5_1``).
``Q5_0``'s ``sz`` is not stored: it is ``sc`` itself with :attr:`CpuQuantWeight.zero_scale`
16, and the kernels scale the activation group sums ``X`` by 16 instead (exact: a power
of two), so ``16 X . s`` rounds as ``X . 16 s`` did, bit for bit. Symmetric 4-bit weights
(``Q4_0``, signmax, symmetric RTN / GPTQ: zero 8) hold theirs alike, ``zero_scale`` 8:
4 bits per weight plus one scale per group (4.5 at group 32 with fp16 scales, not 6.0).

8-bit weights with a scale per 16 columns (llama.cpp ``Q6_K``, :func:`has_lane_scales`)
keep ``sc`` float32 ``[out, 2 * nb]`` (two scales per 32-column block, applied per lane by
:mod:`._simd_k`) and no zero-point term (``sz`` ``[out, 0]``).

Those whose codes are 6-bit ones (``Q6_K``: -32..31, :func:`six_bit_codes`) and whose
lane scales factor exactly as an int8 times a float32 per 16 lanes (256 columns,
:func:`factor_lane_scales`; ``Q6_K``'s ``d * sc``) run at 6 bits (``bits`` 6): ``wp``
uint8 ``[out, nb * 24]``, per 64-column chunk the 4-bit chunk's 32 nibble bytes, then
8 bytes per block (``2c``, ``2c + 1``) whose byte ``k`` holds bits 4 and 5 of the block's
codes ``k + 8 g`` at bits ``2 g``, ``2 g + 1`` (g = 0..3), codes ``u - 32``; ``sc`` uint8 ``[out, A + 4 * nsb]``: the int8 lane scales (``2 nb`` of them,
padded to ``A``, a multiple of 4), then the float32 super-block scales (one per 8 blocks);
the kernels multiply the two (exact: the stored ``d * sc``): 6.625 bits per weight.

4- and 5-bit weights in groups of 32 whose scales (or zero-point terms) factor exactly as
an int8 per block times a float32 per 8 blocks (llama.cpp ``Q4_K`` / ``Q5_K``: ``d * sc``
and ``dmin * m``, :func:`factor_group_terms`) hold them factored: uint8 ``[out, A + 4 nsb]``
(:func:`pack_factored`), 1.5 bytes per 32 columns instead of 4; the kernels form
``float32(q) * d``, the stored scale bit for bit. ``Q4_K`` then runs at 4.75 bits per
weight and ``Q5_K`` at 5.75.

This is a copy made once at upload (never on disk): 4.375 bits/weight for INT4 g128
(fp16 scale, float32 zero term per 128); llama.cpp's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 their
file's size.
8-bit codes whose width is already a multiple of 32 need no change: :func:`repack_q8_view`
wraps given codes (e.g. a copy-on-write file view of an ``.eif`` embedding) without a copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..quantized import SYMMETRIC_ZERO_4BIT, QuantizedTensor

BLOCK = 32  # activation quantization block (columns) == integer dot block
#: Bytes per two-block chunk of a 5-bit row (:data:`._simd_ir.CHUNK_BYTES`).
CHUNK_BYTES_Q5 = 40
#: The zero of symmetric 5-bit codes (``Q5_0``: stored code ``u``, weight ``(u - 16) s``).
FIVE_BIT_ZERO = 16


@dataclass
class CpuQuantWeight:
    """A quantized weight ``W[out, in]`` repacked for the CPU kernels.

    Attributes:
        bits: 4, 5, 6 or 8.
        out_features, in_features: logical shape.
        group_size: columns per scale group (of the source tensor).
        n_blocks: 32-column blocks per row after padding (``nb``; even for 4 bits).
        wp: uint8 ``[out, nb * 16]`` (4-bit), uint8 ``[out, nb * 20]`` (5-bit), uint8
            ``[out, nb * 24]`` (6-bit) or int8 ``[out, nb * 32]`` (8-bit).
        sc: float32 or uint16 (fp16 bits) ``[out, ng]`` group scales; 6-bit: uint8, the
            packed lane scales (module docstring, :func:`lane6_scale_offset`); 4- / 5-bit
            with ``ng == nb``: also uint8 factored (:func:`factor_group_terms`).
        sz: ``[out, ng]`` scale times zero point (``s * z``), or ``[out, 0]`` where there
            is no zero-point term (symmetric 8-bit, lane scales); float32, fp16 or factored
            as ``sc`` may be (each independently); ``sc`` itself where implicit
            (``zero_scale``).
        bmap: int32 ``[nb]`` block -> group index.
        lane_scales: ``sc`` holds one scale per 16 columns (``[out, 2 * nb]``; 8-bit
            only): the kernels of :mod:`.qlane` run it.
        zero_scale: the zero-point term is ``zero_scale * sum_g sz[r, g] X[g]``; 1, or 16
            / 8 with ``sz`` the array ``sc`` (symmetric 5- / 4-bit: ``sz = 16 s`` / ``8 s``
            held implicitly; the kernels multiply ``X`` by it).
        nbytes: bytes streamed per GEMV (codes + sc + sz, ``sz`` not again when it is
            ``sc``).
    """

    bits: int
    out_features: int
    in_features: int
    group_size: int
    n_blocks: int
    wp: np.ndarray
    sc: np.ndarray
    sz: np.ndarray
    bmap: np.ndarray
    lane_scales: bool = False
    zero_scale: float = 1.0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def n_groups(self) -> int:
        if self.bits == 6:  # sc holds packed int8 lane scales and their super-block scales
            return 2 * self.n_blocks
        if self.sc.dtype == np.uint8:  # factored: one scale per block
            return self.n_blocks
        return int(self.sc.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.wp.nbytes + self.sc.nbytes
                   + (0 if self.zero_scale != 1.0 else self.sz.nbytes))


def blocks_align_with_groups(w: QuantizedTensor) -> bool:
    """True if every 32-column block lies inside one scale group (the fast kernels' need)."""
    return w.group_size % BLOCK == 0 or w.n_groups == 1


#: Columns per scale of a lane-scaled weight (half a 32-column block).
LANE_GROUP = 16


def has_lane_scales(w: QuantizedTensor) -> bool:
    """True for a symmetric 8-bit weight in groups of 16 columns (llama.cpp ``Q6_K``):
    :func:`repack` keeps a scale per half block for the kernels of :mod:`.qlane`."""
    return (w.bits == 8 and w.group_size == LANE_GROUP and w.n_groups > 1 and w.mins is None
            and w.zeros is None)


def runs_on_integer_kernels(w: QuantizedTensor) -> bool:
    """True if :func:`repack` takes ``w`` (else the caller dequantizes it to float32)."""
    return blocks_align_with_groups(w) or has_lane_scales(w)


#: Lane scales per float32 super-block scale of a 6-bit weight (256 columns, ``Q6_K``).
SUPER_LANES = 16
#: Bytes per 64-column chunk of a 6-bit row: 32 nibble bytes, four u32 bit planes.
CHUNK_BYTES_Q6 = 48


def six_bit_codes(w: QuantizedTensor) -> np.ndarray | None:
    """The unsigned 6-bit codes ``u = q + 32`` uint8 ``[out, in_padded]`` (0..63) of a
    lane-scaled weight whose codes lie in -32..31 (llama.cpp ``Q6_K``); else None."""
    if not has_lane_scales(w) or w.qweight.size == 0:
        return None
    q = w.qweight
    if int(q.min()) < -32 or int(q.max()) > 31:
        return None
    return (q.astype(np.int16) + 32).astype(np.uint8)


def factor_scales(scales: np.ndarray, per: int = SUPER_LANES
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """Scales float32 ``[out, n]`` as int8 ``q`` ``[out, per * nsb]`` (zero past ``n``)
    times float32 ``d`` ``[out, nsb]``, one per ``per`` scales, such that
    ``float32(q) * d`` equals each scale bit for bit (signed zeros too); None if some
    super-block has no such factoring (or a non-finite scale). Tries ``|q|`` of the largest
    scale from 128 down, with ``d`` of either sign."""
    s32 = np.asarray(scales, np.float32)
    out, n = s32.shape
    if not np.isfinite(s32).all():
        return None
    nsb = -(-n // per)
    s = np.zeros((out, nsb * per), np.float32)
    s[:, :n] = s32
    s = s.reshape(out * nsb, per)
    amax = np.abs(s).max(axis=1)
    d = np.zeros(out * nsb, np.float32)
    q = np.zeros((out * nsb, per), np.int8)
    zero = amax == 0  # an all-zero super-block: d +0, q +-1 (keeps each zero's sign)
    q[zero] = np.where(np.signbit(s[zero]), -1, 1)
    todo = np.flatnonzero(~zero)
    for qm in range(128, 0, -1):
        for sign in (1, -1):  # q = -128 needs d of the other sign than the largest scale
            if todo.size == 0:
                break
            cand = (np.float32(sign) * amax[todo] / np.float32(qm)).astype(np.float32)
            st = s[todo]
            qf = np.rint(st / cand[:, None])
            qc = np.clip(qf, -128, 127).astype(np.float32)
            prod = (qc + np.float32(0)) * cand[:, None]  # the kernels' float32(q) * d
            ok = ((qf == qc) & (prod.view(np.uint32) == st.view(np.uint32))).all(axis=1)
            d[todo[ok]] = cand[ok]
            q[todo[ok]] = qc[ok].astype(np.int8)
            todo = todo[~ok]
    if todo.size:
        return None
    return q.reshape(out, nsb * per), d.reshape(out, nsb)


def factor_lane_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`factor_scales` per :data:`SUPER_LANES` lane scales (``Q6_K``'s 256 columns)."""
    return factor_scales(scales, SUPER_LANES)


def factored_offset(n: int) -> int:
    """Byte offset of the float32 super-scales in a factored scale row of ``n`` int8
    scales (``n`` padded to a multiple of 4)."""
    return (n + 3) // 4 * 4


def lane6_scale_offset(nb: int) -> int:
    """Byte offset of the float32 super-block scales in a 6-bit weight's ``sc`` row (after
    its ``2 nb`` int8 lane scales, padded to a multiple of 4)."""
    return factored_offset(2 * nb)


def pack_factored(q: np.ndarray, d: np.ndarray, n: int) -> np.ndarray:
    """uint8 ``[out, A + 4 nsb]``: ``n`` int8 scales ``q`` (zero-padded to ``A`` =
    :func:`factored_offset`), then the float32 ``d`` ``[out, nsb]`` (their bytes)."""
    out, nsb = d.shape
    at = factored_offset(n)
    sc = np.zeros((out, at + 4 * nsb), np.uint8)
    k = min(q.shape[1], n)
    sc[:, :k] = q[:, :k].view(np.uint8)
    sc[:, at:] = np.ascontiguousarray(d, np.float32).view(np.uint8).reshape(out, 4 * nsb)
    return sc


#: Groups per float32 super-scale of a factored 4- / 5-bit weight (256 columns: ``Q4_K``,
#: ``Q5_K``).
SUPER_GROUPS = 8
#: Rows :func:`factor_group_terms` tries first (independent fp16 scales fail at once).
PROBE_ROWS = 8


def factor_group_terms(a: np.ndarray, nb: int) -> np.ndarray:
    """A 4- / 5-bit weight's float32 ``[out, nb]`` scales (or zero-point terms), one per
    32-column block, as a factored uint8 row (:func:`pack_factored`: int8 per block times
    a float32 per :data:`SUPER_GROUPS` blocks) if they factor exactly, else ``a`` itself.
    The kernels read either (:func:`._simd_ir.group_value`) with the same float results."""
    if a.shape[1] != nb or nb == 0 or a.shape[0] == 0:
        return a
    if factor_scales(a[:PROBE_ROWS], SUPER_GROUPS) is None:  # cheap no for fp16 scales
        return a
    f = factor_scales(a, SUPER_GROUPS)
    return a if f is None else pack_factored(*f, nb)


def half_if_exact(a: np.ndarray) -> np.ndarray:
    """float32 scales (or zero-point terms) ``a`` as uint16 fp16 bits if every value (signed
    zeros too) is an fp16 value, else ``a``: the kernels widen them exactly
    (:func:`._simd_ir.group_scale`), so the floats they compute are unchanged."""
    if a.dtype != np.float32 or a.size == 0:
        return a
    with np.errstate(over="ignore"):  # beyond fp16's range: inf, then unequal
        h = a.astype(np.float16)
    if np.array_equal(h.astype(np.float32).view(np.uint32), a.view(np.uint32)):
        return h.view(np.uint16)
    return a


def term_values(a: np.ndarray, nb: int) -> np.ndarray:
    """The float32 values ``[out, n]`` of a scale or zero-point-term array of any kind the
    kernels read: float32 as it is, uint16 fp16 bits widened, factored uint8 (``nb``
    blocks, :func:`pack_factored`) multiplied out. For oracles and inspection."""
    if a.dtype == np.uint16:
        return a.view(np.float16).astype(np.float32)
    if a.dtype == np.uint8:
        at = factored_offset(nb)
        q = a[:, :nb].view(np.int8).astype(np.float32)
        d = np.ascontiguousarray(a[:, at:]).view(np.float32)
        return (q * np.repeat(d, SUPER_GROUPS, axis=1)[:, :nb]).astype(np.float32)
    return np.asarray(a, np.float32)


def _repack_q6(w: QuantizedTensor, u: np.ndarray, q: np.ndarray, d: np.ndarray) -> CpuQuantWeight:
    out, kp = w.out_features, w.in_padded
    kpad = -(-kp // (2 * BLOCK)) * 2 * BLOCK
    nb = kpad // BLOCK
    full = np.zeros((out, kpad), np.uint8)
    full[:, :kp] = u
    c3 = full.reshape(out, nb // 2, 2, BLOCK)
    wp = np.empty((out, nb // 2, CHUNK_BYTES_Q6), np.uint8)
    wp[:, :, :BLOCK] = (c3[:, :, 0, :] & 15) | ((c3[:, :, 1, :] & 15) << 4)
    hi = (c3 >> 4).reshape(out, nb // 2, 2, 4, 8)  # [.., block, g, k]: code 8 g + k's bits 4, 5
    crumbs = np.zeros((out, nb // 2, 2, 8), np.uint8)
    for g in range(4):
        crumbs |= hi[:, :, :, g, :] << (2 * g)
    wp[:, :, BLOCK:] = crumbs.reshape(out, nb // 2, 16)
    nsb = -(-nb // (SUPER_LANES // 2))
    dd = np.zeros((out, nsb), np.float32)
    dd[:, :min(nsb, d.shape[1])] = d[:, :nsb]
    sc = pack_factored(q, dd, 2 * nb)
    bmap = (2 * np.arange(nb)).astype(np.int32)
    return CpuQuantWeight(6, out, w.in_features, LANE_GROUP, nb, wp.reshape(out, nb * 24), sc,
                          np.zeros((out, 0), np.float32), bmap, lane_scales=True)


def _repack_lanes(w: QuantizedTensor) -> CpuQuantWeight:
    u = six_bit_codes(w)
    f = None if u is None else factor_lane_scales(w.scales)
    if f is not None:
        return _repack_q6(w, u, *f)
    return repack_lanes8(w)


def repack_lanes8(w: QuantizedTensor) -> CpuQuantWeight:
    """A lane-scaled weight as 8-bit codes and float32 lane scales (any codes and scales;
    :func:`repack` takes the 6-bit form where it applies)."""
    out, kp = w.out_features, w.in_padded
    kpad = -(-kp // BLOCK) * BLOCK
    nb = kpad // BLOCK
    wp = np.zeros((out, kpad), np.int8)
    wp[:, :kp] = w.qweight
    sc = np.zeros((out, 2 * nb), np.float32)  # a padded half block: scale 0, codes 0
    sc[:, :w.n_groups] = w.scales
    bmap = (2 * np.arange(nb)).astype(np.int32)
    return CpuQuantWeight(8, out, w.in_features, LANE_GROUP, nb, wp, sc,
                          np.zeros((out, 0), np.float32), bmap, lane_scales=True)


def block_groups(nb: int, g: int, ng: int) -> np.ndarray:
    """``bmap`` int32 ``[nb]``: the group of each 32-column block (groups of ``g`` columns,
    ``ng`` of them; padded blocks past the last group take it: their activations are 0)."""
    return np.minimum(np.arange(nb) * BLOCK // g, ng - 1).astype(np.int32)


def five_bit_codes(w: QuantizedTensor) -> np.ndarray | None:
    """The unsigned 5-bit codes ``[out, in_padded]`` uint8 (0..31) of an 8-bit weight that
    is a 5-bit one (llama.cpp ``Q5_0``: symmetric codes in -16..15, stored ``+ 16``;
    ``Q5_1``: codes 0..31 with float mins) and whose blocks align with its groups; None
    for any other weight."""
    if (w.bits != 8 or w.zeros is not None or w.n_groups < 1 or has_lane_scales(w)
            or not blocks_align_with_groups(w)):
        return None
    q = w.qweight
    lo, hi = (0, 31) if w.mins is not None else (-16, 15)
    if q.size == 0 or int(q.min()) < lo or int(q.max()) > hi:
        return None
    return (q.astype(np.int16) - lo).astype(np.uint8)


def _repack_q5(w: QuantizedTensor, codes: np.ndarray) -> CpuQuantWeight:
    out, kp, g, ng = w.out_features, w.in_padded, w.group_size, w.n_groups
    kpad = -(-kp // (2 * BLOCK)) * 2 * BLOCK
    nb = kpad // BLOCK
    full = np.zeros((out, kpad), np.uint8)
    full[:, :kp] = codes
    c3 = full.reshape(out, nb // 2, 2, BLOCK)
    wp = np.empty((out, nb // 2, CHUNK_BYTES_Q5), np.uint8)
    wp[:, :, :BLOCK] = (c3[:, :, 0, :] & 15) | ((c3[:, :, 1, :] & 15) << 4)
    fifth = np.packbits(c3 >> 4, axis=-1, bitorder="little")  # [out, nb/2, 2, 4] bytes
    wp[:, :, BLOCK:] = fifth.reshape(out, nb // 2, 8)
    sc = half_if_exact(factor_group_terms(np.ascontiguousarray(w.scales, dtype=np.float32), nb))
    bmap = block_groups(nb, g, ng)
    if w.mins is not None:
        mins = np.ascontiguousarray(-np.asarray(w.mins, np.float32))
        sz = half_if_exact(factor_group_terms(mins, nb))
        return CpuQuantWeight(5, out, w.in_features, g, nb, wp.reshape(out, nb * 20), sc, sz,
                              bmap)
    # w = (q - 16) * s: sz = 16 s, held as sc itself (zero_scale 16)
    return CpuQuantWeight(5, out, w.in_features, g, nb, wp.reshape(out, nb * 20), sc, sc,
                          bmap, zero_scale=float(FIVE_BIT_ZERO))


def _owned_rows(a: np.ndarray, dtype) -> bool:
    """``a`` is a writable C-contiguous ``dtype`` array in RAM that owns its memory (not a
    view of a file mapping or of a larger array), as the kernels take a copy."""
    return (a.dtype == dtype and a.flags.c_contiguous and a.flags.owndata
            and a.flags.writeable)


def repack(w: QuantizedTensor) -> CpuQuantWeight:
    """Repack a quantized weight for the CPU integer-dot kernels.

    Args:
        w: 4- or 8-bit weight whose 32-column blocks each lie in one group
            (:func:`blocks_align_with_groups`), or an 8-bit one with lane scales
            (:func:`has_lane_scales`).

    Returns:
        The repacked weight: a new copy (the source may be a memmap), except an 8-bit
        weight's codes already in RAM in the kernels' layout, which it shares.

    Raises:
        ValueError: groups straddle 32-column blocks (caller falls back to dense).
    """
    if has_lane_scales(w):
        return _repack_lanes(w)
    codes5 = five_bit_codes(w)
    if codes5 is not None:
        return _repack_q5(w, codes5)
    if not blocks_align_with_groups(w):
        raise ValueError(f"group size {w.group_size} is not a multiple of {BLOCK}")
    out, kp, g, ng = w.out_features, w.in_padded, w.group_size, w.n_groups
    chunk = 2 * BLOCK if w.bits == 4 else BLOCK
    kpad = -(-kp // chunk) * chunk
    nb = kpad // BLOCK
    bmap = block_groups(nb, g, ng)
    sc = np.ascontiguousarray(w.scales, dtype=np.float32)
    if w.bits == 4:
        codes = np.zeros((out, kpad), np.uint8)
        codes[:, :kp] = w.codes()
        # [out, nch, 2, 32] -> byte j of chunk c = code(64c + j) | code(64c + 32 + j) << 4
        c3 = codes.reshape(out, nb // 2, 2, BLOCK)
        wp = (c3[:, :, 0, :] | (c3[:, :, 1, :] << 4)).reshape(out, nb * 16)
        z = None if w.mins is not None else w.zero_points()  # float32 [out, ng], 8 when symmetric
    else:
        if kpad == kp and _owned_rows(w.qweight, np.int8):
            wp = w.qweight  # already the kernels' layout, in RAM: shared, not copied
        else:
            wp = np.zeros((out, kpad), np.int8)
            wp[:, :kp] = w.qweight
        z = None if w.mins is not None else 0
    if w.bits == 4 and w.symmetric:  # sz = 8 sc: held as sc itself, zero_scale 8
        sc = half_if_exact(factor_group_terms(sc, nb))
        return CpuQuantWeight(4, out, w.in_features, g, nb, np.ascontiguousarray(wp), sc, sc,
                              bmap, zero_scale=float(SYMMETRIC_ZERO_4BIT))
    if z is None:
        sz = np.ascontiguousarray(-np.asarray(w.mins, np.float32))  # w = q * s - sz
    elif w.bits == 8:  # symmetric 8-bit: no zero-point term at all
        sz = np.zeros((out, 0), np.float32)
    else:
        sz = (sc * z).astype(np.float32)
    if w.bits == 4:
        sc, sz = factor_group_terms(sc, nb), factor_group_terms(sz, nb)
    return CpuQuantWeight(w.bits, out, w.in_features, g, nb, np.ascontiguousarray(wp),
                          half_if_exact(sc), half_if_exact(sz), bmap)


def repack_q8_view(w: QuantizedTensor, codes: np.ndarray) -> CpuQuantWeight | None:
    """The 8-bit weight ``w`` for the CPU kernels with ``codes`` as its ``wp`` (no copy).

    Args:
        w: an 8-bit weight (symmetric by format) whose ``in_padded`` is a multiple of 32
            and whose blocks align with its groups.
        codes: int8 ``[out, in_padded]`` writable, C-contiguous, equal to ``w.qweight``
            (e.g. :func:`edgeinfer.backends.osmemory.private_file_view` of it).

    Returns:
        the weight (``sc`` a float32 copy of the scales, ``sz`` ``[out, 0]``), or None if ``w``
        does not qualify (the caller repacks).
    """
    if (w.bits != 8 or w.mins is not None or w.in_padded % BLOCK or not blocks_align_with_groups(w)
            or codes.dtype != np.int8 or codes.shape != w.qweight.shape
            or not codes.flags.c_contiguous or not codes.flags.writeable):
        return None
    nb, g, ng = w.in_padded // BLOCK, w.group_size, w.n_groups
    bmap = block_groups(nb, g, ng)
    sc = np.ascontiguousarray(w.scales, dtype=np.float32)
    return CpuQuantWeight(8, w.out_features, w.in_features, g, nb, codes, sc,
                          np.zeros((w.out_features, 0), np.float32), bmap)


assert SYMMETRIC_ZERO_4BIT == 8  # the 4-bit symmetric zero the kernels assume via zero_points()
