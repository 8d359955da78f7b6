"""Time the 16-token AMX GEMM of 4-bit weights (``_amx.gemm_amx``) on SmolLM2 / Qwen shapes.

usage:
  python benchmarks/amx_gemm.py [--tokens 256] [--threads 2] [--group 128] [--sym]

Random RTN-style weights (``tests/test_cpu_kernels.random_q``), best of 5 calls after one
warm call. Prints per shape the time, the nanoseconds per block step (16 tokens x 16 rows x
one 32-column block) per thread, and the integer ops per second (2 per multiply-add).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864),  # Qwen: qkv, o, gate|up, down
          (1728, 576), (3072, 576), (576, 1536)]             # SmolLM2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--sym", action="store_true")
    a = ap.parse_args(argv)
    from test_cpu_kernels import random_q

    from edgeinfer.backends.cpu import CpuBackend, _amx
    if not _amx.HAVE_AMX:
        print("no AMX tiles on this CPU or OS")
        return 1
    cpu = CpuBackend(threads=a.threads)
    rng = np.random.default_rng(0)
    t_n = a.tokens
    for out, n_in in SHAPES:
        h = cpu.upload_weight(random_q(rng, out, n_in, 4, a.group, a.sym))
        x = rng.standard_normal((t_n, n_in)).astype(np.float32)
        _amx.gemm_amx(x, h, None)
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            _amx.gemm_amx(x, h, None)
            best = min(best, time.perf_counter() - t)
        steps = (t_n / 16) * (out / 16) * (n_in / 32)
        print(f"{out:6d} x {n_in:5d}  T={t_n}: {best * 1e3:7.2f} ms  "
              f"{best * a.threads * 1e9 / steps:6.1f} ns/block step/thread  "
              f"{2 * out * n_in * t_n / best / 1e9:6.0f} GOPS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
