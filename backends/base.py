"""The backend contract: memory and ops the one transformer forward is written in.

Every op is output-returning and documents its shapes; tensors are whatever the
backend's ``upload`` returned ("handles"), host numpy arrays for the reference and CPU
backends, device buffers for OpenCL. Only :meth:`Backend.to_host` brings data back.
The numpy reference backend defines the semantics; every other backend is tested
against it op by op and on whole models.

Shapes use: T tokens in this call, D hidden, Hq / Hkv query / KV heads, hd head dim,
F intermediate, V vocab.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from .quantized import QuantizedTensor


@dataclass(eq=False)
class PreNormBlock:
    """The uploaded tensors and switches of one pre-norm decoder block, built once per
    layer by the model so that :meth:`Backend.decoder_block` needs no per-call lookups.
    Plain (Llama, SmolLM2, Qwen2, Mistral) unless the optional norms are set (Gemma 3).

    Handles: ``input_norm``, ``post_norm`` (the norm before the MLP) [D]; ``qkv`` =
    [Wq, Wk, Wv] and ``qkv_bias`` (three biases or None); ``cos``, ``sin`` RoPE tables
    [max_pos, r/2]; ``wo``, ``w_gate``, ``w_up``, ``w_down``. Switches: ``heads`` (Hq, Hkv,
    hd), ``eps``, ``unit_offset``, ``scale`` (attention score multiplier), ``window``
    (None = global), ``softcap`` (None = off), ``act`` ("silu" or "gelu_tanh").
    Optional norms (None = absent): ``q_norm`` / ``k_norm`` [hd] (QK-norm, per head,
    before RoPE), ``attn_out_norm`` / ``mlp_out_norm`` [D] (sandwich norms on the
    attention and MLP branch outputs, before each residual add). Compared by identity.
    """

    input_norm: Any
    qkv: list
    qkv_bias: list
    cos: Any
    sin: Any
    wo: Any
    post_norm: Any
    w_gate: Any
    w_up: Any
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
        """No QK-norm and no sandwich norms (the fused halves' block)."""
        return (self.q_norm is None and self.k_norm is None and self.attn_out_norm is None
                and self.mlp_out_norm is None)


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

    def linear_many(self, x: Any, ws: list[Any], biases: list[Any | None]) -> list[Any]:
        """[x @ W_i.T (+ b_i) for each i]: several linears sharing one input (q/k/v,
        gate/up). Backends override it to read x once and dispatch once."""
        return [self.linear(x, w, b) for w, b in zip(ws, biases)]

    # ---- fused halves of a pre-norm decoder block (defaults compose the ops above) ----
    def attention_input(self, x: Any, norm_w: Any, eps: float, unit_offset: bool,
                        ws: list[Any], biases: list[Any | None], cos: Any, sin: Any,
                        positions: np.ndarray, heads: tuple[int, int, int]
                        ) -> tuple[Any, Any, Any]:
        """Everything before attention: ``h = rmsnorm(x)``, q/k/v projections, RoPE.

        Args:
            x: residual stream [T, D].
            norm_w: input-norm weight [D] (``unit_offset``: scale by 1 + w).
            ws, biases: [Wq, Wk, Wv] ([H * hd, D] each) and their biases (or None).
            cos, sin: RoPE tables [max_pos, r/2]; positions: int32 [T] on the host.
            heads: (Hq, Hkv, hd).

        Returns:
            (q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd]), q and k rotated. Backends may
            return views of scratch storage, valid until the next call of this op.
        """
        t = positions.shape[0]
        hq, hkv, hd = heads
        h = self.rmsnorm(x, norm_w, eps, unit_offset)
        q, k, v = self.linear_many(h, ws, biases)
        q = self.rope(self.reshape(q, (t, hq, hd)), cos, sin, positions)
        k = self.rope(self.reshape(k, (t, hkv, hd)), cos, sin, positions)
        return q, k, self.reshape(v, (t, hkv, hd))

    def attention_output_mlp(self, x: Any, a: Any, wo: Any, norm_w: Any, eps: float,
                             unit_offset: bool, w_gate: Any, w_up: Any, w_down: Any,
                             act: str = "silu") -> Any:
        """Everything after attention: ``x1 = x + a @ Wo.T``, ``h = rmsnorm(x1)``, returns
        ``x1 + glu(h @ Wg.T, h @ Wu.T, act) @ Wd.T``.

        Shapes: x [T, D], a [T, Hq * hd], Wo [D, Hq * hd], Wg/Wu [F, D], Wd [D, F] ->
        [T, D]. ``x`` is not modified; backends may return scratch storage, valid until
        the next call of this op (feed it to the next layer, do not keep it).
        """
        x = self.add(x, self.linear(a, wo))
        h = self.rmsnorm(x, norm_w, eps, unit_offset)
        gate, up = self.linear_many(h, [w_gate, w_up], [None, None])
        return self.add(x, self.linear(self.glu(gate, up, act), w_down))

    def decoder_block(self, x: Any, blk: PreNormBlock, positions: np.ndarray, cache: Any,
                      layer: int) -> Any:
        """A whole pre-norm decoder block: :meth:`attention_input`, :meth:`attention`
        (appending K/V at ``positions`` of cache layer ``layer``), then
        :meth:`attention_output_mlp`; a block with QK-norm or sandwich norms (not
        ``blk.plain``) composes the single ops instead (:meth:`composed_block`).

        Shapes: x [T, D] -> [T, D]; positions int32 [T] on the host (consecutive, from
        ``start_pos``). Backends may fuse it (the CPU backend runs decode as one or two
        Numba calls) and may return scratch storage, valid until the next call of this
        op; ``x`` is not modified unless it is that scratch.
        """
        t = positions.shape[0]
        hq, _, hd = blk.heads
        if not blk.plain:
            return self.composed_block(x, blk, positions, cache, layer)
        q, k, v = self.attention_input(x, blk.input_norm, blk.eps, blk.unit_offset, blk.qkv,
                                       blk.qkv_bias, blk.cos, blk.sin, positions, blk.heads)
        a = self.attention(q, k, v, cache, layer, int(positions[0]), blk.scale, blk.window,
                           blk.softcap)
        return self.attention_output_mlp(x, self.reshape(a, (t, hq * hd)), blk.wo,
                                         blk.post_norm, blk.eps, blk.unit_offset, blk.w_gate,
                                         blk.w_up, blk.w_down, blk.act)

    def composed_block(self, x: Any, blk: PreNormBlock, positions: np.ndarray, cache: Any,
                       layer: int, capture: dict[str, Any] | None = None,
                       capture_only: bool = False) -> Any:
        """:meth:`decoder_block` one op at a time, any block (the optional norms where set,
        in the order of HF ``modeling_gemma3.py``); not meant to be overridden: the
        reference composition that fused paths are tested against.

        Args:
            capture: if given, filled with the *input* of each linear group ("q_proj"
                (shared by q/k/v), "o_proj", "gate_proj" (shared by gate/up),
                "down_proj"), for the AWQ/GPTQ calibration in ``edgeinfer.quant``.
            capture_only: with ``capture``, stop once the last input is captured (the
                down projection is not run) and return None.
        """
        t = positions.shape[0]
        hq, hkv, hd = blk.heads
        eps, off = blk.eps, blk.unit_offset
        h = self.rmsnorm(x, blk.input_norm, eps, off)
        if capture is not None:
            capture["q_proj"] = h
        q, k, v = self.linear_many(h, blk.qkv, blk.qkv_bias)
        q = self.reshape(q, (t, hq, hd))
        k = self.reshape(k, (t, hkv, hd))
        v = self.reshape(v, (t, hkv, hd))
        if blk.q_norm is not None:
            q = self.rmsnorm(q, blk.q_norm, eps, off)
        if blk.k_norm is not None:
            k = self.rmsnorm(k, blk.k_norm, eps, off)
        q = self.rope(q, blk.cos, blk.sin, positions)
        k = self.rope(k, blk.cos, blk.sin, positions)
        a = self.attention(q, k, v, cache, layer, int(positions[0]), blk.scale, blk.window,
                           blk.softcap)
        a = self.reshape(a, (t, hq * hd))
        if capture is not None:
            capture["o_proj"] = a
        o = self.linear(a, blk.wo)
        if blk.attn_out_norm is not None:
            o = self.rmsnorm(o, blk.attn_out_norm, eps, off)
        x = self.add(x, o)
        h = self.rmsnorm(x, blk.post_norm, eps, off)
        if capture is not None:
            capture["gate_proj"] = h
        gate, up = self.linear_many(h, [blk.w_gate, blk.w_up], [None, None])
        m = self.glu(gate, up, blk.act)
        if capture is not None:
            capture["down_proj"] = m
            if capture_only:
                return None
        d = self.linear(m, blk.w_down)
        if blk.mlp_out_norm is not None:
            d = self.rmsnorm(d, blk.mlp_out_norm, eps, off)
        return self.add(x, d)

    def embed_step(self, table: Any, ids: np.ndarray, scale: float = 1.0) -> Any:
        """As :meth:`embed`, but the result may be scratch storage valid until the next
        call of this op (the forward feeds it straight to the first block)."""
        return self.embed(table, ids, scale)

    def norm_logits(self, x: Any, norm_w: Any, eps: float, unit_offset: bool, head: Any,
                    softcap: float | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Logits of the last row: ``logits(rmsnorm(x[T-1:T]), head, softcap)``, float32
        numpy [1, V] on the host, written into ``out`` (float32 [1, V]) when given (a
        caller-owned buffer reused across decode steps) and returned."""
        t = x.shape[0]
        h = self.rmsnorm(self.select_rows(x, slice(t - 1, t)), norm_w, eps, unit_offset)
        y = self.logits(h, head, softcap)
        if out is None:
            return y
        out[...] = y
        return out

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

    def logits(self, x: Any, head: Any, softcap: float | None = None) -> np.ndarray:
        """Final projection x[T, D] @ head[V, D].T -> float32 numpy [T, V] on the host."""
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
