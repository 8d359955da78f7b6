"""Memory budget: how long a context fits in ``--max-memory`` with a given KV dtype.

The plan adds up, in bytes (MiB = 2**20 bytes throughout):

* **weights** — what the caller measured (:func:`weight_bytes` of the tensors as uploaded);
* **scratch** — float32 activations of one prefill chunk of ``T`` tokens, one row of
  logits, and a measured runtime constant :data:`RUNTIME_OVERHEAD_BYTES`;
* **KV cache** — exactly what :class:`edgeinfer.backends.kvcache.HostKVCache` allocates
  (:func:`~edgeinfer.backends.kvcache.kv_cache_nbytes`, the same function it sizes itself
  with), ``kv_bytes_per_token`` per position without sliding windows.

``max_context = min(max_position_embeddings, floor((budget - weights - scratch) /
kv_bytes_per_token))`` (with windowed layers, the largest ``n`` whose cache fits).

Activation estimate for a chunk of T tokens (D hidden, F intermediate, Hq/Hkv heads,
hd head dim; all float32): ``5·T·D`` (residual, normed input, attention output and
projection, MLP output) + ``2·T·(Hq + 2·Hkv)·hd`` (q, k, v and their RoPE'd copies) +
``4·T·F`` (gate, up, activation, product) + ``2·Hq·T·T`` (scores and probabilities of
the chunk's own block; fast backends tile attention over the cache) + ``V`` (logits).
The numpy reference backend materializes ``Hq·T·S`` scores per layer and can exceed it
on long contexts: it is the oracle, not the memory-bounded path.

Giving memory back to the OS (resident set size) without changing any result lives in
:mod:`edgeinfer.backends.osmemory` (the backends use it; re-exported here):
:func:`release_free_heap`, :func:`release_mapped_pages`, :func:`private_file_view`,
:func:`release_jit_compiler_pages` and :class:`ForwardReleaser`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .backends.kvcache import (
    ALL_KV_DTYPES,
    DEFAULT_MAX_CHUNK,
    kv_bytes_per_token_layer,
    kv_cache_nbytes,
)
from .backends.osmemory import (  # noqa: F401  (re-exported)
    JIT_LIBRARIES,
    ForwardReleaser,
    private_file_view,
    release_free_heap,
    release_jit_compiler_pages,
    release_mapped_pages,
    views_readonly_map,
)
from .errors import MemoryBudgetError

MIB = 1 << 20

#: Resident memory of the runtime before weights and KV, a budget: the interpreter,
#: numpy, numba/llvmlite, tokenizers and edgeinfer imported (about 104 MiB peak RSS),
#: plus the loaded JIT-compiled kernels and allocator slack.
RUNTIME_OVERHEAD_BYTES = 240 * MIB


@dataclass
class MemoryPlan:
    """What fits in a memory budget (all sizes in bytes).

    Attributes:
        budget_bytes: the budget (``max_memory_mb`` MiB).
        weights_bytes: model weights as stored for the backend.
        kv_bytes_per_token: KV bytes one more position costs (all layers; windowed
            layers count only while their ring is not full).
        scratch_bytes: prefill-chunk activations + logits + runtime overhead.
        max_context: longest context (tokens) that fits, capped by the model's positions.
        fits: ``max_context`` >= the requested ``n_ctx`` (>= 1 if none was requested).
        kv_dtype, prefill_chunk, n_ctx: the inputs (n_ctx None if not requested).
        kv_bytes: KV bytes at ``max_context`` (exact, including ring tables).
        model_max_positions: the model's ``max_position_embeddings``.
        parallel: sequences that each get a cache of ``max_context`` positions
            (continuous batching, :mod:`edgeinfer.batching`); ``kv_bytes`` counts all.
    """

    budget_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    scratch_bytes: int
    max_context: int
    fits: bool
    kv_dtype: str
    prefill_chunk: int
    n_ctx: int | None
    kv_bytes: int
    model_max_positions: int
    parallel: int = 1

    @property
    def total_bytes(self) -> int:
        """Weights + scratch + KV at ``max_context``."""
        return self.weights_bytes + self.scratch_bytes + self.kv_bytes


def weight_bytes(tensors: Mapping[str, Any]) -> int:
    """Bytes of a model's tensors (numpy arrays or QuantizedTensor: their ``nbytes``)."""
    return int(sum(int(t.nbytes) for t in tensors.values()))


def scratch_bytes(cfg, prefill_chunk: int, overhead_bytes: int = RUNTIME_OVERHEAD_BYTES) -> int:
    """Activation bytes of one prefill chunk + one row of logits + the runtime overhead.

    ``cfg`` is a :class:`edgeinfer.models.config.ModelConfig`; formula in the module docstring.
    """
    t = prefill_chunk
    d, f = cfg.hidden_size, cfg.intermediate_size
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    floats = 5 * t * d + 2 * t * (hq + 2 * hkv) * hd + 4 * t * f + 2 * hq * t * t + cfg.vocab_size
    return 4 * floats + overhead_bytes


def _windows(cfg, use_windows: bool) -> list[int | None] | None:
    if not use_windows:
        return None
    return [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]


#: The context a model runs with when none is asked for (tokens).
DEFAULT_CONTEXT = 4096


def context_length(model_max: int, n_ctx: int | None = None,
                   memory_max: int | None = None) -> int:
    """The one context rule (the runtime, ``chat``, ``serve`` and ``info`` all use it):
    ``n_ctx`` when given (``--ctx``), else :data:`DEFAULT_CONTEXT`, lowered to what the
    memory budget allows (``memory_max``: :attr:`MemoryPlan.max_context`); never more
    than the model's positions ``model_max``."""
    if n_ctx is not None:
        return max(1, min(int(n_ctx), int(model_max)))
    n = min(DEFAULT_CONTEXT, int(model_max))
    if memory_max is not None:
        n = min(n, int(memory_max))
    return max(1, n)


def plan_memory(cfg, weight_bytes: int, max_memory_mb: float, kv_dtype: str = "int8",
                prefill_chunk: int = 512, *, n_ctx: int | None = None,
                use_windows: bool = False, parallel: int = 1,
                overhead_bytes: int = RUNTIME_OVERHEAD_BYTES) -> MemoryPlan:
    """Plan weights + scratch + KV cache inside ``max_memory_mb`` MiB.

    Args:
        cfg: the model's ``ModelConfig``.
        weight_bytes: bytes of the weights as the backend holds them (:func:`weight_bytes`).
        max_memory_mb: total process budget, MiB (2**20 bytes).
        kv_dtype: one of ``f32``, ``f16``, ``int8``, ``int4``, ``k8v4`` (see kvcache).
        prefill_chunk: tokens per prefill forward call (sizes the scratch).
        n_ctx: a requested context; ``fits`` tells whether it fits (default: >= 1 token).
        use_windows: size sliding-window layers as rings (only if the cache is built
            with ``window_sizes``; the engine does not do that yet).
        parallel: sequences generating at once, each with its own cache of the
            context (``max_context`` is then per sequence).
        overhead_bytes: runtime constant (default :data:`RUNTIME_OVERHEAD_BYTES`).

    Returns:
        a :class:`MemoryPlan`.

    Raises:
        MemoryBudgetError: the weights, the scratch and one token of KV do not fit;
            the message gives each figure in MiB and the smallest budget that works.
        ValueError: unknown ``kv_dtype`` or non-positive ``prefill_chunk``.
    """
    if kv_dtype not in ALL_KV_DTYPES:
        raise ValueError(f"unsupported KV cache dtype {kv_dtype!r}; choose one of {ALL_KV_DTYPES}")
    if prefill_chunk <= 0:
        raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
    budget = int(max_memory_mb * MIB)
    scratch = scratch_bytes(cfg, prefill_chunk, overhead_bytes)
    L, hkv, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    wins = _windows(cfg, use_windows)
    max_chunk = max(prefill_chunk, 1) if wins else DEFAULT_MAX_CHUNK

    if parallel < 1:
        raise ValueError(f"parallel must be at least 1, got {parallel}")

    def kv(n: int) -> int:  # all sequences' caches
        return parallel * kv_cache_nbytes(L, hkv, hd, n, kv_dtype, wins, max_chunk) if n > 0 else 0

    per_token = L * kv_bytes_per_token_layer(hkv, hd, kv_dtype)
    avail = budget - weight_bytes - scratch
    if avail < kv(1):
        need = weight_bytes + scratch + kv(1)
        raise MemoryBudgetError(
            f"--max-memory {max_memory_mb:g} MiB is too small for this model: weights "
            f"{weight_bytes / MIB:.1f} MiB + scratch and runtime {scratch / MIB:.1f} MiB "
            f"(prefill chunk {prefill_chunk}) + KV {per_token} bytes per token ({kv_dtype}) "
            f"needs at least {need / MIB:.1f} MiB; raise --max-memory to "
            f"{need / MIB + 1:.0f} or more, or use a smaller model / prefill chunk")
    max_pos = cfg.max_position_embeddings
    if wins is None:
        n = min(max_pos, avail // (per_token * parallel))
    else:  # kv(n) is non-decreasing: the largest n in [1, max_pos] with kv(n) <= avail
        lo, hi = 1, max_pos
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if kv(mid) <= avail else (lo, mid - 1)
        n = lo
    n = int(n)
    want = n_ctx if n_ctx is not None else 1
    return MemoryPlan(budget_bytes=budget, weights_bytes=int(weight_bytes),
                      kv_bytes_per_token=per_token, scratch_bytes=scratch, max_context=n,
                      fits=n >= want, kv_dtype=kv_dtype, prefill_chunk=prefill_chunk,
                      n_ctx=n_ctx, kv_bytes=kv(n), model_max_positions=max_pos,
                      parallel=int(parallel))


def parallel_sequences(plan: MemoryPlan, n_ctx: int) -> int:
    """How many sequences of ``n_ctx`` positions each (their caches) fit in the budget
    of ``plan`` (weights and scratch counted once), without sliding-window rings."""
    avail = plan.budget_bytes - plan.weights_bytes - plan.scratch_bytes
    return max(0, int(avail // (plan.kv_bytes_per_token * max(1, int(n_ctx)))))


def format_plan(plan: MemoryPlan) -> str:
    """Human-readable lines for ``edgeinfer info --max-memory N --kv-dtype D``."""
    mib = lambda b: f"{b / MIB:8.1f} MiB"
    capped = " (the model's limit)" if plan.max_context == plan.model_max_positions else ""
    lines = [
        f"memory budget      {mib(plan.budget_bytes)}",
        f"  weights          {mib(plan.weights_bytes)}",
        f"  scratch+runtime  {mib(plan.scratch_bytes)}  (prefill chunk {plan.prefill_chunk} tokens)",
        f"  KV cache         {mib(plan.kv_bytes)}  ({plan.kv_dtype}, {plan.kv_bytes_per_token} bytes/token)",
        f"  total            {mib(plan.total_bytes)}",
        f"max context        {plan.max_context} tokens{capped}"
        + (f" per sequence, {plan.parallel} in parallel" if plan.parallel > 1 else ""),
    ]
    for n in sorted({min(plan.model_max_positions, c) for c in (2048, 4096, plan.max_context)}):
        lines.append(f"parallel sequences {parallel_sequences(plan, n)} at {n} tokens each")
    if plan.n_ctx is not None:
        lines.append(f"requested context  {plan.n_ctx} tokens: "
                     + ("fits" if plan.fits else "does NOT fit; lower --ctx or raise --max-memory"))
    return "\n".join(lines)


def available_memory_mb() -> float | None:
    """The memory the OS can give without swapping now (Linux ``MemAvailable``), MiB;
    None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_parallel(cfg, weight_bytes: int, kv_dtype: str, prefill_chunk: int,
                     n_ctx: int | None = None, max_memory_mb: float | None = None,
                     cap: int = 4) -> int:
    """The server's default ``--parallel``: min(``cap``, the sequences of the context
    (:func:`context_length` of ``n_ctx``) that fit in ``max_memory_mb``, else in the memory
    available now), at least 1."""
    budget = max_memory_mb
    if budget is None:
        avail = available_memory_mb()
        if avail is None:
            return 1
        budget = avail
    n = context_length(cfg.max_position_embeddings, n_ctx)
    try:
        plan = plan_memory(cfg, weight_bytes, budget, kv_dtype, prefill_chunk)
    except MemoryBudgetError:
        return 1
    return max(1, min(int(cap), parallel_sequences(plan, n)))
