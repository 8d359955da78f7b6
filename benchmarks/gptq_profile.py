"""Where a GPTQ convert's time goes: wall seconds per phase.

usage:
  python benchmarks/gptq_profile.py MODEL --calib TEXT [-o OUT.eif] [--layers N]
      [--n-calib N] [--calib-len L] [--float-hessians] [--no-act-order]

Runs :func:`edgeinfer.quant.convert.convert` (method gptq, act-order as the CLI's
default unless ``--no-act-order``) with timers wrapped around
its phases: calibration ids (tokenize); the default true-sequential pass of each layer
(one forward; inside it the Hessians and the solves, and in those the factor and the
compiled block kernel); with ``--float-hessians`` (``true_sequential=False``) the
capture forward (Hessian accumulation included), the four solves (summed over the pool's
threads), the propagating forward instead; the backend ops of all forwards; the final embedding table + write
(indented names are parts of a line above; ``linear`` includes the fused groups). Prints
one JSON object: wall seconds per phase, and the process's CPU seconds (all threads) in
total and per phase (phases that overlap on threads count each other's CPU), and the
process's minor page faults in total and per phase (the same overlap). ``--layers N`` stops after N layers (no
file written).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import threading
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--calib", required=True)
    ap.add_argument("-o", "--out", default="/tmp/gptq_profile.eif")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--n-calib", type=int, default=None)
    ap.add_argument("--calib-len", type=int, default=None)
    ap.add_argument("--float-hessians", action="store_true")
    ap.add_argument("--no-act-order", action="store_true")
    a = ap.parse_args(argv)
    from edgeinfer.quant import calibrate as cal, convert as conv, gptq, gptq_sequential as seq

    spent: dict[str, float] = collections.defaultdict(float)
    spent_cpu: dict[str, float] = collections.defaultdict(float)
    faults: dict[str, int] = collections.defaultdict(int)
    lock = threading.Lock()

    def cpu():
        t = os.times()
        return t.user + t.system

    def minflt():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def timed(name, fn):
        def wrapper(*args, **kw):
            t, c, f = time.perf_counter(), cpu(), minflt()
            try:
                return fn(*args, **kw)
            finally:
                with lock:
                    spent[name] += time.perf_counter() - t
                    spent_cpu[name] += cpu() - c
                    faults[name] += minflt() - f
        return wrapper

    conv.calibration_ids = timed("calibration_ids", conv.calibration_ids)
    cal.load_layer = timed("load_layer", cal.load_layer)
    run_layer = cal._run_layer

    def run_layer_t(be, cfg, lw, i, x, rope, stats=None, **kw):
        if a.layers is not None and i >= a.layers:
            raise StopIteration
        name = "forward_capture" if stats is not None else "forward_propagate"
        return timed(name, run_layer)(be, cfg, lw, i, x, rope, stats, **kw)

    cal._run_layer = run_layer_t
    layer_pass = seq.gptq_layer

    def layer_pass_t(be, cfg, lw, i, x, rope):
        if a.layers is not None and i >= a.layers:
            raise StopIteration
        return timed("layer_pass (true-sequential)", layer_pass)(be, cfg, lw, i, x, rope)

    seq.gptq_layer = layer_pass_t
    seq.SequentialGPTQBackend._quantize = timed("  hessian + solve (in pass)",
                                                 seq.SequentialGPTQBackend._quantize)
    gptq.Hessian.add = timed("  hessian_add", gptq.Hessian.add)
    be_cls = cal.CalibrationBackend
    for op in ("attention", "linear", "glu", "rope", "rmsnorm", "add"):
        setattr(be_cls, op, timed(f"  op {op} (both forwards)", getattr(be_cls, op)))
    gptq.Hessian.H = property(timed("  hessian_H", gptq.Hessian.H.fget))
    cal.gptq_quantize = timed("  gptq_quantize (threads summed)", cal.gptq_quantize)
    gptq.hessian_factor = timed("    hessian_factor", gptq.hessian_factor)
    kern = gptq._block_kernel()
    gptq._block_kernel = lambda: timed("    block_kernel", kern)
    conv.write_eif = timed("write_eif", conv.write_eif)
    conv._table = timed("embed_table", conv._table)
    if os.path.exists(a.out):
        os.remove(a.out)
    src = a.model
    if not os.path.exists(src):
        from edgeinfer.catalog import catalog_source

        src = catalog_source(src, progress=False)
    load = os.getloadavg()
    t0, c0, f0 = time.perf_counter(), os.times(), minflt()
    try:
        conv.convert(src, a.out, method="gptq", calib_path=a.calib, progress=False,
                     n_calib=a.n_calib, calib_len=a.calib_len,
                     act_order=not a.no_act_order, true_sequential=not a.float_hessians)
    except StopIteration:
        pass
    total, c1 = time.perf_counter() - t0, os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    print(json.dumps({"total_s": round(total, 2), "cpu_s": round(cpu, 2),
                      "minor_faults": minflt() - f0,
                      "load_avg_before": load, "load_avg_after": os.getloadavg(),
                      "phases_s": {k: round(v, 2) for k, v in spent.items()},
                      "phases_cpu_s": {k: round(v, 2) for k, v in spent_cpu.items()},
                      "phases_minor_faults": dict(faults)},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
