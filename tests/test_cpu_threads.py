"""What the CPU backend runs under: its OpenMP wait policy (the runtime's default unless
the user sets one, never written to the environment, os.environ or a child process's,
and recorded truthfully) and the instruction path of each kernel family.

Each case runs in a fresh process (the policy is fixed when the OpenMP runtime loads).
The measure: CPU time the process burns while its main thread sleeps right after a
parallel kernel, as a fraction of the sleep: 20 ms naps (the gaps while generating:
libgomp's default spins a few ms after each region, 0.27-0.44 of such naps; sleeping
PASSIVE workers ~0.005; ACTIVE the whole nap) and one 1 s nap (a chat waiting for its
user: the default's few ms of spin are < 2% of it, ACTIVE spins through it). A spinning
worker only gets its share of a loaded machine's cores (~2 / load), so the lower bounds
on spinning are set low.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CASE = r"""
import ctypes, json, os, subprocess, sys, time
import numpy as np
if sys.argv[1] == "preload":  # Numba's OpenMP runtime loaded before edgeinfer's pool starts
    ctypes.CDLL("libgomp.so.1")
if sys.argv[1] == "torch":  # another copy of libgomp (torch's own file) loaded first
    import torch
before = dict(os.environ)
from edgeinfer.backends.cpu import CpuBackend, threading_info
be = CpuBackend(threads=2)
x, w = np.ones((64, 1024), np.float32), np.ones(1024, np.float32)
be.rmsnorm(x, w, 1e-5)  # the parallel row kernel (64 x 1024 >= _PAR_MIN_ELEMS)
idle, n, nap = 0.0, 25, 0.02
for _ in range(n):
    be.rmsnorm(x, w, 1e-5)
    c = time.process_time()
    time.sleep(nap)
    idle += time.process_time() - c
be.rmsnorm(x, w, 1e-5)
c = time.process_time()
time.sleep(1.0)
long_idle = time.process_time() - c
child = subprocess.run([sys.executable, "-c",
                        "import os; print(os.environ.get('OMP_WAIT_POLICY', '<unset>'))"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(json.dumps({"info": list(threading_info()), "idle_frac": idle / (n * nap),
                  "long_idle_frac": long_idle / 1.0,
                  "environ_unchanged": dict(os.environ) == before, "child": child}))
"""

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2,
    reason="needs 2 CPUs: with one, libgomp throttles spinning and ACTIVE looks like PASSIVE")


def _run(mode: str, **env_extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(NUMBA_NUM_THREADS="2", NUMBA_THREADING_LAYER="omp", **env_extra)
    r = subprocess.run([sys.executable, "-c", CASE, mode], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_default_policy_spins_while_generating_sleeps_when_waiting_and_leaves_env_alone():
    r = _run("clean")
    assert r["info"] == ["omp", "default", "edgeinfer"]
    assert r["idle_frac"] > 0.05, r  # workers still awake between close regions
    assert r["long_idle_frac"] < 0.02, r  # a waiting chat or server: asleep
    assert r["environ_unchanged"], r
    assert r["child"] == "<unset>", r


def test_users_passive_policy_sleeps_between_regions():
    r = _run("clean", OMP_WAIT_POLICY="PASSIVE")
    assert r["info"] == ["omp", "PASSIVE", "environment"]
    assert r["idle_frac"] < 0.025, r  # control for the default's spin above
    assert r["child"] == "PASSIVE", r


@pytest.mark.parametrize("first", ["preload", "torch"])
def test_a_runtime_loaded_earlier_keeps_its_default_and_the_record_says_so(first):
    # torch loads its own libgomp into the global symbol scope, where Numba binds to it.
    if first == "torch":
        pytest.importorskip("torch")
    r = _run(first)
    assert r["info"] == ["omp", "default", "preloaded"]
    assert r["idle_frac"] > 0.05, r
    assert r["environ_unchanged"], r
    assert r["child"] == "<unset>", r


def test_users_policy_wins_and_passes_through_unchanged():
    # positive control of the measure: spinning workers show up as idle CPU time
    r = _run("clean", OMP_WAIT_POLICY="active")
    assert r["info"] == ["omp", "ACTIVE", "environment"]
    assert r["idle_frac"] > 0.05, r
    assert r["long_idle_frac"] > 0.2, r  # control for the default's bound above
    assert r["environ_unchanged"], r
    assert r["child"] == "active", r


PATHS = r"""
import json
from edgeinfer.backends.cpu import _blockdot, _simd, gemv, kernel_paths
print(json.dumps({**kernel_paths(), "simd_kernel": _simd._ROWS is _simd.SIMD_ROWS,
                  "blockdot": gemv.q4_rows4 is _blockdot.BLOCKDOT_ROWS[4],
                  "blockdot8": gemv.q8_rows4 is _blockdot.BLOCKDOT_ROWS[4],
                  "blockdot5": gemv.q5_rows4 is _blockdot.BLOCKDOT_ROWS5[4]}))
"""


def _paths(**env_extra) -> dict:
    env = dict(os.environ, **env_extra)
    r = subprocess.run([sys.executable, "-c", PATHS], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_kernel_paths_report_what_was_chosen():
    import llvmlite.binding as llb

    p = _paths()
    assert p["gemv"] == ("avx2" if p["simd_kernel"] else "portable")
    assert ("gemv_q4" in p) == p["blockdot"] == p["blockdot8"] == p["blockdot5"]  # AMX
    if p["blockdot"]:
        assert p["gemv_q4"] == "avx2-blockdot" and p["qgemm_q4"] in ("amx", "avx2-blockdot")
        for b in (5, 8):
            assert p[f"gemv_q{b}"] == "avx2-blockdot" and p[f"qgemm_q{b}"] == p["qgemm_q4"]
        assert _paths(EDGEINFER_CPU_AMX="0")["qgemm_q4"] == "avx2-blockdot"
    assert p["numba"] == llb.get_host_cpu_name()
    assert p["gemm"].startswith("openblas:") and len(p["gemm"]) > len("openblas:")
    # the values follow the runtime's own choice, not a constant: force other choices
    forced = _paths(OPENBLAS_CORETYPE="Nehalem", NUMBA_CPU_NAME="generic")
    assert forced["gemm"] == "openblas:Nehalem"
    assert forced["numba"] == "generic"
