"""Decode plans (``Backend.compile_decode``) as the model holds them: one per KV cache,
built when the cache is made, dropped with it, nothing stapled onto the caches or the
blocks, the caller's weight handles left alone; and the decode step through a plan ==
the model's composition of single ops on the same backend."""
from __future__ import annotations

import dataclasses
import gc
import weakref

import numpy as np
import pytest
from edgeinfer.backends.base import DecoderBlock
from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.models.transformer import Transformer
from test_cpu_model import rtn4
from tiny_models import tiny_gemma


def _model(backend, q4=True):
    cfg, tensors = tiny_gemma(vocab_size=128, hidden_size=64, intermediate_size=96,
                              num_attention_heads=4)
    if q4:
        tensors = {k: rtn4(v, 32) if v.ndim == 2 and "embed" not in k else v
                   for k, v in tensors.items()}
    return Transformer(cfg, tensors, backend, 64)


def test_one_plan_per_cache_held_by_the_model():
    m = _model(CpuBackend(threads=1))
    a, b = m.new_cache(32, "int8"), m.new_cache(32, "f32")
    pa, pb = m.plan(a), m.plan(b)
    assert pa is not None and pb is not None and pa is not pb
    assert m.plan(a) is pa  # built once (when the cache was made), then kept
    m.forward(np.array([1, 2, 3], np.int32), a)
    m.forward(np.array([4], np.int32), a)
    assert m.plan(a) is pa
    ref = weakref.ref(pa)
    del a, pa
    gc.collect()
    assert ref() is None  # the cache's plan went with it
    assert m.plan(b) is pb


def test_nothing_stapled_onto_caches_blocks_or_weights():
    be = CpuBackend(threads=1)
    m = _model(be)
    fresh = set(m.new_cache(32, "int4").__dict__)
    cache = m.new_cache(32, "int4")
    ids = np.array([5], np.int32)
    m.forward(np.array([1, 2, 3, 4], np.int32), cache)
    for _ in range(3):
        m.forward(ids, cache)
    assert set(cache.__dict__) == fresh
    blk = m.blocks[0]
    assert isinstance(blk, DecoderBlock)
    with pytest.raises(dataclasses.FrozenInstanceError):
        blk.qkv = None
    assert not hasattr(be, "_dec") and not hasattr(be, "_fused")


def test_exact_decode_and_reference_compile_no_plan():
    for be in (CpuBackend(threads=1, exact_decode=True), ReferenceBackend()):
        m = _model(be, q4=False)
        assert m.plan(m.new_cache(16)) is None


@pytest.mark.parametrize("kv", ["f32", "int8", "int4"])
@pytest.mark.parametrize("q4", [True, False])
def test_planned_decode_equals_composition(kv, q4, monkeypatch):
    """Step-wise plans (Gemma blocks) equal the composition bit for bit: logits and the
    cache, decode steps at positions 0 and later, f32 ring layers included (max_chunk 4:
    the attention op between the halves)."""
    be = CpuBackend(threads=1)
    m = _model(be, q4)
    planned = m.new_cache(32, kv, max_chunk=4)
    monkeypatch.setattr(be, "compile_decode", lambda step, cache: None)
    composed = m.new_cache(32, kv, max_chunk=4)  # this cache composes the ops
    assert m.plan(planned) is not None and m.plan(composed) is None
    for ids in ([7], [1, 2, 3], [9], [11], [4, 5], [6], [8]):
        ids = np.array(ids, np.int32)
        y_p, y_c = m.forward(ids, planned), m.forward(ids, composed)
        assert np.array_equal(y_p, y_c), ids
    for layer in range(m.cfg.num_hidden_layers):
        for name, arr in composed.raw(layer).items():
            assert np.array_equal(arr.view(np.uint8), planned.raw(layer)[name].view(np.uint8))


def test_kv_cache_rotation_is_public():
    from edgeinfer.backends.kvcache import HostKVCache, hadamard
    assert HostKVCache(1, 2, 64, 8, "f16").rotation is None
    r = HostKVCache(1, 2, 64, 8, "int8").rotation
    assert r.dtype == np.float32 and np.array_equal(r, hadamard(32))


def test_equality_control_sees_one_ulp(monkeypatch):
    """Control for the test above: one ulp changed in the plan's GLU output (the step-wise
    MLP, dense weights: no int8 activation rounding to absorb it) is caught by the same
    comparison."""
    from edgeinfer.backends.cpu import stepwise
    be = CpuBackend(threads=1)
    m = _model(be, q4=False)
    planned = m.new_cache(32, "int8")
    monkeypatch.setattr(be, "compile_decode", lambda step, cache: None)
    composed = m.new_cache(32, "int8")
    glu = stepwise.glu_into

    def nudged(y, g, u, gelu):
        glu(y, g, u, gelu)
        y[0, 0] = np.nextafter(y[0, 0], np.float32(np.inf))
        return y

    monkeypatch.setattr(stepwise, "glu_into", nudged)
    for c in (planned, composed):
        m.forward(np.array([1, 2, 3], np.int32), c)
    assert not np.array_equal(m.forward(np.array([9], np.int32), planned),
                              m.forward(np.array([9], np.int32), composed))
