"""GGUF block types run natively: lossless re-layout, kernel parity, the real SmolLM2 file.

* Re-layout: ``QuantizedTensor.dequantize`` of every re-laid type equals
  ``gguf.quants.dequantize`` of the source blocks bit for bit (random blocks, every code
  pattern, and real tensors of the catalog files).
* Kernels: the CPU backend on the new layouts (float mins, 8-bit 5-bit codes, Q6_K's
  16-column groups) against the numpy reference backend, decode (T = 1, int8
  activations) and prefill (T > 1); more on Q6_K in tests/test_gguf_q6k.py.
* Real model: SmolLM2's Q4_1 / Q8_0 file loads with no float32 weight copy, the
  reference backend gives bit-identical logits to the dequantized file, and the CPU
  backend agrees with it.
"""
from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest

from edgeinfer.backends.cpu import CpuBackend, CpuQuantWeight
from edgeinfer.backends.quantized import QuantizedTensor
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.errors import ModelFormatError
from edgeinfer.readers.gguf import read_gguf
from edgeinfer.readers.gguf_blocks import NATIVE_TYPES, relayout
from edgeinfer.readers.gguf_file import GGUFFile

QT = gguf.GGMLQuantizationType
REF = ReferenceBackend()
CPU = CpuBackend()
ACT_TOL = 2e-4  # the integer linears' 15-bit activations (tests/test_cpu_kernels.py)
FLOAT_TOL = 1e-5

#: byte offsets of each type's fp16 fields (d, and m / dmin) inside a block
_F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def nerr(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def random_blocks(rng, qname: str, rows: int, blocks_per_row: int) -> np.ndarray:
    """Random bytes [rows, row_bytes] of ``qname`` blocks with finite fp16 scale fields
    (every code / sub-scale bit pattern occurs)."""
    block, size = gguf.GGML_QUANT_SIZES[QT[qname]]
    raw = rng.integers(0, 256, (rows, blocks_per_row, size), dtype=np.uint8)
    for at in _F16_FIELDS[qname]:
        vals = (rng.standard_normal((rows, blocks_per_row)) * 0.01).astype(np.float16)
        raw[:, :, at:at + 2] = vals.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return raw.reshape(rows, blocks_per_row * size)


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qname", sorted(NATIVE_TYPES))
def test_relayout_is_bit_identical_to_gguf_dequantize(qname):
    rng = np.random.default_rng(len(qname) * 7 + ord(qname[-1]))
    block = gguf.GGML_QUANT_SIZES[QT[qname]][0]
    raw = random_blocks(rng, qname, 9, 3 if block == 256 else 6)
    w = relayout(raw, qname, "t", "x.gguf")
    ref = gguf.quants.dequantize(raw, QT[qname])
    assert w.shape == ref.shape == (9, raw.shape[1] // gguf.GGML_QUANT_SIZES[QT[qname]][1] * block)
    assert bits_equal(w.dequantize(), ref)
    assert bits_equal(w.dequantize(rows=np.array([4, 0])), ref[[4, 0]])  # embedding lookups
    # control: one flipped code bit changes the result (the comparison can fail)
    raw2 = raw.copy()
    raw2[3, -1] ^= 0x10
    assert not bits_equal(relayout(raw2, qname, "t", "x.gguf").dequantize(), ref)


@pytest.mark.parametrize("qname", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_relayout_of_gguf_quantized_floats(qname):
    """Blocks made by gguf's own quantizer (realistic codes and scales) round-trip."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((5, 128)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(x, QT[qname])
    w = relayout(raw, qname, "t", "x.gguf")
    assert bits_equal(w.dequantize(), gguf.quants.dequantize(raw, QT[qname]))
    assert np.abs(w.dequantize() - x).max() < 0.13 * np.abs(x).max()  # x, within a 4-bit step


def test_relayout_sizes_are_the_files_own():
    rng = np.random.default_rng(0)
    want = {"Q4_0": 4.5, "Q4_1": 5.0, "Q8_0": 8.5, "Q5_0": 8.5, "Q5_1": 9.0, "Q4_K": 6.0,
            "Q5_K": 10.0, "Q6_K": 10.0}
    for qname, bpw in want.items():
        w = relayout(random_blocks(rng, qname, 4, 2), qname, "t", "x.gguf")
        assert w.bits_per_weight == bpw, qname


@pytest.mark.parametrize("qname", sorted(NATIVE_TYPES))
def test_relayout_refuses_a_partial_block(qname):
    raw = random_blocks(np.random.default_rng(1), qname, 2, 2)[:, :-1]  # one byte short
    with pytest.raises(ModelFormatError, match=r"x\.gguf.*'blk\.0\.attn_q\.weight'.*whole number"):
        relayout(np.ascontiguousarray(raw), qname, "blk.0.attn_q.weight", "x.gguf")


def test_quantized_tensor_mins_are_validated():
    codes = np.zeros((2, 16), np.uint8)
    s = np.ones((2, 1), np.float16)
    with pytest.raises(ValueError, match="mins"):
        QuantizedTensor(codes, s, None, 4, 32, 32, mins=np.ones((2, 2), np.float16))
    with pytest.raises(ValueError, match="not both"):
        QuantizedTensor(codes, s, np.zeros((2, 1), np.uint8), 4, 32, 32, mins=s.copy())
    with pytest.raises(ValueError, match="padded"):
        QuantizedTensor(codes, s, None, 4, 32, 31, mins=s.copy())


# ---- CPU kernels on the re-laid layouts vs the reference backend ----------------------------
KCASES = [("Q4_1", 37, 4), ("Q4_1", 300, 18), ("Q4_0", 13, 6), ("Q8_0", 9, 18),
          ("Q5_0", 33, 6), ("Q5_1", 21, 6), ("Q5_1", 260, 18), ("Q4_K", 11, 2),
          ("Q5_K", 11, 2), ("Q5_K", 70, 3),
          ("Q6_K", 11, 2), ("Q6_K", 130, 3)]


@pytest.mark.parametrize("qname,out,nblk", KCASES)
@pytest.mark.parametrize("t", [1, 7])
def test_cpu_linear_on_relaid_weights_matches_reference(qname, out, nblk, t):
    rng = np.random.default_rng(out * 31 + nblk + t)
    raw = random_blocks(rng, qname, out, nblk)
    w = relayout(raw, qname, "t", "x.gguf")
    x = rng.standard_normal((t, w.in_features)).astype(np.float32)
    bias = rng.standard_normal(out).astype(np.float32)
    h = CPU.upload_weight(w)
    bits = {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}.get(qname, w.bits)  # repack's codes
    assert isinstance(h, CpuQuantWeight) and h.bits == bits  # the integer kernels, no float copy
    ref = REF.linear(x, REF.upload_weight(w), bias)
    assert bits_equal(REF.upload_weight(w), gguf.quants.dequantize(raw, QT[qname]))
    y = CPU.linear(x, h, bias)
    assert nerr(y, ref) < ACT_TOL  # decode GEMV and prefill GEMM: the same integer numerics
    if t == 1:  # control: without the mins term the result is far off (they are used)
        if w.mins is not None:
            h0 = CPU.upload_weight(QuantizedTensor(w.qweight, w.scales, None, w.bits,
                                                   w.group_size, w.in_features))
            assert nerr(CPU.linear(x, h0, bias), ref) > 3e-2


@pytest.mark.parametrize("qname", ["Q8_0", "Q5_0", "Q5_1", "Q4_1", "Q5_K"])
def test_cpu_embedding_rows_of_relaid_tables_are_exact(qname):
    rng = np.random.default_rng(5)
    w = relayout(random_blocks(rng, qname, 50, 4), qname, "t", "x.gguf")
    ids = np.array([3, 0, 49, 3])
    got = CPU.embed(CPU.upload_embedding(w), ids, scale=1.0)
    np.testing.assert_allclose(got, w.dequantize(rows=ids), rtol=1e-6, atol=1e-7)


# ---- the real catalog files -----------------------------------------------------------------
def test_real_catalog_tensors_relayout_bit_identical(smollm2_gguf, qwen_gguf, gemma_gguf):
    """The smallest 2-D tensor of each native type in each catalog file."""
    seen = set()
    for path in (smollm2_gguf, qwen_gguf, gemma_gguf):
        g = GGUFFile(path)
        first: dict[str, object] = {}
        for info in sorted(g.tensors.values(), key=lambda i: i.nbytes):
            qn = QT(info.qtype).name
            if qn in NATIVE_TYPES and len(info.dims) == 2:
                first.setdefault(qn, info)
        for qn, info in first.items():
            w = relayout(g.raw(info), qn, info.name, str(path))
            assert bits_equal(w.dequantize(), g.dequantize(info)), (path, info.name)
            seen.add(qn)
    assert seen == {"Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_gguf):
    return read_gguf(smollm2_gguf), read_gguf(smollm2_gguf, native=False)


def test_smollm2_loads_natively_with_no_float_weights(smollm2_pair):
    native, flt = smollm2_pair
    kinds = {n: type(native.tensors[n]).__name__ for n in native.tensors}
    linear = [n for n in kinds if n.endswith("_proj.weight")]
    assert len(linear) == 7 * 30 and all(kinds[n] == "QuantizedTensor" for n in linear)
    emb = native.tensors["model.embed_tokens.weight"]
    assert isinstance(emb, QuantizedTensor) and (emb.bits, emb.group_size) == (8, 32)
    q = native.tensors["model.layers.2.self_attn.q_proj.weight"]
    assert q.mins is not None and (q.bits, q.group_size) == (4, 32)
    # the llama Q/K row un-permutation applies to codes, scales and mins alike
    for n in ("model.layers.2.self_attn.q_proj.weight", "model.layers.2.self_attn.k_proj.weight",
              "model.layers.2.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert bits_equal(native.tensors[n].dequantize(), flt.tensors[n]), n
    total = sum(t.nbytes for t in native.tensors.values())
    assert total == native.provenance["native_weight_bytes"]
    assert total < 1.0 * 98362432  # the file's own size (98 MB), not float32's 540 MB


def test_smollm2_reference_logits_equal_the_dequantized_file(smollm2_pair):
    from edgeinfer import api

    native, flt = smollm2_pair
    ids = np.array([1, 504, 3458, 282, 4649, 314], np.int32)

    def logits(src, backend):
        tr = api.Model(src, backend=backend, n_ctx=64).transformer
        cache = tr.new_cache(64)
        full = np.asarray(tr.forward(ids, cache, all_logits=True))  # prefill, T = 6
        step = np.asarray(tr.forward(np.array([28], np.int32), cache))  # decode, T = 1
        return full, step.reshape(-1)

    a, a1 = logits(native, "reference")
    b, b1 = logits(flt, "reference")
    assert np.array_equal(a, b) and np.array_equal(a1, b1)  # same float32 weights and math
    c, c1 = logits(native, "cpu")
    assert nerr(c, a) < 2e-3 and (c.argmax(-1) == a.argmax(-1)).all()
    assert nerr(c1, a1) < 3e-2 and c1.argmax() == a1.argmax()  # int8 activations, 30 layers


def test_unsupported_types_are_logged_not_silent(qwen_gguf, caplog, monkeypatch):
    """Every type of the catalog files is native now: with Q6_K taken out of the table,
    the Qwen file's Q6_K tensors load as float32 and say so (and, put back, natively)."""
    from edgeinfer.readers import gguf_blocks

    q6k = gguf_blocks.NATIVE_TYPES["Q6_K"]
    monkeypatch.delitem(gguf_blocks.NATIVE_TYPES, "Q6_K")
    with caplog.at_level(logging.INFO, logger="edgeinfer"):
        src = read_gguf(qwen_gguf)
    msg = [r.getMessage() for r in caplog.records if "dequantized to float32" in r.getMessage()]
    assert len(msg) == 1 and "12 Q6_K tensor(s)" in msg[0] and "ffn_down.weight" in msg[0]
    q6 = [n for n in src.shapes if n.endswith("down_proj.weight")]
    types = {type(src.tensors[n]).__name__ for n in q6}
    assert types == {"QuantizedTensor", "ndarray"}  # Q4_K native, Q6_K dequantized
    monkeypatch.setitem(gguf_blocks.NATIVE_TYPES, "Q6_K", q6k)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edgeinfer"):
        src = read_gguf(qwen_gguf)
    assert not any("dequantized to float32" in r.getMessage() for r in caplog.records)
    assert {type(src.tensors[n]).__name__ for n in q6} == {"QuantizedTensor"}


def test_a_nan_block_scale_is_a_format_error_naming_the_tensor(smollm2_gguf, tmp_path):
    """A hostile file: one fp16 block scale set to NaN (0x7E00) in a Q4_1 tensor; loading
    the tensor natively refuses it, naming the file and the tensor (the float path's
    check of the dequantized values does too)."""
    bad = tmp_path / "bad.gguf"
    data = bytearray(smollm2_gguf.read_bytes())
    info = GGUFFile(smollm2_gguf).tensors["blk.4.ffn_up.weight"]
    data[info.offset + 20 * 7:info.offset + 20 * 7 + 2] = b"\x00\x7e"  # block 7's d
    bad.write_bytes(bytes(data))
    src = read_gguf(bad)
    with pytest.raises(ModelFormatError, match=r"bad\.gguf.*model\.layers\.4\.mlp\.up_proj"
                                               r"\.weight \(blk\.4\.ffn_up\.weight\) scales.*non-finite"):
        src.tensors["model.layers.4.mlp.up_proj.weight"]
    with pytest.raises(ModelFormatError, match=r"bad\.gguf.*up_proj.*non-finite"):
        read_gguf(bad, native=False).tensors["model.layers.4.mlp.up_proj.weight"]
    assert isinstance(src.tensors["model.layers.4.mlp.gate_proj.weight"], QuantizedTensor)


@pytest.mark.slow
def test_smollm2_catalog_file_greedy_golden_text(smollm2_pair):
    """The catalog file run natively on the CPU backend (prefill, then 32 decode steps with
    int8 activations) greedily writes what the numpy oracle writes on the dequantized
    file, token for token."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from greedy import greedy

    from edgeinfer.api import tokenizer_for
    from edgeinfer.models.transformer import Transformer

    native, flt = smollm2_pair
    tok = tokenizer_for(native)
    ids = tok.encode("Once upon a time, there was a little girl named")
    ours = greedy(Transformer(native.config, native.tensors, CPU, 256), ids, 32)
    oracle = greedy(Transformer(flt.config, flt.tensors, REF, 256), ids, 32)
    assert ours == oracle
    assert tok.decode(ours) == (" Emma who loved to play in the sun. She would often go to the "
                                "beach and play with her friends. One day, she decided to go to "
                                "the beach")


@pytest.mark.parametrize("qtype,block_bytes,elems", [("Q8_0", 34, 32), ("Q4_1", 20, 32),
                                                    ("Q5_0", 22, 32), ("Q6_K", 210, 256),
                                                    ("Q4_K", 144, 256)])
def test_relayout_by_rows_equals_relayout_whole(qtype, block_bytes, elems):
    """Re-laying a tensor a few rows at a time (each chunk's file pages released) gives the
    arrays of the whole-tensor relayout, byte for byte, with a partial last chunk."""
    from edgeinfer.readers.gguf import relayout_by_rows
    from edgeinfer.readers.gguf_blocks import relayout

    rng = np.random.default_rng(block_bytes)
    rows, nblk = 23, 512 // elems + 1
    raw = rng.integers(0, 256, (rows, nblk * block_bytes), dtype=np.uint8)
    for b in range(nblk):  # finite fp16 fields: the first 4 bytes of each block as small halves
        raw[:, b * block_bytes:b * block_bytes + 4] = np.array([0.01, 0.02], np.float16).view(np.uint8)
    whole = relayout(raw, qtype, "w", "test")
    parts = relayout_by_rows(raw, lambda p: relayout(p, qtype, "w", "test"),
                             chunk_bytes=5 * raw.shape[1])  # 5 rows a chunk: 4 chunks + 3
    for f in ("qweight", "scales", "zeros", "mins"):
        a, b = getattr(whole, f), getattr(parts, f)
        assert (a is None) == (b is None), f
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f
    assert (whole.bits, whole.group_size, whole.in_features, whole.method) == (
        parts.bits, parts.group_size, parts.in_features, parts.method)
