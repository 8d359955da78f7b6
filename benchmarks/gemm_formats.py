"""Prefill GEMM time of llama.cpp block formats on the CPU backend (its own path choice).

usage:
  python benchmarks/gemm_formats.py [--tokens 256] [--threads 2]

Random blocks of each format (the generators of ``tests/test_gguf_q6k.py`` and
``tests/test_gguf_q5.py``) at the catalog models' shapes, re-laid as a GGUF load re-lays
them, then ``CpuBackend.linear`` on [T, in] float32 activations: best of 5 calls after a
warm one. Prints one line per (format, shape): milliseconds and GMAC/s.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

#: (format, out, in): Gemma 3 270M / Qwen2.5-0.5B ffn_down (Q6_K), their gate|up (Q5_0).
CASES = [("Q6_K", 640, 2048), ("Q6_K", 896, 4864), ("Q5_0", 4096, 640),
         ("Q5_0", 4864, 896), ("Q5_0", 896, 4864)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    from test_gguf_q5 import q5_blocks
    from test_gguf_q6k import q6k_blocks

    from edgeinfer.backends.cpu import CpuBackend
    from edgeinfer.readers.gguf_blocks import relayout

    be = CpuBackend(threads=a.threads)
    rng = np.random.default_rng(0)
    for fmt, out, k in CASES:
        raw = (q6k_blocks(rng, out, k // 256) if fmt == "Q6_K" else
               q5_blocks(rng, fmt, out, k // 32))
        w = be.upload_weight(relayout(raw, fmt, "t", "x.gguf"))
        x = rng.standard_normal((a.tokens, k)).astype(np.float32)
        be.linear(x, w)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            be.linear(x, w)
            best = min(best, time.perf_counter() - t0)
        print(f"{fmt} {out} x {k} T={a.tokens}: {best * 1e3:.2f} ms "
              f"{out * k * a.tokens / best / 1e9:.0f} GMAC/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
