"""The backend contract: memory, single ops, and one optional hook.

The model (:mod:`edgeinfer.models.block`, :mod:`edgeinfer.models.transformer`) is
written as calls of the single ops. Every op is output-returning and documents its
shapes; tensors are whatever the backend's ``upload`` returned ("handles"), host numpy
arrays for the reference and CPU backends, device buffers for OpenCL. Only
:meth:`Backend.to_host` brings data back. The numpy reference backend defines the
semantics; every other backend is tested against it op by op and on whole models.

The hook, :meth:`Backend.compile_decode`, may turn the model's decode step
(:class:`DecodeStep`: embedding, :class:`DecoderBlock` s, logits) into a
:class:`DecodePlan` for one KV cache: built once, held by the model, equal to the
composition it replaces. Without one the model composes the ops.

Shapes use: T tokens in this call, D hidden, Hq / Hkv query / KV heads, hd head dim,
F intermediate, V vocab.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from .quantized import QuantizedTensor


@dataclass(frozen=True, eq=False)
class LinearGroup:
    """Linears that share one input (q/k/v, gate/up), as :meth:`Backend.group_linears`
    prepared them for :meth:`Backend.linear_many`. ``weights`` [out_i, in] and ``biases``
    ([out_i] or None) are the handles to use from now on (a backend may make them views
    of one fused copy); backends may subclass it to hold their fused form."""

    weights: tuple
    biases: tuple


@dataclass(frozen=True, eq=False)
class DecoderBlock:
    """What one pre-norm decoder block computes: its uploaded tensors and switches.

    The math is :func:`edgeinfer.models.block.block_forward`; a backend may compile the
    block into a plan (:meth:`Backend.compile_decode`). Plain (Llama, SmolLM2, Qwen2,
    Mistral) unless the optional norms are set (Gemma 3).

    Handles: ``input_norm``, ``mlp_norm`` (the norm before the MLP) [D]; ``qkv`` (Wq
    [Hq hd, D], Wk, Wv [Hkv hd, D] and their biases) and ``gate_up`` (Wg, Wu [F, D]) as
    :class:`LinearGroup`; ``wo`` [D, Hq hd], ``w_down`` [D, F]; ``cos``, ``sin`` RoPE
    tables [max_pos, r/2]. Switches: ``heads`` (Hq, Hkv, hd), ``eps``, ``unit_offset``
    (norms scale by 1 + w), ``scale`` (attention score multiplier), ``window`` (None =
    global), ``softcap`` (None = off), ``act`` ("silu" or "gelu_tanh"). Optional norms
    (None = absent): ``q_norm`` / ``k_norm`` [hd] (QK-norm per head, before RoPE),
    ``attn_out_norm`` / ``mlp_out_norm`` [D] (sandwich norms on the branch outputs,
    before each residual add). Compared by identity.
    """

    input_norm: Any
    qkv: LinearGroup
    cos: Any
    sin: Any
    wo: Any
    mlp_norm: Any
    gate_up: LinearGroup
    w_down: Any
    heads: tuple
    eps: float
    unit_offset: bool
    scale: float
    window: int | None
    softcap: float | None
    act: str
    q_norm: Any = None
    k_norm: Any = None
    attn_out_norm: Any = None
    mlp_out_norm: Any = None

    @property
    def plain(self) -> bool:
        """No QK-norm and no sandwich norms."""
        return (self.q_norm is None and self.k_norm is None and self.attn_out_norm is None
                and self.mlp_out_norm is None)


@dataclass(frozen=True, eq=False)
class DecodeStep:
    """What one decode step computes, for :meth:`Backend.compile_decode`:
    ``x = embed[id] * embed_scale``, each of ``blocks``, then the logits
    ``softcap(rmsnorm(x, norm) @ head.T)``. ``eps`` and ``unit_offset`` are the final
    norm's; ``softcap`` None = off."""

    embed: Any
    embed_scale: float
    blocks: tuple
    norm: Any
    eps: float
    unit_offset: bool
    head: Any
    softcap: float | None


class DecodePlan(ABC):
    """A decode step compiled by a backend for one model and one KV cache (built once, held
    by the model); it must equal the model's composition of single ops. It may hold the
    cache's arrays but not the cache object, which it is given at each step (the model
    maps caches to plans weakly, so a plan dies with its cache)."""

    @abstractmethod
    def run(self, ids: np.ndarray, positions: np.ndarray, cache: Any,
            out: np.ndarray | None) -> np.ndarray:
        """Logits float32 [1, V] of token ``ids`` (int32 [1]) at ``positions`` (int32 [1]),
        appending its K/V to ``cache`` (the one the plan was compiled for; ``length`` is
        the caller's to advance); written into ``out`` (float32 [1, V]) when given.

        Raises:
            ValueError: the position does not fit in the cache.
        """


class Backend(ABC):
    """Abstract compute backend. Subclasses: reference, cpu, opencl."""

    name: str = "abstract"

    # ---- memory ----------------------------------------------------------------------
    @abstractmethod
    def upload(self, a: np.ndarray) -> Any:
        """Upload a dense float32 tensor (norm weights, biases, RoPE tables)."""

    @abstractmethod
    def upload_weight(self, w: np.ndarray | QuantizedTensor) -> Any:
        """Upload a linear weight ``[out, in]``, dense float32 or quantized; may repack."""

    def upload_embedding(self, w: np.ndarray | QuantizedTensor) -> Any:
        """Upload an embedding table ``[V, D]``; the handle must also work in :meth:`linear`
        (tied output head). Default: same as :meth:`upload_weight`."""
        return self.upload_weight(w)

    def group_linears(self, ws: list[Any], biases: list[Any | None]) -> LinearGroup:
        """Uploaded weights ``ws`` [out_i, in] and biases sharing one input, prepared for
        :meth:`linear_many`; the caller uses the group's handles instead of ``ws`` from
        then on (which are not modified). Default: the handles as they are."""
        return LinearGroup(tuple(ws), tuple(biases))

    @abstractmethod
    def to_host(self, t: Any) -> np.ndarray:
        """Copy a tensor back as a numpy array."""

    @abstractmethod
    def new_kv_cache(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int,
                     dtype: str = "f32", window_sizes: list[int | None] | None = None,
                     max_chunk: int = 512) -> Any:
        """Preallocate a KV cache of ``max_tokens`` positions per layer.

        ``window_sizes`` (per layer, None = global) lets a backend keep only the
        ``window - 1 + max_chunk`` most recent positions of a sliding-window layer (a
        ring); ``max_chunk`` is the most tokens one forward call appends.
        The returned object has ``max_tokens``, ``length`` (tokens held), ``nbytes``,
        ``reset()`` and ``trim(n)`` (keep the first ``n`` positions; a ring that no
        longer holds what the kept prefix needs resets to length 0)."""

    # ---- ops -------------------------------------------------------------------------
    @abstractmethod
    def embed(self, table: Any, ids: np.ndarray, scale: float = 1.0) -> Any:
        """x[T, D] = table[ids] * scale; ``ids`` int32 [T] on the host."""

    @abstractmethod
    def rmsnorm(self, x: Any, w: Any, eps: float, unit_offset: bool = False) -> Any:
        """y[T, N] = x / sqrt(mean(x**2) + eps) * (w or 1 + w), math in float32.

        Applied over the last axis; ``x`` may also be [T, H, hd] (QK-norm per head)."""

    @abstractmethod
    def linear(self, x: Any, w: Any, bias: Any | None = None) -> Any:
        """y[T, out] = x[T, in] @ W[out, in].T (+ bias[out]); W dense or quantized."""

    def linear_many(self, x: Any, group: LinearGroup) -> list[Any]:
        """[x @ W_i.T (+ b_i) for each member i of ``group``] (q/k/v, gate/up sharing one
        input). Backends override it to read x once and dispatch once."""
        return [self.linear(x, w, b) for w, b in zip(group.weights, group.biases)]

    # ---- the one optional hook ----------------------------------------------------------
    def compile_decode(self, step: DecodeStep, cache: Any) -> DecodePlan | None:
        """A plan for decode steps (T = 1) of ``step`` over ``cache``, or None (the
        default): the model then composes the single ops. Called once per cache; a plan
        decides there whether its fast path applies."""
        return None

    @abstractmethod
    def rope(self, x: Any, cos: Any, sin: Any, positions: np.ndarray) -> Any:
        """Rotate x[T, H, hd] by position (NeoX / rotate-half pairing (i, i + r/2)).

        ``cos``/``sin`` are tables [max_pos, r/2] (r = rotary dims, r <= hd; dims >= r
        pass through unchanged); ``positions`` int32 [T] on the host."""

    @abstractmethod
    def attention(self, q: Any, k: Any, v: Any, cache: Any, layer: int, start_pos: int,
                  scale: float, window: int | None = None,
                  softcap: float | None = None) -> Any:
        """Causal GQA attention that also appends to the KV cache.

        Writes k, v [T, Hkv, hd] at cache positions start_pos..start_pos+T-1 of
        ``layer``, then for each query t (absolute position p = start_pos + t) and head h
        attends over keys j with max(0, p - window + 1) <= j <= p using KV head
        h // (Hq // Hkv). Scores = q.k * scale, softmax in float32. Returns [T, Hq, hd].
        """

    @abstractmethod
    def glu(self, gate: Any, up: Any, act: str = "silu") -> Any:
        """y[T, F] = act(gate) * up; act "silu" or "gelu_tanh"."""

    @abstractmethod
    def add(self, a: Any, b: Any) -> Any:
        """Elementwise a + b (residual)."""

    def logits(self, x: Any, head: Any, softcap: float | None = None,
               norm: tuple | None = None) -> np.ndarray:
        """Final projection x[T, D] @ head[V, D].T -> float32 numpy [T, V] on the host,
        ``tanh(y / softcap) * softcap`` if ``softcap``; with ``norm`` = (w [D], eps,
        unit_offset) x is first RMS-normalized (the model's final norm, which a backend
        may fuse into the projection)."""
        if norm is not None:
            x = self.rmsnorm(x, *norm)
        y = self.linear(x, head)
        out = self.to_host(y).astype(np.float32, copy=False)
        if softcap:
            out = np.tanh(out / softcap) * softcap
        return out

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        """A view of x with a new shape (same element count, row-major)."""
        return x.reshape(shape)

    def select_rows(self, x: Any, rows: slice) -> Any:
        """x[rows] for a [T, ...] tensor (used to keep only the last position)."""
        return x[rows]

    #: whether :meth:`concat_rows` works, so that a batched decode step composes the ops
    #: over B rows (:meth:`edgeinfer.models.transformer.Transformer.forward_batch`);
    #: False: the model runs each sequence of a batch by itself.
    batched_rows: bool = True
    #: set by the model around a batched decode step: while True, :meth:`linear` must give
    #: every row the numerics it has alone (M = 1), e.g. one BLAS GEMV per row for dense
    #: weights, whose M > 1 GEMM sums in another order
    rows_alone: bool = False

    def concat_rows(self, parts: list[Any]) -> Any:
        """The [T_i, ...] tensors of ``parts`` stacked along the first axis."""
        return np.concatenate(parts)

    def govern(self) -> None:
        """Called by the model before each forward, on the thread that runs it (the CPU
        backend adapts its thread count to contention there); a no-op by default."""
