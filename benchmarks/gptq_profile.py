"""Where a GPTQ convert's time goes: wall seconds per phase.

usage:
  python benchmarks/gptq_profile.py MODEL --calib TEXT [-o OUT.eif] [--layers N]

Runs :func:`edgeinfer.quant.convert.convert` (method gptq) with timers wrapped around
its phases: calibration ids (tokenize), the capture forward of each layer (Hessian
accumulation included, also shown on its own), the backend ops of both forwards, the four
solves (wall of the pool; inside them, summed over worker threads: the factor, the
compiled block kernel), the propagating forward, and the final embedding table + write
(indented names are parts of a line above; ``linear`` includes the fused groups). Prints one JSON object.
``--layers N`` stops after N layers (no file written).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import threading
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--calib", required=True)
    ap.add_argument("-o", "--out", default="/tmp/gptq_profile.eif")
    ap.add_argument("--layers", type=int, default=None)
    a = ap.parse_args(argv)
    from edgeinfer.quant import calibrate as cal, convert as conv, gptq

    spent: dict[str, float] = collections.defaultdict(float)
    lock = threading.Lock()

    def timed(name, fn):
        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                with lock:
                    spent[name] += time.perf_counter() - t
        return wrapper

    conv.calibration_ids = timed("calibration_ids", conv.calibration_ids)
    cal.load_layer = timed("load_layer", cal.load_layer)
    run_layer = cal._run_layer

    def run_layer_t(be, cfg, lw, i, x, rope, stats=None):
        if a.layers is not None and i >= a.layers:
            raise StopIteration
        name = "forward_capture" if stats is not None else "forward_propagate"
        return timed(name, run_layer)(be, cfg, lw, i, x, rope, stats)

    cal._run_layer = run_layer_t
    gptq.Hessian.add = timed("  hessian_add (in capture)", gptq.Hessian.add)
    be_cls = cal.CalibrationBackend
    for op in ("attention", "linear", "glu", "rope", "rmsnorm"):
        setattr(be_cls, op, timed(f"  op {op} (both forwards)", getattr(be_cls, op)))
    gptq.Hessian.H = property(timed("hessian_H (in solves)", gptq.Hessian.H.fget))
    cal.gptq_quantize = timed("  gptq_quantize (threads summed)", cal.gptq_quantize)
    gptq.hessian_factor = timed("    hessian_factor", gptq.hessian_factor)
    kern = gptq._block_kernel()
    gptq._block_kernel = lambda: timed("    block_kernel", kern)
    pool_cls = cal._solver_pool

    def pool_t():
        p = pool_cls()
        p.run = timed("solves (pool wall)", p.run)
        return p

    cal._solver_pool = pool_t
    conv.write_eif = timed("write_eif", conv.write_eif)
    conv._table = timed("embed_table", conv._table)
    if os.path.exists(a.out):
        os.remove(a.out)
    src = a.model
    if not os.path.exists(src):
        from edgeinfer.catalog import catalog_source

        src = catalog_source(src, progress=False)
    t0 = time.perf_counter()
    try:
        conv.convert(src, a.out, method="gptq", calib_path=a.calib, progress=False)
    except StopIteration:
        pass
    total = time.perf_counter() - t0
    print(json.dumps({"total_s": round(total, 2), "load_avg": os.getloadavg(),
                      "phases_s": {k: round(v, 2) for k, v in spent.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
