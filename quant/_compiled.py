"""The converter's numba kernels: compiled where numba imports, else plain Python."""
from __future__ import annotations

from collections.abc import Callable


def compiled(fn: Callable, **options) -> Callable:
    """``fn`` compiled by ``numba.njit`` (cached on disk, the GIL released, plus
    ``options``), or ``fn`` itself where numba is unavailable (slow, same values)."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency
        return fn
    return numba.njit(cache=True, nogil=True, **options)(fn)
