"""Hostile GGUF and ``.eif`` files: one test per root cause (issue 14, S4/S5/S6).

GGUF cases are the real stories260K.gguf with one field changed (tests/hostile.py takes
it apart and puts it back byte for byte); ``.eif`` cases are the tiny model of
test_container.py with one header or metadata field changed.
"""
from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from hostile import ARRAY, F32, STRING, U8, U32, gguf_parts, gguf_value, safetensors_bytes
from test_container import TOKENIZER, tiny_model

from edgeinfer.container import describe_eif, read_eif, write_eif
from edgeinfer.errors import ModelFormatError, UnsupportedModelError
from edgeinfer.readers import read_model
from edgeinfer.readers.gguf_file import GGUFFile


@pytest.fixture
def parts(stories_gguf):
    return gguf_parts(stories_gguf)


def _read(parts, tmp_path, alignment=None):
    return read_model(parts.write(tmp_path / "m.gguf", alignment))


# ---------------------------------------------------------------- GGUF layout
@pytest.mark.parametrize("align", [0, 3, 48, 2 ** 31 + 1])
def test_gguf_alignment_must_be_a_power_of_two(parts, tmp_path, align):
    parts.set("general.alignment", U32, align)
    with pytest.raises(ModelFormatError, match=rf"m\.gguf: general\.alignment = {align}; GGUF needs "
                                               r"a positive power of two"):
        _read(parts, tmp_path, alignment=32)
    parts.set("general.alignment", STRING, "32")
    with pytest.raises(ModelFormatError, match=r"general\.alignment = '32'"):
        _read(parts, tmp_path, alignment=32)


def test_gguf_other_power_of_two_alignment_reads(parts, tmp_path, stories_gguf):
    """Positive control: alignment 16 (offsets are multiples of 32, so of 16 too) with
    the data section starting at a multiple of 16 gives the same tensors."""
    parts.set("general.alignment", U32, 16)
    got, want = _read(parts, tmp_path, alignment=16), read_model(stories_gguf)
    name = "model.layers.4.self_attn.q_proj.weight"
    np.testing.assert_array_equal(got.tensors[name], want.tensors[name])


def test_gguf_tensor_offsets_aligned_inside_and_disjoint(parts, tmp_path):
    t = parts.tensors
    name, dims, qt, off = t[3]
    t[3] = (name, dims, qt, off + 4)
    with pytest.raises(ModelFormatError, match=r"'blk\.0\.attn_q\.weight' has data offset \d+, not "
                                               r"a multiple of general\.alignment 32"):
        _read(parts, tmp_path)
    t[3] = (name, dims, qt, t[2][3])  # onto output.weight
    with pytest.raises(ModelFormatError, match="overlaps"):
        _read(parts, tmp_path)
    t[3] = (name, dims, qt, len(parts.data) + 32)
    with pytest.raises(ModelFormatError, match=r"truncated GGUF file: tensor 'blk\.0\.attn_q"):
        _read(parts, tmp_path)
    t[3] = (name, (64, 64, 1, 1, 1), qt, off)
    with pytest.raises(ModelFormatError, match="5 dimensions"):
        _read(parts, tmp_path)


def test_gguf_duplicate_keys_and_header_limits(parts, tmp_path):
    parts.kv.append(parts.kv[16])  # llama.block_count again
    with pytest.raises(ModelFormatError, match=r"metadata key 'llama\.block_count' appears twice"):
        _read(parts, tmp_path)
    parts.kv.pop()
    deep = struct.pack("<IQ", ARRAY, 1) * 100_000 + struct.pack("<IQ", U8, 0)
    parts.kv.append(("x.deep", ARRAY, deep))
    with pytest.raises(ModelFormatError, match=r"'x\.deep': arrays nested more than 2 deep"):
        _read(parts, tmp_path)
    parts.kv[-1] = ("x.huge", ARRAY, struct.pack("<IQ", STRING, 2 ** 40))
    with pytest.raises(ModelFormatError, match=r"'x\.huge': more than 16777216 array elements"):
        _read(parts, tmp_path)
    raw = bytearray(parts.to_bytes())
    struct.pack_into("<Q", raw, 16, 2 ** 60)  # n_kv
    (tmp_path / "kv.gguf").write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match="1152921504606846976 metadata entries"):
        read_model(tmp_path / "kv.gguf")


def test_gguf_metadata_strings_are_bounded(parts, tmp_path, monkeypatch):
    """Strings decoded from the metadata are capped in total (a huge file of strings would
    otherwise be decoded whole); the cap is lowered here to the seed's own size."""
    from edgeinfer.readers import gguf_file

    path = parts.write(tmp_path / "m.gguf")
    total = GGUFFile(path)._string_bytes  # every string: keys, values, tensor names
    monkeypatch.setattr(gguf_file, "MAX_METADATA_STRING_BYTES", total)
    assert GGUFFile(path).metadata["general.architecture"] == "llama"  # at the cap: reads
    monkeypatch.setattr(gguf_file, "MAX_METADATA_STRING_BYTES", total - 1)
    with pytest.raises(ModelFormatError, match=rf"more than {total - 1} bytes of strings"):
        GGUFFile(path)


# ---------------------------------------------------------------- GGUF metadata values
@pytest.mark.parametrize("key,vtype,value,why", [
    ("llama.attention.head_count", U32, 0, r"head_count = 0; expected an integer >= 1"),
    ("llama.attention.head_count_kv", U32, 0, r"head_count_kv = 0; expected an integer >= 1"),
    ("llama.embedding_length", F32, 64.0, r"embedding_length = 64\.0; expected an integer"),
    ("llama.attention.layer_norm_rms_epsilon", F32, float("nan"), r"epsilon = nan; expected a finite"),
    ("llama.attention.layer_norm_rms_epsilon", F32, -0.5, r"epsilon = -0\.5; expected a finite"),
    ("llama.rope.freq_base", F32, 0.0, r"freq_base = 0\.0; expected a finite number > 0"),
    ("llama.rope.dimension_count", U32, 7, r"RoPE needs a positive even number"),
    ("llama.block_count", U32, 10 ** 9, r"llama\.block_count = 1000000000 layers, but the file "
                                       r"has tensors for 5"),
    ("tokenizer.chat_template", U32, 1, r"tokenizer\.chat_template: the chat template is a int"),
    ("tokenizer.ggml.tokens", ARRAY, (U32, [1, 2]), r"tokenizer\.ggml\.tokens must be an array of "
                                                    r"strings"),
    ("tokenizer.ggml.scores", ARRAY, (F32, [0.0]), r"tokenizer\.ggml\.scores must be an array of 512"),
    ("tokenizer.ggml.pre", ARRAY, (U8, [1]), r"tokenizer\.ggml\.pre = \[1\] is not a string"),
])
def test_gguf_metadata_values_are_checked(parts, tmp_path, key, vtype, value, why):
    parts.set(key, vtype, value)
    with pytest.raises(ModelFormatError, match=rf"m\.gguf.*{why}"):
        _read(parts, tmp_path)


def test_gguf_architecture_and_vocabulary(parts, tmp_path):
    parts.set("general.architecture", ARRAY, (STRING, ["llama"]))
    with pytest.raises(UnsupportedModelError, match=r"architecture \['llama'\] is not supported"):
        _read(parts, tmp_path)
    parts.set("general.architecture", STRING, "llama")
    toks = GGUFFile(parts.write(tmp_path / "ok.gguf")).metadata
    n = len(toks["tokenizer.ggml.tokens"])
    parts.set("tokenizer.ggml.tokens", ARRAY, (STRING, toks["tokenizer.ggml.tokens"] + ["extra"]))
    parts.set("tokenizer.ggml.scores", ARRAY, (F32, toks["tokenizer.ggml.scores"] + [0.0]))
    parts.set("tokenizer.ggml.token_type", ARRAY, (U32, toks["tokenizer.ggml.token_type"] + [1]))
    with pytest.raises(ModelFormatError, match=rf"has {n + 1} tokens but the embedding has {n} rows"):
        _read(parts, tmp_path)


def test_gguf_vocabulary_text_is_bounded(parts, tmp_path):
    """The SentencePiece merge derivation costs a step per character of every token: one
    token of 10^5 characters is refused before it runs."""
    toks = GGUFFile(parts.write(tmp_path / "ok.gguf")).metadata["tokenizer.ggml.tokens"]
    parts.set("tokenizer.ggml.tokens", ARRAY, (STRING, toks[:-1] + ["a" * 100_000]))
    with pytest.raises(ModelFormatError, match=r"a token of 100000 characters"):
        _read(parts, tmp_path)


def test_gguf_layer_count_is_checked_before_the_layer_list(parts, tmp_path):
    """A gemma3 GGUF claiming 10^9 blocks: the per-layer attention-type list (10^9
    entries) is never built; a zero sliding-window pattern never reaches a modulo."""
    parts.kv = [(k.replace("llama.", "gemma3.", 1), t, v) for k, t, v in parts.kv]
    parts.set("general.architecture", STRING, "gemma3")
    parts.set("gemma3.block_count", U32, 10 ** 9)
    with pytest.raises(ModelFormatError, match=r"gemma3\.block_count = 1000000000 layers"):
        _read(parts, tmp_path)
    parts.set("gemma3.block_count", U32, 5)
    parts.set("gemma3.attention.sliding_window", U32, 4)
    parts.set("gemma3.attention.sliding_window_pattern", U32, 0)
    with pytest.raises(ModelFormatError, match=r"sliding_window_pattern = 0; expected a positive"):
        _read(parts, tmp_path)


def test_gguf_nan_weight_is_named_when_loaded(parts, tmp_path):
    off = dict((t[0], t[3]) for t in parts.tensors)["output_norm.weight"]
    data = bytearray(parts.data)
    struct.pack_into("<f", data, off + 4 * 3, math.nan)
    parts.data = bytes(data)
    src = _read(parts, tmp_path)
    with pytest.raises(ModelFormatError, match=r"'model\.norm\.weight \(output_norm\.weight\)' holds "
                                               r"1 non-finite values.*first at \(3,\)"):
        src.tensors["model.norm.weight"]


# ---------------------------------------------------------------- .eif
def _eif(tmp_path: Path, tied: bool = False) -> Path:
    cfg, t = tiny_model(tied)
    p = tmp_path / "m.eif"
    write_eif(p, cfg, t, tokenizer_json=TOKENIZER, bos_token="<s>", eos_token="</s>",
              overwrite=True)  # a fresh file per case
    return p


def _rewrite(p: Path, mutate) -> None:
    """Apply ``mutate(header, data)`` (edit in place, or return new data) to an .eif."""
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    out = mutate(header, data)
    p.write_bytes(safetensors_bytes(header, data if out is None else out))


def _meta(**kw):
    def mutate(h, d):
        h["__metadata__"].update(kw)
    return mutate


def _meta_json(key, fn):
    def mutate(h, d):
        h["__metadata__"][key] = json.dumps(fn(json.loads(h["__metadata__"][key])))
    return mutate


_Q = "model.layers.0.mlp.down_proj.weight"


def _entry(name, **kw):
    def mutate(h, d):
        h[name].update(kw)
    return mutate


@pytest.mark.parametrize("mutate,why", [
    (_meta(format_version="1.5"), r"format_version '1\.5' is not a version number"),
    (_meta(format_version="1.0"), r"format_version '1\.0' is not a version number"),
    (_meta(format_version=" 1"), r"format_version ' 1' is not a version number"),
    (_meta(format_version="0"), r"format_version 0 is not one edgeinfer wrote"),
    (_meta(format_version=1), r"'__metadata__' must map strings to strings"),
    (_entry(_Q + ".scales", data_offsets=[-8, 56]), r"data_offsets \[-8, 56\] are not"),
    (_entry(_Q + ".qweight", dtype="I8"), r"4-bit qweight must be uint8"),
    (_entry(_Q + ".scales", dtype="U16"), r"dtype U16; \.eif stores F32, F16, U8, I8"),
    (_entry("model.norm.weight", dtype="I32"), r"'model\.norm\.weight' has dtype I32; \.eif stores"),
    (_entry("model.norm.weight", dtype="U8", shape=[64]),
     r"dense tensor 'model\.norm\.weight' has dtype U8"),
    (_meta_json("quantization", lambda q: {**q, _Q: {**q[_Q], "in_features": 48}}),
     rf"{_Q}' has shape \(16, 48\), expected \(16, 40\)"),
    (_meta_json("quantization", lambda q: {**q, _Q: {**q[_Q], "group_size": 24}}),
     r"group_size 24 does not divide"),
    (_meta_json("quantization", lambda q: {**q, _Q: {**q[_Q], "bits": "4"}}), r"bits = '4' is invalid"),
    (_meta_json("config", lambda c: {**c, "intermediate_size": 48}),
     r"mlp\.gate_proj\.weight' has shape \(40, 16\), expected \(48, 16\)"),
    (_meta_json("config", lambda c: {**c, "num_hidden_layers": 10 ** 9}),
     r"num_hidden_layers must be an integer in 1\.\.65536"),
    (_meta_json("config", lambda c: {**c, "num_hidden_layers": 60000}),
     r"num_hidden_layers = 60000 layers, but the file has tensors for 2"),
    (_meta_json("config", lambda c: {**c, "num_key_value_heads": 0}),
     r"metadata 'config': num_key_value_heads must be an integer"),
    (_meta(config='{"model_type": "llama", "model_type": "qwen2"}'), r"duplicate key 'model_type'"),
    (_meta(special="[1]"), r"metadata 'special' is a list, expected a dict"),
    (_meta(provenance='"x"'), r"metadata 'provenance' is a str, expected a dict"),
    (_meta(special='{"bos_token": 1}'), r"'special' must hold bos_token/eos_token strings"),
    (_meta(tokenizer="[]"), r"metadata 'tokenizer': a tokenizer\.json must be a JSON object"),
    (_meta(tokenizer=json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "<s>": 1, "</s>": 40},
                                           "merges": []}})), r"'</s>' has id 40.*vocab_size = 32"),
    (_meta(special='{"bos_token": "<b>"}'), r"special bos_token '<b>' is not in the vocabulary"),
])
def test_eif_refusals_name_the_field(tmp_path, mutate, why):
    p = _eif(tmp_path)
    _rewrite(p, mutate)
    with pytest.raises((ModelFormatError, UnsupportedModelError), match=rf"m\.eif.*{why}"):
        read_eif(p)


def test_eif_data_outside_or_overlapping_is_refused(tmp_path):
    p = _eif(tmp_path)
    _rewrite(p, lambda h, d: d[:-1])
    with pytest.raises(ModelFormatError, match=r"m\.eif: tensor .* truncated"):
        read_eif(p)
    p = _eif(tmp_path)
    first = min((v["data_offsets"][0], k) for k, v in json.loads(
        p.read_bytes()[8:8 + struct.unpack("<Q", p.read_bytes()[:8])[0]]).items() if k != "__metadata__")
    _rewrite(p, _entry(_Q + ".scales", data_offsets=[first[0], first[0] + 64]))
    with pytest.raises(ModelFormatError, match="overlaps the previous tensor"):
        read_eif(p)
    with pytest.raises(ModelFormatError, match="overlaps the previous tensor"):
        describe_eif(p)


def test_eif_unknown_tensors_are_refused_and_tied_head_warned(tmp_path, caplog):
    p = _eif(tmp_path)

    def add(h, d):
        h["model.layers.0.extra.weight"] = {"dtype": "F32", "shape": [2],
                                             "data_offsets": [len(d), len(d) + 8]}
        return d + b"\0" * 8

    _rewrite(p, add)
    with pytest.raises(ModelFormatError, match=r"model\.layers\.0\.extra\.weight are not used"):
        read_eif(p)
    p = _eif(tmp_path)
    _rewrite(p, _meta_json("config", lambda c: {**c, "tie_word_embeddings": True}))
    with caplog.at_level(logging.WARNING):
        src = read_eif(p)
    assert "lm_head.weight" not in src.tensors
    assert "the stored lm_head.weight is not used" in caplog.text


def test_eif_scales_checked_for_nan_and_zero_rows(tmp_path, caplog):
    p = _eif(tmp_path)
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])
    b, e = h[_Q + ".scales"]["data_offsets"]  # float16 [16, 2]

    def patch(values: bytes, at: int):
        data = bytearray(raw[8 + n:])
        data[b + at:b + at + len(values)] = values
        p.write_bytes(raw[:8 + n] + bytes(data))

    patch(np.array([0, 0], np.float16).tobytes(), 2 * 2 * 5)  # row 5 of the scales: all zero
    with caplog.at_level(logging.WARNING):
        src = read_eif(p)
    assert f"tensor '{_Q}' has 1 of 16 rows whose scales are all zero" in caplog.text
    assert src.tensors[_Q].scales[5].tolist() == [0, 0]
    caplog.clear()
    patch(np.array([np.nan], np.float16).tobytes(), 2 * 2 * 7 + 2)
    with pytest.raises(ModelFormatError, match=rf"'{_Q}\.scales' holds 1 non-finite values.*\(7, 1\)"):
        read_eif(p)
    p = _eif(tmp_path)  # positive control: the untouched file reads without a warning
    with caplog.at_level(logging.WARNING):
        read_eif(p)
    assert "all zero" not in caplog.text
