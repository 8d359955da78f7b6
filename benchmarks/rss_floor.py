"""Resident memory of the runtime itself, before and after a model: what a model's peak
RSS cannot go below.

usage:
  python benchmarks/rss_floor.py [MODEL] [--ctx 2048]

Prints one JSON object: ``VmRSS`` (MiB) after the interpreter starts and after each import
(numpy, numba with llvmlite, ``edgeinfer.api``, the CPU backend, tokenizers); with MODEL (a
catalog name, ``.gguf`` or ``.eif``) also after loading it at ``--ctx``, after
``warm_up()`` (the kernels loaded from Numba's cache, or compiled) and after a 16-token
generation, each with the peak so far (``VmHWM``). Linux only (``/proc/self/status``).
"""
from __future__ import annotations

import argparse
import json


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--ctx", type=int, default=2048)
    a = ap.parse_args(argv)
    out = {"python": _status("VmRSS")}
    import numpy  # noqa: F401
    out["numpy"] = _status("VmRSS")
    import numba  # noqa: F401
    out["numba"] = _status("VmRSS")
    import edgeinfer.api  # noqa: F401
    out["edgeinfer.api"] = _status("VmRSS")
    from edgeinfer.backends.cpu import CpuBackend  # noqa: F401
    out["cpu_backend"] = _status("VmRSS")
    import tokenizers  # noqa: F401
    out["tokenizers"] = _status("VmRSS")
    if a.model:
        import edgeinfer
        m = edgeinfer.load(a.model, n_ctx=a.ctx)
        out["loaded"] = [_status("VmRSS"), _status("VmHWM")]
        m.warm_up()
        out["warm"] = [_status("VmRSS"), _status("VmHWM")]
        m.generate("Hello", max_tokens=16)
        out["generated"] = [_status("VmRSS"), _status("VmHWM")]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
