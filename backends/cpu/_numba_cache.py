"""Numba's on-disk cache for this package's kernels, keyed on every kernel source file.

Numba stamps a cached function with the content hash of its own source file only. A
kernel here calls kernels of other files (``gemv`` calls the IR row kernels of ``_simd``,
``plan`` calls ``fused``, ``kvquant`` ...), and Numba inlines or links their machine code
into the caller's cache entry; after an edit of a callee's file, the caller's entry
still matches its own file and serves the old callee. The locators installed here add
the hash of all ``*.py`` files of this directory to the stamp, so an edit of any kernel
file invalidates every kernel's entry (one recompile, never stale code).

Installed by :func:`install` before the kernel modules are imported (a dispatcher picks
its locator when it is decorated); functions of other packages keep Numba's locators.
Uses Numba's locator classes (``numba.core.caching``); where they are missing, nothing
is installed and Numba's own stamps apply (:func:`install` returns False).
"""
from __future__ import annotations

import functools
import hashlib
import os

KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def _tree_hash(directory: str, listing: tuple) -> bytes:  # listing: ((name, mtime, size), ...)
    h = hashlib.sha256()
    for name, _, _ in listing:
        with open(os.path.join(directory, name), "rb") as f:
            h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.digest()


def tree_stamp(directory: str = KERNEL_DIR) -> bytes:
    """sha256 over the names and contents of ``directory``'s ``*.py`` files (32 bytes);
    re-read when a file's mtime or size changes."""
    listing = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".py"):
            st = os.stat(os.path.join(directory, name))
            listing.append((name, st.st_mtime_ns, st.st_size))
    return _tree_hash(directory, tuple(listing))


def _in_kernel_dir(py_file: str) -> bool:
    return os.path.dirname(os.path.abspath(py_file)) == KERNEL_DIR


def _tree_stamped(base):
    """A subclass of Numba locator ``base`` for this directory's functions only, whose
    stamp is (the function file's stamp, :func:`tree_stamp`)."""

    class Locator(base):
        def get_source_stamp(self):
            return (super().get_source_stamp(), tree_stamp())

        @classmethod
        def from_function(cls, py_func, py_file):
            if not _in_kernel_dir(py_file):
                return None
            return super().from_function(py_func, py_file)

    Locator.__name__ = Locator.__qualname__ = "KernelTree" + base.__name__
    return Locator


_INSTALLED: list = []


def install() -> bool:
    """Put the tree-stamped locators first in Numba's locator list (idempotent).

    Returns:
        True if installed (now or before), False if this Numba lacks the classes used.
    """
    if _INSTALLED:
        return True
    try:
        from numba.core import caching
        bases = [caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                 caching.UserWideCacheLocator]
        registry = caching.CacheImpl._locator_classes
    except AttributeError:
        return False
    ours = [_tree_stamped(b) for b in bases]
    registry[:0] = ours
    _INSTALLED.extend(ours)
    return True
