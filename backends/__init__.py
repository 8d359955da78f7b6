"""Compute backends behind one contract (:mod:`edgeinfer.backends.base`).

``reference`` (numpy, the oracle), ``cpu`` (Numba), ``opencl`` (pyopencl). Importing
this package imports neither numba nor pyopencl: :func:`get_backend` imports a backend
module only when it is asked for.
"""
from __future__ import annotations

import importlib

from .base import Backend

_BACKENDS = {
    "reference": ("edgeinfer.backends.reference", "ReferenceBackend"),
    "cpu": ("edgeinfer.backends.cpu", "CpuBackend"),
    "opencl": ("edgeinfer.backends.opencl", "OpenCLBackend"),
}

BACKEND_NAMES = tuple(_BACKENDS)


def get_backend(name: str, **options) -> Backend:
    """Instantiate a backend by name.

    Args:
        name: one of :data:`BACKEND_NAMES`.
        **options: backend-specific (``threads`` for cpu, ``device`` for opencl).

    Raises:
        ValueError: unknown name.
        edgeinfer.errors.BackendUnavailableError: the backend cannot run here.
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    mod, cls = _BACKENDS[name]
    return getattr(importlib.import_module(mod), cls)(**options)
