"""Float32 linears through BLAS sgemm: dequantized weight tiles (``exact_decode``, any T)
and dense weights (T > 2). Prefill on quantized weights normally takes the integer GEMM
of :mod:`.qgemm` instead, whose rows equal the decode GEMV's bit for bit.

The output rows are split into tiles; each tile is dequantized once into a float32
buffer (a serial Numba kernel that releases the GIL) and multiplied by all T tokens with
``np.dot`` (OpenBLAS sgemm). No full float copy of the weight ever exists. Results are
float32 math on exactly-dequantized weights (no activation rounding): ~1e-6 relative to
the reference.

Threading: tiles run on a small pool of Python threads, each with OpenBLAS limited to
one thread (``openblas_set_num_threads_local``), so that two spinning thread pools never
fight for the cores (benchmarks/MEASUREMENTS.md). With numpy's bundled OpenBLAS that
setting is not local: once a worker has started, ``openblas_get_num_threads()`` answers 1 on
the main thread too, and a main-thread sgemm runs on one core (the calibration pass
spreads its products over the pool for that reason, :mod:`edgeinfer.quant.calib_backend`).
"""
from __future__ import annotations

import ctypes
import glob
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .qlane import row_dequant
from .repack import CpuQuantWeight

#: Largest tile (output rows) per sgemm call: 256 x 4864 x 4 B = 5 MB worst case.
MAX_TILE_ROWS = 256


def _openblas_libs():
    """ctypes handles of the OpenBLAS libraries numpy bundles (usually one)."""
    here = os.path.dirname(np.__file__)
    for pat in ("../numpy.libs/*openblas*.so*", ".dylibs/*openblas*.dylib", "../numpy.libs/*openblas*.dll"):
        for path in glob.glob(os.path.join(here, pat)):
            try:
                yield ctypes.CDLL(path)
            except OSError:
                continue


def _openblas_local_threads():
    """``openblas_set_num_threads_local`` of numpy's bundled OpenBLAS, or None."""
    for lib in _openblas_libs():
        fn = getattr(lib, "openblas_set_num_threads_local", None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def blas_core() -> str:
    """The BLAS behind the prefill sgemm and the kernel core its runtime dispatch chose,
    e.g. ``"openblas:Haswell"`` (OpenBLAS ``get_corename``; scipy-openblas prefixes the
    symbol); ``"blas:<numpy's build name>"`` when that cannot be asked."""
    for lib in _openblas_libs():
        for sym in ("openblas_get_corename", "scipy_openblas_get_corename64_",
                    "scipy_openblas_get_corename"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn.argtypes, fn.restype = [], ctypes.c_char_p
                return "openblas:" + fn().decode("ascii", "replace").strip()
    try:
        name = np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]
    except (TypeError, KeyError, AttributeError):
        name = "unknown"
    return f"blas:{name}"


_SET_LOCAL = _openblas_local_threads()


def _worker_init() -> None:
    if _SET_LOCAL is not None:
        _SET_LOCAL(1)


class GemmPool:
    """Worker threads for prefill tiles (one BLAS thread each).

    Args:
        threads: worker count (the backend's thread count).
    """

    def __init__(self, threads: int):
        self.threads = max(1, int(threads))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="edgeinfer-gemm",
                                         initializer=_worker_init)

    def tiles(self, rows: int) -> list[tuple[int, int]]:
        """Split ``rows`` output rows into (start, count) tiles, a multiple of the thread
        count (so every worker gets one) and at most ``MAX_TILE_ROWS`` each."""
        n = max(self.threads, -(-rows // MAX_TILE_ROWS))
        n = -(-n // self.threads) * self.threads
        step = -(-rows // n)
        return [(r0, min(step, rows - r0)) for r0 in range(0, rows, step)]

    def run(self, fn, items) -> None:
        """Run ``fn(item)`` for every item on the pool and wait (re-raises errors).

        Always on the workers, even for one item: their BLAS is single-threaded, the
        caller's is not ours to change."""
        for _ in self._pool.map(fn, items):
            pass

    def close(self) -> None:
        """Stop the worker threads (waits for running items)."""
        self._pool.shutdown(wait=True)


def gemm_quant(x: np.ndarray, w: CpuQuantWeight, bias: np.ndarray | None,
               pool: GemmPool) -> np.ndarray:
    """y[T, out] = x[T, in] @ W[out, in].T (+ bias) for a repacked quantized weight.

    Each tile's [T, rows] product is written straight into its columns of ``y``: no
    [out, T] intermediate and transposed copy (which doubled the transient memory: 2 x
    10 MB for Qwen2.5-0.5B's fused gate|up at T = 256, 2 x 20 MB at T = 512).

    Args:
        x: float32 [T, in] C-contiguous.
        w: 4- or 8-bit repacked weight.
        bias: float32 [out] or None.
        pool: tile workers.

    Returns:
        float32 [T, out] (new array).
    """
    out, k = w.out_features, w.in_features
    y = np.empty((x.shape[0], out), np.float32)
    deq = row_dequant(w)
    one = np.float32(1.0)

    def work(tile):
        r0, rows = tile
        buf = np.empty((rows, k), np.float32)
        deq(buf, w.wp, w.sc, w.sz, w.bmap, np.arange(r0, r0 + rows), one)
        y[:, r0:r0 + rows] = np.dot(x, buf.T)  # [T, rows] tile (<= 512 KB at T = 512)

    pool.run(work, pool.tiles(out))
    if bias is not None:
        y += bias
    return y


def gemm_dense(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None,
               pool: GemmPool) -> np.ndarray:
    """y[T, out] = x[T, in] @ W[out, in].T (+ bias) for a dense float32 weight, tiled
    over output rows on the same workers (one BLAS thread each), each tile written into
    its columns of ``y`` (as :func:`gemm_quant`)."""
    out = w.shape[0]
    y = np.empty((x.shape[0], out), np.float32)

    def work(tile):
        r0, rows = tile
        y[:, r0:r0 + rows] = np.dot(x, w[r0:r0 + rows].T)

    pool.run(work, pool.tiles(out))
    if bias is not None:
        y += bias
    return y
