"""Device tensors, the activation pool, and weight repacking for the OpenCL kernels.

Activations are :class:`DeviceTensor` views of pooled ``cl.Buffer`` blocks. A block goes
back to its pool when the last view of it is garbage-collected (CPython refcounting makes
that immediate), so after the first decode step every later step reuses the same buffers
and creates none (``BufferPool.created`` stops growing; a test checks it). Reuse is safe
because the queue is in-order: a kernel that overwrites a recycled block runs after every
kernel that read it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from ..quantized import QuantizedTensor, unpack_nibbles
from .device import cl

log = logging.getLogger(__name__)


def _size_class(nbytes: int) -> int:
    """Round a request up to a power of two (>= 256 B) so varying prefill lengths share blocks."""
    n = 256
    while n < nbytes:
        n *= 2
    return n


class BufferPool:
    """Free lists of device buffers keyed by size class.

    Attributes:
        created: buffers allocated so far (constant during a steady decode loop).
    """

    def __init__(self, context):
        self.context = context
        self._free: dict[int, list] = {}
        self.created = 0

    def acquire(self, nbytes: int) -> _Block:
        size = _size_class(max(int(nbytes), 1))
        free = self._free.get(size)
        buf = free.pop() if free else None
        if buf is None:
            buf = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, size)
            self.created += 1
        return _Block(buf, size, self)

    def release(self, buf, size: int) -> None:
        self._free.setdefault(size, []).append(buf)

    def clear(self) -> None:
        """Drop every cached free buffer (the device frees them once no command uses them)."""
        self._free.clear()


class _Block:
    """Owns one pooled buffer; returns it to the pool when collected."""

    __slots__ = ("buf", "pool", "size")

    def __init__(self, buf, size: int, pool: BufferPool | None):
        self.buf, self.size, self.pool = buf, size, pool

    def __del__(self):
        if self.pool is not None:  # owned (non-pooled) buffers are simply freed
            self.pool.release(self.buf, self.size)


class DeviceTensor:
    """A row-major tensor in a device buffer.

    Attributes:
        shape: logical shape; dtype: numpy dtype (float32 activations, int32 ids).
        buf: the ``cl.Buffer`` (may be larger than ``nbytes``: pooled size class).
    """

    __slots__ = ("_block", "dtype", "shape")

    def __init__(self, block: _Block, shape: tuple[int, ...], dtype=np.float32):
        self._block = block
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)

    @property
    def buf(self):
        """The ``cl.Buffer``."""
        return self._block.buf

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def reshape(self, shape: tuple[int, ...]) -> DeviceTensor:
        """A view with a new shape (same element count); shares the buffer."""
        shape = tuple(int(s) for s in shape)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape a tensor of shape {self.shape} to {shape}")
        return DeviceTensor(self._block, shape, self.dtype)

    def __repr__(self) -> str:
        return f"DeviceTensor(shape={self.shape}, dtype={self.dtype})"


def owned_tensor(context, queue, a: np.ndarray) -> DeviceTensor:
    """Upload ``a`` into a buffer of its own (weights, tables: never pooled)."""
    a = np.ascontiguousarray(a)
    buf = cl.Buffer(context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                    hostbuf=a if a.nbytes else np.zeros(1, np.uint8))
    return DeviceTensor(_Block(buf, max(a.nbytes, 1), None), a.shape, a.dtype)


# ---- weights ------------------------------------------------------------------------

@dataclass
class DeviceWeight:
    """A linear / embedding weight ``W[out, in]`` repacked for the kernels.

    Formats (``fmt``):
      * ``"f32"``: ``codes`` float32 ``[out, stride]``, rows zero-padded to a multiple of 8.
      * ``"q4"``: ``codes`` uint32 ``[out, stride]`` (8 nibbles per word, low first: the
        on-disk bytes viewed little-endian, rows padded to whole words), ``scales``
        float32 ``[out, n_groups]`` (fp16 scales are widened at upload: the CPU kernels
        avoid vload_half, a library call on PoCL, for +2 bytes per group), ``zeros`` uint8
        ``[out, n_groups]`` unpacked from the nibble-packed zero points (or None:
        symmetric, z = 8).
      * ``"q8"``: ``codes`` int8 ``[out, stride]`` (padded to a multiple of 8), ``scales``.
    Codes, scales and zero points live in separate buffers (structure of arrays) so each
    GEMV work-group streams a row's codes contiguously.

    Attributes:
        gemv_ok: the word-wise GEMV kernel applies (a code word never straddles a group);
            otherwise every T uses the GEMM kernel, which dequantizes per element. The
            row kernels of ``fused.cl`` have the same condition (int8 included: 8-column
            words) plus ``in_features`` within the device's ``caps.kmax``.
        scale_half: whether ``scales`` are fp16 (kept for the kernels' SCALE_HALF variant;
            :func:`repack_weight` now always stores float32).
    """

    fmt: str
    out_features: int
    in_features: int
    codes: object
    scales: object | None
    zeros: object | None
    stride: int
    n_groups: int
    group_size: int
    scale_half: bool
    gemv_ok: bool
    nbytes: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)


def _buf(context, a: np.ndarray):
    a = np.ascontiguousarray(a)
    return cl.Buffer(context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)


def _pad_cols(a: np.ndarray, cols: int) -> np.ndarray:
    if a.shape[1] == cols:
        return np.ascontiguousarray(a)
    out = np.zeros((a.shape[0], cols), a.dtype)
    out[:, : a.shape[1]] = a
    return out


def repack_weight(context, w: np.ndarray | QuantizedTensor) -> DeviceWeight:
    """Repack a host weight (dense float or :class:`QuantizedTensor`) into device buffers.

    Raises:
        ValueError: not 2-D, or an unsupported dtype.
    """
    if isinstance(w, QuantizedTensor) and w.mins is not None:
        log.info("a %s weight [%d, %d] with float group mins has no OpenCL kernel yet: "
                 "uploaded dequantized (float32, same values)", w.method, *w.shape)
        w = w.dequantize()
    if isinstance(w, QuantizedTensor):
        s = np.asarray(w.scales).astype(np.float32)  # exact widening of fp16
        half = False
        n, ng, g = w.out_features, w.n_groups, w.group_size
        if w.bits == 4:
            wpr = -(-w.in_padded // 8)
            codes = _pad_cols(np.asarray(w.qweight, np.uint8), wpr * 4).view("<u4")
            zeros = None if w.zeros is None else unpack_nibbles(w.zeros, ng).astype(np.uint8)
            nbytes = codes.nbytes + s.nbytes + (0 if zeros is None else zeros.nbytes)
            return DeviceWeight("q4", n, w.in_features, _buf(context, codes), _buf(context, s),
                                None if zeros is None else _buf(context, zeros), wpr, ng, g,
                                half, ng == 1 or g % 8 == 0, nbytes)
        kp = -(-w.in_padded // 8) * 8
        codes = _pad_cols(np.asarray(w.qweight, np.int8), kp)
        return DeviceWeight("q8", n, w.in_features, _buf(context, codes), _buf(context, s), None,
                            kp, ng, g, half, ng == 1 or g % 4 == 0, codes.nbytes + s.nbytes)
    a = np.asarray(w)
    if a.ndim != 2:
        raise ValueError(f"a linear weight must be 2-D [out, in], got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"dense weights must be floating point, got {a.dtype}")
    kp = -(-a.shape[1] // 8) * 8
    codes = _pad_cols(a.astype(np.float32, copy=False), kp)
    return DeviceWeight("f32", a.shape[0], a.shape[1], _buf(context, codes), None, None, kp,
                        1, kp, False, True, codes.nbytes)
