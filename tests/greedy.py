"""Greedy decoding straight on a :class:`~edgeinfer.models.transformer.Transformer`
(no engine, sampler or tokenizer), shared by the model-level tests."""
from __future__ import annotations

import numpy as np


def greedy(model, ids, n: int, kv_dtype: str = "f32", chunk: int | None = None,
           cache_tokens: int | None = None) -> list[int]:
    """The ``n`` argmax tokens after prompt ``ids``.

    The prompt is prefilled whole, or in chunks of ``chunk`` tokens (the cache's
    ``max_chunk``); the cache holds ``cache_tokens`` positions (default: just enough).
    """
    extra = {"max_chunk": chunk} if chunk else {}
    cache = model.new_cache(cache_tokens or len(ids) + n + 1, kv_dtype, **extra)
    step = chunk or len(ids)
    for s in range(0, len(ids), step):
        logits = model.forward(np.asarray(ids[s:s + step]), cache)
    out = []
    for _ in range(n):
        t = int(np.argmax(logits[-1]))
        out.append(t)
        logits = model.forward(np.asarray([t]), cache)
    return out
