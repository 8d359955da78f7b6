"""Adapts the thread count of Numba's parallel regions while generating (issue 16).

A decode step is ~60 parallel regions; a worker that another process keeps off its core
makes the main thread wait a time slice at each region's barrier.

Signals, read once per forward (their measured values: benchmarks/MEASUREMENTS.md):

* ``getrusage(RUSAGE_SELF)``: involuntary context switches per forward (not alone: one
  quiet long prefill forward has many) and CPU time / (wall x threads) (spinning workers
  keep it near 1 when nothing competes);
* ``/proc/loadavg``'s runnable count (``os.pread`` on a kept fd; system-wide, as
  ``os.cpu_count()``): whether a core is free again.

Policy: a generation (the first forward, or one after an idle gap of :data:`IDLE_S`)
starts on the cores the runnable count leaves free. Then a window (at least
:data:`WINDOW_S`) with both :data:`SWITCHES_PER_STEP` and utilization under
:data:`UTIL_MAX` is contended; :data:`DROP_WINDOWS` in a row drop the
count to the cores the others leave (at least one fewer). The first :data:`COLD_WINDOWS`
are not judged (the first forwards look contended while kernels load).
A probe back up needs :data:`RISE_WINDOWS` windows in a row with a free core and the
backoff since the last drop (:data:`BACKOFF_S`, doubled by each failed probe, reset by one
that holds); a probe meeting contention drops at once. With no free core seen, a probe
still comes :data:`BACKOFF_S` [1] after the backoff (others may run at a lower priority).
``EDGEINFER_CPU_ADAPT_THREADS=0``: off (the configured count always).
"""
from __future__ import annotations

import os
import resource
import time

ENV = "EDGEINFER_CPU_ADAPT_THREADS"
#: shortest window judged, seconds (several decode steps; a slow step is one by itself)
WINDOW_S = 0.05
#: involuntary switches per forward from which a window counts as contended
SWITCHES_PER_STEP = 2.0
#: process CPU time / (wall time * threads) under which a window counts as contended
UTIL_MAX = 0.85
#: contended windows in a row before dropping threads (2 were seen in a row at nice -20
#: beside a busy loop, where 2 threads still beat 1)
DROP_WINDOWS = 3
#: windows after construction left unjudged (first-use work looks like contention)
COLD_WINDOWS = 2
#: windows in a row with a free core before probing more threads
RISE_WINDOWS = 4
#: a gap between calls longer than this (idle between requests) starts a fresh window
IDLE_S = 0.5
#: backoff before a probe after a drop, seconds: (first, most)
BACKOFF_S = (1.0, 64.0)


def usage() -> tuple[int, float]:
    """The process's involuntary context switches and CPU seconds so far (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nivcsw, r.ru_utime + r.ru_stime


class LoadAvg:
    """The system's runnable task count from ``/proc/loadavg`` (the reader included), or
    None where the file is missing; the fd is opened once."""

    def __init__(self, path: str = "/proc/loadavg"):
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError:
            self.fd = None

    def __call__(self) -> int | None:
        if self.fd is None:
            return None
        try:
            b = os.pread(self.fd, 128, 0)
            i = b.index(b"/")
            return int(b[b.rindex(b" ", 0, i) + 1:i])
        except (OSError, ValueError):
            return None

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)


class ThreadGovernor:
    """Chooses the thread count of the parallel regions, 1..``max_threads``.

    Args:
        max_threads: the configured count (the user's ``--threads``): never exceeded.
        enabled: None reads :data:`ENV` (off when ``"0"``); always off for one thread.
        cpus: CPUs the runnable count covers (default ``os.cpu_count()``).
        clock / usage / runnable / get_threads / set_threads: injected for tests
            (default: ``time.monotonic``, :func:`usage`, :class:`LoadAvg`,
            Numba's per-thread get / set).

    ``drops`` / ``probes`` count the decisions taken.
    """

    def __init__(self, max_threads: int, enabled: bool | None = None, cpus: int | None = None,
                 clock=time.monotonic, usage=usage, runnable=None,
                 get_threads=None, set_threads=None):
        self.max = int(max_threads)
        if enabled is None:
            enabled = os.environ.get(ENV, "1").strip() != "0"
        self.enabled = bool(enabled) and self.max > 1
        self.n = self.max
        self.cpus = cpus or os.cpu_count() or self.max
        self._clock, self._usage = clock, usage
        self._runnable = runnable if runnable is not None else (
            LoadAvg() if self.enabled else (lambda: None))
        if get_threads is None or set_threads is None:
            import numba
            get_threads, set_threads = numba.get_num_threads, numba.set_num_threads
        self._get, self._set = get_threads, set_threads
        self._t0 = self._last = None  # window start, previous call
        self._sw0 = self._k = 0  # switches at the window's start, forwards in it
        self._cpu0 = 0.0  # CPU seconds at the window's start
        self._hot = self._free = 0  # contended / roomy windows in a row
        self._probing = False
        self._cold = COLD_WINDOWS
        self._backoff = BACKOFF_S[0]
        self._next_probe = 0.0
        self.drops = self.probes = 0

    def step(self) -> int:
        """Call before each forward, on the thread that runs the kernels: judges the window
        when due and sets that thread's Numba thread count to the decision. Returns it."""
        if self.enabled:
            now = self._clock()
            if self._t0 is None or now - self._last > IDLE_S:
                (self._sw0, self._cpu0), self._t0, self._k = self._usage(), now, 0
                self._start(now)
            elif now - self._t0 >= WINDOW_S:
                self._judge(now)
            self._last = now
            self._k += 1
        n = self.n
        if self._get() != n:
            self._set(n)
        return n

    def _judge(self, now: float) -> None:
        sw, cpu = self._usage()
        per = (sw - self._sw0) / max(1, self._k)
        util = (cpu - self._cpu0) / ((now - self._t0) * self.n)
        self._t0, self._sw0, self._cpu0, self._k = now, sw, cpu, 0
        if self._cold:
            self._cold -= 1
            return
        if self.n > 1 and per >= SWITCHES_PER_STEP and util < UTIL_MAX:
            self._hot += 1
            self._free = 0
            if self._probing or self._hot >= DROP_WINDOWS:
                self._drop(now)
            return
        self._hot = 0
        if self._probing:  # a clean window at the probed count: it holds
            self._probing = False
            self._backoff = BACKOFF_S[0]
            return
        if self.n >= self.max or now < self._next_probe:
            self._free = 0
            return
        room = self._room()
        if room is None or room > self.n:
            self._free += 1
        elif now >= self._next_probe + BACKOFF_S[1]:  # busy that long: probe blind (the
            room, self._free = None, RISE_WINDOWS     # others may be niced, say)
        else:
            self._free = 0
        if self._free >= RISE_WINDOWS:
            self._free = 0
            self._probing = True
            self.probes += 1
            self.n = self.max if room is None else min(self.max, room)

    def _start(self, now: float) -> None:
        """A generation starts (the first forward, or one after an idle gap): the workers
        sleep, so the runnable tasks besides this thread are the others'; start on the
        cores they leave (a short run would end before the windows judge a collapse)."""
        r = self._runnable()
        if r is None:
            return
        n = min(self.max, max(1, self.cpus - max(0, r - 1)))
        if n == self.n:
            return
        self._hot = self._free = 0
        self._probing = False
        if n < self.n:
            self.drops += 1
            self._next_probe = now  # the usual windows with a free core bring it back
        self.n = n

    def _room(self) -> int | None:
        """Threads the other runnable tasks leave a core for (None: unknown)."""
        r = self._runnable()
        if r is None:
            return None
        return self.cpus - max(0, r - self.n)

    def _drop(self, now: float) -> None:
        if self._probing:
            self._backoff = min(2 * self._backoff, BACKOFF_S[1])
        self._probing = False
        self._hot = self._free = 0
        room = self._room()
        self.n = max(1, min(self.n - 1, self.n if room is None else room))
        self._next_probe = now + self._backoff
        self.drops += 1
