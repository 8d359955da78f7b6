"""Numba's threading layer, started with edgeinfer's OpenMP wait policy, and the record of
what the process runs under.

The wait policy: Numba's OpenMP workers should sleep between parallel regions
(``PASSIVE``) rather than spin (libgomp's default spins ~300k iterations, a few ms, after
each region; ``ACTIVE`` spins for minutes): on a machine shared with other processes a
spinning worker burns the time slice its partner needs.

libgomp reads ``OMP_WAIT_POLICY`` once, from the C environment, when it is loaded
(``initialize_env`` in libgomp's ``env.c``, a library constructor), and offers no call to
change it later. Numba loads it when it starts its threading layer (``_launch_threads``
in ``numba/np/ufunc/parallel.py``, run by the first ``set_num_threads`` or parallel
call). So :func:`start_threads` puts ``OMP_WAIT_POLICY=PASSIVE`` in the environment
for exactly that call and removes it right after: the pool keeps PASSIVE, while
``os.environ`` (and so every subprocess, e.g. llama.cpp in the benchmark) is left as the
user had it. It applies nothing when the user set ``OMP_WAIT_POLICY`` (their value wins)
or when the runtime Numba will run on was already loaded, its policy fixed then (e.g.
torch imported first: its own libgomp sits in the global symbol scope and Numba binds to
it); the record says which of these happened.

The window in which the variable is set is one library load; a subprocess started by
another thread inside that window would inherit it (edgeinfer starts none).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import struct
import threading
from typing import NamedTuple

#: The policy edgeinfer applies to its own pool when the user did not choose one.
DEFAULT_WAIT_POLICY = "PASSIVE"
_VAR = "OMP_WAIT_POLICY"
#: OpenMP runtimes that read OMP_WAIT_POLICY when loaded (GNU, LLVM, Intel).
_OMP_LIBS = ("libgomp", "libomp", "libiomp5")


class ThreadingInfo(NamedTuple):
    """What Numba's parallel kernels run under in this process.

    ``layer``: Numba's threading layer (``"omp"``, ``"tbb"`` or ``"workqueue"``).
    ``wait_policy``: ``"PASSIVE"``, ``"ACTIVE"``, ``"default"`` (the OpenMP runtime's own:
    libgomp spins a few ms, then sleeps) or ``"n/a"`` (a layer without one).
    ``source``: ``"edgeinfer"`` (applied by :func:`start_threads`), ``"environment"``
    (the user's ``OMP_WAIT_POLICY``), ``"preloaded"`` (an OpenMP runtime was loaded
    before the layer started, so nothing could be applied) or ``"none"``.
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
            parallel._launch_threads()
        elif preloaded:
            policy, source = "default", "preloaded"
            parallel._launch_threads()
        else:
            policy, source = DEFAULT_WAIT_POLICY, "edgeinfer"
            os.environ[_VAR] = DEFAULT_WAIT_POLICY
            try:
                parallel._launch_threads()
            finally:
                os.environ.pop(_VAR, None)  # it was absent: leave it absent
        layer = numba.threading_layer()
        if layer != "omp":
            policy, source = "n/a", "none"
        _INFO = ThreadingInfo(layer, policy, source)
        return _INFO


def threading_info() -> ThreadingInfo:
    """The :class:`ThreadingInfo` of this process (starts the threading layer if needed)."""
    return _INFO if _INFO is not None else start_threads()
