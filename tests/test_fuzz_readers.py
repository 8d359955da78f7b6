"""Fuzzing the readers of hostile files (issue 14): safetensors headers, GGUF metadata
and tensor tables, ``.eif`` metadata and headers, and the shard index.

Each test mutates a real, valid file (stories260K's HF folder and GGUF, the tiny
``.eif`` of test_container.py) and reads it back: a valid result or one of edgeinfer's
own error types (EdgeInferError) are the only outcomes allowed; any other exception, or
an example past the deadline, fails. Bounded: a fixed number of examples per test, no
example database, the whole file well under a minute (``EDGEINFER_FUZZ_EXAMPLES=N`` for a
longer random hunt).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hostile import (  # noqa: E402
    ARRAY, BOOL, F32, F64, I8, I16, I32, I64, STRING, U8, U16, U32, U64, copy_folder, gguf_parts,
    safetensors_bytes)
from test_container import TOKENIZER, tiny_model  # noqa: E402

from edgeinfer.api import tokenizer_for  # noqa: E402
from edgeinfer.container import describe_eif, read_eif, write_eif  # noqa: E402
from edgeinfer.errors import EdgeInferError  # noqa: E402
from edgeinfer.models.families import BY_GGUF_ARCH  # noqa: E402
from edgeinfer.readers import read_model  # noqa: E402

#: Examples per test: a fixed, reproducible 50 by default; EDGEINFER_FUZZ_EXAMPLES=N runs N
#: random ones (a longer hunt).
_N = int(os.environ.get("EDGEINFER_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_N or 50, deadline=3000, database=None, derandomize=not _N,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

#: JSON values, small but of every kind (and the odd huge/negative number).
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


def _only_our_errors(fn) -> None:
    try:
        fn()
    except EdgeInferError:
        pass


def _byte_edits(data: bytes, edits: list[tuple[int, int]], lo: int, hi: int) -> bytes:
    """Overwrite bytes at positions in [lo, hi) (position fractions, byte values)."""
    buf = bytearray(data)
    for frac, val in edits:
        buf[lo + frac % max(hi - lo, 1)] = val
    return bytes(buf)


EDITS = st.lists(st.tuples(st.integers(0, 2 ** 31), st.integers(0, 255)), min_size=1, max_size=6)


class _Seeds(dict):
    """The seed files (bytes); a short repr keeps hypothesis' failure reports readable."""

    def __repr__(self) -> str:
        return "<fuzz seeds>"


@pytest.fixture(scope="module")
def work(tmp_path_factory, stories_dir, stories_gguf):
    base = tmp_path_factory.mktemp("fuzz")
    folder = copy_folder(stories_dir, base / "hf")
    raw = (folder / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    cfg, t = tiny_model()
    eif = base / "m.eif"
    write_eif(eif, cfg, t, tokenizer_json=TOKENIZER, bos_token="<s>", eos_token="</s>")
    return _Seeds(base=base, folder=folder, stories_dir=stories_dir, st=raw, st_n=n, gguf=gguf_parts(stories_gguf),
                  gguf_bytes=stories_gguf.read_bytes(), eif=eif.read_bytes())


# ---------------------------------------------------------------- safetensors header
@FUZZ
@given(edits=EDITS)
def test_fuzz_safetensors_header_bytes(work, edits):
    raw, n = work["st"], work["st_n"]
    (work["folder"] / "model.safetensors").write_bytes(_byte_edits(raw, edits, 0, 8 + n))
    _only_our_errors(lambda: read_model(work["folder"]))


@FUZZ
@given(pick=st.integers(0, 10 ** 6), field=st.sampled_from(["dtype", "shape", "data_offsets", "x"]),
       value=JSON)
def test_fuzz_safetensors_header_fields(work, pick, field, value):
    raw, n = work["st"], work["st_n"]
    header = json.loads(raw[8:8 + n])
    names = sorted(header)
    name = names[pick % len(names)]
    if isinstance(header[name], dict):
        header[name][field] = value
    else:
        header[name] = value
    (work["folder"] / "model.safetensors").write_bytes(safetensors_bytes(header, raw[8 + n:]))
    _only_our_errors(lambda: read_model(work["folder"]))


# ---------------------------------------------------------------- shard index
SHARD_NAMES = st.sampled_from(["model.safetensors", "../model.safetensors", "/dev/zero", "",
                               "/etc/passwd", "config.json", ".", "..", "hf/model.safetensors",
                               "x\x00y", "model.safetensors/", "a" * 300]) | st.text(max_size=20)


@FUZZ
@given(entries=st.dictionaries(st.text(max_size=40) | st.sampled_from(
    ["model.norm.weight", "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]),
    SHARD_NAMES | JSON, max_size=6), wrap=st.booleans(), junk=JSON)
def test_fuzz_index(work, entries, wrap, junk):
    folder = work["folder"]
    (folder / "model.safetensors").write_bytes(work["st"])
    doc = {"weight_map": entries, "metadata": junk} if wrap else junk
    (folder / "model.safetensors.index.json").write_text(json.dumps(doc))
    try:
        _only_our_errors(lambda: read_model(folder))
    finally:
        (folder / "model.safetensors.index.json").unlink()


# ---------------------------------------------------------------- folder JSON files
_KEYS = {
    "config.json": ["num_hidden_layers", "hidden_size", "num_key_value_heads", "head_dim",
                    "rope_parameters", "rope_scaling", "eos_token_id", "bos_token_id",
                    "tie_word_embeddings", "model_type", "text_config", "layer_types",
                    "rms_norm_eps", "max_position_embeddings", "quantization_config"],
    "tokenizer_config.json": ["bos_token", "eos_token", "add_bos_token", "chat_template"],
    "generation_config.json": ["eos_token_id", "temperature", "top_k", "do_sample"],
    "tokenizer.json": ["model", "added_tokens", "post_processor", "decoder", "normalizer"],
}


@FUZZ
@given(name=st.sampled_from(sorted(_KEYS)), pick=st.integers(0, 100), key=st.text(max_size=8),
       use_known=st.booleans(), value=JSON)
def test_fuzz_folder_json_files(work, name, pick, key, use_known, value):
    folder, src = work["folder"], work["stories_dir"]
    (folder / "model.safetensors").write_bytes(work["st"])
    doc = json.loads((src / name).read_text())
    k = _KEYS[name][pick % len(_KEYS[name])] if use_known else key
    if name == "tokenizer.json" and k == "model" and isinstance(value, dict):
        value = {**doc["model"], **value}
    doc[k] = value
    (folder / name).write_text(json.dumps(doc))
    try:
        _only_our_errors(lambda: tokenizer_for(read_model(folder)))  # the load, tokenizer built
    finally:
        (folder / name).write_bytes((src / name).read_bytes())


# ---------------------------------------------------------------- GGUF
_TYPES = [U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, U64, I64, F64]
_INT_RANGE = {U8: (0, 255), I8: (-128, 127), U16: (0, 2 ** 16 - 1), I16: (-2 ** 15, 2 ** 15 - 1),
              U32: (0, 2 ** 32 - 1), I32: (-2 ** 31, 2 ** 31 - 1), U64: (0, 2 ** 64 - 1),
              I64: (-2 ** 63, 2 ** 63 - 1)}


@st.composite
def gguf_typed_value(draw):
    vtype = draw(st.sampled_from(_TYPES + [ARRAY]))
    if vtype in _INT_RANGE:
        lo, hi = _INT_RANGE[vtype]
        return vtype, draw(st.integers(lo, hi) | st.sampled_from([0, 1, 2, 3, 2 ** 30 % (hi + 1)]))
    if vtype in (F32, F64):
        return vtype, draw(st.floats(width=32 if vtype == F32 else 64))
    if vtype == BOOL:
        return vtype, draw(st.booleans())
    if vtype == STRING:
        return vtype, draw(st.text(max_size=10))
    etype = draw(st.sampled_from([U8, U32, I32, F32, STRING, BOOL]))
    if etype == STRING:
        items = draw(st.lists(st.text(max_size=4), max_size=5))
    elif etype == F32:
        items = draw(st.lists(st.floats(width=32), max_size=5))
    elif etype == BOOL:
        items = draw(st.lists(st.booleans(), max_size=5))
    else:
        lo, hi = _INT_RANGE[etype]
        items = draw(st.lists(st.integers(lo, hi), max_size=5))
    return ARRAY, (etype, items)


@FUZZ
@given(pick=st.integers(0, 10 ** 6), typed=gguf_typed_value(), append=st.booleans())
def test_fuzz_gguf_metadata_values(work, pick, typed, append):
    parts = gguf_parts_copy(work)
    vtype, value = typed
    if append:
        key = ["general.alignment", "llama.attention.key_length", "tokenizer.ggml.add_bos_token",
               "tokenizer.huggingface.json", "llama.rope.scaling.type", "llama.vocab_size",
               "tokenizer.ggml.merges", "tokenizer.ggml.pre"][pick % 8]
    else:
        key = parts.kv[pick % len(parts.kv)][0]
    parts.set(key, vtype, value)
    path = parts.write(work["base"] / "f.gguf")
    _only_our_errors(lambda: tokenizer_for(read_model(path)))


_ARCH_KEYS = ["attention.sliding_window", "attention.sliding_window_pattern",
              "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
              "rope.scaling.attn_factor", "rope.freq_base_swa", "final_logit_softcapping",
              "attn_logit_softcapping", "block_count", "attention.key_length",
              "rope.dimension_count", "context_length"]


@FUZZ
@given(arch=st.sampled_from(sorted(BY_GGUF_ARCH)), edits=st.lists(st.tuples(
    st.sampled_from(_ARCH_KEYS), gguf_typed_value()), max_size=3))
def test_fuzz_gguf_other_architectures(work, arch, edits):
    """The seed relabelled as every GGUF architecture edgeinfer reads, with that family's
    own metadata keys fuzzed (its fixups run on them)."""
    parts = gguf_parts_copy(work)
    parts.kv = [(k.replace("llama.", f"{arch}.", 1), t, v) for k, t, v in parts.kv]
    parts.set("general.architecture", STRING, arch)
    for key, (vtype, value) in edits:
        parts.set(f"{arch}.{key}", vtype, value)
    path = parts.write(work["base"] / "a.gguf")
    _only_our_errors(lambda: tokenizer_for(read_model(path)))


@FUZZ
@given(pick=st.integers(0, 10 ** 6), dims=st.lists(st.integers(0, 2 ** 64 - 1) | st.integers(0, 600),
                                                   max_size=6),
       qtype=st.integers(0, 2 ** 32 - 1) | st.integers(0, 40), offset=st.integers(0, 2 ** 64 - 1)
       | st.integers(0, 2 ** 20), which=st.sets(st.sampled_from(["dims", "qtype", "offset"]),
                                                min_size=1))
def test_fuzz_gguf_tensor_table(work, pick, dims, qtype, offset, which):
    parts = gguf_parts_copy(work)
    i = pick % len(parts.tensors)
    name, d0, q0, o0 = parts.tensors[i]
    parts.tensors[i] = (name, tuple(dims) if "dims" in which else d0,
                        qtype if "qtype" in which else q0, offset if "offset" in which else o0)
    path = parts.write(work["base"] / "t.gguf")
    _only_our_errors(lambda: read_model(path))


@FUZZ
@given(edits=EDITS)
def test_fuzz_gguf_header_bytes(work, edits):
    data = work["gguf_bytes"]
    start = work["gguf"].extra["data_start"]
    path = work["base"] / "b.gguf"
    path.write_bytes(_byte_edits(data, edits, 0, start))
    _only_our_errors(lambda: read_model(path))


def gguf_parts_copy(work):
    p = work["gguf"]
    return type(p)(p.version, list(p.kv), list(p.tensors), p.data, p.alignment, dict(p.extra))


# ---------------------------------------------------------------- .eif
def _eif_header(work) -> tuple[dict, bytes]:
    raw = work["eif"]
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _read_both(path: Path) -> None:
    _only_our_errors(lambda: tokenizer_for(read_eif(path)))
    _only_our_errors(lambda: describe_eif(path))


@FUZZ
@given(key=st.sampled_from(["format", "format_version", "config", "quantization", "tokenizer",
                            "chat_template", "special", "generation", "provenance", "new"]),
       value=JSON, as_text=st.booleans())
def test_fuzz_eif_metadata(work, key, value, as_text):
    header, data = _eif_header(work)
    header["__metadata__"][key] = json.dumps(value) if as_text else value
    path = work["base"] / "m.eif"
    path.write_bytes(safetensors_bytes(header, data))
    _read_both(path)


@FUZZ
@given(key=st.sampled_from(["config", "quantization", "special"]), sub=st.text(max_size=20) | st.sampled_from(
    ["num_hidden_layers", "vocab_size", "num_key_value_heads", "rope_theta", "bits", "group_size",
     "in_features", "symmetric", "bos_token", "layer_types", "rope_scaling", "head_dim"]),
       value=JSON, pick=st.integers(0, 1000))
def test_fuzz_eif_metadata_fields(work, key, sub, value, pick):
    header, data = _eif_header(work)
    doc = json.loads(header["__metadata__"][key])
    if key == "quantization":
        name = sorted(doc)[pick % len(doc)]
        doc[name][sub] = value
    else:
        doc[sub] = value
    header["__metadata__"][key] = json.dumps(doc)
    path = work["base"] / "m.eif"
    path.write_bytes(safetensors_bytes(header, data))
    _read_both(path)


@FUZZ
@given(pick=st.integers(0, 10 ** 6), field=st.sampled_from(["dtype", "shape", "data_offsets"]),
       value=JSON | st.lists(st.integers(-2 ** 40, 2 ** 40), max_size=3)
       | st.sampled_from(["U8", "I8", "F16", "F32", "BF16", "I64"]))
def test_fuzz_eif_tensor_entries(work, pick, field, value):
    header, data = _eif_header(work)
    names = sorted(k for k in header if k != "__metadata__")
    header[names[pick % len(names)]][field] = value
    path = work["base"] / "m.eif"
    path.write_bytes(safetensors_bytes(header, data))
    _read_both(path)


@FUZZ
@given(edits=EDITS)
def test_fuzz_eif_header_bytes(work, edits):
    raw = work["eif"]
    (n,) = struct.unpack("<Q", raw[:8])
    path = work["base"] / "m.eif"
    path.write_bytes(_byte_edits(raw, edits, 0, 8 + n))
    _read_both(path)


def test_fuzz_seeds_are_valid(work):
    """Positive control: the unmutated seeds read, so the fuzzers start from real files."""
    folder = work["folder"]
    (folder / "model.safetensors").write_bytes(work["st"])
    assert read_model(folder).config.num_hidden_layers == 5
    path = gguf_parts_copy(work).write(work["base"] / "seed.gguf")
    assert read_model(path).config.vocab_size == 512
    (work["base"] / "seed.eif").write_bytes(work["eif"])
    assert read_eif(work["base"] / "seed.eif").config.vocab_size == 32
