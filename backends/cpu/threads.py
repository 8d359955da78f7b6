"""Numba's threading layer, started with the OpenMP runtime's own wait policy, and the
record of what the process runs under.

The wait policy: between parallel regions Numba's OpenMP workers either spin or sleep.
A decode step is ~60 regions a few microseconds apart; a sleeping worker (``PASSIVE``)
takes tens of microseconds to wake on this kind of VM, so the main thread does most of a
GEMV alone and two threads barely beat one. The runtime's default spins a bounded while
after each region, then sleeps (libgomp: ``GOMP_SPINCOUNT`` 300000 iterations, a few ms;
``initialize_env`` in libgomp's ``env.c``; LLVM's libomp: ``KMP_BLOCKTIME`` 200 ms): the
workers spin only while regions keep coming, i.e. while generating, and a waiting chat or
server costs nothing after those few ms. ``ACTIVE`` would spin for minutes.

So :func:`start_threads` leaves the policy to the runtime (the same default llama.cpp's
OpenMP gets) and never writes ``os.environ``; a user's ``OMP_WAIT_POLICY`` (or
``GOMP_SPINCOUNT``) is read by the runtime as given. The record says which applies, and
when the runtime Numba runs on was loaded before (e.g. torch imported first: its own
libgomp sits in the global symbol scope and Numba binds to it).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import struct
import threading
from typing import NamedTuple

_VAR = "OMP_WAIT_POLICY"
#: OpenMP runtimes that read OMP_WAIT_POLICY when loaded (GNU, LLVM, Intel).
_OMP_LIBS = ("libgomp", "libomp", "libiomp5")


class ThreadingInfo(NamedTuple):
    """What Numba's parallel kernels run under in this process.

    ``layer``: Numba's threading layer (``"omp"``, ``"tbb"`` or ``"workqueue"``).
    ``wait_policy``: ``"PASSIVE"``, ``"ACTIVE"``, ``"default"`` (the OpenMP runtime's own:
    libgomp spins a few ms after a region, then sleeps) or ``"n/a"`` (a layer without one).
    ``source``: ``"edgeinfer"`` (the pool started by :func:`start_threads`, on the
    runtime's default), ``"environment"`` (the user's ``OMP_WAIT_POLICY``),
    ``"preloaded"`` (an OpenMP runtime was loaded before the layer started, its settings
    fixed then) or ``"none"``.
    """

    layer: str
    wait_policy: str
    source: str


_INFO: ThreadingInfo | None = None
_LOCK = threading.Lock()


def elf_needed(path: str) -> list[str]:
    """The DT_NEEDED names of a little-endian ELF64 shared object ([] if not one)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:6] != b"\x7fELF\x02\x01":
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for _, sh_type, _, _, off, size, link, _, _, _ in secs:
        if sh_type != 6:  # SHT_DYNAMIC; its sh_link is the string table
            continue
        stroff = secs[link][4]
        for j in range(0, size, 16):
            tag, val = struct.unpack_from("<qQ", data, off + j)
            if tag == 1:  # DT_NEEDED
                out.append(data[stroff + val:data.index(b"\0", stroff + val)].decode())
    return out


def _omp_runtime_loaded() -> bool:
    """True when Numba's parallel regions would run on an OpenMP runtime that is already
    loaded (its policy is then fixed): one in the global symbol scope (e.g. torch's own
    ``libgomp``, loaded ``RTLD_GLOBAL`` with ``libtorch_global_deps``: Numba's ``omppool``
    binds to it), or the very file ``omppool`` links (``dlopen(RTLD_NOLOAD)`` matches a
    loaded object by name or file)."""
    try:
        if hasattr(ctypes.CDLL(None), "omp_get_num_threads"):  # dlsym in the global scope
            return True
    except OSError:
        pass
    spec = importlib.util.find_spec("numba.np.ufunc.omppool")
    if spec is None or not spec.origin or not hasattr(os, "RTLD_NOLOAD"):
        return False
    try:
        names = [n for n in elf_needed(spec.origin) if n.startswith(_OMP_LIBS)]
    except (OSError, struct.error, ValueError, IndexError, UnicodeDecodeError):
        return False
    for name in names:
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            return True
        except OSError:
            continue
    return False


def start_threads() -> ThreadingInfo:
    """Start Numba's threading layer (once per process) and return what it runs under.

    ``os.environ`` is the same after the call as before it.
    """
    global _INFO
    with _LOCK:
        if _INFO is not None:
            return _INFO
        import numba
        from numba.np.ufunc import parallel

        user = os.environ.get(_VAR)
        preloaded = bool(getattr(parallel, "_is_initialized", False)) or _omp_runtime_loaded()
        if user is not None:
            policy, source = user.strip().upper() or "default", "environment"
        elif preloaded:
            policy, source = "default", "preloaded"
        else:
            policy, source = "default", "edgeinfer"
        parallel._launch_threads()
        layer = numba.threading_layer()
        if layer != "omp":
            policy, source = "n/a", "none"
        _INFO = ThreadingInfo(layer, policy, source)
        return _INFO


def threading_info() -> ThreadingInfo:
    """The :class:`ThreadingInfo` of this process (starts the threading layer if needed)."""
    return _INFO if _INFO is not None else start_threads()
