"""Where one prefill's time goes: wall time per Numba kernel (and how often it ran).

usage:
  python benchmarks/prefill_profile.py MODEL.eif [--tokens 1024] [--threads 2] [--kv int8]

Runs a warm-up prefill, then one timed prefill of the bench prompt (bench_cpu's
``prompt_ids``) with every Numba dispatcher call timed (wall clock around the call, so
a kernel's figure includes its dispatch; the Python between kernels is the remainder of
``total_s``). Prints one JSON object: ``tokens``, ``total_s``, ``prefill_tok_s`` and
``kernels`` {name: {"s": seconds, "calls": n}}, largest first.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cpu import prompt_ids  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv", default="int8")
    a = ap.parse_args(argv)
    from numba.core.dispatcher import Dispatcher, _DispatcherBase

    from edgeinfer.backends.cpu import CpuBackend
    from edgeinfer.container import read_eif
    from edgeinfer.models.transformer import Transformer

    src = read_eif(a.model)
    model = Transformer(src.config, src.tensors, CpuBackend(threads=a.threads), a.tokens + 8)
    ids = prompt_ids(model.cfg.vocab_size, a.tokens)
    model.forward(ids, model.new_cache(a.tokens + 8, a.kv))  # warm-up (compile, caches)
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def timed(self, *args, **kw):
        t = time.perf_counter()
        r = _DispatcherBase.__call__(self, *args, **kw)
        spent[self.py_func.__name__] += time.perf_counter() - t
        calls[self.py_func.__name__] += 1
        return r

    Dispatcher.__call__ = timed
    try:
        cache = model.new_cache(a.tokens + 8, a.kv)
        t0 = time.perf_counter()
        model.forward(ids, cache)
        total = time.perf_counter() - t0
    finally:
        del Dispatcher.__call__
    kernels = {k: {"s": round(v, 4), "calls": calls[k]}
               for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    print(json.dumps({"model": a.model, "tokens": a.tokens, "threads": a.threads, "kv": a.kv,
                      "total_s": round(total, 4), "prefill_tok_s": round(a.tokens / total, 1),
                      "kernels": kernels}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
