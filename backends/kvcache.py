"""Host-memory KV cache shared by the reference and CPU backends.

Preallocated once for ``max_tokens`` positions per layer (the decode loop allocates
nothing). Storage dtype f32 or f16 here; quantized dtypes extend :class:`HostKVCache`
with their own ``write``/``read``. ``length`` is the number of positions held; the
engine compares token ids and calls :meth:`trim` to reuse a common prefix.
"""
from __future__ import annotations

import numpy as np

KV_DTYPES = ("f32", "f16")


class HostKVCache:
    """K and V for every layer: ``k[layer]``, ``v[layer]`` are ``[max_tokens, Hkv, hd]``.

    Attributes:
        max_tokens: positions preallocated per layer.
        length: positions currently valid (0..max_tokens).
        dtype: "f32" or "f16".
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: str = "f32"):
        if dtype not in KV_DTYPES:
            raise ValueError(f"unsupported KV cache dtype {dtype!r}; choose one of {KV_DTYPES}")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        np_dtype = np.float32 if dtype == "f32" else np.float16
        shape = (n_layers, max_tokens, n_kv_heads, head_dim)
        self.k = np.zeros(shape, np_dtype)  # [L, S, Hkv, hd]
        self.v = np.zeros(shape, np_dtype)  # [L, S, Hkv, hd]
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes preallocated for K and V."""
        return int(self.k.nbytes + self.v.nbytes)

    def bytes_per_token(self) -> int:
        return self.nbytes // self.max_tokens

    def reset(self) -> None:
        self.length = 0

    def trim(self, n: int) -> None:
        """Keep the first ``n`` positions (n <= length)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} positions to {n}")
        self.length = n

    def check_room(self, start_pos: int, t: int) -> None:
        if start_pos + t > self.max_tokens:
            raise ValueError(
                f"KV cache overflow: positions {start_pos}..{start_pos + t - 1} do not fit in "
                f"{self.max_tokens} preallocated positions"
            )

    def write(self, layer: int, start_pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v ``[T, Hkv, hd]`` at positions start_pos.. of ``layer``."""
        t = k.shape[0]
        self.check_room(start_pos, t)
        self.k[layer, start_pos:start_pos + t] = k
        self.v[layer, start_pos:start_pos + t] = v

    def read(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """K, V float32 ``[end, Hkv, hd]`` of positions 0..end-1 (reference path)."""
        return (self.k[layer, :end].astype(np.float32, copy=False),
                self.v[layer, :end].astype(np.float32, copy=False))
