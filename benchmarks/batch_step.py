"""Time a batched decode step: ``Transformer.forward_batch`` of B sequences against one.

usage:
  python benchmarks/batch_step.py MODEL [--rows 1 2 4 8] [--context 64] [--steps 30]

MODEL is anything ``edgeinfer.api.load`` takes. Each of B int8 caches is prefilled with
``--context`` tokens, then ``--steps`` steps are timed (B = 1: ``forward``, the compiled
decode plan; B > 1: ``forward_batch``). Prints one line per B: the median step in ms and
the aggregate tokens per second.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    from edgeinfer import api

    tr = api.load(a.model, threads=a.threads).transformer
    prompt = (np.arange(1, a.context + 1, dtype=np.int32) % 1000) + 10
    for b in a.rows:
        caches = [tr.new_cache(a.context + a.steps + 8, "int8") for _ in range(b)]
        for c in caches:
            tr.forward(prompt, c)
        ids = np.full(b, 5, np.int32)

        def step():
            return tr.forward_batch(ids, caches) if b > 1 else tr.forward(ids, caches[0])

        for _ in range(3):
            step()
        times = []
        for _ in range(a.steps - 3):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        ms = float(np.median(times)) * 1e3
        print(f"B={b} step {ms:.2f} ms, {b / ms * 1e3:.1f} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
