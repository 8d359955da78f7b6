"""What the parity tests (tests/test_ops.py, tests/test_forward.py) share: the one error
metric and the backends under test, by name."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest


def nmse(y, ref) -> float:
    """``||y - ref||² / ||ref||²`` in float64 (llama.cpp test-backend-ops' NMSE); 0 for two
    zero arrays, inf for a nonzero ``y`` against a zero ``ref``.

    Raises:
        AssertionError: the shapes differ or ``y`` is not finite.
    """
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    assert y.shape == ref.shape, (y.shape, ref.shape)
    assert np.isfinite(y).all(), "non-finite output"
    den = float(np.sum(ref * ref))
    num = float(np.sum((y - ref) ** 2))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


@functools.cache
def _backend_or_reason(name: str):
    if name == "reference":
        from edgeinfer.backends.reference import ReferenceBackend

        return ReferenceBackend(), None
    if name.startswith("cpu"):
        from edgeinfer.backends.cpu import CpuBackend

        return CpuBackend(exact_decode=name == "cpu-exact"), None
    try:
        from edgeinfer.backends.opencl import OpenCLBackend, OpenCLUnavailableError
    except ImportError as e:
        return None, f"pyopencl is not installed (pip install 'edgeinfer[opencl]'): {e}"
    try:
        be = OpenCLBackend()
    except OpenCLUnavailableError as e:
        return None, f"no usable OpenCL device: {e}"
    if name == "opencl-splitkv":
        be.caps = dataclasses.replace(be.caps, split_kv_chunk=16, split_kv_max_t=8)
    else:
        be.caps = dataclasses.replace(be.caps, fused=name == "opencl-fused")
    return be, None


def backend(name: str):
    """One shared instance per name: "reference", "cpu", "cpu-exact" (``exact_decode``),
    "opencl-fused" / "opencl-unfused" (row kernels and decode plan forced on / off),
    "opencl-splitkv" (split-KV attention forced, 16-key chunks); skips, naming why, when
    pyopencl or an OpenCL device is missing."""
    be, reason = _backend_or_reason(name)
    if be is None:
        pytest.skip(reason)
    return be
