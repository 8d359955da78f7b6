"""The on-device KV cache: float32 / float16 storage, or the int8 / int4 / k8v4 formats of
:mod:`edgeinfer.backends.kvcache` (same codes, scales and Hadamard-rotated K; k8v4 is K
as int8 and V as int4, :mod:`edgeinfer.backends.kvformat`).

Same bookkeeping as :class:`edgeinfer.backends.kvcache.HostKVCache` (``length``,
``trim``, ``reset``, overflow check, sizes) so the engine treats both alike; the data
never leaves the device except through :meth:`DeviceKVCache.raw` / ``read`` (tests,
debugging). fp16 storage saturates at +-65504 on write instead of becoming inf
(https://github.com/huggingface/transformers/pull/17306).
int4's K channel statistics (offset m, scale c per layer, KV head and channel; 4-bit K
only: k8v4's 8-bit K has none, as on the host) are computed on the host by the same
:func:`~edgeinfer.backends.kvcache.k_channel_stats` from the first rows of a write at
position 0 (one small device-to-host copy per layer per new sequence) and kept in a host
copy and a per-layer device buffer.

Ring storage (sliding-window layers)
------------------------------------
Every layer is a ring of ``S`` slots, ``S = layer_slots(max_tokens, W, max_chunk)`` (the
host cache's rule: ``min(max_tokens, W - 1 + max_chunk)`` for a window ``W``,
``max_tokens`` for a global layer), and position ``p`` lives in slot ``p % S`` (a global
layer never wraps: ``p < max_tokens = S``). The kernels take ``S`` and index slots, so
there is one code path. A layer whose ``S < max_tokens`` (a *ring layer*) keeps a host
int64 position table ``[S]`` (-1 = empty), exactly like the host cache: ``trim`` uses it
to decide whether a kept prefix is still attendable (else the whole cache resets), and
``nbytes`` counts it, so ``nbytes == kv_cache_nbytes(...) == HostKVCache(...).nbytes``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..kvcache import (
    DEFAULT_MAX_CHUNK,
    KSTAT_POSITIONS,
    dequant_asym4,
    dequant_sym8,
    hadamard,
    k_channel_stats,
    kv_group_size,
    layer_slots,
    trim_rings,
)
from .device import cl

_INT32_MAX = 2**31 - 1
#: KV dtypes the OpenCL kernels implement (all of the host cache's).
OPENCL_KV_DTYPES = ("f32", "f16", "int8", "int4", "k8v4")
#: (K bits, V bits) of the quantized dtypes: attention_q.cl's KBITS / VBITS variants.
KV_BITS = {"int8": (8, 8), "int4": (4, 4), "k8v4": (8, 4)}


def _layout(dtype: str, hd: int, g: int) -> list[tuple[str, int, type]]:
    """(array name, elements per (slot, KV head) row, numpy dtype) of ``dtype``.

    Names and shapes follow ``HostKVCache.raw`` (the layout table in its module docstring).
    """
    if dtype == "f32":
        return [("k", hd, np.float32), ("v", hd, np.float32)]
    if dtype == "f16":
        return [("k", hd, np.float16), ("v", hd, np.float16)]
    kbits, vbits = KV_BITS[dtype]
    if kbits == 8:
        k = [("k_q", hd, np.int8), ("k_scale", hd // g, np.float16)]
    else:
        k = [("k_q", hd // 2, np.uint8), ("k_scale", hd // g, np.float16),
             ("k_min", hd // g, np.float16)]
    if vbits == 8:
        return k + [("v_q", hd, np.int8), ("v_scale", 1, np.float16)]
    return k + [("v_q", hd // 2, np.uint8), ("v_scale", hd // g, np.float16),
                ("v_min", hd // g, np.float16)]


class DeviceKVCache:
    """Preallocated device KV cache, one ring of slots per layer (module docstring).

    Args:
        context, queue: the backend's OpenCL context and queue.
        n_layers, n_kv_heads, head_dim: geometry (``hd`` = head_dim).
        max_tokens: positions (context) the cache can hold, > 0.
        dtype: one of :data:`OPENCL_KV_DTYPES`.
        window_sizes: per layer a sliding window ``W`` or None (global); default all global.
        max_chunk: most tokens one attention call may append to a windowed layer.

    Attributes:
        n_layers, n_kv_heads, head_dim, max_tokens, window_sizes, max_chunk: as given.
        length: positions currently valid (0..max_tokens).
        dtype: "f32", "f16", "int8", "int4" or "k8v4".
        group_size: channels per quantization group (quantized dtypes; ``kv_group_size(hd)``).
        slots: per layer, its ring length ``S`` (positions it stores).
        buffers: name -> ``cl.Buffer`` of ``[sum(slots), n_kv_heads, per_row]`` elements,
            layer after layer (names as in :func:`_layout`); ``k`` / ``v`` alias the
            float arrays.
        k_off, k_cs: int4 only, float32 ``[n_layers, Hkv, hd]`` host copies of the K
            channel statistics (m = 0, c = 1 until a write at position 0); device copies
            per layer in ``k_stat_buffers[layer]`` (not counted in ``nbytes``).

    Raises:
        ValueError: unknown dtype, non-positive sizes, a window list of the wrong length,
            an odd head_dim for int4 / k8v4, or storage beyond the kernels' 32-bit indexing.
    """

    def __init__(self, context, queue, n_layers: int, n_kv_heads: int, head_dim: int,
                 max_tokens: int, dtype: str = "f32",
                 window_sizes: Sequence[int | None] | None = None,
                 max_chunk: int | None = None):
        max_chunk = DEFAULT_MAX_CHUNK if max_chunk is None else max_chunk
        if dtype not in OPENCL_KV_DTYPES:
            raise ValueError(f"unsupported KV cache dtype {dtype!r} on OpenCL; choose one of "
                             f"{OPENCL_KV_DTYPES}")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if min(n_layers, n_kv_heads, head_dim, max_chunk) <= 0:
            raise ValueError("n_layers, n_kv_heads, head_dim and max_chunk must be positive")
        if dtype in ("int4", "k8v4") and head_dim % 2:
            raise ValueError(f"{dtype} KV needs an even head_dim (two 4-bit codes per byte), "
                             f"got {head_dim}")
        windows = [None] * n_layers if window_sizes is None else list(window_sizes)
        if len(windows) != n_layers:
            raise ValueError(f"window_sizes has {len(windows)} entries for {n_layers} layers")
        if any(w is not None and w <= 0 for w in windows):
            raise ValueError(f"window sizes must be positive or None, got {windows}")
        self.slots = [layer_slots(max_tokens, w, max_chunk) for w in windows]
        rows = sum(self.slots) * n_kv_heads
        if rows * head_dim > _INT32_MAX:
            raise ValueError(f"KV cache of {rows * head_dim} elements per tensor exceeds the "
                             "kernels' 32-bit indexing; use fewer max_tokens")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.max_tokens, self.dtype, self.length = max_tokens, dtype, 0
        self.window_sizes, self.max_chunk = windows, max_chunk
        self.group_size = kv_group_size(head_dim)
        # first slot row of each layer in the stacked buffers
        self._row0 = np.concatenate([[0], np.cumsum(self.slots)[:-1]]).astype(int).tolist()
        # position held by each slot of a ring layer (-1 = empty); None for linear layers
        self._pos = [np.full(s, -1, np.int64) if s < max_tokens else None for s in self.slots]
        self._queue = queue
        self._layout = _layout(dtype, head_dim, self.group_size)
        flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
        self.buffers = {}
        self._slot_bytes = 0  # device bytes of one slot (all arrays, all KV heads)
        for name, per_row, dt in self._layout:
            nbytes = rows * per_row * np.dtype(dt).itemsize
            # zero-filled so a read before any write is defined (and finite)
            self.buffers[name] = cl.Buffer(context, flags, hostbuf=np.zeros(max(nbytes, 1), np.uint8))
            self._slot_bytes += n_kv_heads * per_row * np.dtype(dt).itemsize
        self.k = self.buffers.get("k")
        self.v = self.buffers.get("v")
        self.k_stat_buffers = [(None, None)] * n_layers
        if dtype == "int4":
            self.k_off = np.zeros((n_layers, n_kv_heads, head_dim), np.float32)
            self.k_cs = np.ones((n_layers, n_kv_heads, head_dim), np.float32)
            self.k_stat_buffers = [(cl.Buffer(context, flags, hostbuf=self.k_off[i]),
                                    cl.Buffer(context, flags, hostbuf=self.k_cs[i]))
                                   for i in range(n_layers)]

    def fix_k_stats(self, layer: int, k_first: np.ndarray) -> None:
        """int4: set ``layer``'s K channel statistics from the float32 K ``[T, Hkv, hd]``
        of a write at position 0 (its first ``KSTAT_POSITIONS`` rows), host and device."""
        m, c = k_channel_stats(np.asarray(k_first, np.float32)[:KSTAT_POSITIONS])
        self.k_off[layer], self.k_cs[layer] = m, c
        for buf, arr in zip(self.k_stat_buffers[layer], (self.k_off[layer], self.k_cs[layer])):
            cl.enqueue_copy(self._queue, buf, arr, is_blocking=True)

    @property
    def quantized(self) -> bool:
        return self.dtype in KV_BITS

    @property
    def kv_bits(self) -> tuple[int, int]:
        """(K bits, V bits) of a quantized dtype (:data:`KV_BITS`)."""
        return KV_BITS[self.dtype]

    # ---- sizes (the host cache's definitions) -------------------------------------------
    @property
    def device_nbytes(self) -> int:
        """Bytes of the device buffers (K and V codes and scales of every slot)."""
        return sum(self.slots) * self._slot_bytes

    @property
    def nbytes(self) -> int:
        """Bytes preallocated: device slots plus the host position tables of ring layers;
        equals ``kv_cache_nbytes`` and ``HostKVCache.nbytes`` for the same arguments."""
        return self.device_nbytes + sum(p.nbytes for p in self._pos if p is not None)

    def bytes_per_token(self) -> int:
        """``nbytes // max_tokens`` (average over the context; exact without windows)."""
        return self.nbytes // self.max_tokens

    def used_nbytes(self) -> int:
        """Bytes of the positions held now, as ``HostKVCache.used_nbytes``: per layer
        ``min(length, S)`` slots, plus a ring layer's position table."""
        n = sum(min(self.length, s) for s in self.slots) * self._slot_bytes
        return int(n + sum(p.nbytes for p in self._pos if p is not None))

    # ---- bookkeeping --------------------------------------------------------------------
    def positions(self, layer: int) -> np.ndarray | None:
        """int64 [S] position held by each slot of a ring layer (-1 empty); None if linear."""
        return self._pos[layer]

    def reset(self) -> None:
        """Forget every position (storage is kept, not zeroed)."""
        self.length = 0
        for p in self._pos:
            if p is not None:
                p[:] = -1

    def trim(self, n: int) -> None:
        """Keep the first ``n`` positions (0 <= n <= length), dropping the rest.

        As ``HostKVCache.trim``: a ring layer keeps them only if it still holds every key
        positions >= n can attend to (``max(0, n - W + 1) .. n - 1``); otherwise the whole
        cache resets (``length`` 0) and the caller recomputes.

        Raises:
            ValueError: ``n`` outside ``0..length``.
        """
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} positions to {n}")
        if trim_rings(self._pos, self.window_sizes, n):
            self.length = n
        else:
            self.reset()

    def check_room(self, start_pos: int, t: int) -> None:
        """Raise ValueError if positions start_pos .. start_pos+t-1 exceed the cache."""
        if start_pos < 0 or start_pos + t > self.max_tokens:
            raise ValueError(
                f"KV cache overflow: positions {start_pos}..{start_pos + t - 1} do not fit in "
                f"{self.max_tokens} preallocated positions")

    def begin_write(self, layer: int, start_pos: int, t: int, window: int | None) -> int:
        """Validate and record an attention call's write of positions start_pos .. +t-1 to
        ``layer``; returns the layer's ring length ``S`` for the kernels.

        Raises:
            ValueError: overflow; a chunk longer than a ring layer was sized for (it would
                overwrite keys its own queries attend to); an attention ``window`` wider
                than the layer's ring can serve (None or > the layer's window).
        """
        self.check_room(start_pos, t)
        s, p = self.layer_slots(layer), self._pos[layer]
        if p is None:
            return s
        w = self.window_sizes[layer]
        if window is None or window > w:
            raise ValueError(f"layer {layer} stores a window of {w} positions; attention with "
                             f"window {window} would read keys it no longer holds")
        if t > s - (w - 1):
            raise ValueError(
                f"a chunk of {t} tokens is larger than the {self.max_chunk} a windowed layer "
                f"(window {w}) was sized for; prefill in smaller chunks or build the cache "
                f"with max_chunk >= {t}")
        pos = np.arange(start_pos, start_pos + t)
        p[pos % s] = pos
        return s

    def layer_slots(self, layer: int) -> int:
        """Ring length ``S`` of ``layer`` (``max_tokens`` for a global layer)."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} out of range for a {self.n_layers}-layer cache")
        return self.slots[layer]

    def layer_rows(self, layer: int) -> int:
        """Index of the first slot row of ``layer`` (rows of ``n_kv_heads`` heads)."""
        self.layer_slots(layer)
        return self._row0[layer]

    def layer_offset(self, layer: int) -> int:
        """Element offset of ``layer`` in the float K / V buffers."""
        return self.layer_rows(layer) * self.n_kv_heads * self.head_dim

    # ---- data (host copies: tests, debugging) -------------------------------------------
    def raw(self, layer: int, end: int | None = None) -> dict[str, np.ndarray]:
        """Host copies of the storage arrays of slots 0..end-1 of ``layer`` (default all
        ``S``; for a linear layer slot = position), ``[end, Hkv, per_row]``, names as
        ``HostKVCache.raw``; int4 adds ``k_off``, ``k_cs`` ``[Hkv, hd]`` float32."""
        end = self.layer_slots(layer) if end is None else end
        if not 0 <= end <= self.layer_slots(layer):
            raise ValueError(f"layer {layer} has {self.slots[layer]} slots, asked for {end}")
        out = {}
        for name, per_row, dt in self._layout:
            h = np.empty((end, self.n_kv_heads, per_row), dt)
            if end:
                off = self.layer_rows(layer) * self.n_kv_heads * per_row * h.itemsize
                cl.enqueue_copy(self._queue, h, self.buffers[name], src_offset=off, is_blocking=True)
            out[name] = h
        if self.dtype == "int4":  # the layer's K channel statistics [Hkv, hd], read back
            for name, buf in zip(("k_off", "k_cs"), self.k_stat_buffers[layer]):
                out[name] = np.empty((self.n_kv_heads, self.head_dim), np.float32)
                cl.enqueue_copy(self._queue, out[name], buf, is_blocking=True)
        return out

    def _dequant(self, layer: int, a: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """K, V float32 ``[n, Hkv, hd]`` from raw arrays ``a`` of ``layer``."""
        if not self.quantized:
            return a["k"].astype(np.float32), a["v"].astype(np.float32)
        g = self.group_size
        hmat = hadamard(g)
        kbits, vbits = self.kv_bits
        if kbits == 8:
            y = dequant_sym8(a["k_q"], a["k_scale"])
        else:
            y = dequant_asym4(a["k_q"], a["k_scale"], a["k_min"])
        if vbits == 8:
            v = dequant_sym8(a["v_q"], a["v_scale"])
        else:
            v = dequant_asym4(a["v_q"], a["v_scale"], a["v_min"])
        shp = y.shape
        k = (y.reshape(*shp[:-1], shp[-1] // g, g) @ hmat).reshape(shp)
        if self.dtype == "int4":
            k = k * self.k_cs[layer] + self.k_off[layer]
        return k.astype(np.float32), v.astype(np.float32)

    def read_positions(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Held keys and values of positions < ``end`` with their absolute positions, as
        ``HostKVCache.read_positions``: (k, v float32 [n, Hkv, hd], positions int64 [n])."""
        p = self._pos[layer]
        if p is None:
            k, v = self._dequant(layer, self.raw(layer, end))
            return k, v, np.arange(end, dtype=np.int64)
        sel = np.nonzero((p >= 0) & (p < end))[0]
        sel = sel[np.argsort(p[sel])]
        a = {name: arr[sel] for name, arr in self.raw(layer).items()
             if name not in ("k_off", "k_cs")}
        k, v = self._dequant(layer, a)
        return k, v, p[sel]

    def read(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """K, V float32 ``[end, Hkv, hd]`` of positions 0..end-1, dequantized (tests); for a
        ring layer, positions no longer held read as zeros (as ``HostKVCache.read``)."""
        if self._pos[layer] is None:
            return self._dequant(layer, self.raw(layer, end))
        k, v, pos = self.read_positions(layer, end)
        kd = np.zeros((end, self.n_kv_heads, self.head_dim), np.float32)
        vd = np.zeros_like(kd)
        kd[pos], vd[pos] = k, v
        return kd, vd
