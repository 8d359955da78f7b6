"""The backend that runs the calibration forwards (:mod:`.calibrate`): the reference ops
over whole fresh sequences, BLAS-fast, spread over a worker pool."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from ..backends.base import LinearGroup
from ..backends.reference import ReferenceBackend

#: Rows per call of :class:`CalibrationBackend`'s row-wise ops (a few hundred KB each).
OP_ROWS = 256
#: Rows per sgemm of :class:`CalibrationBackend`'s linears on the pool (many blocks per
#: call, so a worker slowed by another process is not waited for long).
LINEAR_ROWS = 2048


class CalibrationBackend(ReferenceBackend):
    """The reference backend for calibration forwards over whole fresh sequences
    (``start_pos == 0``), the same products and softmax as the reference, BLAS-fast:

    * attention by batched matmuls on the current K/V directly (nothing is kept in the
      cache); with :attr:`seq_len` set, a call of ``B * seq_len`` rows is ``B`` independent
      sequences of ``seq_len`` tokens (one matmul stack over KV heads per sequence: its
      scores stay in cache), so :func:`_run_layer` runs many sequences per call;
    * the row-wise ops (rmsnorm, rope, glu) in blocks of :data:`OP_ROWS` rows (temporaries
      in cache, not in memory: 3-8x faster on a chunk of 4096 rows, the same values);
    * q/k/v and gate/up as one GEMM on the rows stacked once at upload
      (:meth:`group_linears`), split into views;
    * with ``pool`` (a :class:`~edgeinfer.backends.cpu.gemm.GemmPool`), the row blocks
      (also the linears', :data:`LINEAR_ROWS`) and the sequences of the attention spread
      over its workers (one BLAS thread each; numpy releases the GIL): the same values,
      every block computed alone either way;
    * the ops' float32 outputs in reused buffers (:meth:`_new`).

    Any other call is the reference's."""

    def __init__(self, pool=None, **options):
        super().__init__(**options)
        self._masks: dict = {}
        self.seq_len: int | None = None
        self.pool = pool
        self._spares: list[np.ndarray] = []

    def _new(self, shape: tuple) -> np.ndarray:
        """An uninitialized float32 array of ``shape`` (every element is then written):
        a view of a kept 1-D buffer of that size that nothing else references any more
        (no reference, no reader: ``sys.getrefcount`` counts the views' bases too), else
        of a new one, kept. A layer's op outputs repeat in size, so after the first layer
        they reuse memory instead of faulting in fresh pages (tens of MB each, unmapped
        at every free: ``benchmarks/gptq_profile.py``'s fault counts)."""
        n = int(np.prod(shape))
        for buf in self._spares:
            # references: the list, the loop variable, the call's argument
            if buf.size == n and sys.getrefcount(buf) <= 3:
                return buf.reshape(shape)
        buf = np.empty(n, np.float32)
        self._spares.append(buf)
        return buf.reshape(shape)

    def add(self, a, b):
        if (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                and a.dtype == b.dtype == np.float32):
            return np.add(a, b, out=self._new(a.shape))
        return super().add(a, b)

    def _mask(self, t: int, window: int | None) -> np.ndarray:
        """Additive causal (and sliding-window) mask [t, t]: 0 where visible, -inf elsewhere."""
        masks = self._masks
        if (t, window) not in masks:
            pos = np.arange(t)
            visible = pos[None, :] <= pos[:, None]
            if window is not None:
                visible &= pos[None, :] > pos[:, None] - window
            masks[(t, window)] = np.where(visible, np.float32(0), np.float32(-np.inf))
        return masks[(t, window)]

    def group_linears(self, ws, biases):
        if len(ws) < 2:
            return super().group_linears(ws, biases)
        w = np.concatenate(ws, axis=0)  # [sum out_i, in]
        b = None
        if any(x is not None for x in biases):
            b = np.concatenate([np.zeros(len(wi), np.float32) if x is None else x
                                for wi, x in zip(ws, biases)])
        return _FusedGroup(tuple(ws), tuple(biases), w, b, tuple(len(wi) for wi in ws))

    def linear(self, x, w, bias=None):
        """``x [T, in] @ wᵀ (+ bias)``, float32; with a pool, in blocks of
        :data:`LINEAR_ROWS` rows spread over its workers (one BLAS thread each). The same
        values as one sgemm: OpenBLAS gives an output row the same bits in any row block
        (its blocking splits rows and columns, never a dot product's sum;
        ``tests/test_gptq_sequential.py``)."""
        if (self.pool is None or self.rows_alone or x.ndim != 2 or len(x) < 2 * LINEAR_ROWS
                or x.dtype != np.float32 or w.dtype != np.float32
                or (bias is not None and bias.dtype != np.float32)):
            return super().linear(x, w, bias)
        y = self._new((len(x), w.shape[0]))
        wt = w.T

        def block(r):
            s = slice(r, r + LINEAR_ROWS)
            np.matmul(x[s], wt, out=y[s])
            if bias is not None:
                y[s] += bias

        self._each(block, range(0, len(x), LINEAR_ROWS))
        return y

    def linear_many(self, x, group):
        if not isinstance(group, _FusedGroup):
            return super().linear_many(x, group)
        y = self.linear(x, group.fused, group.fused_bias)
        out, r = [], 0
        for n in group.sizes:
            out.append(y[:, r:r + n])
            r += n
        return out

    # row-wise ops in blocks of OP_ROWS rows: each block's temporaries stay in cache (the
    # values are the reference's: every row is computed alone)
    def _by_rows(self, fn, x, *rest):
        if len(x) <= OP_ROWS:
            return fn(x, *rest)
        y = fn(x[:OP_ROWS], *[a[:OP_ROWS] for a in rest])
        shape = (len(x),) + y.shape[1:]
        out = self._new(shape) if y.dtype == np.float32 else np.empty(shape, y.dtype)
        out[:OP_ROWS] = y

        def block(r):
            s = slice(r, r + OP_ROWS)
            out[s] = fn(x[s], *[a[s] for a in rest])

        self._each(block, range(OP_ROWS, len(x), OP_ROWS))
        return out

    def _each(self, fn, items) -> None:
        """``fn(item)`` for every item: on the pool's workers if there is one."""
        if self.pool is None:
            for it in items:
                fn(it)
        else:
            self.pool.run(fn, items)

    def rmsnorm(self, x, w, eps, unit_offset=False):
        return self._by_rows(lambda xs: super(CalibrationBackend, self).rmsnorm(
            xs, w, eps, unit_offset), x)

    def rope(self, x, cos, sin, positions):
        return self._by_rows(lambda xs, ps: super(CalibrationBackend, self).rope(
            xs, cos, sin, ps), x, positions)

    def glu(self, gate, up, act="silu"):
        if not (act == "silu" and gate.ndim == 2 and gate.shape == up.shape
                and gate.dtype == up.dtype == np.float32):
            return self._by_rows(lambda g, u: super(CalibrationBackend, self).glu(g, u, act),
                                 gate, up)
        out = self._new(gate.shape)

        def block(r):  # the reference's gate * (0.5 * (1 + tanh(0.5 gate))) * up, in place
            s = slice(r, r + OP_ROWS)
            o, g = out[s], gate[s]
            np.multiply(g, np.float32(0.5), out=o)
            np.tanh(o, out=o)
            o += np.float32(1.0)
            o *= np.float32(0.5)
            np.multiply(g, o, out=o)
            o *= up[s]

        self._each(block, range(0, len(gate), OP_ROWS))
        return out

    def attention(self, q, k, v, cache, layer, start_pos, scale, window=None, softcap=None):
        if start_pos != 0:
            return super().attention(q, k, v, cache, layer, start_pos, scale, window, softcap)
        rows, hq, hd = q.shape
        t = self.seq_len if self.seq_len and rows % self.seq_len == 0 else rows
        out = self._new((rows, hq, hd))
        self._mask(t, window)  # made once, before any worker needs it

        def one(r):  # one sequence at a time: its scores stay in cache
            s = slice(r, r + t)
            out[s] = self._attend_one(q[s], k[s], v[s], scale, window, softcap)

        self._each(one, range(0, rows, t))
        return out

    def _attend_one(self, q, k, v, scale, window, softcap):
        """Causal attention of one sequence: q [T, Hq, hd], k/v [T, Hkv, hd]."""
        t, hq, hd = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        # [Hkv, g*T, hd] @ [Hkv, hd, T]: per KV head, the products of its g query heads
        qg = np.ascontiguousarray(q.reshape(t, hkv, g, hd).transpose(1, 2, 0, 3))
        kt = np.ascontiguousarray(k.transpose(1, 2, 0))
        scores = np.matmul(qg.reshape(hkv, g * t, hd), kt).reshape(hkv, g, t, t)
        scores *= np.float32(scale)
        if softcap:
            scores = np.tanh(scores / softcap) * softcap
        scores += self._mask(t, window)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores, out=scores)
        p /= p.sum(axis=-1, keepdims=True)
        vt = np.ascontiguousarray(v.transpose(1, 0, 2))
        out = np.matmul(p.reshape(hkv, g * t, t), vt)  # [Hkv, g*T, hd]
        return out.reshape(hkv, g, t, hd).transpose(2, 0, 1, 3).reshape(t, hq, hd)


@dataclass(frozen=True, eq=False)
class _FusedGroup(LinearGroup):
    """A :class:`LinearGroup` with its members' rows stacked once (``fused [sum out_i,
    in]``, ``fused_bias`` or None) and their row counts ``sizes``."""

    fused: np.ndarray = None
    fused_bias: np.ndarray | None = None
    sizes: tuple = ()
