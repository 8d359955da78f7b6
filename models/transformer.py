"""The one decoder-only transformer forward, written against the backend contract.

Llama, SmolLM2, Mistral, Qwen2, Gemma3 and Phi-3 differ only in config switches (QKV
bias, QK-norm, sandwich norms, (1 + w) RMSNorm, GELU-tanh gating, embedding scale,
per-layer sliding window and RoPE base, partial rotary, LongRoPE) filled from
:mod:`.families`; readers map their tensors onto one canonical set. There is no
per-model copy of attention code.

References: Llama (Touvron et al., 2023) and HF ``modeling_llama.py`` / ``modeling_qwen2.py``
/ ``modeling_gemma3.py`` for the exact order of norms and residuals.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..backends.base import Backend, DecodePlan, DecoderBlock, DecodeStep
from ..backends.osmemory import release_free_heap
from .block import RowCaches, block_forward
from .config import ModelConfig
from .families import LINEAR_KEYS, layer_tensor_names  # noqa: F401 (re-exported)
from .rope import rope_switch, rope_tables


def upload_layer(backend: Backend, tensors: Mapping[str, Any], i: int) -> dict[str, Any]:
    """Upload the tensors of layer ``i`` that exist in ``tensors``; returns short-name handles."""
    out = {}
    for short, name in layer_tensor_names(i).items():
        if name in tensors:
            t = tensors[name]
            out[short] = backend.upload_weight(t) if short in LINEAR_KEYS else backend.upload(t)
    return out


def decoder_layer(be: Backend, cfg: ModelConfig, lw: dict[str, Any], x: Any, positions: np.ndarray,
                  rope: tuple[Any, Any], cache: Any, cache_layer: int, layer: int,
                  capture: dict[str, Any] | None = None, capture_only: bool = False) -> Any:
    """Layer ``layer`` of a model from its uploaded tensors ``lw`` (short names, see
    :data:`~edgeinfer.models.families.LAYER_TENSORS`) and RoPE tables ``rope`` = (cos,
    sin): x [T, D] -> [T, D], appending K/V at ``positions`` of layer ``cache_layer`` of
    ``cache``; ``capture`` as :func:`.block.block_forward` (calibration runs one layer
    at a time; ``capture_only`` skips the down projection and returns None)."""
    blk = decoder_block(be, cfg, lw, rope, layer)
    return block_forward(be, blk, x, positions, cache, cache_layer, capture, capture_only)


def decoder_block(be: Backend, cfg: ModelConfig, lw: dict[str, Any], rope: tuple[Any, Any],
                  layer: int) -> DecoderBlock:
    """Layer ``layer``'s tensors and switches as a :class:`DecoderBlock` (QK-norm and
    sandwich norms as its optional norms; with sandwich norms the pre-FFN norm is the
    norm before the MLP). q/k/v and gate/up become :class:`LinearGroup` of ``be``, whose
    handles replace the members' in ``lw``."""
    sandwich = cfg.sandwich_norms
    qkv = be.group_linears([lw["q_proj"], lw["k_proj"], lw["v_proj"]],
                           [lw.get("q_bias"), lw.get("k_bias"), lw.get("v_bias")])
    gate_up = be.group_linears([lw["gate_proj"], lw["up_proj"]], [None, None])
    lw["q_proj"], lw["k_proj"], lw["v_proj"] = qkv.weights
    lw["gate_proj"], lw["up_proj"] = gate_up.weights
    return DecoderBlock(
        lw["input_layernorm"], qkv, rope[0], rope[1], lw["o_proj"],
        lw["pre_feedforward_layernorm"] if sandwich else lw["post_attention_layernorm"],
        gate_up, lw["down_proj"],
        (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim),
        cfg.rms_norm_eps, cfg.norm_unit_offset, cfg.attn_scale, cfg.layer_window(layer),
        cfg.attn_logit_softcapping, cfg.activation,
        q_norm=lw["q_norm"] if cfg.qk_norm else None,
        k_norm=lw["k_norm"] if cfg.qk_norm else None,
        attn_out_norm=lw["post_attention_layernorm"] if sandwich else None,
        mlp_out_norm=lw["post_feedforward_layernorm"] if sandwich else None)


class RopeSwitchError(ValueError):
    """A forward call would mix LongRoPE's short and long factors in one sequence."""


_UNSET = object()


class Transformer:
    """A model's weights uploaded to a backend, plus the forward pass.

    Args:
        cfg: the model config.
        tensors: canonical name -> float32 array or QuantizedTensor (e.g. ``ModelSource.tensors``).
        backend: where weights live and ops run.
        max_positions: RoPE table length (positions the model may be asked for).

    Raises:
        KeyError: a required tensor is missing (readers validate before this).
    """

    #: A tied embedding (also the output head) is uploaded as a weight (its own copy on
    #: the CPU backend); False: as an embedding table (an ``.eif``'s 8-bit table a file
    #: view there), which ``benchmarks/layout_ab.py --what view`` compares.
    tied_as_weight = True

    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, Any], backend: Backend,
                 max_positions: int | None = None):
        self.cfg = cfg
        self.backend = backend
        self.max_positions = max_positions or cfg.max_position_embeddings
        be = backend
        emb = tensors["model.embed_tokens.weight"]
        if cfg.tie_word_embeddings or "lm_head.weight" not in tensors:
            # also the output head, read whole every step: a weight of its own, not a
            # lookup table whose rows are mapped on demand (Backend.upload_embedding)
            up = be.upload_weight if self.tied_as_weight else be.upload_embedding
            self.embed_tokens = up(emb)
            self.lm_head = self.embed_tokens
        else:
            self.embed_tokens = be.upload_embedding(emb)
            self.lm_head = be.upload_weight(tensors["lm_head.weight"])
        self.norm = be.upload(tensors["model.norm.weight"])
        # One (cos, sin) pair per distinct RoPE base (gemma3 has a local and a global one).
        self._rope: dict[float, tuple[Any, Any]] = {}
        for i in range(cfg.num_hidden_layers):
            theta = cfg.layer_rope_theta(i)
            if theta not in self._rope:
                cos, sin = rope_tables(cfg, self.max_positions, theta)
                self._rope[theta] = (be.upload(cos), be.upload(sin))
        # per layer: upload, then the block's tensors and switches (its fused copies), then
        # the freed temporaries go back to the OS, so the load peaks near the weights' size
        self.layers, blocks = [], []
        for i in range(cfg.num_hidden_layers):
            lw = upload_layer(be, tensors, i)
            self.layers.append(lw)
            blocks.append(decoder_block(be, cfg, lw, self._rope[cfg.layer_rope_theta(i)], i))
            release_free_heap()
        self.blocks = tuple(blocks)
        #: LongRoPE: sequences longer than this run ``long_blocks`` (the same blocks with
        #: the long-factor tables); None for every other RoPE (``long_blocks`` = ``blocks``).
        self.rope_switch = rope_switch(cfg)
        self.long_blocks = self.blocks
        if self.rope_switch is not None:
            long = {theta: tuple(be.upload(t) for t in
                                 rope_tables(cfg, self.max_positions, theta, long=True))
                    for theta in self._rope}
            self.long_blocks = tuple(
                dataclasses.replace(blk, cos=long[cfg.layer_rope_theta(i)][0],
                                    sin=long[cfg.layer_rope_theta(i)][1])
                for i, blk in enumerate(self.blocks))
        #: what a decode step computes, with the short and (LongRoPE) the long tables
        self.decode_steps = {
            long: DecodeStep(self.embed_tokens, cfg.embed_scale, blocks, self.norm,
                             cfg.rms_norm_eps, cfg.norm_unit_offset, self.lm_head,
                             cfg.final_logit_softcapping)
            for long, blocks in ((False, self.blocks), (True, self.long_blocks))}
        # the backend's decode plans per cache ({long_rope: plan or None}); weak keys, so
        # a cache the caller drops takes its plans with it
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # positions p.. of a call are a view of this table: nothing allocated per step
        self._positions = np.arange(self.max_positions, dtype=np.int32)
        self._positions.flags.writeable = False

    def long_rope(self, n_tokens: int) -> bool:
        """Whether a sequence of ``n_tokens`` runs with LongRoPE's long factors."""
        return self.rope_switch is not None and n_tokens > self.rope_switch

    def new_cache(self, max_tokens: int, dtype: str = "f32", max_chunk: int = 512) -> Any:
        """Preallocate a KV cache for ``max_tokens`` positions (see ``Backend.new_kv_cache``).

        Sliding-window layers get ring storage of ``window - 1 + max_chunk`` positions
        (they never attend further back), so long chats cost less memory; ``max_chunk``
        must bound the tokens of every forward call made with this cache.
        """
        c = self.cfg
        windows = [c.layer_window(i) for i in range(c.num_hidden_layers)]
        extra = {}
        if any(w is not None for w in windows):
            extra = {"window_sizes": windows, "max_chunk": max_chunk}
        cache = self.backend.new_kv_cache(c.num_hidden_layers, c.num_key_value_heads,
                                          c.head_dim, max_tokens, dtype, **extra)
        self.plan(cache)
        return cache

    def plan(self, cache: Any, long_rope: bool = False) -> DecodePlan | None:
        """The backend's decode plan for ``cache`` (compiled on first use, then kept while
        the cache lives; ``long_rope``: with LongRoPE's long tables), or None when decode
        steps compose the single ops."""
        plans = self._plans.get(cache)
        if plans is None:
            plans = self._plans[cache] = {}
        if long_rope not in plans:
            plans[long_rope] = self.backend.compile_decode(self.decode_steps[long_rope], cache)
        return plans[long_rope]

    def forward(self, ids: np.ndarray, cache: Any, all_logits: bool = False,
                out: np.ndarray | None = None, long_rope: bool | None = None) -> np.ndarray:
        """Run T tokens starting at position ``cache.length``; T > 1 is prefill, T == 1 decode.

        Args:
            ids: int32 [T] token ids.
            cache: KV cache; its ``length`` advances by T.
            all_logits: return logits of every position (perplexity) instead of the last.
            out: optional float32 [1, V] buffer for the last position's logits (not with
                ``all_logits``): written and returned, so that a decode loop reusing it
                allocates nothing on the CPU backend. Without it the result is a new array.
            long_rope: LongRoPE models only (:attr:`rope_switch`): run with the long
                factors (True) or the short ones (False), as the caller knows the cached
                prefix was computed; None: by this call's end, ``start + T > rope_switch``.

        Returns:
            float32 numpy logits [T, V] if ``all_logits`` else [1, V].

        Raises:
            ValueError: the positions exceed the cache or the RoPE table.
            RopeSwitchError: ``long_rope`` is None and the call crosses the switch with
                a cached prefix (computed with the short factors): re-run the whole
                sequence from position 0 (as :class:`~edgeinfer.engine.Engine` does).
        """
        self.backend.govern()  # the CPU backend's thread count, on this (the kernels') thread
        ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
        t = ids.shape[0]
        start = cache.length
        if start + t > self.max_positions:
            raise ValueError(f"positions up to {start + t} exceed the model's table of "
                             f"{self.max_positions}")
        positions = self._positions[start:start + t]
        blocks, long = self.blocks, False
        if self.rope_switch is not None:
            if long_rope is None:
                long_rope = start + t > self.rope_switch
                if long_rope and 0 < start <= self.rope_switch:
                    raise RopeSwitchError(
                        f"positions {start}..{start + t - 1} cross LongRoPE's switch at "
                        f"{self.rope_switch} tokens over a prefix computed with the short "
                        f"factors; re-run the whole sequence from position 0")
            if long_rope:
                blocks, long = self.long_blocks, True
        if t == 1:
            plans = self._plans.get(cache)
            plan = plans.get(long, _UNSET) if plans is not None else _UNSET
            if plan is _UNSET:
                plan = self.plan(cache, long)
            if plan is not None:
                y = plan.run(ids, positions, cache, None if all_logits else out)
                cache.length = start + 1
                return y
        be, cfg = self.backend, self.cfg
        x = be.embed(self.embed_tokens, ids, cfg.embed_scale)
        for i, blk in enumerate(blocks):
            x = block_forward(be, blk, x, positions, cache, i)
        cache.length = start + t
        if not all_logits:  # only the last position's logits
            x = be.select_rows(x, slice(t - 1, t))
        y = be.logits(x, self.lm_head, cfg.final_logit_softcapping,
                      norm=(self.norm, cfg.rms_norm_eps, cfg.norm_unit_offset))
        if out is None or all_logits:
            return y
        out[...] = y
        return out

    def forward_batch(self, ids: np.ndarray, caches: list, out: np.ndarray | None = None
                      ) -> np.ndarray:
        """One decode step of B sequences: token ``ids[i]`` at position ``caches[i].length``
        of cache i, as one forward whose linears see M = B rows (each weight read once)
        and whose attention runs per sequence over its own cache (:class:`.block.RowCaches`).

        Row i equals ``forward(ids[i:i+1], caches[i])`` (bit-identical on the CPU backend,
        whose linears give every row the single-token GEMV's numerics whatever M). B = 1,
        a backend without :attr:`~edgeinfer.backends.base.Backend.batched_rows` (OpenCL)
        and LongRoPE models run each sequence by itself (its own decode plan).

        Args:
            ids: int32 [B] one token per sequence.
            caches: B distinct KV caches of this model; each ``length`` advances by 1.
            out: optional float32 [B, V] buffer for the logits.

        Returns:
            float32 logits [B, V] (``out`` when given).

        Raises:
            ValueError: a position exceeds its cache or the RoPE table; B != len(caches);
                a cache given twice.
        """
        ids = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
        b = ids.shape[0]
        if b != len(caches) or b == 0:
            raise ValueError(f"forward_batch: {b} ids for {len(caches)} caches")
        if len({id(c) for c in caches}) != b:
            raise ValueError("forward_batch: a cache appears twice in one step")
        if b == 1 or not self.backend.batched_rows or self.rope_switch is not None:
            rows = [self.forward(ids[i:i + 1], c) for i, c in enumerate(caches)]
            y = np.concatenate(rows)
            if out is None:
                return y
            out[...] = y
            return out
        positions = np.fromiter((c.length for c in caches), np.int32, b)
        if int(positions.max()) + 1 > self.max_positions:
            raise ValueError(f"positions up to {int(positions.max()) + 1} exceed the model's "
                             f"table of {self.max_positions}")
        be, cfg = self.backend, self.cfg
        for c in caches:
            if c.length + 1 > c.max_tokens:
                raise ValueError(f"position {c.length} does not fit a cache of "
                                 f"{c.max_tokens} positions")
        be.govern()
        rc = RowCaches(caches)
        be.rows_alone = True
        try:
            x = be.embed(self.embed_tokens, ids, cfg.embed_scale)
            for i, blk in enumerate(self.blocks):
                x = block_forward(be, blk, x, positions, rc, i)
            y = be.logits(x, self.lm_head, cfg.final_logit_softcapping,
                          norm=(self.norm, cfg.rms_norm_eps, cfg.norm_unit_offset))
        finally:
            be.rows_alone = False
        for c in caches:
            c.length += 1
        if out is None:
            return y
        out[...] = y
        return out
