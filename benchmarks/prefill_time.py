"""Time one model's prefill: the N-token ``forward`` into a fresh int8 KV cache, best of R.

usage:
  python benchmarks/prefill_time.py MODEL [--tokens 256] [--repeat 5] [--threads 2]

MODEL is anything ``edgeinfer.api.load`` takes (catalog name, ``.gguf``, ``.eif``). The
prompt is random token ids (seed 0, ids 100-29999); one warm-up forward first. Prints one
JSON object: ``model``, ``tokens``, ``best_s``, ``tok_s``, ``runs_s`` and ``load`` (the
1-minute load average after the runs). For an A/B, run it under each tree
(``PYTHONPATH=TREE``), alternating.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    from edgeinfer import api

    tr = api.load(a.model, threads=a.threads).transformer
    ids = np.random.default_rng(0).integers(100, 30000, a.tokens).astype(np.int32)
    tr.forward(ids, tr.new_cache(a.tokens + 8, "int8"))
    runs = []
    for _ in range(a.repeat):
        cache = tr.new_cache(a.tokens + 8, "int8")
        t0 = time.perf_counter()
        tr.forward(ids, cache)
        runs.append(time.perf_counter() - t0)
    best = min(runs)
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    print(json.dumps({"model": a.model, "tokens": a.tokens, "best_s": round(best, 4),
                      "tok_s": round(a.tokens / best, 1),
                      "runs_s": [round(r, 4) for r in runs], "load": load}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
