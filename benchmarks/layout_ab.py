"""In-process A/B of two weight layouts on the CPU backend: one model per layout, loaded in
one process and timed alternately (prefill of 256 tokens, 128 decode steps).

    python benchmarks/layout_ab.py MODEL.eif --what half   # fp16-held scales vs float32
    python benchmarks/layout_ab.py MODEL.eif --what view   # tied 8-bit table: copy vs file view

``half``: scales / zero-point terms held as fp16 bits where exact (the default,
``repack.half_if_exact``) against float32 (``half_if_exact`` made the identity while the
second model loads). ``view``: a tied 8-bit embedding table (SmolLM2's, also the head) of
an ``.eif`` uploaded as a weight, its own copy (the default,
``Transformer.tied_as_weight``), against a copy-on-write view of the file
(``CpuBackend.upload_embedding``, ``private_file_view``). Prints tok/s per round (decode:
1 / mean step time).
"""
from __future__ import annotations

import argparse
import importlib
import time

import numpy as np

import edgeinfer


def load_pair(path: str, what: str, threads: int):
    """(default model, alternative model)."""
    a = edgeinfer.load(path, threads=threads)
    if what == "half":
        mod = importlib.import_module("edgeinfer.backends.cpu.repack")
        name, alt = "half_if_exact", (lambda x: x)
    else:
        from edgeinfer.models.transformer import Transformer
        mod, name, alt = Transformer, "tied_as_weight", False
    orig = getattr(mod, name)
    setattr(mod, name, alt)
    try:
        b = edgeinfer.load(path, threads=threads)
    finally:
        setattr(mod, name, orig)
    return a, b


def run(model, ids: np.ndarray, steps: int = 128) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one fresh cache."""
    tr = model.transformer
    cache = tr.new_cache(1024, "int8")
    t0 = time.perf_counter()
    tr.forward(ids, cache)
    tp = time.perf_counter() - t0
    tok = np.array([200], np.int32)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tr.forward(tok, cache)
        ts.append(time.perf_counter() - t0)
    return len(ids) / tp, 1.0 / float(np.mean(ts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--what", choices=("half", "view"), required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    a, b = load_pair(args.model, args.what, args.threads)
    ids = np.random.default_rng(0).integers(100, 30000, 256).astype(np.int32)
    run(a, ids, 16), run(b, ids, 16)  # compile / warm
    for _ in range(args.rounds):
        ra, rb = run(a, ids), run(b, ids)
        print("default: prefill %.1f decode %.1f | alternative: prefill %.1f decode %.1f tok/s"
              % (ra + rb), flush=True)


if __name__ == "__main__":
    main()
