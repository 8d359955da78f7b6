"""CPU a waiting server burns between requests: the cost of the OpenMP wait policy.

usage:
  python benchmarks/idle_cpu.py [-m smollm2-135m-instruct] [--threads 2] [--idle 10]

Starts ``edgeinfer serve`` in its own process, sends one completion (64 tokens, greedy)
through the official openai client, waits 1 s, then reads the server process's CPU time
(utime + stime of ``/proc/PID/stat``) across ``--idle`` seconds with no request. Prints
one JSON object: ``idle_cpu_frac`` (CPU seconds / wall seconds; 1.0 = one core busy),
``generate_s`` (the request's wall time) and ``omp_wait_policy_env`` (this process's
``OMP_WAIT_POLICY``, which the server inherits).
Linux only (reads /proc).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--idle", type=float, default=10.0)
    a = ap.parse_args(argv)
    from openai import OpenAI

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "-m", a.model, "--port",
                             str(port), "--threads", str(a.threads), "--quiet"], cwd=ROOT)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 600
        while True:
            try:
                client.models.list()
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("server did not start")
                time.sleep(0.5)
        t0 = time.perf_counter()
        client.completions.create(model=a.model, prompt="Once upon a time", max_tokens=64,
                                  temperature=0)
        gen = time.perf_counter() - t0
        time.sleep(1.0)
        c0, w0 = _cpu_s(proc.pid), time.perf_counter()
        time.sleep(a.idle)
        frac = (_cpu_s(proc.pid) - c0) / (time.perf_counter() - w0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(json.dumps({"model": a.model, "threads": a.threads, "idle_s": a.idle,
                      "idle_cpu_frac": round(frac, 4), "generate_s": round(gen, 3),
                      "omp_wait_policy_env": os.environ.get("OMP_WAIT_POLICY", "<unset>")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
