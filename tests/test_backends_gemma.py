"""Windowed (Gemma 3) models on the OpenCL backend beyond the tiny model's forward parity
(tests/test_forward.py): Gemma 3 270M's ring cache (slow), and the engine's prefix reuse
through ring caches."""
from __future__ import annotations

import numpy as np
import pytest
from edgeinfer.backends import get_backend
from edgeinfer.backends.errors import BackendUnavailableError
from edgeinfer.models.transformer import Transformer
from greedy import greedy
from tiny_models import tiny_gemma


@pytest.mark.slow
def test_gemma3_270m_opencl_ring_greedy_equals_reference(gemma_gguf):
    """Gemma 3 270M with its window cut to 16 (same weights on both backends): a 36-
    token prompt prefilled in 24-token chunks (longer than the window), then decode;
    OpenCL's ring-cache tokens equal the reference's. f32 KV: the logits agree to 1e-6
    (measured), while int8 codes that differ by one at rounding ties (device vs numpy
    summation order) move this base model's logits by ~2e-2, enough to flip a near-tie
    argmax (margin 0.02 at step 3). ~30 s on PoCL."""
    import dataclasses

    pytest.importorskip("pyopencl", reason="pyopencl[pocl] is needed for the OpenCL backend")
    from edgeinfer.api import tokenizer_for
    from edgeinfer.readers import read_model

    try:
        be = get_backend("opencl")
    except BackendUnavailableError as e:  # no OpenCL platform here
        pytest.skip(f"opencl backend unavailable: {e}")
    src = read_model(str(gemma_gguf))
    cfg = dataclasses.replace(src.config, sliding_window=16)
    tensors = {k: src.tensors[k] for k in src.tensors}
    prompt = tokenizer_for(src).encode(
        "The history of the bicycle begins in the early nineteenth century, when inventors "
        "in Germany and France built wooden machines that riders pushed along with their "
        "feet. Later designs added pedals, and", add_special=True)
    assert len(prompt) > 2 * 16
    model = Transformer(cfg, tensors, be)
    assert model.new_cache(128, "f32", 24).slots[:6] == [39] * 5 + [128]
    got = greedy(model, prompt, 8, "f32", chunk=24, cache_tokens=128)
    ref = greedy(Transformer(cfg, tensors, get_backend("reference")), prompt, 8, "f32",
                 chunk=24, cache_tokens=128)
    assert got == ref


@pytest.mark.parametrize("kv", ["f32", "int4"])
def test_opencl_engine_prefix_reuse_through_rings(kv):
    """engine.prefill's prefix reuse on OpenCL's ring cache (window 6, chunks of 4: rings
    of 9 slots): a prefix the rings still serve is kept, one they lost resets the cache
    (both exactly as the reference backend's host cache), and the logits equal a fresh
    prefill's either way."""
    pytest.importorskip("pyopencl", reason="pyopencl[pocl] is needed for the OpenCL backend")
    from edgeinfer.engine import Engine

    try:
        be = get_backend("opencl")
    except BackendUnavailableError as e:
        pytest.skip(f"opencl backend unavailable: {e}")
    cfg, tensors = tiny_gemma()
    rng = np.random.default_rng(5)
    a = list(rng.integers(0, 64, 21))
    b = a[:17] + list(rng.integers(0, 64, 6))   # rings hold 12..20: keys 12..16 still there
    c = a[:5] + list(rng.integers(0, 64, 9))    # needs keys 0..4: long overwritten
    engines = [Engine(Transformer(cfg, tensors, x), None, n_ctx=64, kv_dtype=kv, prefill_chunk=4)
               for x in (be, get_backend("reference"))]
    for ids, want_reused in ((a, 0), (b, 17), (c, 0)):
        (got, n_got), (ref, n_ref) = (e.prefill(ids) for e in engines)
        assert n_got == n_ref == want_reused
        fresh, _ = Engine(Transformer(cfg, tensors, be), None, n_ctx=64, kv_dtype=kv,
                          prefill_chunk=4).prefill(ids)
        assert np.abs(got - ref).max() < 1e-4 and np.abs(got - fresh).max() < 1e-5
