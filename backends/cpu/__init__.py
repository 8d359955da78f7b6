"""The Numba CPU backend: INT4/INT8 integer-dot GEMV for decode, dequantized tiles + BLAS
for prefill, blocked GQA attention over the host KV cache.

Tensors are host numpy float32 arrays. Quantized weights are repacked once at upload
(:mod:`.repack`); dense float32 weights are used as given (a float32 memmap stays a
memmap). Importing this module imports Numba; ``import edgeinfer.backends`` does not.

Kernel modules: :mod:`.gemv` (decode, T <= ``GEMV_MAX_T``), :mod:`.gemm` (prefill),
:mod:`.attention`, :mod:`.elementwise`, with the SIMD row kernels in :mod:`._simd`.

Threading: Numba's OpenMP pool (``OMP_WAIT_POLICY=PASSIVE`` by default, see below) for
the decode kernels; a small Python thread pool with single-threaded OpenBLAS for the
prefill GEMM (:mod:`.gemm`), so two spinning pools never fight over the cores.
"""
from __future__ import annotations

import os

# Numba's OpenMP workers sleep between parallel regions instead of spinning. Measured on
# this 2-core machine kind with other processes competing (load ~12): a 0.5 MB GEMV took
# 24 ms median with libgomp's default spin (the spinning worker burns the time slice its
# partner needs), 58 us with PASSIVE; GOMP_SPINCOUNT=1000 gave 140 us. Must be set before
# the threading layer starts (first parallel call in the process); an explicit
# OMP_WAIT_POLICY=active in the environment (dedicated, quiet machine) wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba
import numpy as np

from ..base import Backend
from ..kvcache import HostKVCache
from ..quantized import QuantizedTensor
from .attention import attention as _attention
from .elementwise import (
    dequant_rows_q4,
    dequant_rows_q8,
    rmsnorm_rows,
    rmsnorm_rows_par,
    rope_tokens,
    rope_tokens_par,
)
from .gemm import GemmPool, gemm_dense, gemm_quant
from .gemv import ActScratch, gemv_quant
from .repack import CpuQuantWeight, blocks_align_with_groups, repack

__all__ = ["CpuBackend", "CpuQuantWeight", "physical_cores"]

#: Token counts up to this use the integer GEMV once per token; above, dequant + BLAS.
GEMV_MAX_T = 2
_NO_POS = np.zeros(0, np.int64)
_GELU_C = np.float32(0.7978845608028654)  # sqrt(2 / pi)
#: Row-wise ops on fewer elements than this run serially (a parallel region costs ~3 us).
_PAR_MIN_ELEMS = 32768


def physical_cores() -> int:
    """Physical cores available to this process (SMT siblings counted once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, (os.cpu_count() or 2) // 2)
    seen = set()
    for c in cpus:
        path = f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                seen.add(f.read().strip())
        except OSError:
            seen.add(str(c))
    return max(1, len(seen))


class CpuBackend(Backend):
    """Numba CPU implementation of :class:`~edgeinfer.backends.base.Backend`.

    Args:
        threads: worker threads (default: physical cores, capped by
            ``numba.config.NUMBA_NUM_THREADS``): Numba's parallel kernels (set with
            ``numba.set_num_threads``, which is per calling thread: construct the backend
            on the thread that runs the model) and the prefill GEMM tile workers.
        exact_decode: compute decode (T <= ``GEMV_MAX_T``) quantized linears like prefill
            (dequantized tiles + BLAS, float32 activations) instead of the int8-activation
            integer GEMV: slower (every tile is dequantized per token), but logits match
            the reference to ~1e-6 (the fast path to ~1e-2 normalized error, like
            llama.cpp's Q8_0 activations). For parity tests and debugging.

    One instance runs one forward at a time (activation scratch is shared); use one
    backend per concurrent session.

    Weight handles: float32 ndarray ``[out, in]`` (dense) or :class:`CpuQuantWeight`.
    Quantized weights whose scale groups straddle 32-column blocks (group size not a
    multiple of 32 with several groups) are dequantized to float32 at upload.
    """

    name = "cpu"

    def __init__(self, threads: int | None = None, exact_decode: bool = False, **_options):
        n = physical_cores() if threads is None else int(threads)
        if n < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = min(n, numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(self.threads)
        self.exact_decode = bool(exact_decode)
        self._act = ActScratch()
        self._pool = GemmPool(self.threads)

    # ---- memory ----------------------------------------------------------------------
    def upload(self, a):
        """float32 C-contiguous view or copy of ``a`` (no copy when already so)."""
        return np.ascontiguousarray(a, dtype=np.float32)

    def upload_weight(self, w):
        """Repack a QuantizedTensor for the integer kernels; dense weights as float32."""
        if isinstance(w, QuantizedTensor):
            if blocks_align_with_groups(w):
                return repack(w)
            return np.ascontiguousarray(w.dequantize(), dtype=np.float32)
        return np.ascontiguousarray(w, dtype=np.float32)

    def to_host(self, t):
        """The array itself (tensors already live on the host)."""
        return np.asarray(t)

    def new_kv_cache(self, n_layers, n_kv_heads, head_dim, max_tokens, dtype="f32"):
        """A :class:`~edgeinfer.backends.kvcache.HostKVCache` ``[L, S, Hkv, hd]``."""
        return HostKVCache(n_layers, n_kv_heads, head_dim, max_tokens, dtype)

    # ---- ops -------------------------------------------------------------------------
    def embed(self, table, ids, scale=1.0):
        """x[T, D] = table[ids] * scale; quantized tables dequantize only the rows used."""
        ids = np.asarray(ids).reshape(-1)
        if isinstance(table, CpuQuantWeight):
            if ids.size and (ids.min() < 0 or ids.max() >= table.out_features):
                raise IndexError(f"token id out of range 0..{table.out_features - 1}")
            out = np.empty((ids.shape[0], table.in_features), np.float32)
            fn = dequant_rows_q4 if table.bits == 4 else dequant_rows_q8
            fn(out, table.wp, table.sc, table.sz, table.bmap, ids.astype(np.int64),
               np.float32(scale))
            return out
        x = table[ids]
        return x * np.float32(scale) if scale != 1.0 else x

    def rmsnorm(self, x, w, eps, unit_offset=False):
        """y[..., N] = x / sqrt(mean(x**2) + eps) * (w | 1 + w) over the last axis, float32."""
        n = x.shape[-1]
        x2 = np.ascontiguousarray(x).reshape(-1, n)
        y = np.empty_like(x2)
        fn = rmsnorm_rows_par if x2.size >= _PAR_MIN_ELEMS else rmsnorm_rows
        fn(y, x2, w, float(eps), bool(unit_offset))
        return y.reshape(x.shape)

    def linear(self, x, w, bias=None):
        """y[T, out] = x[T, in] @ W[out, in].T (+ bias[out]).

        Quantized W: T <= ``GEMV_MAX_T`` uses the int8-activation integer GEMV (unless
        ``exact_decode``), larger T dequantized tiles + BLAS on the tile workers. Dense W:
        numpy BLAS (tiled on the workers for T > ``GEMV_MAX_T``).

        Raises:
            ValueError: ``in`` does not match the weight.
        """
        if (w.__class__ is CpuQuantWeight and x.ndim == 2 and x.shape[0] == 1
                and x.shape[1] == w.in_features and not self.exact_decode):
            # decode fast path: minimal Python per call (~0.2 ms per SmolLM2 token)
            y = np.empty((1, w.out_features), np.float32)
            gemv_quant(y[0], x[0], w, bias, self._act)
            return y
        k = x.shape[-1]
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, k)
        t = x2.shape[0]
        if isinstance(w, CpuQuantWeight):
            if k != w.in_features:
                raise ValueError(f"linear: x has {k} features, weight expects {w.in_features}")
            if t <= GEMV_MAX_T and not self.exact_decode:
                y = np.empty((t, w.out_features), np.float32)
                for i in range(t):
                    gemv_quant(y[i], x2[i], w, bias, self._act)
            else:
                y = gemm_quant(x2, w, bias, self._pool)
        elif t <= GEMV_MAX_T:
            y = x2 @ w.T
            if bias is not None:
                y += bias
        else:
            y = gemm_dense(x2, w, bias, self._pool)
        return y.reshape(x.shape[:-1] + (y.shape[-1],))

    def rope(self, x, cos, sin, positions):
        """Rotate x[T, H, hd] (NeoX pairing) by tables cos/sin [P, r/2] at positions [T]."""
        x = np.ascontiguousarray(x)
        y = np.empty_like(x)
        pos = positions if positions.dtype.kind == "i" else np.asarray(positions, np.int64)
        fn = rope_tokens_par if x.size >= _PAR_MIN_ELEMS else rope_tokens
        fn(y, x, cos, sin, pos)
        return y

    def attention(self, q, k, v, cache, layer, start_pos, scale, window=None, softcap=None):
        """Append k, v [T, Hkv, hd] to ``cache`` and attend: returns out[T, Hq, hd] float32.

        See :meth:`Backend.attention`. f32/f16 caches are read in place by the kernel.

        Raises:
            ValueError: the positions do not fit in the cache.
        """
        t, hq, hd = q.shape
        cache.check_room(start_pos, t)
        q = np.ascontiguousarray(q, dtype=np.float32)
        k = np.ascontiguousarray(k, dtype=np.float32)
        v = np.ascontiguousarray(v, dtype=np.float32)
        out = np.empty((t, hq, hd), np.float32)
        win, cap = int(window or 0), float(softcap or 0.0)
        raw = cache.raw(layer) if hasattr(cache, "raw") else {"k": cache.k[layer],
                                                              "v": cache.v[layer]}
        ring = hasattr(cache, "positions") and cache.positions(layer) is not None
        kc = raw.get("k")
        if kc is not None and not ring and kc.dtype in (np.float32, np.float16):
            vc = raw["v"]
            if kc.dtype == np.float16:  # the kernel converts (and saturates) bits itself
                kc, vc = kc.view(np.uint16), vc.view(np.uint16)
            _attention(out, q, k, v, kc, vc, _NO_POS, True, int(start_pos), float(scale),
                       win, cap)
            return out
        # quantized or ring storage: the cache encodes/decodes, the kernel masks by position
        cache.write(layer, start_pos, k, v)
        kk, vv, pos = cache.read_positions(layer, start_pos + t)
        _attention(out, q, k, v, np.ascontiguousarray(kk, np.float32),
                   np.ascontiguousarray(vv, np.float32), np.asarray(pos, np.int64), False,
                   int(start_pos), float(scale), win, cap)
        return out

    def glu(self, gate, up, act="silu"):
        """y[T, F] = act(gate) * up, act "silu" or "gelu_tanh".

        numpy ufuncs (SIMD exp / tanh, ~1 ns per element), not Numba: a scalar libm
        ``exp`` per element in Numba measured 10 ns (15 us for F = 1536).

        Raises:
            ValueError: unknown activation.
        """
        if act == "silu":
            gelu = False
        elif act in ("gelu_tanh", "gelu_pytorch_tanh"):
            gelu = True
        else:
            raise ValueError(f"unsupported activation {act!r}")
        g = np.asarray(gate, dtype=np.float32)
        if gelu:  # 0.5 g (1 + tanh(c (g + 0.044715 g^3))) * up
            y = g * g
            y *= np.float32(0.044715)
            y += np.float32(1.0)
            y *= g
            y *= _GELU_C
            np.tanh(y, out=y)
            y += np.float32(1.0)
            y *= g
            y *= np.float32(0.5)
        else:  # silu: g / (1 + exp(-g))
            y = np.negative(g)
            with np.errstate(over="ignore"):  # exp(-g) -> inf gives the right limit 0
                np.exp(y, out=y)
            y += np.float32(1.0)
            np.divide(g, y, out=y)
        y *= up
        return y

    def add(self, a, b):
        """Elementwise a + b (numpy; one call, no Numba dispatch needed)."""
        return a + b
