"""The OpenCL backend: the :class:`~edgeinfer.backends.base.Backend` contract on device buffers.

Weights are uploaded once (repacked, :mod:`.memory`); activations and the KV cache stay on
the device; the only device->host copy of a step is the final logits row. Dispatch:
``linear`` with T == 1 uses the GEMV kernels (one work-group per row block), T > 1 (or a
group size the word-wise GEMV cannot take) the tiled GEMM.

CPU devices such as PoCL (``caps.fused``), where every launch costs tens of
microseconds: linears run the row kernels of ``fused.cl`` (prefill: one launch with a
token loop), and a decode step is a compiled plan (:mod:`.plan`) that fuses the input
norm into the q/k/v launch, RoPE into the KV write, the residual adds into the GEMVs and
the GLU into the gate/up launch: a llama layer is 6 launches instead of 16, and no step
synchronizes with the host except the logits read.
"""
from __future__ import annotations

import math

import numpy as np

from ..base import Backend
from ..quantized import QuantizedTensor
from . import plan as _plan
from .attention_q import attention_q
from .device import (
    OpenCLUnavailableError,
    cl,
    device_context,
    env_device_spec,
    select_device,
)
from .kvcache import DeviceKVCache
from .memory import BufferPool, DeviceTensor, DeviceWeight, owned_tensor, repack_weight

# Scalar kernel arguments are plain Python numbers: every kernel has declared scalar dtypes
# (device.scalar_arg_dtypes), the fast pyopencl path; numpy scalars cost ~25 us each.
_I = int
_F = float
_ACTS = {"silu": 0, "gelu_tanh": 1}
_WFMT = {"f32": 0, "q4": 1, "q8": 2}
# flags of fused.cl's gemv_rows
_F_ZEROS, _F_NORM, _F_NORM_OFF, _F_RES, _F_GLU, _F_GELU = 1, 2, 4, 8, 16, 32
_F_BIAS = (64, 128, 256)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class OpenCLBackend(Backend):
    """OpenCL implementation of the backend contract.

    Args:
        device: device spec (see :func:`.device.select_device`): ``None`` (then the
            ``EDGEINFER_OPENCL_DEVICE`` environment variable, then the first GPU), an index
            ``"0"``, ``"platform:device"`` like ``"1:0"``, or a name substring.
        require_fp16: refuse a device without ``cl_khr_fp16`` (fp16 *storage* of scales
            and the KV cache works everywhere through vload_half / vstore_half).

    Attributes:
        device_info: the chosen device's description (as :func:`.device.list_devices`).
        caps: probed capabilities and launch shapes (:class:`.device.DeviceCaps`).
        pool: the activation :class:`.memory.BufferPool`.

    Raises:
        OpenCLUnavailableError: no pyopencl / platform, bad index, no name match, fp16
            required but missing, or a big-endian device.
    """

    name = "opencl"
    #: a batched decode step runs each sequence by itself here (no row-concatenation
    #: kernel yet): correct, but each weight is read once per sequence
    batched_rows = False

    def __init__(self, device: str | int | None = None, require_fp16: bool = False, **_options):
        if device is None:
            device = env_device_spec()
        dev, info = select_device(device)
        if not dev.endian_little:
            raise OpenCLUnavailableError(f"device {info['name']!r} is big-endian; the INT4 "
                                         "repack assumes little-endian words")
        if require_fp16 and not info["fp16"]:
            raise OpenCLUnavailableError(
                f"device {info['name']!r} lacks cl_khr_fp16, which was required; choose another "
                f"device (see `edgeinfer devices`) or drop the fp16 requirement")
        self.device_info = info
        self._dc = device_context(dev)
        self.context, self.queue, self.caps = self._dc.context, self._dc.queue, self._dc.caps
        self.pool = BufferPool(self.context)
        # Fixed local sizes for elementwise kernels: a runtime-chosen size can vary with the
        # global size, and PoCL compiles a kernel once per local size.
        self._ew = (min(64, self.caps.max_wg),)
        self._ew2 = (self._ew[0], 1)
        self.launches = 0  # kernels enqueued so far (tests and benchmarks count them)

    def __repr__(self) -> str:
        return f"OpenCLBackend({self.device_info['platform']} / {self.device_info['name']})"

    # ---- helpers -----------------------------------------------------------------------
    def _k(self, file: str, name: str, **variant):
        """The kernel to launch next (each call is followed by exactly one launch)."""
        self.launches += 1
        return self._dc.kernel(file, name, **variant)

    @property
    def fused(self) -> bool:
        """Whether linears run the row kernels and decode steps a plan (module docstring)."""
        return self.caps.fused

    def _row_ok(self, w: DeviceWeight) -> bool:
        """Whether fused.cl's row kernels take weight ``w``."""
        if w.scale_half or _round_up(w.in_features, 8) > self.caps.kmax:
            return False
        return w.fmt == "f32" or w.n_groups == 1 or w.group_size % 8 == 0

    def _new(self, shape, dtype=np.float32) -> DeviceTensor:
        """A pooled activation tensor (uninitialized)."""
        n = math.prod(shape) * (4 if dtype is np.float32 else np.dtype(dtype).itemsize)
        return DeviceTensor(self.pool.acquire(n), shape, dtype)

    def _host_ints(self, a: np.ndarray) -> DeviceTensor:
        """Stage a small int32 host array in a pooled buffer (blocking write: the queue is
        idle at the start of a step, after the previous step's logits read)."""
        a = np.ascontiguousarray(a, dtype=np.int32)
        t = self._new(a.shape, np.int32)
        cl.enqueue_copy(self.queue, t.buf, a, is_blocking=True)
        return t

    @staticmethod
    def _check(x, name: str) -> DeviceTensor:
        if not isinstance(x, DeviceTensor):
            raise TypeError(f"{name} must be a tensor of this OpenCL backend (from upload() or "
                            f"an op), got {type(x).__name__}")
        return x

    def _gsize(self, n: int) -> tuple[int]:
        """Global size of a 1-D elementwise launch (a multiple of the local size ``_ew``)."""
        return (_round_up(max(n, 1), self._ew[0]),)

    # ---- memory ------------------------------------------------------------------------
    def upload(self, a: np.ndarray) -> DeviceTensor:
        """Upload a dense tensor (float -> float32, integer -> int32) into its own buffer."""
        a = np.asarray(a)
        a = a.astype(np.int32 if np.issubdtype(a.dtype, np.integer) else np.float32, copy=False)
        return owned_tensor(self.context, self.queue, a)

    def upload_weight(self, w: np.ndarray | QuantizedTensor) -> DeviceWeight:
        """Repack and upload a linear weight ``[out, in]`` (see :class:`.memory.DeviceWeight`)."""
        return repack_weight(self.context, w)

    def to_host(self, t) -> np.ndarray:
        """Copy a :class:`DeviceTensor` back (blocking) as a numpy array of its shape."""
        t = self._check(t, "to_host argument")
        out = np.empty(t.shape, t.dtype)
        if out.nbytes:
            cl.enqueue_copy(self.queue, out, t.buf, is_blocking=True)
        return out

    def new_kv_cache(self, n_layers, n_kv_heads, head_dim, max_tokens, dtype="f32",
                     window_sizes=None, max_chunk=None) -> DeviceKVCache:
        """A :class:`DeviceKVCache`: per layer a ring of ``max_tokens`` slots, or for a
        sliding-window layer ``min(max_tokens, W - 1 + max_chunk)`` (the host cache's
        rule and byte count). ``dtype`` "f32" / "f16" (plain) or "int8" / "int4" / "k8v4" (the
        formats of :mod:`edgeinfer.backends.kvcache`, quantized on write by a kernel).

        Raises:
            ValueError: an unknown dtype, head_dim above the kernel limit, bad windows, or
                a cache beyond 32-bit indexing.
        """
        if head_dim > self.caps.max_hd:
            raise ValueError(f"head_dim {head_dim} exceeds the attention kernel's limit "
                             f"{self.caps.max_hd}")
        return DeviceKVCache(self.context, self.queue, n_layers, n_kv_heads, head_dim,
                             max_tokens, dtype, window_sizes, max_chunk)

    def logits(self, x, head, softcap=None, norm=None):
        """See :meth:`Backend.logits`. On a CPU device one row's norm and projection are one
        row-kernel launch (the norm in its prologue)."""
        x = self._check(x, "x")
        if (norm is not None and self.caps.fused and isinstance(head, DeviceWeight)
                and self._row_ok(head) and x.size == x.shape[-1] <= self.caps.kmax):
            y = self._new((1, head.out_features))
            kern, g, l, args = self.rows_launch(x, [(y.buf, head, None)], norm=norm)
            self.launches += 1
            kern(self.queue, g, l, *args)
            out = self.to_host(y)
            if softcap:
                out = np.tanh(out / softcap) * softcap
            return out
        return super().logits(x, head, softcap, norm)

    def reshape(self, x, shape):
        """A view of x with a new shape (no copy)."""
        return self._check(x, "x").reshape(shape)

    def select_rows(self, x, rows: slice):
        """x[rows] of a [T, ...] tensor, copied into a pooled buffer (device-side copy)."""
        x = self._check(x, "x")
        start, stop, step = rows.indices(x.shape[0])
        if step != 1:
            raise ValueError("select_rows supports contiguous slices only")
        n = max(stop - start, 0)
        if start == 0 and n == x.shape[0]:
            return x  # the whole tensor (the last row of one): no copy
        row_bytes = x.nbytes // max(x.shape[0], 1)
        y = self._new((n,) + x.shape[1:], x.dtype)
        if n:
            cl.enqueue_copy(self.queue, y.buf, x.buf, byte_count=n * row_bytes,
                            src_offset=start * row_bytes, dst_offset=0)
        return y

    # ---- ops ---------------------------------------------------------------------------
    def embed(self, table, ids, scale=1.0):
        """x[T, D] = table[ids] * scale; ``ids`` int32 [T] on the host.

        Raises:
            ValueError: an id outside 0..V-1.
        """
        ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
        if not isinstance(table, DeviceWeight):
            raise TypeError("embed needs a table from upload_embedding()/upload_weight()")
        v, d = table.shape
        if ids.size and (ids.min() < 0 or ids.max() >= v):
            raise ValueError(f"token id out of range 0..{v - 1}: {ids.min()}..{ids.max()}")
        t = ids.size
        y = self._new((t, d))
        if t == 0:
            return y
        self._embed_into(y, self._host_ints(ids), table, scale)
        return y

    def _embed_into(self, y: DeviceTensor, idt: DeviceTensor, table: DeviceWeight, scale):
        """The embedding launch: rows ``idt`` (int32 [T] on the device) of ``table`` times
        ``scale`` into ``y`` [T, D]."""
        t, d = idt.size, table.shape[1]
        g = (_round_up(d, self._ew[0]), t)
        if table.fmt == "f32":
            self._k("dense.cl", "embed_f32")(self.queue, g, self._ew2, y.buf, idt.buf, table.codes,
                                             _I(d), _I(table.stride), _F(scale))
        elif table.fmt == "q4":
            self._k("quant.cl", "embed_q4", SCALE_HALF=int(table.scale_half))(
                self.queue, g, self._ew2, y.buf, idt.buf, table.codes, table.scales, table.zeros,
                _I(d), _I(table.stride), _I(table.n_groups), _I(table.group_size),
                _I(table.zeros is not None), _F(scale))
        else:
            self._k("quant.cl", "embed_q8", SCALE_HALF=int(table.scale_half))(
                self.queue, g, self._ew2, y.buf, idt.buf, table.codes, table.scales, _I(d),
                _I(table.stride), _I(table.n_groups), _I(table.group_size), _F(scale))

    def rmsnorm(self, x, w, eps, unit_offset=False):
        """y[..., N] = x / sqrt(mean(x**2) + eps) * (w or 1 + w) over the last axis."""
        x, w = self._check(x, "x"), self._check(w, "w")
        n = x.shape[-1]
        if w.size != n:
            raise ValueError(f"rmsnorm weight has {w.size} elements for rows of {n}")
        y = self._new(x.shape)
        self._rmsnorm_into(y.buf, x, w, eps, unit_offset)
        return y

    def _rmsnorm_into(self, out, x, w, eps, unit_offset):
        n = x.shape[-1]
        rows = x.size // n
        lws = self.caps.lws
        self._k("dense.cl", "rmsnorm")(self.queue, (rows * lws,), (lws,), out, x.buf, w.buf,
                                       _I(n), _F(eps), _I(bool(unit_offset)))

    def linear(self, x, w, bias=None):
        """y[T, out] = x[T, in] @ W[out, in].T (+ bias[out]); W from upload_weight()."""
        x = self._check(x, "x")
        if not isinstance(w, DeviceWeight):
            raise TypeError("linear needs a weight from upload_weight()/upload_embedding(), "
                            f"got {type(w).__name__}")
        n, k = w.shape
        if x.shape[-1] != k:
            raise ValueError(f"linear: x has {x.shape[-1]} features, weight expects {k}")
        t = x.size // k
        y = self._new((t, n))
        has_b = bias is not None
        c = self.caps
        b = self._check(bias, "bias").buf if has_b else None
        if c.fused and self._row_ok(w):
            # a CPU device: the row kernel with a token loop (gemm.cl's tiles and barriers
            # are slow under PoCL)
            kw = -(-k // 8)
            wpg = kw if (w.fmt == "f32" or w.n_groups == 1) else w.group_size // 8
            flags = (_F_ZEROS if w.zeros is not None else 0) | (_F_BIAS[0] if has_b else 0)
            r = c.rlws
            self._k("fused.cl", "gemm_rows", WFMT=_WFMT[w.fmt], RLWS=r, KMAX=c.kmax)(
                self.queue, (_round_up(n, r),), (r,), y.buf, x.buf, w.codes, w.scales, w.zeros,
                b, _I(t), _I(n), _I(k), _I(kw), _I(w.stride), _I(w.n_groups), _I(wpg), _I(flags))
            return y
        if t == 1 and w.gemv_ok:
            g, l = (_round_up(n, c.rows) // c.rows * c.lws,), (c.lws,)
            if w.fmt == "f32":
                self._k("dense.cl", "gemv_f32")(self.queue, g, l, y.buf, x.buf, w.codes, b,
                                                _I(n), _I(k), _I(w.stride), _I(has_b))
            elif w.fmt == "q4":
                self._k("quant.cl", "gemv_q4", SCALE_HALF=int(w.scale_half))(
                    self.queue, g, l, y.buf, x.buf, w.codes, w.scales, w.zeros, b, _I(n), _I(k),
                    _I(w.stride), _I(w.n_groups), _I(w.group_size), _I(w.zeros is not None),
                    _I(has_b))
            else:
                self._k("quant.cl", "gemv_q8", SCALE_HALF=int(w.scale_half))(
                    self.queue, g, l, y.buf, x.buf, w.codes, w.scales, b, _I(n), _I(k),
                    _I(w.stride), _I(w.n_groups), _I(w.group_size), _I(has_b))
            return y
        fmt = {"f32": 0, "q4": 1, "q8": 2}[w.fmt]
        ts, rt = c.ts, c.rt
        g = (_round_up(n, ts), _round_up(t, ts * rt) // rt)
        self._k("gemm.cl", "gemm", WFMT=fmt, SCALE_HALF=int(w.scale_half))(
            self.queue, g, (ts, ts), y.buf, x.buf, w.codes, w.scales, w.zeros, b, _I(t), _I(n),
            _I(k), _I(w.stride), _I(w.n_groups), _I(w.group_size), _I(w.zeros is not None),
            _I(has_b))
        return y

    def rope(self, x, cos, sin, positions):
        """Rotate x[T, H, hd] (NeoX rotate-half, partial rotary); tables [max_pos, r/2].

        Raises:
            ValueError: a position outside the table, or rotary dims > hd.
        """
        x, cos, sin = self._check(x, "x"), self._check(cos, "cos"), self._check(sin, "sin")
        t, _, hd = x.shape
        max_pos, r2 = cos.shape
        if 2 * r2 > hd:
            raise ValueError(f"rotary dims {2 * r2} exceed head dim {hd}")
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if positions.size != t:
            raise ValueError(f"{positions.size} positions for {t} tokens")
        if t and (positions.min() < 0 or positions.max() >= max_pos):
            raise ValueError(f"positions {positions.min()}..{positions.max()} outside the RoPE "
                             f"table of {max_pos}")
        y = self._new(x.shape)
        if t == 0:
            return y
        p0 = int(positions[0])
        contiguous = bool(np.array_equal(positions, np.arange(p0, p0 + t)))
        self._rope_into(y.buf, x, cos, sin, p0, None if contiguous else positions)
        return y

    def _rope_into(self, out, x, cos, sin, p0, positions):
        """rope of x into buffer ``out``; positions p0.. (or the int32 array ``positions``)."""
        _, h, hd = x.shape
        r2 = cos.shape[1]
        pos = None if positions is None else self._host_ints(positions)
        total = x.size
        self._k("dense.cl", "rope")(self.queue, self._gsize(total), self._ew, out, x.buf, cos.buf,
                                    sin.buf, None if pos is None else pos.buf, _I(p0),
                                    _I(pos is not None), _I(h), _I(hd), _I(r2), _I(total))

    def attention(self, q, k, v, cache, layer, start_pos, scale, window=None, softcap=None):
        """Causal GQA attention appending k, v [T, Hkv, hd] to ``cache``; returns [T, Hq, hd].

        Query t (position p = start_pos + t), head h attends keys max(0, p - window + 1)
        .. p of KV head h // (Hq / Hkv); scores q.k * scale (tanh soft-capped if
        ``softcap``), softmax in float32 with the running max subtracted
        (https://github.com/huggingface/transformers/pull/17306). The
        cache may be f32 / f16 (attention.cl) or int8 / int4 / k8v4 (attention_q.cl); positions
        live in slot ``p % S`` of the layer's ring (:mod:`.kvcache`).

        Raises:
            ValueError: cache overflow, bad window, head counts that do not group, a chunk
                or window larger than a ring layer was sized for.
        """
        q, k, v = self._check(q, "q"), self._check(k, "k"), self._check(v, "v")
        if not isinstance(cache, DeviceKVCache):
            raise TypeError("attention needs a cache from this backend's new_kv_cache()")
        t, hq, hd = q.shape
        hkv = k.shape[1]
        if hq % hkv or k.shape != (t, hkv, hd) or v.shape != k.shape:
            raise ValueError(f"attention shapes q{q.shape} k{k.shape} v{v.shape} do not form GQA")
        if (hkv, hd) != (cache.n_kv_heads, cache.head_dim):
            raise ValueError(f"cache holds {cache.n_kv_heads} heads x {cache.head_dim}, "
                             f"got k of {hkv} x {hd}")
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        ring = cache.begin_write(layer, start_pos, t, window)  # slots S: position p -> p % S
        out = self._new((t, hq, hd))
        if t == 0:
            return out
        if cache.quantized:
            return attention_q(self, out, q, k, v, cache, layer, start_pos, scale, window,
                               softcap, ring)
        off = cache.layer_offset(layer)
        n = t * hkv * hd
        self._k("attention.cl", "kv_write", KV_HALF=int(cache.dtype == "f16"))(
            self.queue, self._gsize(n), self._ew, cache.k, cache.v, k.buf, v.buf,
            _I(off), _I(start_pos), _I(ring), _I(hkv * hd), _I(n))
        return self._attend(out, q, cache, layer, start_pos, ring, scale, window, softcap)

    def _attend(self, out, q, cache, layer, start_pos, ring, scale, window, softcap):
        """The attention launch(es) of :meth:`attention` over an f32 / f16 cache whose
        keys are written: ``out`` [T, Hq, hd] from ``q`` [T, Hq, hd]; split over the keys
        for a long context and few queries."""
        t, hq, hd = q.shape
        hkv = cache.n_kv_heads
        off = cache.layer_offset(layer)
        kv_half = int(cache.dtype == "f16")
        lws = self.caps.lws
        c = self.caps.split_kv_chunk
        n_keys = start_pos + t if window is None else min(start_pos + t, window + t - 1)
        if c and t <= self.caps.split_kv_max_t and n_keys > 2 * c:
            # long context, few queries: split the keys over more work-groups
            nsplit = -(-(start_pos + t) // c)
            part = self._new((t, hq, nsplit, hd + 2))
            self._k("attention.cl", "attention_split", KV_HALF=kv_half)(
                self.queue, (hq * lws, t, nsplit), (lws, 1, 1), part.buf, q.buf, cache.k,
                cache.v, _I(off), _I(ring), _I(hq), _I(hkv), _I(hd), _I(start_pos),
                _I(window or 0), _F(scale), _F(softcap or 0.0), _I(c), _I(nsplit))
            self._k("attention.cl", "attention_combine", KV_HALF=kv_half)(
                self.queue, (hq * lws, t), (lws, 1), out.buf, part.buf, _I(hq), _I(hd),
                _I(nsplit))
            return out
        self._k("attention.cl", "attention", KV_HALF=kv_half)(
            self.queue, (hq * lws, t), (lws, 1), out.buf, q.buf, cache.k, cache.v, _I(off),
            _I(ring), _I(hq), _I(hkv), _I(hd), _I(start_pos), _I(window or 0), _F(scale),
            _F(softcap or 0.0))
        return out

    def glu(self, gate, up, act="silu"):
        """y[T, F] = act(gate) * up; act "silu" or "gelu_tanh"."""
        gate, up = self._check(gate, "gate"), self._check(up, "up")
        if act not in _ACTS:
            raise ValueError(f"unsupported activation {act!r}")
        if gate.shape != up.shape:
            raise ValueError(f"glu shapes differ: {gate.shape} vs {up.shape}")
        y = self._new(gate.shape)
        n = gate.size
        self._k("dense.cl", "glu")(self.queue, self._gsize(n), self._ew, y.buf, gate.buf, up.buf,
                                   _I(n), _I(_ACTS[act]))
        return y

    def add(self, a, b):
        """Elementwise a + b (same shape)."""
        a, b = self._check(a, "a"), self._check(b, "b")
        if a.size != b.size:
            raise ValueError(f"add shapes differ: {a.shape} vs {b.shape}")
        y = self._new(a.shape)
        n = a.size
        self._k("dense.cl", "add")(self.queue, self._gsize(n), self._ew, y.buf, a.buf, b.buf, _I(n))
        return y

    # ---- the decode plan --------------------------------------------------------------
    def compile_decode(self, step, cache):
        """A :class:`.plan.OpenCLDecodePlan` on a CPU device (``caps.fused``) whose every
        linear takes the row kernels, else None (see :mod:`.plan`)."""
        if not self.caps.fused or not isinstance(cache, DeviceKVCache):
            return None
        return _plan.compile_decode(self, step, cache)

    @staticmethod
    def activation_code(act: str) -> int:
        """The kernels' code of a GLU activation (0 SiLU, 1 GELU-tanh).

        Raises:
            ValueError: unsupported activation.
        """
        if act not in _ACTS:
            raise ValueError(f"unsupported activation {act!r}")
        return _ACTS[act]

    @staticmethod
    def _compatible(a: DeviceWeight, b: DeviceWeight) -> bool:
        """Whether two weights on one input can share a ``gemv_rows`` launch."""
        return (a.fmt == b.fmt and a.stride == b.stride and a.n_groups == b.n_groups
                and a.group_size == b.group_size and a.in_features == b.in_features
                and (a.zeros is None) == (b.zeros is None))

    def rows_launch(self, x: DeviceTensor, outs, res=None, glu=None, norm=None):
        """The kernel and arguments of one ``gemv_rows`` launch (enqueue with
        ``kernel(queue, gsize, lsize, *args)``): ``outs`` [(out buffer, weight, bias)]
        (1-3 compatible weights on input ``x`` [1, K]; with ``glu`` (0 SiLU, 1 GELU) two,
        gate then up, the first buffer receiving ``act(gate) * up``), ``res`` a [1, N]
        tensor added to the output, ``norm`` = (w, eps, unit_offset): ``x`` is first
        RMS-normalized in the prologue.

        Returns:
            (kernel, gsize, lsize, args).
        """
        w0 = outs[0][1]
        flags = _F_ZEROS if w0.zeros is not None else 0
        if norm is not None:
            normw, eps, off = norm
            flags |= _F_NORM | (_F_NORM_OFF if off else 0)
            normw = normw.buf
        else:
            normw, eps = None, 0.0
        if res is not None:
            flags |= _F_RES
        if glu is not None:
            flags |= _F_GLU | (_F_GELU if glu == 1 else 0)
        args = []
        ns = []
        for i in range(3):
            if i < len(outs):
                _, w, bias = outs[i]
                if bias is not None:
                    flags |= _F_BIAS[i]
                args.append((w.codes, w.scales, w.zeros, None if bias is None else bias.buf))
                ns.append(w.out_features)
            else:
                args.append((None, None, None, None))
                ns.append(0)
        k = w0.in_features
        kw = -(-k // 8)
        if w0.fmt == "f32" or w0.n_groups == 1:
            wpg = kw
        else:
            wpg = w0.group_size // 8
        rows = ns[0] if glu is not None else sum(ns)
        ys = [o[0] for o in outs] + [None] * (3 - len(outs))
        if glu is not None:
            ys[1] = None
        r = self.caps.rlws
        kern = self._dc.kernel("fused.cl", "gemv_rows", WFMT=_WFMT[w0.fmt], RLWS=r,
                               KMAX=self.caps.kmax)
        return (kern, (_round_up(rows, r),), (r,),
                (ys[0], ys[1], ys[2], x.buf, normw, None if res is None else res.buf,
                 *args[0], *args[1], *args[2], _I(ns[0]), _I(ns[1]), _I(ns[2]), _I(k),
                 _I(kw), _I(w0.stride), _I(w0.n_groups), _I(wpg), _I(flags), _F(eps)))
