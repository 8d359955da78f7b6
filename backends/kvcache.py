"""Host-memory KV cache shared by the reference and CPU backends: f32, f16, int8, int4, k8v4.

Storage is preallocated once for ``max_tokens`` positions (or a ring, below); the numpy
``write``/``read`` here allocate temporaries (they are the reference path), fast
kernels write and read the raw arrays in place (layout table below). ``length`` is the
number of positions held; the engine compares token ids and calls
:meth:`HostKVCache.trim` to reuse a common prefix (and reads ``length`` back
afterwards: a cache may keep *less* than asked, see ``trim``).

``HostKVCache(..., dtype=...)`` returns the class that implements ``dtype``
(:class:`HostKVCache` itself for f32/f16, :class:`Int8KVCache`, :class:`Int4KVCache`,
:class:`K8V4KVCache`), so ``Backend.new_kv_cache`` needs no change.

Quantized formats: formulas, helpers, design measurements and the quality table live in
:mod:`.kvformat` (re-exported here: ``hadamard``, ``quant_asym4``, ``k_channel_stats``,
...). int4 keeps, per layer, a K channel offset ``m`` and scale ``c`` fixed by the
write at position 0 (:meth:`HostKVCache.k_input`).

Raw layout for fast backends (read the quantized cache directly)
----------------------------------------------------------------
:meth:`HostKVCache.raw` returns the per-layer arrays (``S`` = slots of that layer):

====== =========== ========================== ===========================================
dtype  name        shape / dtype              meaning
====== =========== ========================== ===========================================
f32    k, v        [S, Hkv, hd] float32       plain values
f16    k, v        [S, Hkv, hd] float16       plain values
int8   k_q         [S, Hkv, hd] int8          codes of the *rotated* K groups
int8   k_scale     [S, Hkv, hd/G] float16     s per group
int8   v_q         [S, Hkv, hd] int8          codes of V
int8   v_scale     [S, Hkv] float16           s per (token, head)
int4   k_q         [S, Hkv, hd/2] uint8       packed codes of the scaled, rotated K groups
int4   k_scale     [S, Hkv, hd/G] float16     s per group
int4   k_min       [S, Hkv, hd/G] float16     m per group
int4   v_q         [S, Hkv, hd/2] uint8       packed codes of V
int4   v_scale     [S, Hkv, hd/G] float16     s per group
int4   v_min       [S, Hkv, hd/G] float16     m per group
int4   k_off       [Hkv, hd] float32          K channel offset m (per layer, not in nbytes)
int4   k_cs        [Hkv, hd] float32          K channel scale c (power of two)
k8v4   k_q, k_scale as int8                   K as int8
k8v4   v_q, v_scale, v_min as int4            V as int4
====== =========== ========================== ===========================================

A fast kernel rotates the query once (``q_g @ H_G`` per group, :func:`hadamard`; for
int4 ``(q * c)_g @ H_G`` and adds ``q . m``) and dots it with the dequantized rotated K
``y'`` directly; V needs no rotation. Without windows the arrays also exist stacked
over layers as attributes (``cache.k`` ``[L, S, Hkv, hd]`` for f32/f16 as before,
``cache.k_q`` ``[L, S, Hkv, hd]`` for int8, ...).

Sliding-window (ring) storage
-----------------------------
``window_sizes[layer] = W`` (None = global) stores that layer in a ring of
``S = min(max_tokens, W - 1 + max_chunk)`` slots: position ``p`` lives in slot
``p % S``, and ``positions(layer)`` (int64 ``[S]``, -1 = empty) records which
position each slot holds. ``W - 1 + max_chunk`` slots are what a chunk of up to
``max_chunk`` tokens needs, since the contract writes the whole chunk before its
first query attends to the ``W - 1`` keys before it. :meth:`read_positions` returns the
held keys with their absolute positions; :meth:`read` keeps the dense ``[end, ...]``
shape (zeros where a position left the window, which the attention's window mask
hides). :meth:`trim` on a ring keeps the prefix only if every key that later
positions can still attend to is held; otherwise it resets the whole cache (never a
raw slice of the ring: https://github.com/ml-explore/mlx-examples/issues/1000). The
engine reads ``length`` back after ``trim``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .kvformat import (  # noqa: F401  (re-exported: the format's public helpers)
    KSTAT_POSITIONS,
    _f16,
    _rotate,
    _safe,
    dequant_asym4,
    dequant_sym8,
    hadamard,
    k_channel_stats,
    kv_group_size,
    quant_asym4,
    quant_sym8,
    unpack4,
)

#: Float storage dtypes. Kept as the float-only tuple: backends/opencl validates with it.
KV_DTYPES = ("f32", "f16")
#: Every dtype :class:`HostKVCache` stores.
ALL_KV_DTYPES = ("f32", "f16", "int8", "int4", "k8v4")
#: Default rows per prefill chunk a ring layer must hold beyond its window (engine default).
DEFAULT_MAX_CHUNK = 512


# ---- sizes (used by the cache and by edgeinfer.memory; must agree exactly) ------------
def kv_bytes_per_token_layer(n_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes one position of one layer takes (K and V, codes + scales), for ``dtype``."""
    g = kv_group_size(head_dim)
    per_head = {
        "f32": 8 * head_dim,
        "f16": 4 * head_dim,
        "int8": (head_dim + 2 * (head_dim // g)) + (head_dim + 2),
        "int4": 2 * (head_dim // 2 + 4 * (head_dim // g)),
        "k8v4": (head_dim + 2 * (head_dim // g)) + (head_dim // 2 + 4 * (head_dim // g)),
    }
    if dtype not in per_head:
        raise ValueError(f"unsupported KV cache dtype {dtype!r}; choose one of {ALL_KV_DTYPES}")
    return n_kv_heads * per_head[dtype]


def trim_rings(slot_positions: list, window_sizes: list, n: int) -> bool:
    """Forget positions >= ``n`` in each ring layer's slot table, in place, and say
    whether every ring still holds all the keys positions >= ``n`` can attend to
    (``max(0, n - W + 1) .. n - 1``); shared by the host and OpenCL caches' ``trim``.

    Args:
        slot_positions: per layer an int64 [S] table (the position each slot holds, -1
            for none) or None for a linear layer.
        window_sizes: per layer the window W (ignored where the table is None).
        n: the length to keep.

    Returns:
        True if the first ``n`` positions can be kept, False if the cache must reset.
    """
    ok = True
    for p, w in zip(slot_positions, window_sizes):
        if p is None:
            continue
        p[p >= n] = -1
        lo = max(0, n - w + 1)
        if np.count_nonzero((p >= lo) & (p < n)) != n - lo:
            ok = False
    return ok


def layer_slots(max_tokens: int, window: int | None, max_chunk: int = DEFAULT_MAX_CHUNK) -> int:
    """Slots a layer preallocates: ``max_tokens``, or ``W - 1 + max_chunk`` if that is fewer."""
    if window is None:
        return max_tokens
    return min(max_tokens, window - 1 + max_chunk)


def kv_cache_nbytes(n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int,
                    dtype: str = "f32", window_sizes: Sequence[int | None] | None = None,
                    max_chunk: int = DEFAULT_MAX_CHUNK) -> int:
    """Bytes a :class:`HostKVCache` with these arguments allocates (== its ``nbytes``)."""
    per = kv_bytes_per_token_layer(n_kv_heads, head_dim, dtype)
    wins = list(window_sizes) if window_sizes is not None else [None] * n_layers
    total = 0
    for w in wins:
        s = layer_slots(max_tokens, w, max_chunk)
        total += s * per
        if s < max_tokens:
            total += 8 * s  # int64 positions of a ring layer
    return total


# ---- the cache ---------------------------------------------------------------------
class HostKVCache:
    """K and V of every layer, preallocated; f32/f16 here, int8/int4 in subclasses.

    Args:
        n_layers, n_kv_heads, head_dim: geometry (``hd`` = head_dim).
        max_tokens: positions (context) the cache can hold, > 0.
        dtype: one of :data:`ALL_KV_DTYPES`; ``HostKVCache(dtype="int8")`` builds an
            :class:`Int8KVCache` (likewise int4).
        window_sizes: per layer, a sliding window ``W`` (ring storage, see the module
            docstring) or None (global). Default: all global.
        max_chunk: most tokens one ``write`` may add to a ring layer.

    Attributes:
        max_tokens, length (positions valid, 0..max_tokens), dtype, n_layers,
        n_kv_heads, head_dim, group_size (G), window_sizes, slots (per layer).
        k, v: ``[L, S, Hkv, hd]`` float32/float16 (f32/f16 without windows; the CPU
            backend's kernels read them directly). Quantized dtypes expose their raw
            arrays the same way (``k_q``, ``k_scale``, ...).

    Raises:
        ValueError: unknown dtype, non-positive sizes, a window list of the wrong length.
    """

    #: (name, per-slot shape as a function of (Hkv, hd, G), numpy dtype) of the storage.
    _ARRAYS: tuple = ()
    #: per-layer (not per-slot) arrays in ``raw``, outside ``nbytes`` (int4's K statistics)
    _FIXED: tuple = ()
    rotate_k: bool = False

    def __new__(cls, *args, **kwargs):
        impl = cls
        if cls is HostKVCache:
            dtype = kwargs.get("dtype", args[4] if len(args) > 4 else "f32")
            impl = _CLASSES.get(dtype, HostKVCache)
        return super().__new__(impl)

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: str = "f32", window_sizes: Sequence[int | None] | None = None,
                 max_chunk: int = DEFAULT_MAX_CHUNK):
        if dtype not in ALL_KV_DTYPES:
            raise ValueError(f"unsupported KV cache dtype {dtype!r}; choose one of {ALL_KV_DTYPES}")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if min(n_layers, n_kv_heads, head_dim, max_chunk) <= 0:
            raise ValueError("n_layers, n_kv_heads, head_dim and max_chunk must be positive")
        if dtype in ("int4", "k8v4") and head_dim % 2:
            raise ValueError(f"int4 KV needs an even head_dim (two codes per byte), got {head_dim}")
        if window_sizes is None:
            window_sizes = [None] * n_layers
        window_sizes = list(window_sizes)
        if len(window_sizes) != n_layers:
            raise ValueError(f"window_sizes has {len(window_sizes)} entries for {n_layers} layers")
        if any(w is not None and w <= 0 for w in window_sizes):
            raise ValueError(f"window sizes must be positive or None, got {window_sizes}")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.max_tokens, self.dtype, self.length = max_tokens, dtype, 0
        self.group_size = kv_group_size(head_dim)
        self.window_sizes = window_sizes
        self.max_chunk = max_chunk
        self.slots = [layer_slots(max_tokens, w, max_chunk) for w in window_sizes]
        self._ring = [s < max_tokens for s in self.slots]
        # positions held by each slot of a ring layer (-1 = empty); None for linear layers
        self._pos = [np.full(s, -1, np.int64) if r else None
                     for s, r in zip(self.slots, self._ring)]
        hkv, hd, g = n_kv_heads, head_dim, self.group_size
        self._layer: list[dict[str, np.ndarray]] = [{} for _ in range(n_layers)]
        uniform = not any(self._ring)
        for name, shape_fn, np_dtype in self._arrays(dtype):
            per_slot = shape_fn(hkv, hd, g)
            if uniform:  # one stacked array, per-layer views (as before: cache.k[L, S, Hkv, hd])
                stacked = np.zeros((n_layers, max_tokens, *per_slot), np_dtype)
                setattr(self, name, stacked)
                for layer in range(n_layers):
                    self._layer[layer][name] = stacked[layer]
            else:
                for layer in range(n_layers):
                    self._layer[layer][name] = np.zeros((self.slots[layer], *per_slot), np_dtype)
        if self.rotate_k:
            self._h = hadamard(g)

    # ---- storage description (subclasses override) ------------------------------------
    def _arrays(self, dtype):
        np_dtype = np.float32 if dtype == "f32" else np.float16
        return (("k", lambda h, d, g: (h, d), np_dtype), ("v", lambda h, d, g: (h, d), np_dtype))

    def _store(self, a: dict[str, np.ndarray], idx, k: np.ndarray, v: np.ndarray) -> None:
        """Encode k, v float32 [T, Hkv, hd] into the slots ``idx`` of layer arrays ``a``."""
        if a["k"].dtype == np.float16:  # saturate instead of overflowing to inf
            k, v = _f16(k), _f16(v)
        a["k"][idx] = k
        a["v"][idx] = v

    def _load(self, a: dict[str, np.ndarray], idx) -> tuple[np.ndarray, np.ndarray]:
        """Decode the slots ``idx`` of layer arrays ``a`` to float32 [n, Hkv, hd]."""
        return a["k"][idx].astype(np.float32, copy=False), a["v"][idx].astype(np.float32, copy=False)

    # ---- bookkeeping -------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes preallocated: K and V codes, scales, and ring position tables."""
        n = sum(arr.nbytes for layer in self._layer for name, arr in layer.items()
                if name not in self._FIXED)
        return int(n + sum(p.nbytes for p in self._pos if p is not None))

    def bytes_per_token(self) -> int:
        """``nbytes // max_tokens`` (average over the context; exact without windows)."""
        return self.nbytes // self.max_tokens

    def used_nbytes(self) -> int:
        """Bytes of the positions held now: per layer ``min(length, S)`` slots (a ring
        layer holds at most its ``S`` slots, plus its position table) of K and V codes and
        scales. The generation stats' ``kv_bytes``."""
        n = 0
        for layer, a in enumerate(self._layer):
            per_slot = sum(arr.nbytes // arr.shape[0] for name, arr in a.items()
                           if name not in self._FIXED)
            n += min(self.length, self.slots[layer]) * per_slot
            if self._pos[layer] is not None:
                n += self._pos[layer].nbytes
        return int(n)

    def raw(self, layer: int) -> dict[str, np.ndarray]:
        """The storage arrays of ``layer`` by name (see the layout table); views, not copies."""
        return self._layer[layer]

    @property
    def rotation(self) -> np.ndarray | None:
        """H_G (float32 [G, G], :func:`hadamard`) that K groups are multiplied by before
        quantization (and a fast kernel's query), or None for f32 / f16."""
        return self._h if self.rotate_k else None

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

        A ring layer can keep them only if it still holds every key positions >= n can
        attend to (``max(0, n - W + 1) .. n - 1``); if any ring layer lost one, the
        whole cache is reset (``length`` becomes 0) and the caller recomputes.

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
                f"{self.max_tokens} preallocated positions"
            )

    def _slots_of(self, layer: int, start_pos: int, t: int):
        if not self._ring[layer]:
            return slice(start_pos, start_pos + t)
        if t > self.slots[layer] - (self.window_sizes[layer] - 1):
            raise ValueError(
                f"a chunk of {t} tokens is larger than the {self.max_chunk} a windowed layer "
                f"(window {self.window_sizes[layer]}) was sized for; prefill in smaller chunks "
                f"or build the cache with max_chunk >= {t}")
        return (start_pos + np.arange(t)) % self.slots[layer]

    # ---- data --------------------------------------------------------------------------
    def write(self, layer: int, start_pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v ``[T, Hkv, hd]`` (float32 or float16) at positions start_pos.. of ``layer``.

        Raises:
            ValueError: the positions exceed ``max_tokens``, or a ring layer's chunk limit.
        """
        t = k.shape[0]
        self.check_room(start_pos, t)
        idx = self._slots_of(layer, start_pos, t)
        k = self.k_input(layer, start_pos, np.asarray(k, np.float32))
        self._store(self._layer[layer], idx, k, np.asarray(v, np.float32))
        if self._ring[layer]:
            self._pos[layer][idx] = np.arange(start_pos, start_pos + t)

    def k_input(self, layer: int, start_pos: int, k: np.ndarray) -> np.ndarray:
        """The float32 K ``[T, Hkv, hd]`` the format quantizes (before any rotation).

        ``k`` itself except for int4, whose K channel statistics a write at position 0
        (re)fixes first (:class:`Int4KVCache`). Fast backends call this, as ``write`` does,
        so that their codes are bit-identical.
        """
        return k

    def read_positions(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Held keys and values of positions < ``end``, with their absolute positions.

        Returns:
            (k float32 [n, Hkv, hd], v float32 [n, Hkv, hd], positions int64 [n] ascending);
            for a linear layer n == end and positions == arange(end).
        """
        p = self._pos[layer]
        if p is None:
            k, v = self._load(self._layer[layer], slice(0, end))
            return k, v, np.arange(end, dtype=np.int64)
        sel = np.nonzero((p >= 0) & (p < end))[0]
        sel = sel[np.argsort(p[sel])]
        k, v = self._load(self._layer[layer], sel)
        return k, v, p[sel]

    def read(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """K, V float32 ``[end, Hkv, hd]`` of positions 0..end-1, dequantized (reference path).

        For a ring layer, positions no longer held read as zeros (outside the window).
        """
        if self._pos[layer] is None:
            return self._load(self._layer[layer], slice(0, end))
        k, v, pos = self.read_positions(layer, end)
        kd = np.zeros((end, self.n_kv_heads, self.head_dim), np.float32)
        vd = np.zeros_like(kd)
        kd[pos], vd[pos] = k, v
        return kd, vd


class Int8KVCache(HostKVCache):
    """int8 KV cache: K per (token, head, group of G) symmetric after a Hadamard rotation,
    V per (token, head) symmetric; formulas and layout in the module docstring."""

    rotate_k = True

    def _arrays(self, dtype):
        return (
            ("k_q", lambda h, d, g: (h, d), np.int8),          # [S, Hkv, hd] int8
            ("k_scale", lambda h, d, g: (h, d // g), np.float16),  # [S, Hkv, hd/G]
            ("v_q", lambda h, d, g: (h, d), np.int8),          # [S, Hkv, hd] int8
            ("v_scale", lambda h, d, g: (h,), np.float16),     # [S, Hkv]
        )

    def _store(self, a, idx, k, v):
        a["k_q"][idx], a["k_scale"][idx] = quant_sym8(_rotate(k, self._h), self.group_size)
        vq, vs = quant_sym8(v, v.shape[-1])
        a["v_q"][idx], a["v_scale"][idx] = vq, vs[..., 0]

    def _load(self, a, idx):
        k = _rotate(dequant_sym8(a["k_q"][idx], a["k_scale"][idx]), self._h)
        v = dequant_sym8(a["v_q"][idx], a["v_scale"][idx][..., None])
        return k, v


class Int4KVCache(HostKVCache):
    """int4 KV cache: K and V per (token, head, group of G) asymmetric with f16 scale and
    minimum; K first shifted and scaled per channel (``(k - m) / c``, fixed by the write
    at position 0, :func:`k_channel_stats`) and Hadamard-rotated; two codes per byte, low
    nibble first. Formulas in :mod:`.kvformat`.

    The statistics come from the first ``KSTAT_POSITIONS`` rows of that write (fewer if
    it was shorter: ``stat_rows``), so a kept prefix equals a fresh write of a longer
    sequence only if it holds those rows and the fresh write would take as many
    (:meth:`edgeinfer.engine.Engine.prefill` checks this before reusing a prefix).
    """

    rotate_k = True
    _FIXED = ("k_off", "k_cs")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stat_rows = 0  # rows the K statistics came from (0: none yet)
        for a in self._layer:  # until a write at position 0: m = 0, c = 1
            a["k_off"] = np.zeros((self.n_kv_heads, self.head_dim), np.float32)  # m [Hkv, hd]
            a["k_cs"] = np.ones((self.n_kv_heads, self.head_dim), np.float32)    # c [Hkv, hd]

    def _arrays(self, dtype):
        return (
            ("k_q", lambda h, d, g: (h, d // 2), np.uint8),        # [S, Hkv, hd/2] packed
            ("k_scale", lambda h, d, g: (h, d // g), np.float16),  # [S, Hkv, hd/G]
            ("k_min", lambda h, d, g: (h, d // g), np.float16),    # [S, Hkv, hd/G]
            ("v_q", lambda h, d, g: (h, d // 2), np.uint8),
            ("v_scale", lambda h, d, g: (h, d // g), np.float16),
            ("v_min", lambda h, d, g: (h, d // g), np.float16),
        )

    def k_input(self, layer, start_pos, k):
        """``(k - m) / c`` float32 ``[T, Hkv, hd]``; a write at position 0 (a new sequence)
        first sets ``m, c = k_channel_stats(k[:KSTAT_POSITIONS])`` for ``layer``."""
        a = self._layer[layer]
        if start_pos == 0 and k.shape[0] > 0:
            a["k_off"][...], a["k_cs"][...] = k_channel_stats(k[:KSTAT_POSITIONS])
            self.stat_rows = min(KSTAT_POSITIONS, k.shape[0])
        return (k - a["k_off"]) / a["k_cs"]

    def _store(self, a, idx, k, v):
        g = self.group_size
        a["k_q"][idx], a["k_scale"][idx], a["k_min"][idx] = quant_asym4(_rotate(k, self._h), g)
        a["v_q"][idx], a["v_scale"][idx], a["v_min"][idx] = quant_asym4(v, g)

    def _load(self, a, idx):
        k = _rotate(dequant_asym4(a["k_q"][idx], a["k_scale"][idx], a["k_min"][idx]), self._h)
        v = dequant_asym4(a["v_q"][idx], a["v_scale"][idx], a["v_min"][idx])
        return k * a["k_cs"] + a["k_off"], v


class K8V4KVCache(HostKVCache):
    """Mixed: K as in int8 (rotated, symmetric per group), V as in int4 (asymmetric per
    group, packed). K is the sensitive half (https://github.com/ggml-org/llama.cpp/pull/7412)."""

    rotate_k = True

    def _arrays(self, dtype):
        return (
            ("k_q", lambda h, d, g: (h, d), np.int8),              # [S, Hkv, hd] int8
            ("k_scale", lambda h, d, g: (h, d // g), np.float16),  # [S, Hkv, hd/G]
            ("v_q", lambda h, d, g: (h, d // 2), np.uint8),        # [S, Hkv, hd/2] packed
            ("v_scale", lambda h, d, g: (h, d // g), np.float16),
            ("v_min", lambda h, d, g: (h, d // g), np.float16),
        )

    def _store(self, a, idx, k, v):
        g = self.group_size
        a["k_q"][idx], a["k_scale"][idx] = quant_sym8(_rotate(k, self._h), g)
        a["v_q"][idx], a["v_scale"][idx], a["v_min"][idx] = quant_asym4(v, g)

    def _load(self, a, idx):
        k = _rotate(dequant_sym8(a["k_q"][idx], a["k_scale"][idx]), self._h)
        v = dequant_asym4(a["v_q"][idx], a["v_scale"][idx], a["v_min"][idx])
        return k, v


_CLASSES = {"f32": HostKVCache, "f16": HostKVCache, "int8": Int8KVCache, "int4": Int4KVCache,
            "k8v4": K8V4KVCache}
