"""Giving memory back to the OS: resident set size (RSS) without changing any result.

Used by the backends at upload and after forwards, and by :mod:`edgeinfer.api` after
loading (re-exported by :mod:`edgeinfer.memory`). No Numba here (importable anywhere).

* :func:`release_free_heap`: glibc ``malloc_trim`` (freed heap holes left by the
  tokenizer build, the weight repacking, the fused q|k|v / gate|up copies, prefill buffers);
* :func:`release_mapped_pages`: the pages of arrays that view a file mapping (an ``.eif``
  tensor once repacked, the rows an embedding lookup mapped);
* :func:`private_file_view`: a writable copy-on-write view of a read-only mapped tensor
  (an 8-bit embedding used in place, resident only where read);
* :func:`release_jit_compiler_pages`: the clean pages of LLVM, idle once the Numba
  kernels are loaded;
* :class:`ForwardReleaser`: when a backend calls them during generation.

What they save: benchmarks/MEASUREMENTS.md and the README's peak-RSS figures.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

# ---- giving memory back to the OS ----------------------------------------------------
_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # Linux; mmap.MADV_DONTNEED where Python exposes it
_libc_handle = None


def _libc():
    """The C library (``ctypes.CDLL``), or None where it cannot be loaded."""
    global _libc_handle
    if _libc_handle is None:
        try:
            _libc_handle = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:
            _libc_handle = False
    return _libc_handle or None


def release_free_heap() -> bool:
    """Return the free pages of the C heap to the OS (glibc ``malloc_trim(0)``).

    glibc keeps freed memory in the middle of its heaps and arenas mapped (only the top of
    a heap is trimmed by ``free``), so short-lived buffers of a few MB (tokenizer JSON
    parse, repacking temporaries, the member arrays replaced by a fused copy, prefill
    activations) stay in RSS after they die (tens of MiB; benchmarks/MEASUREMENTS.md).
    Cheap when there is nothing to give back. Nothing changes for the program: the pages are faulted in again (zeroed) if the allocator
    reuses them.

    Returns:
        True if ``malloc_trim`` ran (glibc), False elsewhere (musl, macOS, Windows).
    """
    libc = _libc()
    fn = getattr(libc, "malloc_trim", None) if libc is not None else None
    if fn is None:
        return False
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    fn(0)
    return True


def _buffer_map(a):
    """The ``mmap.mmap`` whose memory ndarray ``a`` views (``np.frombuffer`` of the map:
    the base chain ends in a memoryview of it), or None."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None


def _readonly_map(a):
    """The read-only (``ACCESS_READ``) ``mmap.mmap`` that ndarray ``a`` views, or None."""
    mm = _buffer_map(a)
    if mm is None:
        return None
    try:
        with memoryview(mm) as m:
            return mm if m.readonly else None  # ACCESS_READ: pages are never written
    except (ValueError, TypeError):  # closed map
        return None


def _vma_private_kb(addr: int) -> int | None:
    """``Anonymous`` (KiB: pages copied on write) of the mapping holding ``addr``, from
    ``/proc/self/smaps``; None if unknown."""
    hit = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=2)
                if "-" in head[0] and not head[0].endswith(":"):
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    hit = lo <= addr < hi
                elif hit and head[0] == "Anonymous:":
                    return int(head[1])
    except (OSError, ValueError):
        pass
    return None


def views_readonly_map(a) -> bool:
    """True if ndarray ``a`` views a read-only (``ACCESS_READ``) ``mmap`` (``.eif`` tensors)."""
    return _readonly_map(a) is not None


def private_file_view(a: np.ndarray) -> np.ndarray | None:
    """A writable copy-on-write view of the file bytes a read-only mapped array shows.

    ``a`` views a read-only ``mmap`` of a file (an ``.eif`` tensor, read-only: Numba
    compiles separate kernels for read-only arrays). This maps the same file range again
    with ``ACCESS_COPY`` (``MAP_PRIVATE``): the result is an ordinary writable ndarray of
    the same shape and values whose pages are the file's page-cache pages, resident only
    where they are read (an embedding lookup maps the page-cache folio holding its row: up
    to 2 MiB on a kernel with large folios; :func:`release_mapped_pages` unmaps them
    again); a write would make a private copy of that page and never reach the file.
    Linux (``/proc/self/maps`` names the file).

    Returns:
        the view (C-contiguous, ``a``'s dtype and shape), or None when ``a`` is not a
        C-contiguous view of a read-only file mapping or the file cannot be mapped again.
    """
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or a.size == 0:
        return None
    if _readonly_map(a) is None:
        return None
    addr = a.ctypes.data
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    if len(parts) < 6 or not parts[5].startswith("/"):
                        return None
                    path, file_off = parts[5].rstrip("\n"), int(parts[2], 16) + addr - lo
                    break
            else:
                return None
        start = file_off // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        with open(path, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), file_off - start + a.nbytes, access=mmap.ACCESS_COPY,
                           offset=start)
        v = np.frombuffer(mm, a.dtype, count=a.size, offset=file_off - start).reshape(a.shape)
    except (OSError, ValueError):
        return None
    # the same bytes? (the first and last rows: cheap, and catches a replaced file)
    if not (np.array_equal(v.reshape(-1)[:64], a.reshape(-1)[:64])
            and np.array_equal(v.reshape(-1)[-64:], a.reshape(-1)[-64:])):
        return None
    return v


def release_mapped_pages(*arrays) -> int:
    """Drop the resident pages of arrays that view a file mapping, keeping their values.

    ``MADV_DONTNEED`` on a file mapping none of whose pages was written only unmaps the
    pages: the next access maps them again from the page cache (or reads the file), so
    this is safe for an array still in use; it only costs a minor fault later. That holds
    for a read-only (``ACCESS_READ``) map by construction; a writable one (the
    copy-on-write views of :func:`private_file_view`) is released only while
    ``/proc/self/smaps`` shows no private (written) page in it, since those would be
    lost. Arrays that view no mapping (RAM arrays, None) are skipped. The range is
    widened to whole pages (the neighbours' pages are dropped too, equally safely).

    Args:
        *arrays: numpy arrays (or None).

    Returns:
        bytes advised (0 where nothing applied or the platform refuses).
    """
    done = 0
    for a in arrays:
        if a is None or not isinstance(a, np.ndarray) or a.size == 0:
            continue
        mm = _buffer_map(a)
        if mm is None or not hasattr(mm, "madvise"):
            continue
        try:
            if _readonly_map(a) is None and _vma_private_kb(a.ctypes.data) != 0:
                continue  # written (or unknown) pages of a private map: keep them
            start = np.frombuffer(mm, np.uint8, count=1).ctypes.data
            lo, hi = np.lib.array_utils.byte_bounds(a)
            lo = (lo - start) // _PAGE * _PAGE
            hi = min(-(-(hi - start) // _PAGE) * _PAGE, len(mm))
            if hi > lo:
                mm.madvise(getattr(mmap, "MADV_DONTNEED", _MADV_DONTNEED), lo, hi - lo)
                done += hi - lo
        except (OSError, ValueError, TypeError):
            continue
    return done


#: Shared libraries whose code is only run while Numba compiles or loads kernels.
JIT_LIBRARIES = ("libllvmlite",)


def release_jit_compiler_pages(names: tuple[str, ...] = JIT_LIBRARIES) -> int:
    """Drop the resident clean pages of the JIT compiler's shared library (LLVM).

    ``import numba`` maps llvmlite's statically linked LLVM (a ~150 MB file); loading the
    cached kernels pages in more of it (tens of MiB of RSS). Once the kernels are
    loaded LLVM is idle (calling a compiled kernel runs no LLVM code). Only mappings that
    are not writable and hold no private (copy-on-write) page are advised
    ``MADV_DONTNEED``: for them that drops clean file pages and nothing else, and code
    run again later (a kernel compiled for new argument types) is read back from the
    page cache. Linux only (``/proc/self/smaps``); elsewhere a no-op.

    Args:
        names: substrings of the library paths to release.

    Returns:
        bytes advised.
    """
    libc = _libc()
    fn = getattr(libc, "madvise", None) if libc is not None else None
    if fn is None:
        return 0
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    spans, cur = [], None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    path = head[5].strip() if len(head) > 5 else ""
                    cur = None
                    if path.startswith("/") and "w" not in head[1] and any(
                            n in os.path.basename(path) for n in names):
                        a, b = (int(x, 16) for x in head[0].split("-"))
                        cur = [a, b, False]
                        spans.append(cur)
                elif cur is not None and head[0] == "Anonymous:" and int(head[1]) != 0:
                    cur[2] = True  # a copy-on-write page (relocated data): never drop
    except OSError:
        return 0
    done = 0
    for a, b, private in spans:
        if not private and fn(a, b - a, _MADV_DONTNEED) == 0:
            done += b - a
    return done


class ForwardReleaser:
    """When a backend gives memory back during generation (one per backend instance).

    A backend calls :meth:`note_tokens` at the start of a forward (its embedding lookup)
    and :meth:`after_forward` at its end (its logits). After a multi-token forward (a
    prefill chunk: its [T, ...] activations were just freed) the heap is trimmed and the
    given mapped tables' pages are dropped; after each of the first ``warm_forwards``
    forwards (when the kernels are loaded and, on the CPU, the q|k|v and gate|up weights
    fused, freeing the member copies) the heap is trimmed and the JIT compiler's pages
    are dropped as well. Decode steps after those cost one attribute test.

    Within the first forward, :meth:`after_op` (called after each prefill linear op)
    trims the heap after every decoder layer (``layer_ops`` ops): that forward fuses each
    layer's q|k|v and gate|up weights on first use, freeing the member copies, and
    loads the kernels; after the first layer, which has loaded every kernel a layer
    uses, it also drops the JIT compiler's pages. Without this the first prefill peaked
    ~100 MiB above the steady state on Qwen2.5-0.5B (the freed copies of 24 layers).

    Args:
        warm_forwards: forwards after which the JIT compiler's pages are released.
        layer_ops: linear ops of one decoder layer (CPU backend: q|k|v, o, gate|up,
            down = 4).
    """

    def __init__(self, warm_forwards: int = 3, layer_ops: int = 4):
        self.warm_left = int(warm_forwards)
        self.layer_ops = max(1, int(layer_ops))
        self.ops = 0
        self.first = True  # the first forward is running (after_op counts)
        self.multi = False  # a multi-token forward is running
        self.due = True  # after_forward has work to do

    def after_op(self) -> None:
        """A prefill linear op of the first forward ended (see the class docstring)."""
        if not self.first:
            return
        self.ops += 1
        if self.ops % self.layer_ops == 0:
            release_free_heap()
            if self.ops == self.layer_ops:
                release_jit_compiler_pages()

    def note_tokens(self, n: int) -> None:
        """A forward of ``n`` tokens starts."""
        if n > 1:
            self.multi = self.due = True

    def after_forward(self, mapped: tuple = ()) -> None:
        """A forward ended: release what is due (see the class docstring).

        Args:
            mapped: arrays viewing a read-only file map whose pages a lookup touched
                (:func:`release_mapped_pages`; e.g. an embedding table left in the map).
        """
        if not self.due:
            return
        if self.multi or self.warm_left > 0:
            release_free_heap()
            release_mapped_pages(*mapped)
        if self.warm_left > 0:
            self.warm_left -= 1
            release_jit_compiler_pages()
        self.multi = self.first = False
        self.due = self.warm_left > 0
