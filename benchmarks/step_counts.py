"""Operation counts of one warm decode step and one prefill chunk: a timing proxy that a
loaded machine cannot disturb.

Per (model, backend, KV dtype): calls into Numba dispatchers (the kernels a step runs,
counted by patching ``Dispatcher.__call__`` as ``bench_cpu.py``'s ``python_overhead``
does), Python-level function calls and calls of C functions (``sys.setprofile``
"call" / "c_call" events), and OpenCL kernel launches (``OpenCLBackend.launches``).

    python benchmarks/step_counts.py [--models stories-q4,...] [--backends cpu,opencl]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forward_hashes import PROMPT, backend, models  # noqa: E402


def count(fn):
    """(numba dispatcher calls, python calls, c calls) while ``fn()`` runs."""
    from numba.core.dispatcher import Dispatcher, _DispatcherBase
    n_nb = [0]
    ev = {"call": 0, "c_call": 0}
    orig = Dispatcher.__dict__.get("__call__")

    def call(self, *a, **k):
        n_nb[0] += 1
        return _DispatcherBase.__call__(self, *a, **k)

    def prof(frame, event, arg):
        if event in ev:
            ev[event] += 1

    Dispatcher.__call__ = call
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if orig is None:
            del Dispatcher.__call__
        else:
            Dispatcher.__call__ = orig
    # the patched __call__ itself is one Python call per kernel, not the step's own
    return n_nb[0], ev["call"] - n_nb[0], ev["c_call"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="stories-q4,stories-f32,smollm2-int4,smollm2-gguf,"
                                        "gemma3-int4,tiny-gemma-q4-ring,tiny-qwen2-q4")
    ap.add_argument("--backends", default="cpu,opencl")
    ap.add_argument("--kv", default="f32,int8,int4")
    ap.add_argument("--cache", default=str(Path(__file__).resolve().parents[1] / ".cache"
                                           / "forward_hashes"))
    args = ap.parse_args(argv)
    from edgeinfer.models.transformer import Transformer
    table = models(Path(args.cache))
    print("model backend kv | decode: numba python c_calls launches | "
          "prefill(12): numba python c_calls launches")
    for name in args.models.split(","):
        load, chunk = table[name]
        cfg, tensors = load()
        for bname in args.backends.split(","):
            be = backend(bname)
            m = Transformer(cfg, tensors, be, 256)
            for kv in args.kv.split(","):
                prompt = np.array([t % cfg.vocab_size for t in PROMPT[:min(12, chunk)]],
                                  np.int32)
                cache = m.new_cache(128, kv, chunk)
                out = np.empty((1, cfg.vocab_size), np.float32)
                ids = np.array([5], np.int32)
                for _ in range(2):  # warm: compiled kernels, prepared steps
                    cache.reset()
                    m.forward(prompt, cache)
                    for _ in range(3):
                        m.forward(ids, cache, out=out)
                l0 = getattr(be, "launches", 0)
                dec = count(lambda: m.forward(ids, cache, out=out))
                l1 = getattr(be, "launches", 0)
                cache.reset()
                pre = count(lambda: m.forward(prompt, cache))
                l2 = getattr(be, "launches", 0)
                print(f"{name} {bname} {kv} | {dec[0]} {dec[1]} {dec[2]} {l1 - l0} | "
                      f"{pre[0]} {pre[1]} {pre[2]} {l2 - l1}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
