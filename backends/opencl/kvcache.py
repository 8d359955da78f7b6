"""The on-device KV cache: float32 / float16 storage, or the int8 / int4 formats of
:mod:`edgeinfer.backends.kvcache` (same codes, scales and Hadamard-rotated K).

Same bookkeeping as :class:`edgeinfer.backends.kvcache.HostKVCache` (``length``,
``trim``, ``reset``, overflow check) so the engine treats both alike; the data never
leaves the device except through :meth:`DeviceKVCache.read` (tests, debugging).
fp16 storage saturates at +-65504 on write instead of becoming inf (case C23).
int4's K channel statistics (offset m, scale c per layer, KV head and channel) are
computed on the host by the same :func:`~edgeinfer.backends.kvcache.k_channel_stats`
from the first rows of a write at position 0 (one small device-to-host copy per layer
per new sequence) and kept in a host copy and a per-layer device buffer.
Every layer stores all ``max_tokens`` positions (no ring storage for sliding-window
layers yet: the attention kernel applies the window, which is exact, only larger; the
host cache's rings are the model to follow).
"""
from __future__ import annotations

import numpy as np

from ..kvcache import (
    ALL_KV_DTYPES,
    KSTAT_POSITIONS,
    dequant_asym4,
    dequant_sym8,
    hadamard,
    k_channel_stats,
    kv_group_size,
)
from .device import cl

_INT32_MAX = 2**31 - 1


def _layout(dtype: str, hd: int, g: int) -> list[tuple[str, int, type]]:
    """(array name, elements per (layer, position, KV head) row, numpy dtype) of ``dtype``.

    Names and shapes follow ``HostKVCache.raw`` (the layout table in its module docstring).
    """
    if dtype == "f32":
        return [("k", hd, np.float32), ("v", hd, np.float32)]
    if dtype == "f16":
        return [("k", hd, np.float16), ("v", hd, np.float16)]
    if dtype == "int8":
        return [("k_q", hd, np.int8), ("k_scale", hd // g, np.float16),
                ("v_q", hd, np.int8), ("v_scale", 1, np.float16)]
    return [("k_q", hd // 2, np.uint8), ("k_scale", hd // g, np.float16),
            ("k_min", hd // g, np.float16), ("v_q", hd // 2, np.uint8),
            ("v_scale", hd // g, np.float16), ("v_min", hd // g, np.float16)]


class DeviceKVCache:
    """Preallocated device KV cache.

    Attributes:
        n_layers, n_kv_heads, head_dim, max_tokens: geometry.
        length: positions currently valid (0..max_tokens).
        dtype: "f32", "f16", "int8" or "int4".
        group_size: channels per quantization group (int8/int4; ``kv_group_size(hd)``).
        buffers: name -> ``cl.Buffer`` of ``[n_layers, max_tokens, n_kv_heads, per_row]``
            elements (names as in :func:`_layout`); ``k`` / ``v`` alias the float arrays.
        k_off, k_cs: int4 only, float32 ``[n_layers, Hkv, hd]`` host copies of the K
            channel statistics (m = 0, c = 1 until a write at position 0); device copies
            per layer in ``k_stat_buffers[layer]`` (not counted in ``nbytes``).
    """

    def __init__(self, context, queue, n_layers: int, n_kv_heads: int, head_dim: int,
                 max_tokens: int, dtype: str = "f32"):
        if dtype not in ALL_KV_DTYPES:
            raise ValueError(f"unsupported KV cache dtype {dtype!r}; choose one of {ALL_KV_DTYPES}")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if dtype == "int4" and head_dim % 2:
            raise ValueError(f"int4 KV needs an even head_dim (two codes per byte), got {head_dim}")
        rows = n_layers * max_tokens * n_kv_heads
        if rows * head_dim > _INT32_MAX:
            raise ValueError(f"KV cache of {rows * head_dim} elements per tensor exceeds the "
                             "kernels' 32-bit indexing; use fewer max_tokens")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.max_tokens, self.dtype, self.length = max_tokens, dtype, 0
        self.group_size = kv_group_size(head_dim)
        self._queue = queue
        self._layout = _layout(dtype, head_dim, self.group_size)
        flags = cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR
        self.buffers = {}
        self._nbytes = 0
        for name, per_row, dt in self._layout:
            nbytes = rows * per_row * np.dtype(dt).itemsize
            # zero-filled so a read before any write is defined (and finite)
            self.buffers[name] = cl.Buffer(context, flags, hostbuf=np.zeros(max(nbytes, 1), np.uint8))
            self._nbytes += nbytes
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
        return self.dtype in ("int8", "int4")

    @property
    def nbytes(self) -> int:
        """Bytes preallocated for K and V (codes and scales); equals ``kv_cache_nbytes``."""
        return self._nbytes

    def bytes_per_token(self) -> int:
        return self._nbytes // self.max_tokens

    def used_nbytes(self) -> int:
        """Bytes of the ``length`` positions held (every layer stores all positions)."""
        return self.length * self._nbytes // self.max_tokens

    def reset(self) -> None:
        self.length = 0

    def trim(self, n: int) -> None:
        """Keep the first ``n`` positions (n <= length)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} positions to {n}")
        self.length = n

    def check_room(self, start_pos: int, t: int) -> None:
        if start_pos < 0 or start_pos + t > self.max_tokens:
            raise ValueError(
                f"KV cache overflow: positions {start_pos}..{start_pos + t - 1} do not fit in "
                f"{self.max_tokens} preallocated positions")

    def layer_rows(self, layer: int) -> int:
        """Index of the first position row of ``layer`` (rows of ``n_kv_heads`` heads)."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} out of range for a {self.n_layers}-layer cache")
        return layer * self.max_tokens

    def layer_offset(self, layer: int) -> int:
        """Element offset of ``layer`` in the float K / V buffers."""
        return self.layer_rows(layer) * self.n_kv_heads * self.head_dim

    def raw(self, layer: int, end: int) -> dict[str, np.ndarray]:
        """Host copies of the storage arrays of positions 0..end-1 of ``layer``
        (``[end, Hkv, per_row]``, names as ``HostKVCache.raw``; int4 adds ``k_off``,
        ``k_cs`` ``[Hkv, hd]`` float32)."""
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

    def read(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """K, V float32 ``[end, Hkv, hd]`` of positions 0..end-1, dequantized (tests)."""
        a = self.raw(layer, end)
        if not self.quantized:
            return a["k"].astype(np.float32), a["v"].astype(np.float32)
        g = self.group_size
        hmat = hadamard(g)
        if self.dtype == "int8":
            y = dequant_sym8(a["k_q"], a["k_scale"])
            v = dequant_sym8(a["v_q"], a["v_scale"])
        else:
            y = dequant_asym4(a["k_q"], a["k_scale"], a["k_min"])
            v = dequant_asym4(a["v_q"], a["v_scale"], a["v_min"])
        shp = y.shape
        k = (y.reshape(*shp[:-1], shp[-1] // g, g) @ hmat).reshape(shp)
        if self.dtype == "int4":
            k = k * self.k_cs[layer] + self.k_off[layer]
        return k.astype(np.float32), v.astype(np.float32)
