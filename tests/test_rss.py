"""Resident memory: what the runtime gives back to the OS, and that results do not change.

Mechanisms (``edgeinfer.backends.osmemory``, re-exported by ``edgeinfer.memory``): heap
trimming, dropping the pages of file mappings, the copy-on-write file view an ``.eif``
8-bit embedding is used through, the per-forward release schedule; the CPU backend's use
of them (upload, embedding, prefill GEMM) and the RoPE table sized by the context.
Residency is read from ``/proc/self/smaps`` (Linux; skipped elsewhere). The end-to-end
check of the target (peak RSS during ``edgeinfer bench`` <= file + KV + 150 MB) on
SmolLM2 is ``-m slow``.
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from edgeinfer.backends import osmemory
from edgeinfer.backends.quantized import QuantizedTensor

from edgeinfer.memory import (
    ForwardReleaser,
    private_file_view,
    release_free_heap,
    release_mapped_pages,
    views_readonly_map,
)

linux = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")


def _mapping_rss_kb(addr: int) -> int:
    """Rss (KiB) of the mapping that holds address ``addr``."""
    hit = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                hit = lo <= addr < hi
            elif hit and head[0] == "Rss:":
                return int(head[1])
    raise AssertionError("address not mapped")


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture
def mapped(tmp_path):
    """(read-only mmap of a 4 MiB random file, its bytes as a RAM array)."""
    data = np.random.default_rng(0).integers(-128, 128, 4 << 20, dtype=np.int8)
    path = tmp_path / "t.bin"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return mm, data  # closed by the GC (arrays may still view it)


# ---- memory helpers -------------------------------------------------------------------
@linux
def test_release_mapped_pages_drops_residency_and_keeps_values(mapped):
    mm, data = mapped
    a = np.frombuffer(mm, np.int8, count=2 << 20, offset=8192).reshape(1024, 2048)
    assert views_readonly_map(a) and not views_readonly_map(data)
    total = int(a.astype(np.int64).sum())  # touches every page
    assert _mapping_rss_kb(a.ctypes.data) >= 2048
    n = release_mapped_pages(a, None, data)
    assert n == 2 << 20  # page-aligned range of `a` only; the RAM array is skipped
    assert _mapping_rss_kb(a.ctypes.data) == 0
    assert int(a.astype(np.int64).sum()) == total  # re-read from the page cache
    assert np.array_equal(a.reshape(-1), data[8192:8192 + (2 << 20)])


@linux
def test_release_mapped_pages_ignores_writable_maps(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(1 << 16))
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    a = np.frombuffer(mm, np.uint8)
    a[:10] = 7  # a private (copy-on-write) change that DONTNEED would discard
    assert not views_readonly_map(a)
    assert release_mapped_pages(a) == 0
    assert a[:10].tolist() == [7] * 10


@linux
def test_private_file_view_is_writable_same_bytes_and_releasable(mapped):
    mm, data = mapped
    a = np.frombuffer(mm, np.int8, count=4096 * 256, offset=4096 * 3 + 64).reshape(4096, 256)
    assert not a.flags.writeable
    v = private_file_view(a)
    assert v is not None and v.flags.writeable and v.shape == a.shape and v.dtype == a.dtype
    assert not v.flags.owndata and not np.shares_memory(v, data)
    assert np.array_equal(v, a)
    assert _mapping_rss_kb(v.ctypes.data) >= 1024  # all read
    assert release_mapped_pages(v) >= v.nbytes  # never written: its pages can go
    assert _mapping_rss_kb(v.ctypes.data) == 0
    assert np.array_equal(v[1000], a[1000])
    v[0, 0] ^= 1  # copy-on-write: the file and the read-only view are unchanged
    assert a[0, 0] == data[4096 * 3 + 64] != v[0, 0]
    assert release_mapped_pages(v) == 0  # a written page would be lost: kept
    assert v[0, 0] != a[0, 0]
    assert private_file_view(data.reshape(-1, 256)) is None  # not a file view
    assert private_file_view(a[:, ::2]) is None  # not contiguous


def test_release_free_heap_returns_freed_heap_to_the_os():
    libc = osmemory._libc()
    if libc is None or not hasattr(libc, "malloc_trim") or not os.path.exists("/proc/self/status"):
        pytest.skip("glibc malloc_trim and /proc needed")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    n, run, size = 1200, 64, 1024  # 75 MiB of 1 KiB blocks in runs of 64: heap chunks
    big, keep = [], []
    for _ in range(n):
        for _ in range(run):
            p = libc.malloc(size)
            ctypes.memset(p, 1, size)
            big.append(p)
        keep.append(libc.malloc(32))  # pins the heap: free() alone cannot shrink it
    before = _rss_kb()
    for p in big:
        libc.free(p)
    freed_only = _rss_kb()
    assert release_free_heap() is True
    trimmed = _rss_kb()
    for p in keep:
        libc.free(p)
    assert freed_only - trimmed > 0.5 * n * run * size / 1024, (before, freed_only, trimmed)


def test_forward_releaser_schedule(monkeypatch):
    calls = []
    monkeypatch.setattr(osmemory, "release_free_heap", lambda: calls.append("heap"))
    monkeypatch.setattr(osmemory, "release_jit_compiler_pages", lambda: calls.append("jit"))
    monkeypatch.setattr(osmemory, "release_mapped_pages", lambda *a: calls.append("map") or 0)
    r = ForwardReleaser(warm_forwards=2, layer_ops=4)
    r.note_tokens(256)  # first forward, a prefill of 3 layers
    for _ in range(12):
        r.after_op()
    assert calls == ["heap", "jit", "heap", "heap"]  # each layer; JIT pages after the 1st
    calls.clear()
    r.after_forward()
    assert calls == ["heap", "map", "jit"] and not r.first
    r.after_op()  # later forwards: after_op is a no-op
    assert calls == ["heap", "map", "jit"]
    calls.clear()
    r.note_tokens(1)  # second forward: a decode step, still a warm forward
    r.after_forward()
    assert calls == ["heap", "map", "jit"] and not r.due
    calls.clear()
    r.note_tokens(1)
    assert not r.due  # decode steps: nothing to do
    r.note_tokens(100)  # a later prefill chunk: the heap (and mapped tables) only
    r.after_forward()
    assert calls == ["heap", "map"] and not r.due


# ---- the CPU backend ------------------------------------------------------------------
def _q8_from_map(mm: mmap.mmap, rows: int, cols: int, group: int) -> QuantizedTensor:
    """An 8-bit symmetric table whose codes view the read-only map (as an .eif's)."""
    qw = np.frombuffer(mm, np.int8, count=rows * cols).reshape(rows, cols)
    sc = (np.random.default_rng(1).random((rows, cols // group)) * 0.01 + 1e-3).astype(np.float16)
    return QuantizedTensor(qw, sc, None, 8, group, cols)


@linux
def test_upload_embedding_views_the_file_not_a_copy(mapped):
    from edgeinfer.backends.cpu import CpuBackend
    from edgeinfer.backends.cpu.repack import repack

    mm, _ = mapped
    be = CpuBackend(threads=1)
    for group in (128, 512):
        q = _q8_from_map(mm, 8192, 512, group)  # 4 MiB of codes
        w = be.upload_embedding(q)
        ref = repack(q)
        assert w.wp.flags.writeable and not w.wp.flags.owndata and not np.shares_memory(w.wp, ref.wp)
        assert release_mapped_pages(q.qweight) > 0  # forget the pages repack() read
        ids = np.array([3, 8191, 4000, 3])
        x = be.embed(w, ids, 0.5)
        assert np.array_equal(x, be.embed(ref, ids, 0.5))
        assert np.allclose(x, q.dequantize(ids) * 0.5, rtol=1e-6, atol=1e-7)
        assert release_mapped_pages(w.wp) > 0  # what the lookups mapped is given back
        assert _mapping_rss_kb(w.wp.ctypes.data) == 0
        assert np.array_equal(be.embed(w, ids, 0.5), x)
        h = np.random.default_rng(2).standard_normal((1, 512)).astype(np.float32)
        assert np.array_equal(be.linear(h, w), be.linear(h, ref))  # tied head: same GEMV


@linux
def test_prefill_forward_gives_back_an_untied_tables_pages(mapped):
    from edgeinfer.backends.cpu import CpuBackend

    mm, _ = mapped
    be = CpuBackend(threads=1)
    table = be.upload_embedding(_q8_from_map(mm, 8192, 512, 128))
    rng = np.random.default_rng(3)
    head = be.upload_weight(QuantizedTensor(rng.integers(-127, 128, (64, 512), dtype=np.int8),
                                            np.full((64, 4), 0.01, np.float16), None, 8, 128,
                                            512))
    x = be.embed(table, np.arange(0, 8192, 97), 1.0)  # a "prefill" of 85 ids
    assert _mapping_rss_kb(table.wp.ctypes.data) > 0
    be.logits(x[-1:], head)  # end of the forward: released
    assert _mapping_rss_kb(table.wp.ctypes.data) == 0
    x = be.embed(table, np.arange(0, 8192, 97), 1.0)
    be.logits(x[-1:], table)  # tied: the head streams the table every step, kept
    assert _mapping_rss_kb(table.wp.ctypes.data) > 0


@linux
def test_a_tied_table_is_uploaded_as_a_weight_an_untied_one_as_a_file_view(mapped, stories_dir):
    """A tied embedding is also the output head, streamed whole every decode step: the CPU
    backend holds its own copy (anonymous memory, which may use huge pages), not the
    file view an untied lookup table gets (``Transformer.tied_as_weight``)."""
    import dataclasses

    from edgeinfer.backends.cpu import CpuBackend
    from edgeinfer.models.transformer import Transformer
    from edgeinfer.readers import read_model

    mm, _ = mapped
    src = read_model(str(stories_dir))
    v, d = src.config.vocab_size, src.config.hidden_size
    table = _q8_from_map(mm, v, d, d)  # 8-bit, one scale per row, codes in the file map
    tensors = dict(src.tensors, **{"model.embed_tokens.weight": table})
    be = CpuBackend(threads=1)
    untied = Transformer(src.config, tensors, be)
    assert not untied.embed_tokens.wp.flags.owndata and untied.lm_head is not untied.embed_tokens
    tied_cfg = dataclasses.replace(src.config, tie_word_embeddings=True)
    tensors.pop("lm_head.weight")
    tied = Transformer(tied_cfg, tensors, be)
    assert tied.lm_head is tied.embed_tokens and tied.embed_tokens.wp.flags.owndata
    assert not np.shares_memory(tied.embed_tokens.wp, table.qweight)
    ids = np.array([0, v - 1, 7])
    assert np.array_equal(be.embed(tied.embed_tokens, ids), be.embed(untied.embed_tokens, ids))
    Transformer.tied_as_weight = False  # the alternative benchmarks/layout_ab.py times
    try:
        view = Transformer(tied_cfg, tensors, be)
    finally:
        Transformer.tied_as_weight = True
    assert not view.embed_tokens.wp.flags.owndata
    h = np.random.default_rng(2).standard_normal((1, d)).astype(np.float32)
    assert np.array_equal(be.linear(h, view.lm_head), be.linear(h, tied.lm_head))


def test_upload_embedding_in_ram_shares_owned_codes_and_copies_views():
    """An 8-bit table whose codes are an array of their own in RAM (a GGUF's Q8_0 table
    after relayout) is used as it is, not copied a second time; codes that view a larger
    array are copied."""
    from edgeinfer.backends.cpu import CpuBackend, CpuQuantWeight

    be = CpuBackend(threads=1)
    rng = np.random.default_rng(0)
    codes = rng.integers(-127, 128, (64, 128), dtype=np.int8)
    scales = np.full((64, 1), 0.01, np.float16)
    owned = QuantizedTensor(codes[:, :96].copy(), scales, None, 8, 96, 96)  # in RAM
    view = QuantizedTensor(codes[:, :96], scales, None, 8, 96, 96)  # part of a larger array
    ids = np.array([0, 63])
    for q, shared in ((owned, True), (view, False)):
        w = be.upload_embedding(q)
        assert isinstance(w, CpuQuantWeight)
        assert np.shares_memory(w.wp, q.qweight) == shared
        assert np.allclose(be.embed(w, ids), q.dequantize(ids), rtol=1e-6)


@linux
def test_upload_weight_gives_back_the_source_pages(mapped):
    from edgeinfer.backends.cpu import CpuBackend

    mm, _ = mapped
    q = _q8_from_map(mm, 4096, 1024, 128)
    assert int(q.qweight.astype(np.int64).sum()) != 0  # resident now
    assert _mapping_rss_kb(q.qweight.ctypes.data) >= 4096
    w = CpuBackend(threads=1).upload_weight(q)
    assert _mapping_rss_kb(q.qweight.ctypes.data) == 0
    assert np.array_equal(w.wp, q.qweight)  # the copy is intact


def test_fusing_qkv_frees_the_member_copies():
    """group_linears concatenates q|k|v (gate|up) once; the members' own arrays die with
    the handles the caller replaces by the group's (the model does: the freed heap is
    what the first-forward trims give back)."""
    import gc
    import weakref

    from edgeinfer.backends.cpu import CpuBackend

    rng = np.random.default_rng(0)
    be = CpuBackend(threads=1)

    def q4(out):
        return be.upload_weight(QuantizedTensor(
            rng.integers(0, 256, (out, 64), dtype=np.uint8),
            np.full((out, 1), 0.01, np.float16), None, 4, 128, 128))

    ws = [q4(64), q4(32), q4(32)]
    old = [weakref.ref(a) for w in ws for a in (w.wp, w.sc, w.sz)]
    x = rng.standard_normal((5, 128)).astype(np.float32)
    want = [be.linear(x, w) for w in ws]
    group = be.group_linears(ws, [None] * 3)
    ws = list(group.weights)  # as the model does
    got = be.linear_many(x, group)
    for g, y in zip(got, want):
        np.testing.assert_allclose(g, y, rtol=1e-5, atol=1e-5)
    gc.collect()
    assert all(r() is None for r in old)
    assert all(np.shares_memory(w.wp, group.weight.wp) for w in ws)


def test_prefill_gemm_writes_tiles_into_the_output():
    from edgeinfer.backends.cpu import CpuBackend
    from edgeinfer.backends.cpu.gemm import gemm_dense, gemm_quant
    from edgeinfer.backends.cpu.repack import repack

    rng = np.random.default_rng(0)
    out, k, t = 700, 256, 37  # tiles of uneven size, T not a multiple of anything
    codes = rng.integers(0, 16, (out, k), dtype=np.uint8)
    q = QuantizedTensor((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8),
                        (rng.random((out, 2)) * 0.02).astype(np.float16), None, 4, 128, k)
    w = repack(q)
    x = rng.standard_normal((t, k)).astype(np.float32)
    bias = rng.standard_normal(out).astype(np.float32)
    pool = CpuBackend(threads=2)._pool
    wd = q.dequantize().astype(np.float64)
    y = gemm_quant(x, w, bias, pool)
    assert y.shape == (t, out) and y.flags.c_contiguous
    np.testing.assert_allclose(y, x.astype(np.float64) @ wd.T + bias, rtol=2e-5, atol=2e-5)
    wf = wd.astype(np.float32)
    yd = gemm_dense(x, wf, None, pool)
    np.testing.assert_allclose(yd, x.astype(np.float64) @ wd.T, rtol=2e-5, atol=2e-5)


# ---- a whole model --------------------------------------------------------------------
@pytest.fixture(scope="module")
def stories_eif(tmp_path_factory):
    from conftest import STORIES

    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260K not found: {STORIES}")
    from edgeinfer.quant.convert import convert

    out = tmp_path_factory.mktemp("eif") / "stories.eif"
    convert(str(STORIES), str(out), method="rtn", group_size=32, progress=False)
    return out


@linux
def test_model_rope_follows_context_and_embedding_stays_in_the_file(stories_eif):
    from edgeinfer import api
    from edgeinfer.readers import read_model

    src = read_model(str(stories_eif))
    assert src.config.max_position_embeddings > 100
    model = api.Model(src, backend="cpu", n_ctx=100, kv_dtype="f32")
    for cos, sin in model.transformer._rope.values():
        assert cos.shape[0] == sin.shape[0] == 100  # the context, not the model's maximum
    emb = model.transformer.embed_tokens
    assert not emb.wp.flags.owndata and emb.wp.flags.writeable  # the file, copy-on-write
    ref = api.Model(read_model(str(stories_eif)), backend="reference", n_ctx=100,
                    kv_dtype="f32")
    ids = model.encode_prompt("Once upon a time")
    a = model.transformer.forward(np.asarray(ids), model.engine.cache)
    b = ref.transformer.forward(np.asarray(ids), ref.engine.cache)
    # the CPU head GEMV quantizes activations to int8 (~1e-2 normalized error, by design)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2 and a.argmax() == b.argmax()


@pytest.mark.slow
@linux
def test_bench_peak_rss_within_target_smollm2(smollm2_gguf, tmp_path):
    """The issue's target on the default model: run_peak_rss_mb <= file + KV + 150 MB."""
    exe = Path(sys.executable).with_name("edgeinfer")
    eif = tmp_path / "smol.eif"
    subprocess.run([str(exe), "convert", str(smollm2_gguf), "-o", str(eif), "--method", "rtn",
                    "-q"], check=True)
    # warm the Numba disk cache first: kernels compiled during the measured run (a fresh
    # install, or an edited kernel module) add LLVM's transient memory (measured: 349 MiB
    # with backends/cpu/plan.py's kernels not yet cached, 258 MiB once they were; 355 MiB
    # once after a kernel edit with a 32 + 4 token warm-up; 350 once more with a
    # `--repeat 1` warm-up): the measured run's own command
    subprocess.run([str(exe), "bench", str(eif), "--prompt-tokens", "256", "--gen-tokens",
                    "64", "--repeat", "2", "--json", "-q"], check=True, capture_output=True)
    r = subprocess.run([str(exe), "bench", str(eif), "--prompt-tokens", "256", "--gen-tokens",
                        "64", "--repeat", "2", "--json", "-q"], check=True, capture_output=True,
                       text=True)
    d = json.loads(r.stdout)
    assert d["rss_target_mb"] == pytest.approx(d["file_mb"] + d["kv_mb"] + 143.05, abs=0.01)
    assert d["run_peak_rss_mb"] <= d["rss_target_mb"], d


def test_a_loaded_model_drops_its_source_tensors_and_tokenizer_text(stories_gguf):
    """After the upload a Model holds a slim copy of its source: no tensors, row tables or
    tokenizer.json text (Gemma 3's is 67 MiB of str), the caller's source left whole, and the
    original not kept alive; generation is unchanged."""
    import gc
    import weakref

    from edgeinfer import api
    from edgeinfer.readers.gguf import read_gguf

    src = read_gguf(stories_gguf)
    text, names = src.tokenizer_json, sorted(src.tensors)
    expect_bytes = api.source_weight_bytes(src, "cpu")
    fresh = api.Model(read_gguf(stories_gguf), backend="cpu")
    prompt = fresh.tokenizer.encode("Once upon a time")
    want = [e.token for e in fresh.engine.stream(prompt, max_tokens=12, stop=())
            if e.token is not None]
    m = api.Model(src, backend="cpu")
    assert (m.source.tensors, m.source.row_tables, m.source.tokenizer_json) == ({}, {}, "")
    assert m.source.path == src.path and m.source.config == src.config
    assert m.source.generation == src.generation and m.source.shapes == src.shapes
    assert src.tokenizer_json == text and sorted(src.tensors) == names  # caller's, untouched
    assert m.weight_bytes == expect_bytes > 0
    ref = weakref.ref(src)
    del src
    gc.collect()
    assert ref() is None  # nothing in the model holds the full source
    got = [e.token for e in m.engine.stream(prompt, max_tokens=12, stop=())
           if e.token is not None]
    assert got == want and len(got) == 12
