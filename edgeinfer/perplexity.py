"""Perplexity with llama.cpp's method (``tools/perplexity/perplexity.cpp``, ``perplexity()``).

* The whole text is tokenized once; if the model adds BOS, the stream starts with BOS
  (llama.cpp tokenizes with ``add_special=true``).
* It is cut into ``n_chunk = min(n_chunks, len(tokens) // n_ctx)`` chunks of ``n_ctx``
  tokens (the tail is dropped); each chunk is evaluated fresh (new KV cache), and, if the
  model adds BOS, its first token is replaced by BOS (restored afterwards).
* Only the second half is scored: with ``first = n_ctx // 2``, the logits at chunk
  positions ``first .. n_ctx - 2`` predict tokens ``first + 1 .. n_ctx - 1``:
  ``n_ctx - 1 - first`` tokens per chunk (255 at 512).
* ``ppl = exp(mean NLL)`` over all scored tokens; log-softmax in float64.
"""
from __future__ import annotations

import math
import sys

import numpy as np


def perplexity(model, ids, n_ctx: int = 512, n_chunks: int | None = None,
               bos_id: int | None = None, progress: bool = False,
               kv_dtype: str = "f32", on_logprobs=None) -> dict:
    """llama.cpp-compatible perplexity of ``model`` on a token stream.

    Args:
        model: a :class:`~edgeinfer.models.transformer.Transformer` (anything with
            ``new_cache(n)`` and ``forward(ids, cache, all_logits=True) -> [T, V]``).
        ids: int token ids of the text, tokenized *without* special tokens.
        n_ctx: chunk length (512 as llama.cpp's default).
        n_chunks: limit on chunks (None: all whole chunks).
        bos_id: the BOS id if the model adds BOS (prepended to the stream and written over
            the first token of each chunk), else None.
        progress: tqdm bar on stderr.
        kv_dtype: KV cache storage used while evaluating each chunk (to measure what a
            quantized cache costs).
        on_logprobs: optional ``f(chunk_index, logprobs)`` called with each chunk's
            log-softmax over the vocabulary at the scored positions, float64
            ``[n_ctx - 1 - n_ctx // 2, V]`` (for KL divergence against another model).

    Returns:
        dict ``ppl`` (float), ``nll`` (mean negative log-likelihood, nats), ``n_tokens``
        (scored), ``chunks`` (evaluated), ``chunk_ppl`` (running estimate after each chunk,
        as llama.cpp prints ``[i]ppl``).

    Raises:
        ValueError: fewer than ``2 * n_ctx`` tokens (llama.cpp's minimum) or n_ctx < 4.
    """
    toks = np.asarray(ids, np.int64).reshape(-1)
    if bos_id is not None:
        toks = np.concatenate([[bos_id], toks])
    if n_ctx < 4:
        raise ValueError(f"n_ctx must be at least 4, got {n_ctx}")
    if len(toks) < 2 * n_ctx:
        raise ValueError(f"need at least 2 * n_ctx = {2 * n_ctx} tokens, got {len(toks)}: "
                         f"use a longer text or a smaller n_ctx")
    n = len(toks) // n_ctx
    if n_chunks is not None:
        n = min(n, int(n_chunks))
    first = n_ctx // 2
    nll, count, running = 0.0, 0, []
    it = range(n)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="perplexity", unit="chunk", file=sys.stderr)
    cache = model.new_cache(n_ctx, kv_dtype)
    for i in it:
        chunk = toks[i * n_ctx:(i + 1) * n_ctx].copy()
        if bos_id is not None:
            chunk[0] = bos_id
        cache.reset()
        logits = np.asarray(model.forward(chunk.astype(np.int32), cache, all_logits=True),
                            np.float64)[first:n_ctx - 1]
        target = chunk[first + 1:n_ctx]
        mx = logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(logits - mx).sum(axis=1)) + mx[:, 0]
        nll += float(np.sum(lse - logits[np.arange(len(target)), target]))
        if on_logprobs is not None:
            on_logprobs(i, logits - lse[:, None])
        count += len(target)
        running.append(math.exp(nll / count))
    mean = nll / count
    return {"ppl": math.exp(mean), "nll": mean, "n_tokens": count, "chunks": n,
            "chunk_ppl": running}


def divergence(base_logprobs: np.ndarray, logprobs: np.ndarray) -> tuple[float, int, int]:
    """KL divergence and top-1 agreement of a model's next-token distributions against a
    baseline's, as llama.cpp's ``--kl-divergence`` reports them.

    Args:
        base_logprobs: the baseline's log-probabilities ``[T, V]`` (any float dtype, e.g.
            stored as float16; renormalized here).
        logprobs: the model's log-probabilities ``[T, V]`` at the same positions.

    Returns:
        ``(kl_sum, same_top1, T)``: ``Σ_t KL(P_t || Q_t)`` in nats, the number of positions
        whose most likely token is the same, and ``T``.
    """
    lp = np.asarray(base_logprobs, np.float64)
    lp = lp - (np.log(np.exp(lp - lp.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True))
               + lp.max(axis=1, keepdims=True))
    lq = np.asarray(logprobs, np.float64)
    kl = float(np.sum(np.exp(lp) * (lp - lq)))
    same = int(np.sum(lp.argmax(axis=1) == lq.argmax(axis=1)))
    return kl, same, lp.shape[0]
