"""Where a decode step's time goes (``bench_cpu.py --profile``): per backend op, and
Python's share against the same compiled kernels replayed back to back."""
from __future__ import annotations

import statistics
import time

import numpy as np

from bench_cpu import prompt_ids


def profile_step(model, n_ctx: int, steps: int = 20, kv: str = "int8") -> dict:
    """Per-op wall time of decode steps (wrapping the backend's methods) vs the step time.

    With a compiled decode plan the step calls no backend op (except the attention op of
    f32 / f16 ring layers): run with ``--compose`` for the composition's breakdown."""
    be = model.backend
    ids = prompt_ids(model.cfg.vocab_size, n_ctx)
    cache = model.new_cache(n_ctx + 2 * steps + 4, kv)
    model.forward(ids, cache)
    ops = ["embed", "rmsnorm", "linear", "linear_many", "rope", "attention", "glu", "add",
           "logits"]
    acc = {o: 0.0 for o in ops}
    orig = {o: getattr(be, o) for o in ops}
    depth = [0]

    def wrap(o, f):  # outermost op only (logits / linear_many call linear)
        def g(*a, **k):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    acc[o] += time.perf_counter() - t
        return g
    t0 = time.perf_counter()
    for _ in range(steps):
        model.forward(np.array([5], np.int32), cache)
    plain = (time.perf_counter() - t0) / steps
    for o in ops:
        setattr(be, o, wrap(o, orig[o]))
    try:
        for _ in range(steps):
            model.forward(np.array([5], np.int32), cache)
    finally:
        for o in ops:
            delattr(be, o)
    per = {o: acc[o] / steps * 1e3 for o in ops}
    # floor: the same linear kernels called back to back without the model's Python
    from edgeinfer.backends.cpu import CpuQuantWeight
    from edgeinfer.backends.cpu.gemv import gemv_quant
    from edgeinfer.models.transformer import LINEAR_KEYS
    ws = [lw[k] for lw in model.layers for k in LINEAR_KEYS if k in lw] + [model.lm_head]
    xs = [np.random.default_rng(0).standard_normal(w.shape[1]).astype(np.float32) for w in ws]
    ys = [np.empty(w.shape[0], np.float32) for w in ws]
    t0 = time.perf_counter()
    for _ in range(steps):
        for w, x, y in zip(ws, xs, ys):
            if isinstance(w, CpuQuantWeight):
                gemv_quant(y, x, w, None, be.act_scratch)
            else:
                np.dot(w, x, out=y)
    floor = (time.perf_counter() - t0) / steps * 1e3
    return {"step_ms": plain * 1e3, "ops_ms": {k: round(v, 3) for k, v in per.items()},
            "linear_kernels_back_to_back_ms": round(floor, 3),
            "python_outside_ops_ms": round(plain * 1e3 - sum(per.values()), 3)}


def python_overhead(model, n_ctx: int, steps: int = 40, kv: str = "int8") -> dict:
    """Python's share of a decode step: step time minus the same compiled-kernel calls
    replayed back to back.

    Every call from Python into a Numba dispatcher during ``steps`` decode steps is
    recorded (dispatcher + arguments, by patching ``Dispatcher.__call__``), then
    replayed in a tight loop with the same arrays. The replay is the kernels' own time
    plus the unavoidable C-level dispatch; everything else in the step (the model's
    and the backend's Python, numpy temporaries, ufunc ops) counts as overhead.
    """
    from numba.core.dispatcher import Dispatcher, _DispatcherBase
    ids = prompt_ids(model.cfg.vocab_size, n_ctx)
    cache = model.new_cache(n_ctx + 3 * steps + 4, kv)
    model.forward(ids, cache)
    tok = np.array([5], np.int32)
    out = np.empty((1, model.cfg.vocab_size), np.float32)
    for _ in range(3):
        model.forward(tok, cache, out=out)
    rec = []
    orig = Dispatcher.__dict__.get("__call__")

    def call(self, *a, **k):
        rec.append((self, a, k))
        return _DispatcherBase.__call__(self, *a, **k)

    Dispatcher.__call__ = call
    try:
        model.forward(tok, cache, out=out)
    finally:
        if orig is None:
            del Dispatcher.__call__
        else:
            Dispatcher.__call__ = orig
    cache.length -= 1
    # steps and replays interleaved, so that a burst of other load hits both alike
    ts, cs, rs, rcs = [], [], [], []
    for _ in range(steps):
        n0 = cache.length
        t0, c0 = time.perf_counter(), time.process_time()
        model.forward(tok, cache, out=out)
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
        cache.length = n0  # the same position each time, as the replay
        t0, c0 = time.perf_counter(), time.process_time()
        for d, a, k in rec:
            d(*a, **k)
        rs.append(time.perf_counter() - t0)
        rcs.append(time.process_time() - c0)
    step, kern = statistics.median(ts), statistics.median(rs)
    cstep, ckern = statistics.median(cs), statistics.median(rcs)
    # CPU time (both threads) is far less sensitive than wall time to other processes
    # taking the cores: on a loaded machine read python_pct_cpu; the minima (least
    # disturbed step vs least disturbed replay) are the most load-robust wall figure
    return {"step_ms": round(step * 1e3, 3), "kernels_replayed_ms": round(kern * 1e3, 3),
            "kernel_calls": len(rec), "python_ms": round((step - kern) * 1e3, 3),
            "python_pct": round(100 * (step - kern) / step, 1),
            "step_cpu_ms": round(cstep * 1e3, 3), "kernels_replayed_cpu_ms": round(ckern * 1e3, 3),
            "python_pct_cpu": round(100 * (cstep - ckern) / cstep, 1),
            "step_min_ms": round(min(ts) * 1e3, 3), "kernels_replayed_min_ms": round(min(rs) * 1e3, 3),
            "python_pct_min": round(100 * (min(ts) - min(rs)) / min(ts), 1)}
