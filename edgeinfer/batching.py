"""Continuous batching: many sequences of one model generating at once.

Iteration-level scheduling (Orca, Yu et al. 2022; vLLM, Kwon et al. 2023): sequences join
and leave between model steps. Each step of the :class:`Scheduler`'s thread runs

* at most one prefill chunk (``chunk`` tokens, FIFO over the sequences prefilling), so
  a long new prompt is interleaved with the running decodes and their inter-token
  latency stays bounded (chunked prefill, Sarathi: Agrawal et al. 2023), then
* one batched decode step of every sequence waiting for its next token
  (:meth:`edgeinfer.models.transformer.Transformer.forward_batch`: each weight read
  once, attention per sequence over its own cache).

A sequence is a :class:`~edgeinfer.engine.Engine` of its own (a *slot*: its KV cache, its
cached ids for prefix reuse, its sampler) whose model is a :class:`ScheduledModel`: the
engine's ``forward`` calls, made on the caller's thread, are queued for the scheduler
and wait for their result. So sampling (a seeded RNG per request), stop conditions,
constrained output, cancellation and streaming are exactly :meth:`Engine.stream`'s, per
request, and a request's tokens do not depend on what else runs: the logits of a row of
a batched step are bit-identical to that sequence's step alone, and a prefill chunk's
logits do not depend on the chunk size (tests/test_cache_invariance.py) where every
linear is quantized. Dense float32 linears (an HF folder's weights; a GGUF tensor type
without a native kernel, e.g. some of Qwen2.5-Coder's and Gemma 3's ``down_proj``) run a
BLAS GEMM whose rows change by ulps with the chunk's rows (about 5e-6 on stories260K),
so there a sequence is chunked as alone (:func:`scheduler_chunk`), and a prefix-cache
hit can still differ from a cold prefill by that much, with or without batching.

KV memory: fixed slots, one preallocated cache of the full context per slot (the
memory plan, :func:`edgeinfer.memory.plan_memory`, counts them). Paged blocks
(PagedAttention) pay off when sequences of very different lengths share memory; with a
handful of local streams each of which may grow to the context, fixed slots cost the
same bytes, keep the attention kernels reading one contiguous cache, and need no block
table. Untouched cache pages are never faulted in, so RSS grows with the tokens a slot
has held, not with its capacity. A new request takes the free slot whose cached ids
share the longest prefix with its prompt (prefix reuse per slot).

Admission: :meth:`SlotPool.acquire` waits (FIFO by arrival, honouring ``cancel``) while
every slot is busy; the server adds its queue limit on top (503 + ``Retry-After``).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from .engine import Engine, common_prefix_len

#: prompt tokens one scheduler step prefills (a chunk), at most
DEFAULT_CHUNK = 128
#: seconds a step waits for every running sequence to ask for its next token
GATHER_S = 0.002
#: seconds the scheduler thread stays without any sequence before it exits
IDLE_EXIT_S = 2.0


def scheduler_chunk(transformer, prefill_chunk: int) -> int:
    """Prefill tokens per scheduler step: ``min(prefill_chunk, DEFAULT_CHUNK)`` when every
    linear is quantized (the CPU backend's integer kernels give a row the same bits
    whatever the chunk), else ``prefill_chunk`` itself: dense float32 linears run a BLAS
    GEMM whose rows depend on M, so a sequence is chunked as it would be alone."""
    from .models.families import LINEAR_KEYS

    dense = isinstance(transformer.lm_head, np.ndarray) or any(
        isinstance(lw.get(k), np.ndarray) for lw in transformer.layers for k in LINEAR_KEYS)
    return int(prefill_chunk) if dense else min(int(prefill_chunk), DEFAULT_CHUNK)


class _Work:
    """One forward call a slot is waiting for."""

    __slots__ = ("ids", "cache", "out", "kw", "done", "result", "error")

    def __init__(self, ids: np.ndarray, cache: Any, out, kw: dict):
        self.ids, self.cache, self.out, self.kw = ids, cache, out, kw
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None


class Scheduler:
    """The thread that runs one model's forward calls for many sequences, step by step.

    Args:
        transformer: the model (:class:`edgeinfer.models.transformer.Transformer`); its
            backend runs one forward at a time, on this thread only, once started.
        gather_s: seconds a step waits for the running sequences' decode requests.

    The thread starts on the first call and exits after ``IDLE_EXIT_S`` seconds without
    sequences, or at :meth:`close` (a daemon thread: it never keeps the process alive).
    """

    def __init__(self, transformer, gather_s: float = GATHER_S):
        self.transformer = transformer
        self.gather_s = float(gather_s)
        self._cond = threading.Condition()
        self._pending: list[_Work] = []
        self._running = 0  # sequences that will ask again (slots in use)
        self._thread: threading.Thread | None = None
        self._closed = False
        #: steps run, and of them the batched decode steps with B > 1 (for tests and logs)
        self.steps = 0
        self.batched_steps = 0
        self.max_batch = 0

    # ---- the callers' side -----------------------------------------------------------
    def forward(self, ids: np.ndarray, cache: Any, all_logits: bool = False,
                out: np.ndarray | None = None, long_rope: bool | None = None) -> np.ndarray:
        """``Transformer.forward`` run by the scheduler thread (blocks until done)."""
        ids = np.array(ids, dtype=np.int32).reshape(-1)  # a copy: the caller reuses its buffer
        kw = {}
        if all_logits:
            kw["all_logits"] = True
        if long_rope is not None:
            kw["long_rope"] = long_rope
        w = _Work(ids, cache, out, kw)
        with self._cond:
            if self._closed:
                raise RuntimeError("the model's scheduler is closed")
            self._pending.append(w)
            self._start()
            self._cond.notify_all()
        w.done.wait()
        if w.error is not None:
            raise w.error
        return w.result

    def sequence_started(self) -> None:
        with self._cond:
            self._running += 1

    def sequence_ended(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread once the queued calls are answered."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=30)

    # ---- the thread ------------------------------------------------------------------
    def _start(self) -> None:  # with self._cond held
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="edgeinfer-scheduler",
                                            daemon=True)
            self._thread.start()

    def _take(self) -> tuple[_Work | None, list[_Work]] | None:
        """Wait for work; returns (one prefill chunk or None, the decode calls), or None
        when closed and idle."""
        with self._cond:
            idle_since = time.monotonic()
            while not self._pending:
                if self._closed or (self._running == 0
                                    and time.monotonic() - idle_since > IDLE_EXIT_S):
                    self._thread = None  # idle: exit (the next call starts a new one), so
                    return None          # a dropped model is not kept alive by its thread
                self._cond.wait(0.5)
            deadline = time.monotonic() + self.gather_s
            while len(self._pending) < self._running:  # the others are sampling: wait a bit
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            prefill, decodes, rest = None, [], []
            for w in self._pending:
                if w.ids.shape[0] == 1 and not w.kw:
                    decodes.append(w)
                elif prefill is None:
                    prefill = w
                else:
                    rest.append(w)
            self._pending = rest
            return prefill, decodes

    def _loop(self) -> None:
        be = self.transformer.backend
        threads = getattr(be, "threads", None)
        if be.name == "cpu" and threads:  # Numba's thread count is per calling thread
            import numba
            numba.set_num_threads(threads)
        while True:
            got = self._take()
            if got is None:
                return
            prefill, decodes = got
            self.steps += 1
            if prefill is not None:
                self._run_one(prefill)
            if decodes:
                self._run_decodes(decodes)

    def _run_one(self, w: _Work) -> None:
        try:
            w.result = self.transformer.forward(w.ids, w.cache, out=w.out, **w.kw)
        except BaseException as e:  # handed to the waiting caller
            w.error = e
        w.done.set()

    def _run_decodes(self, ws: list[_Work]) -> None:
        b = len(ws)
        self.max_batch = max(self.max_batch, b)
        if b == 1:
            self._run_one(ws[0])
            return
        self.batched_steps += 1
        try:
            y = self.transformer.forward_batch(np.concatenate([w.ids for w in ws]),
                                               [w.cache for w in ws])
        except BaseException as e:
            for w in ws:
                w.error = e
                w.done.set()
            return
        for r, w in enumerate(ws):
            if w.out is not None:
                w.out[...] = y[r:r + 1]
                w.result = w.out
            else:
                w.result = y[r:r + 1].copy()
            w.done.set()


class ScheduledModel:
    """What a slot's :class:`Engine` sees as its model: the transformer's attributes,
    with ``forward`` run by the :class:`Scheduler`."""

    def __init__(self, scheduler: Scheduler):
        self._scheduler = scheduler
        self._tr = scheduler.transformer
        self.rope_switch = getattr(self._tr, "rope_switch", None)

    def forward(self, ids, cache, all_logits=False, out=None, long_rope=None):
        return self._scheduler.forward(ids, cache, all_logits, out, long_rope)

    def new_cache(self, max_tokens: int, dtype: str = "f32", max_chunk: int = 512):
        return self._tr.new_cache(max_tokens, dtype, max_chunk)

    def __getattr__(self, name):
        return getattr(self._tr, name)


class SlotPool:
    """``n`` sequence slots (engines with their own KV cache) over one scheduler.

    Args:
        transformer: the model; tokenizer: its tokenizer.
        n: slots (parallel sequences), >= 1.
        n_ctx: positions per slot's cache; kv_dtype: its storage.
        chunk: prefill tokens per scheduler step.
        first_cache: a cache to use for slot 0 (the model's existing one), or None.

    Caches are made when a slot is first used. Raises ValueError for ``n`` < 1.
    """

    def __init__(self, transformer, tokenizer, n: int, n_ctx: int, kv_dtype: str,
                 chunk: int = DEFAULT_CHUNK, first_cache: Any = None):
        if n < 1:
            raise ValueError(f"parallel must be at least 1, got {n}")
        self.scheduler = Scheduler(transformer)
        self.model = ScheduledModel(self.scheduler)
        self.tokenizer = tokenizer
        self.n = int(n)
        self.n_ctx, self.kv_dtype, self.chunk = n_ctx, kv_dtype, int(chunk)
        self._first_cache = first_cache
        self.slots: list[Engine | None] = [None] * self.n
        self._free = set(range(self.n))
        self._cond = threading.Condition()
        self._waiting: deque = deque()  # tickets of acquire() calls, FIFO

    def engine(self, i: int) -> Engine:
        """Slot ``i``'s engine (made on first use)."""
        e = self.slots[i]
        if e is None:
            cache = self._first_cache if i == 0 else None
            e = self.slots[i] = Engine(self.model, self.tokenizer, n_ctx=self.n_ctx,
                                       kv_dtype=self.kv_dtype, prefill_chunk=self.chunk,
                                       cache=cache)
        return e

    @property
    def in_use(self) -> int:
        """Slots generating now."""
        with self._cond:
            return self.n - len(self._free)

    @property
    def waiting(self) -> int:
        """acquire() calls waiting for a slot."""
        with self._cond:
            return len(self._waiting)

    def _best(self, ids: Sequence[int]) -> int:
        """The free slot whose cached ids share the longest prefix with ``ids`` (ties:
        the lowest index, so few caches are ever touched)."""
        best, best_n = None, -1
        for i in sorted(self._free):
            e = self.slots[i]
            n = 0 if e is None else common_prefix_len(e.cached_ids, ids)
            if n > best_n:
                best, best_n = i, n
        return best

    def cached_ids_for(self, ids: Sequence[int]) -> list[int]:
        """The cached ids of the slot (free or not) sharing the longest prefix with ``ids``."""
        best: list[int] = []
        n_best = -1
        for e in self.slots:
            if e is not None:
                n = common_prefix_len(e.cached_ids, ids)
                if n > n_best:
                    best, n_best = list(e.cached_ids), n
        return best

    def acquire(self, ids: Sequence[int], cancel: threading.Event | None = None,
                timeout: float | None = None) -> int | None:
        """Take a slot for a sequence with prompt ``ids``, waiting in arrival order while
        all are busy. Returns the slot index, or None when ``cancel`` was set (or
        ``timeout`` seconds passed) first."""
        ticket = object()
        t_end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._waiting.append(ticket)
            try:
                while not (self._free and self._waiting[0] is ticket):
                    if cancel is not None and cancel.is_set():
                        return None
                    if t_end is not None and time.monotonic() >= t_end:
                        return None
                    self._cond.wait(0.05)
                i = self._best(ids)
                self._free.discard(i)
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()
        self.engine(i)
        self.scheduler.sequence_started()
        return i

    def release(self, i: int) -> None:
        """Give slot ``i`` back (its cache keeps its ids for prefix reuse)."""
        self.scheduler.sequence_ended()
        with self._cond:
            self._free.add(i)
            self._cond.notify_all()

    def close(self) -> None:
        self.scheduler.close()


class held_slot:
    """``with held_slot(pool, i):`` waits for slot ``i`` to be free and holds it, e.g.
    for the warm-up, which drives slot 0's engine directly."""

    def __init__(self, pool: SlotPool, i: int):
        self.pool, self.i = pool, i

    def __enter__(self) -> Engine:
        p = self.pool
        with p._cond:
            while self.i not in p._free:
                p._cond.wait(0.05)
            p._free.discard(self.i)
        p.scheduler.sequence_started()
        return p.engine(self.i)

    def __exit__(self, *exc) -> None:
        self.pool.release(self.i)


def pooled_stream(pool: SlotPool, ids: list[int], cancel: threading.Event | None, **kw):
    """:meth:`Engine.stream` of ``ids`` on a slot of ``pool`` (``kw``: its keywords),
    waiting for a free slot first (a stream cancelled while waiting ends with
    "cancelled" and empty stats); the slot is given back when the stream ends or is
    closed."""
    from .engine import GenerationEvent, GenerationStats, peak_rss_mb

    i = pool.acquire(ids, cancel)
    if i is None:
        yield GenerationEvent(finish_reason="cancelled", stats=GenerationStats(
            prompt_tokens=len(ids), peak_rss_mb=peak_rss_mb()))
        return
    try:
        yield from pool.engine(i).stream(ids, cancel=cancel, **kw)
    finally:
        pool.release(i)
