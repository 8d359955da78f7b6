"""An untied GGUF embedding stays in the file's blocks (backends/blockrows.py), its rows
decoded on lookup (backends/cpu/blockrows.py).

* Decoders vs ``gguf.quants.dequantize``: the numpy reference and the CPU kernel are
  bit-identical on every legacy type, on quantized Gaussian rows and on hand-made blocks
  with extreme fp16 scales (max, negative, subnormal, zero); the embedding scale is a
  separate float32 rounding; bad ids and shapes are clear errors.
* Reader: a non-finite block scale is a ModelFormatError naming the tensor; a tied table
  (also the head) and a type with no decoder get no row table.
* The catalog Qwen GGUF (Q5_0 untied embedding): its rows equal the re-laid tensor's, and
  the model's greedy tokens and logits are bit-identical with and without the row table.
"""
from __future__ import annotations

import types

import gguf
import numpy as np
import pytest

from edgeinfer.backends.blockrows import BLOCK_TYPES, BlockRows
from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.backends.cpu.blockrows import dequant_block_rows
from edgeinfer.errors import ModelFormatError
from edgeinfer.readers.gguf import gguf_row_tables, read_gguf

TYPES = sorted(BLOCK_TYPES)


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def quantized_rows(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype])


def cpu_rows(t: BlockRows, ids, scale=1.0) -> np.ndarray:
    ids = np.asarray(ids, np.int64)
    out = np.full((ids.size, t.in_features), np.nan, np.float32)
    dequant_block_rows(out, t.raw, ids, t.kind, np.float32(scale))
    return out


@pytest.mark.parametrize("qtype", TYPES)
def test_decoders_equal_gguf_on_quantized_rows(qtype):
    raw = quantized_rows(qtype, 40, 96, seed=len(qtype))
    t = BlockRows(raw, qtype, "t")
    assert t.shape == (40, 96) and t.nbytes == raw.nbytes
    ids = np.array([0, 39, 7, 7, 12])
    want = gguf.quants.dequantize(raw[ids], gguf.GGMLQuantizationType[qtype])
    assert bits_equal(t.dequantize_rows(ids), want)
    assert bits_equal(cpu_rows(t, ids), want)
    assert bits_equal(t.dequantize(rows_per_chunk=16),
                      gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]))
    s = np.float32(5.65685424949238)  # gemma's sqrt(hidden) style embedding scale
    assert bits_equal(cpu_rows(t, ids, s), want * s)


@pytest.mark.parametrize("qtype", TYPES)
def test_decoders_equal_gguf_with_extreme_scales(qtype):
    bb = BLOCK_TYPES[qtype][0]
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (2, 4 * bb), dtype=np.uint8)
    d = np.array([[65504.0, -65504.0, 6e-8, 0.0], [-2.0 ** -14, 1.0, -3.0e-6, 0.5]], np.float16)
    b = raw.reshape(2, 4, bb)
    b[:, :, 0:2] = d.reshape(2, 4, 1).view(np.uint8)
    if qtype in ("Q4_1", "Q5_1"):
        b[:, :, 2:4] = d[::-1].reshape(2, 4, 1).view(np.uint8)  # mins: extremes too
    raw = b.reshape(2, 4 * bb)
    t = BlockRows(raw, qtype, "t")
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    assert np.isfinite(want).all() or qtype in ("Q4_1", "Q5_1")  # max * code may overflow
    assert bits_equal(t.dequantize_rows([0, 1]), want)
    assert bits_equal(cpu_rows(t, [0, 1]), want)


def test_bad_tables_and_ids_are_clear_errors():
    raw = quantized_rows("Q5_0", 4, 64, seed=1)
    with pytest.raises(ValueError, match="no row decoder"):
        BlockRows(raw, "Q6_K", "emb")
    with pytest.raises(ValueError, match=r"uint8 \[V, n \* 22\]"):
        BlockRows(raw[:, :-1], "Q5_0", "emb")
    t = BlockRows(raw, "Q5_0", "emb")
    with pytest.raises(IndexError, match="out of range 0..3"):
        t.dequantize_rows([4])
    be = CpuBackend(threads=1)
    with pytest.raises(IndexError, match="out of range 0..3"):
        be.embed(be.upload_embedding(t), np.array([0, -1]))


def _fake_gguf(raw: np.ndarray, qtype: str, with_head: bool):
    info = types.SimpleNamespace(qtype=int(gguf.GGMLQuantizationType[qtype]),
                                 dims=(raw.shape[1] // BLOCK_TYPES.get(qtype, (1,))[0] * 32,
                                       raw.shape[0]))
    g = types.SimpleNamespace(tensors={"token_embd.weight": info}, path="fake.gguf",
                              raw=lambda _info: raw)
    loaders = {"model.embed_tokens.weight": None}
    if with_head:
        loaders["lm_head.weight"] = None
    return g, loaders


def test_reader_checks_scales_and_skips_tied_tables():
    raw = quantized_rows("Q4_1", 8, 64, seed=2)
    g, loaders = _fake_gguf(raw, "Q4_1", with_head=True)
    t = gguf_row_tables(g, loaders)["model.embed_tokens.weight"]()
    assert isinstance(t, BlockRows) and t.qtype == "Q4_1" and t.shape == (8, 64)
    bad = raw.copy().reshape(8, 2, 20)
    bad[5, 1, 2:4] = np.array([np.inf], np.float16).view(np.uint8)  # a min, not the scale
    g, loaders = _fake_gguf(bad.reshape(8, 40), "Q4_1", with_head=True)
    with pytest.raises(ModelFormatError, match="token_embd.weight.*non-finite"):
        gguf_row_tables(g, loaders)["model.embed_tokens.weight"]()
    g, loaders = _fake_gguf(raw, "Q4_1", with_head=False)  # tied: the table is the head
    assert gguf_row_tables(g, loaders) == {}


def test_qwen_embedding_rows_and_greedy_output_unchanged(qwen_gguf):
    src = read_gguf(qwen_gguf)
    table = src.row_tables["model.embed_tokens.weight"]()
    assert table.qtype == "Q5_0" and table.shape == (151936, 896)
    ids = np.array([0, 1, 9707, 151643, 151935])
    relaid = src.tensors["model.embed_tokens.weight"]
    dense = relaid.dequantize()
    assert bits_equal(table.dequantize_rows(ids), dense[ids])
    assert bits_equal(cpu_rows(table, ids), dense[ids])
    del dense

    from edgeinfer.models.transformer import Transformer

    def run(be):
        tensors = src.runtime_tensors(be)
        m = Transformer(src.config, tensors, be, max_positions=64)
        return m, type(m.embed_tokens).__name__

    on = CpuBackend(threads=2)
    off = CpuBackend(threads=2)
    off.reads_block_rows = False
    (m_on, kind_on), (m_off, kind_off) = run(on), run(off)
    assert (kind_on, kind_off) == ("BlockRows", "CpuQuantWeight")
    prompt = np.array([151644, 872, 198, 7985, 264, 729, 13, 151645, 198], np.int32)
    outs = []
    for m in (m_on, m_off):
        cache = m.new_cache(64)
        plan = m.plan(cache)  # decode steps run the compiled plan, its embed stage included
        assert plan is not None and plan.embed.table is m.embed_tokens
        logits = [np.array(m.forward(prompt, cache)[-1])]
        tok = [int(np.argmax(logits[-1]))]
        for _ in range(6):
            logits.append(np.array(m.forward(np.array(tok[-1:], np.int32), cache)[-1]))
            tok.append(int(np.argmax(logits[-1])))
        outs.append((tok, np.stack(logits)))
    assert outs[0][0] == outs[1][0]
    assert bits_equal(outs[0][1], outs[1][1])
