"""What the model tests of a weight layout share (tests/test_gguf_q6k.py, tests/test_gguf_q5.py):
stories260K with every linear in that layout, and the two row-identity checks on it."""
from __future__ import annotations

import types

import numpy as np

from edgeinfer.backends.quantized import QuantizedTensor


def stories_in_layout(stories_dir, to_layout):
    """stories260K (a SimpleNamespace of config and tensors) with every linear and the head
    replaced by ``to_layout(float32 weight) -> QuantizedTensor``."""
    from edgeinfer.readers import read_model

    src = read_model(str(stories_dir))
    tensors = {n: (to_layout(np.asarray(t, np.float32)) if n.endswith("proj.weight")
                   or n == "lm_head.weight" else t) for n, t in src.tensors.items()}
    assert sum(isinstance(t, QuantizedTensor) for t in tensors.values()) == 7 * 5 + 1
    return types.SimpleNamespace(config=src.config, tensors=tensors)


def assert_rows_bit_identical_whatever_m(model, kv: str) -> None:
    """Logits of a 33-token prompt: computed whole, in chunks and by decode steps, equal."""
    from test_cache_invariance import _prompt, _rows_three_ways

    whole, chunks, steps = _rows_three_ways(model, _prompt(model, 33), kv)
    assert np.array_equal(whole, chunks) and np.array_equal(whole, steps)
    assert np.isfinite(whole).all() and whole.std() > 0.1


def batched_step_handles(model) -> list:
    """Check a batched decode step equals each row alone (tests/test_batching.py); returns
    the CPU handles of the linears and the head, for the caller to check their kind."""
    from test_batching import _check

    from edgeinfer.models.families import LINEAR_KEYS

    tr, _, _ = _check(model, "f16")
    handles = [h for layer in tr.layers for k, h in layer.items() if k in LINEAR_KEYS]
    assert len(handles) == 7 * 5
    return handles + [tr.lm_head]
