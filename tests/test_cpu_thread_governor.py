"""The CPU backend's thread governor (backends/cpu/governor.py, issue 16).

Policy tests drive :class:`ThreadGovernor` with a fake clock, switch counter and runnable
count (no sleeps, no real threads). Integration: the model calls it before every forward,
on the thread that runs the kernels (the engine's, the batching scheduler's), and its
decision reaches that thread's Numba thread count. Greedy tokens and logits of SmolLM2
are the same on 1 and 2 threads (the kernels' sums do not depend on the thread count).
"""
from __future__ import annotations

import threading

import numba
import numpy as np
import pytest
from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.backends.cpu import governor as gv
from edgeinfer.backends.cpu.governor import LoadAvg, ThreadGovernor


DT = 0.011  # seconds per fake forward: a 50 ms window is 5 of them, off its boundary


class Fake:
    """Signals a test sets: ``per`` involuntary switches per forward, ``util`` the share
    of wall time x threads the process runs (default: 0.5 when ``per`` says contended,
    else 1.0), ``others`` runnable tasks besides this process's threads; :meth:`run` makes
    forwards of ``dt`` seconds."""

    def __init__(self, others=0, per=0.0, util=None, seen_at_start=False):
        self.t, self.sw, self.others, self.per, self.util = 100.0, 0.0, others, per, util
        self.seen_at_start = seen_at_start  # the others runnable at a generation's start
        self.cpu = 0.0
        self.threads = 2
        self.sets = []
        self.gov = None

    def clock(self):
        return self.t

    def usage(self):
        return int(self.sw), self.cpu

    def runnable(self):  # the reader and its spinning workers count, as in /proc/loadavg
        g = self.gov
        if g._last is None or self.t - g._last > gv.IDLE_S:  # a start: the workers sleep
            return 1 + (self.others if self.seen_at_start else 0)
        return self.others + g.n

    def set_threads(self, n):
        self.sets.append(n)
        self.threads = n

    def make(self, max_threads=2, cpus=2, enabled=True, runnable=True):
        self.gov = ThreadGovernor(max_threads, enabled=enabled, cpus=cpus, clock=self.clock,
                                  usage=self.usage,
                                  runnable=self.runnable if runnable else (lambda: None),
                                  get_threads=lambda: self.threads,
                                  set_threads=self.set_threads)
        return self.gov

    def run(self, steps, dt=None):
        """``steps`` forwards; returns the thread counts they ran with."""
        out, dt = [], dt or DT
        for _ in range(steps):
            out.append(self.gov.step())
            self.t += dt
            self.sw += self.per
            util = self.util if self.util is not None else (
                0.5 if self.per >= gv.SWITCHES_PER_STEP else 1.0)
            self.cpu += util * dt * self.gov.n
        return out


def test_quiet_machine_keeps_all_threads_and_never_sets_again():
    f = Fake(per=0.5)  # a stray preemption every other step
    g = f.make()
    assert set(f.run(5000)) == {2}
    assert (g.drops, g.probes, f.sets) == (0, 0, [])


def test_contention_drops_to_the_free_cores_after_two_windows():
    f = Fake(others=1, per=9.0)  # one busy loop: a worker loses its core
    g = f.make()
    ran = f.run(35)
    # windows of 5 steps, the first two not judged (cold): the 3rd contended one ends at
    # step 25
    assert ran[:25] == [2] * 25 and set(ran[25:]) == {1}
    assert g.drops == 1 and f.sets == [1] and f.threads == 1


def test_a_generation_starts_on_the_free_cores():
    """A competitor runnable when a generation starts: the first forward already runs on
    the core it leaves (a short CLI run would end before the windows judge), and a later
    generation on a quiet machine starts on every core again."""
    f = Fake(others=1, per=0.4, seen_at_start=True)  # one thread beside a busy loop
    g = f.make()
    assert set(f.run(50)) == {1} and g.drops == 1 and f.sets == [1]
    f.others = 0
    f.t += 5.0  # idle, then a new request; the busy loop has ended
    assert set(f.run(50)) == {2} and f.sets == [1, 2]
    q = Fake(seen_at_start=True)  # nothing else runnable: no change
    q.make()
    assert set(q.run(50)) == {2} and q.sets == []


def test_two_contended_windows_alone_do_not_drop():
    f = Fake()
    g = f.make()
    f.run(10)  # the cold windows
    f.per = 9.0
    f.run(10)  # two windows of switches
    f.per = 0.0
    assert set(f.run(500)) == {2} and g.drops == 0


def test_switches_or_low_utilization_alone_do_not_drop():
    f = Fake(per=15.0, util=0.98)  # long quiet forwards: timer preemptions, threads busy
    g = f.make()
    assert set(f.run(300, dt=0.5)) == {2}
    f.per, f.util = 0.3, 0.4  # quiet, but the caller idles between forwards
    assert set(f.run(300)) == {2} and g.drops == 0
    f.per, f.util = 15.0, 0.55  # both: a worker waits for its core
    f.run(4, dt=0.5)
    assert g.n == 1


def test_drop_keeps_the_cores_left_free():
    f = Fake(others=0, per=0.9 * gv.SWITCHES_PER_STEP)  # just under the bar
    g = f.make(max_threads=4, cpus=4)
    assert set(f.run(200)) == {4}
    f.per, f.others = gv.SWITCHES_PER_STEP, 1
    f.run(16)  # judged at calls 205, 210 and 215
    assert g.n == 3  # 4 cores, one taken
    f.others = 2  # still contended, another core taken
    f.run(15)
    assert g.n == 2


def test_only_rare_blind_probes_while_the_cores_stay_busy():
    f = Fake(others=1, per=9.0)
    g = f.make()
    f.run(26)
    f.per = 0.4  # one thread beside a busy loop: it keeps its core
    ran = f.run(int(gv.BACKOFF_S[1] / DT))  # 64 s
    assert set(ran) == {1} and g.probes == 0 and f.sets == [1]
    f.per = 9.0  # what 2 threads meet beside the loop
    ran = f.run(int(1000 / DT))
    # a blind probe (one window of 5 steps) 64 s after the backoff, which doubles from
    # 1 s to 64 s: probes 1, 67, 135, 207, 287, 383, 511, 639, ... s in: ~0.05% of the steps
    assert 9 <= g.probes <= 11 and ran.count(2) == 5 * g.probes
    assert g.drops == g.probes + 1


def test_core_free_again_probe_after_backoff_and_hold():
    f = Fake(others=1, per=9.0)
    g = f.make()
    f.run(25)
    f.others, f.per = 0, 0.0  # the other process ended
    ran = f.run(200)
    # not before the backoff (1 s after the drop), then 4 roomy windows (200 ms)
    first = ran.index(2)
    t = (25 + first) * DT  # the drop: step 25
    assert 25 * DT + gv.BACKOFF_S[0] + gv.RISE_WINDOWS * 0.05 <= t <= 25 * DT + 1.3
    assert set(ran[first:]) == {2}
    assert g.probes == 1 and g.drops == 1 and f.sets == [1, 2]
    assert g._backoff == gv.BACKOFF_S[0]


def test_failed_probes_back_off_exponentially():
    f = Fake(others=1, per=9.0)
    g = f.make(runnable=False)  # no /proc/loadavg: backoff alone decides when to probe
    f.run(26)
    assert g.n == 1
    slow = []
    for _ in range(6):
        ran = f.run(int(200 / DT))  # 200 s under the busy loop
        slow.append(ran.count(2))
    # probes 1, 2, 4, ..., 64, 64, ... s after each drop (+ 4 windows): each runs one
    # window (5 steps) at 2 threads, meets the contention and drops at once
    assert g._backoff == gv.BACKOFF_S[1]
    assert sum(slow) == 5 * g.probes and g.drops == g.probes + 1
    assert 15 <= g.probes <= 30
    assert slow[-1] <= 5 * 4  # at most one probe per 64 s now: 0.1% of the steps


def test_idle_gap_starts_a_fresh_window():
    f = Fake()
    g = f.make()
    f.run(3)
    f.t += 30.0  # idle between requests while other work ran: switches piled up
    f.sw += 5000
    assert set(f.run(300)) == {2} and g.drops == 0


def test_off_switch_and_one_thread(monkeypatch):
    monkeypatch.setenv(gv.ENV, "0")
    f = Fake(others=1, per=20.0)
    f.threads = 1  # a thread that never set its count: step applies the configured one
    g = ThreadGovernor(2, clock=f.clock, usage=f.usage, runnable=lambda: 3,
                       get_threads=lambda: f.threads, set_threads=f.set_threads)
    f.gov = g
    assert not g.enabled
    assert set(f.run(1000)) == {2} and f.sets == [2]
    monkeypatch.setenv(gv.ENV, "1")
    assert ThreadGovernor(2, get_threads=int, set_threads=int).enabled
    assert not ThreadGovernor(1, get_threads=int, set_threads=int).enabled


def test_loadavg_reader(tmp_path):
    p = tmp_path / "loadavg"
    p.write_text("0.14 0.52 0.80 3/123 4567\n")
    r = LoadAvg(str(p))
    assert r() == 3
    p.write_text("1.00 1.00 1.00 12/345 99\n")
    assert r() == 12
    assert LoadAvg(str(tmp_path / "missing"))() is None
    real = LoadAvg()
    if real.fd is not None:
        assert real() >= 1  # this thread is running


# ---- integration -----------------------------------------------------------------------
def _contended(be):
    """Replace ``be``'s governor by one whose signals say: a core is taken (every call
    advances a fake clock 20 ms with 10 switches); returns the list of calling threads."""
    f = Fake(others=1)
    f.gov = ThreadGovernor(be.threads, enabled=True, cpus=2, clock=f.clock,
                           usage=f.usage, runnable=f.runnable)
    callers = []
    step = f.gov.step

    def counted():
        callers.append(threading.current_thread().name)
        f.t += 0.02
        f.sw += 10
        return step()

    f.gov.step = counted
    be.governor = f.gov
    return callers


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")
def test_engine_and_scheduler_call_the_governor_on_the_kernel_thread(stories_q):
    from edgeinfer.batching import Scheduler
    from edgeinfer.engine import Engine
    from edgeinfer.models.transformer import Transformer

    be = CpuBackend(threads=2)
    tr = Transformer(stories_q.config, stories_q.tensors, be, 128)
    callers = _contended(be)
    eng = Engine(tr, None, n_ctx=128, kv_dtype="int8", prefill_chunk=8)
    prompt = list(range(5, 25))
    logits, _ = eng.prefill(prompt)
    tok = int(np.argmax(logits))
    for _ in range(14):
        tok = int(np.argmax(eng.decode_one(tok)))
    # 3 prefill chunks of 8, 14 decode steps; windows of 3 calls, 2 cold, the 3rd
    # contended one judged at call 15
    assert len(callers) == 3 + 14
    assert be.governor.drops == 1 and numba.get_num_threads() == 1
    numba.set_num_threads(2)

    sched = Scheduler(tr)
    try:
        callers.clear()
        c = tr.new_cache(128, "int8")
        sched.forward(np.array(prompt, np.int32), c)
        sched.forward(np.array([tok], np.int32), c)
        assert callers == ["edgeinfer-scheduler"] * 2
    finally:
        sched.close()


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")
def test_greedy_smollm2_same_tokens_and_logits_on_1_and_2_threads(smollm2):
    from edgeinfer.engine import Engine
    from edgeinfer.models.transformer import Transformer

    be = CpuBackend(threads=2)
    tr = Transformer(smollm2.config, smollm2.tensors, be, 256)
    eng = Engine(tr, None, n_ctx=256, kv_dtype="int8", prefill_chunk=16)
    prompt = list(np.random.default_rng(0).integers(100, 30000, 40))
    runs = {}
    for n in (1, 2, 1):
        be.governor.enabled, be.governor.n = False, n
        eng.reset()
        logits, _ = eng.prefill(prompt)
        assert numba.get_num_threads() == n
        rows, ids = [logits.copy()], []
        for _ in range(24):
            ids.append(int(np.argmax(rows[-1])))
            rows.append(eng.decode_one(ids[-1]).copy())
        runs.setdefault(n, []).append((ids, np.stack(rows)))
    numba.set_num_threads(2)
    (ids1, l1), (ids1b, l1b) = runs[1]
    ids2, l2 = runs[2][0]
    assert ids1 == ids2 == ids1b
    np.testing.assert_array_equal(l1, l2)
    np.testing.assert_array_equal(l1, l1b)
