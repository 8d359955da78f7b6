"""Continuous batching: a batched decode step gives each sequence exactly the logits it
gets alone (``Transformer.forward_batch``), on stories260K (dense float32 from the HF
folder) and SmolLM2-135M (the catalog GGUF's native blocks), for every KV kind.

The rows of the step change membership between steps (sequences join and leave), use the
multi-token integer GEMM for B = 2..4 (4-token blocks plus a remainder) and sit at different
positions. Control: the float-activation path (``exact_decode``) gives other logits, so
equality is not vacuous.
"""
from __future__ import annotations

import numpy as np
import pytest
from edgeinfer.backends import get_backend
from edgeinfer.models.transformer import Transformer
from edgeinfer.readers import read_model

KVS = ["f32", "f16", "int8", "int4"]
LENS = [5, 17, 40, 9]
# (step, members): who decodes in each batched step (join/leave between steps)
SCHEDULE = [(0, [0, 1]), (1, [0, 1, 2, 3]), (2, [3, 1, 2]), (3, [0, 2]), (4, [0, 1, 2, 3])]


def _transformer(src, backend="cpu", **kw):
    opts = {"threads": 2} if backend == "cpu" else {}
    return Transformer(src.config, src.tensors, get_backend(backend, **opts, **kw), 128)


def _prompts(src):
    rng = np.random.default_rng(0)
    return [rng.integers(3, src.config.vocab_size, n).astype(np.int32) for n in LENS]


def _token(i, step):
    return np.int32(7 + 13 * i + step)


def _alone(tr, prompts, kv):
    """Each sequence's logits decoded by itself (the compiled plan), per step it is in."""
    out = {}
    for i, p in enumerate(prompts):
        c = tr.new_cache(128, kv)
        tr.forward(p, c)
        for step, members in SCHEDULE:
            if i in members:
                out[i, step] = tr.forward(np.array([_token(i, step)]), c).copy()
    return out


def _batched(tr, prompts, kv):
    caches = []
    for p in prompts:
        caches.append(tr.new_cache(128, kv))
        tr.forward(p, caches[-1])
    out = {}
    for step, members in SCHEDULE:
        y = tr.forward_batch(np.array([_token(i, step) for i in members]),
                             [caches[i] for i in members])
        assert y.shape == (len(members), tr.cfg.vocab_size)
        for r, i in enumerate(members):
            out[i, step] = y[r:r + 1].copy()
    return out, caches


def _check(src, kv, backend="cpu"):
    tr = _transformer(src, backend)
    prompts = _prompts(src)
    alone = _alone(tr, prompts, kv)
    got, caches = _batched(tr, prompts, kv)
    assert set(got) == set(alone) and len(got) == sum(len(m) for _, m in SCHEDULE)
    for key in alone:
        assert np.array_equal(got[key], alone[key]), key
        assert np.isfinite(got[key]).all() and got[key].std() > 0.1
    for i, c in enumerate(caches):  # each cache advanced by its own steps only
        assert c.length == LENS[i] + sum(i in m for _, m in SCHEDULE)
    return tr, prompts, got


@pytest.fixture(scope="module")
def stories(stories_dir):
    return read_model(str(stories_dir))


@pytest.mark.parametrize("kv", KVS)
def test_batched_step_bit_identical_stories(stories, kv):
    _check(stories, kv)


@pytest.mark.parametrize("kv", KVS)
def test_batched_step_bit_identical_smollm2(smollm2, kv):
    _check(smollm2, kv)


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_batched_step_bit_identical_reference_backend(stories, kv):
    _check(stories, kv, backend="reference")


def test_control_dense_gemm_rows_differ_without_rows_alone(stories):
    """Control: the same composition with the dense weights' M = B BLAS GEMM (the flag
    off) gives other bits (ulps), so the bit-identity above is not vacuous."""
    from edgeinfer.models.block import RowCaches, block_forward

    tr = _transformer(stories)
    prompts = _prompts(stories)
    alone = _alone(tr, prompts, "f32")
    caches = []
    for p in prompts:
        caches.append(tr.new_cache(128, "f32"))
        tr.forward(p, caches[-1])
    ids = np.array([_token(i, 0) for i in range(4)])
    pos = np.array([c.length for c in caches], np.int32)
    be, cfg = tr.backend, tr.cfg
    assert be.rows_alone is False
    x = be.embed(tr.embed_tokens, ids, cfg.embed_scale)
    for i, blk in enumerate(tr.blocks):
        x = block_forward(be, blk, x, pos, RowCaches(caches), i)
    y = be.logits(x, tr.lm_head, None, norm=(tr.norm, cfg.rms_norm_eps, cfg.norm_unit_offset))
    diffs = [float(np.abs(y[i] - alone[i, 0][0]).max()) for i in (0, 1)]
    assert max(diffs) > 0 and max(diffs) < 1e-3


def test_forward_batch_refuses_a_cache_twice_and_a_full_cache(stories):
    tr = _transformer(stories)
    c = tr.new_cache(8, "f32")
    tr.forward(np.arange(3, 10, dtype=np.int32), c)
    with pytest.raises(ValueError, match="twice"):
        tr.forward_batch(np.array([1, 2], np.int32), [c, c])
    full = tr.new_cache(8, "f32")
    tr.forward(np.arange(3, 11, dtype=np.int32), full)
    with pytest.raises(ValueError, match="does not fit"):
        tr.forward_batch(np.array([1, 2], np.int32), [c, full])
    assert c.length == 7 and full.length == 8  # nothing written on refusal


def test_int4_prefix_reuse_never_changes_logits(stories_q):
    """int4 KV fixes its K statistics from the first write's first 32 rows: a prefix is
    reused only where a fresh prefill takes its statistics from the same rows (else it is
    recomputed), so a cache hit gives the logits of a cold prefill (quantized linears;
    dense float32 ones differ by ulps whatever the KV, see edgeinfer.batching)."""
    from edgeinfer import api

    m = api.Model(stories_q, backend="cpu", n_ctx=256, kv_dtype="int4", threads=2)
    e = m.engine
    rng = np.random.default_rng(3)
    p = [1] + [int(t) for t in rng.integers(3, 500, 59)]

    def cold(ids):
        e.reset()
        return e.prefill(ids)[0].copy()

    cases = [(p[:3] + [7] * 50, p[:9], 0),      # stats from another sequence's rows: no reuse
             (p[:5], p[:20], 0),                # stats from 5 rows, a fresh one takes 20
             (p[:40] + [9] * 5, p, 40)]         # the 32 rows are the prompt's own: reused
    for before, ids, reused in cases:
        want = cold(ids)
        e.reset()
        e.prefill(before)
        got, n = e.prefill(ids)
        assert n == reused
        assert np.array_equal(got, want), (before[:3], len(ids), n)
    # control: had the first case kept its 3 tokens, the logits would differ
    e.reset()
    e.prefill(cases[0][0])
    e.cache.trim(3)
    e.cached_ids = e.cached_ids[:3]
    lg = m.transformer.forward(np.asarray(p[3:9], np.int32), e.cache)[-1]
    assert not np.array_equal(lg, cold(p[:9]))


def test_scheduler_chunk_small_only_where_rows_do_not_depend_on_m(stories, smollm2):
    from edgeinfer.batching import DEFAULT_CHUNK, scheduler_chunk

    assert scheduler_chunk(_transformer(smollm2), 512) == DEFAULT_CHUNK  # all quantized
    assert scheduler_chunk(_transformer(stories), 512) == 512  # dense float32 (HF folder)
    assert scheduler_chunk(_transformer(smollm2), 64) == 64


def test_scheduler_thread_exits_when_idle_and_restarts(stories_q):
    """No thread outlives the model's work (a dropped model is freed); the next call
    starts a new one and gets the same tokens."""
    import time

    from edgeinfer import api

    m = api.Model(stories_q, backend="cpu", n_ctx=128, threads=2, parallel=2)
    first = m.generate("Once upon a time", max_tokens=12)
    sched = m.pool.scheduler
    deadline = time.monotonic() + 20
    while sched._thread is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sched._thread is None
    assert m.generate("Once upon a time", max_tokens=12) == first and len(first) > 10
