"""The .eif container: round trip of every field, zero-copy mapping, refusals with clear
messages (foreign file, newer version, truncated, missing tensor), describe_eif."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from edgeinfer.backends.quantized import QuantizedTensor
from edgeinfer.container import FORMAT_VERSION, describe_eif, read_eif, write_eif
from edgeinfer.errors import ModelFormatError
from edgeinfer.models.arch import tensor_specs
from edgeinfer.models.config import ModelConfig
from edgeinfer.quant.rtn import quantize_rtn

TOKENIZER = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "<s>": 1, "</s>": 2},
                                                    "merges": []}})
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def tiny_model(tied: bool = False, seed: int = 0):
    """A 2-layer llama config (hidden 16, vocab 32) and its tensors: linears INT4 (one with
    float32 scales), embedding INT8, norms float32, one dense float16 weight."""
    cfg = ModelConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 40,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": [2, 5],
        "rope_theta": 5e5})
    rng = np.random.default_rng(seed)
    t = {}
    for spec in tensor_specs(cfg):
        a = rng.standard_normal(spec.shape(cfg)).astype(np.float32)
        if spec.linear and spec.name != "lm_head.weight":
            t[spec.name] = quantize_rtn(a, 4, 16 if a.shape[1] % 16 == 0 else 32)
        elif spec.name in ("model.embed_tokens.weight",):
            t[spec.name] = quantize_rtn(a, 8, -1)
        else:
            t[spec.name] = a
    if not tied:
        t["lm_head.weight"] = rng.standard_normal((32, 16)).astype(np.float16)  # dense f16
    w = rng.standard_normal((16, 16)).astype(np.float32)
    w[0, :8] = 3e6  # fp16 scale overflow -> float32 scales (C10)
    t["model.layers.1.self_attn.o_proj.weight"] = quantize_rtn(w, 4, 8, symmetric=True)
    return cfg, t


def _write(path, tied=False, **kw):
    cfg, t = tiny_model(tied)
    args = dict(tokenizer_json=TOKENIZER, chat_template=TEMPLATE, bos_token="<s>", eos_token="</s>",
                add_bos_token=True, generation={"temperature": 0.7, "eos_token_id": [2, 5]},
                provenance={"source": "/x/model.gguf", "method": "rtn"})
    args.update(kw)
    size = write_eif(path, cfg, t, **args)
    return cfg, t, size


def test_round_trip_every_field(tmp_path):
    p = tmp_path / "m.eif"
    cfg, t, size = _write(p)
    assert size == os.path.getsize(p)
    assert [f for f in os.listdir(tmp_path)] == ["m.eif"]  # no temp file left behind
    src = read_eif(p)
    assert src.format == "eif" and src.config == cfg
    assert src.tokenizer_json == TOKENIZER and src.chat_template == TEMPLATE
    assert (src.bos_token, src.eos_token, src.add_bos_token) == ("<s>", "</s>", True)
    assert src.generation == {"temperature": 0.7, "eos_token_id": [2, 5]}
    assert src.provenance["source"] == "/x/model.gguf" and "date" in src.provenance
    assert "edgeinfer_version" in src.provenance
    assert set(src.tensors) == set(t)
    for name, a in t.items():
        b = src.tensors[name]
        if isinstance(a, QuantizedTensor):
            assert isinstance(b, QuantizedTensor)
            assert (b.bits, b.group_size, b.in_features, b.symmetric, b.method) == \
                (a.bits, a.group_size, a.in_features, a.symmetric, a.method)
            assert b.scales.dtype == a.scales.dtype
            np.testing.assert_array_equal(b.qweight, a.qweight)
            np.testing.assert_array_equal(b.scales, a.scales)
            np.testing.assert_array_equal(b.dequantize(), a.dequantize())
            assert src.shapes[name] == a.shape
        else:
            assert b.dtype == a.dtype
            np.testing.assert_array_equal(b, a)
    assert src.tensors["model.layers.1.self_attn.o_proj.weight"].scales.dtype == np.float32
    q = src.provenance["quantization"]["model.layers.0.mlp.down_proj.weight"]
    assert q == {"bits": 4, "group_size": 32, "symmetric": False, "method": "rtn",
                 "in_features": 40, "scales_dtype": "float16"}


def test_read_maps_without_copy(tmp_path):
    p = tmp_path / "m.eif"
    _write(p)
    src = read_eif(p)
    qw = src.tensors["model.layers.0.self_attn.q_proj.weight"].qweight
    norm = src.tensors["model.norm.weight"]
    for a in (qw, norm):
        assert not a.flags.owndata and not a.flags.writeable  # a view of the read-only map
        base = a
        while getattr(base, "base", None) is not None and not isinstance(base, memoryview):
            base = base.base
        assert "mmap" in type(base).__name__ or isinstance(base, memoryview)


def test_tied_file_drops_stray_head(tmp_path):
    p = tmp_path / "t.eif"
    cfg, t, _ = _write(p, tied=True)
    src = read_eif(p)
    assert "lm_head.weight" not in src.tensors and src.config.tie_word_embeddings


def test_refuses_foreign_safetensors(tmp_path):
    from safetensors.numpy import save_file

    p = tmp_path / "foreign.safetensors"
    save_file({"w": np.zeros((2, 2), np.float32)}, str(p))
    with pytest.raises(ModelFormatError, match=r"foreign\.safetensors.*not an edgeinfer model.*convert"):
        read_eif(p)
    g = tmp_path / "garbage.eif"
    g.write_bytes(b"\x00" * 3)
    with pytest.raises(ModelFormatError, match="garbage.eif"):
        read_eif(g)
    g.write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"\x00" * 10)
    with pytest.raises(ModelFormatError, match="invalid JSON"):
        read_eif(g)


def _rewrite_meta(path, **changes):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["__metadata__"].update(changes)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    open(path, "wb").write(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])


def test_refuses_newer_version(tmp_path):
    p = tmp_path / "m.eif"
    _write(p)
    _rewrite_meta(p, format_version=str(FORMAT_VERSION + 1))
    with pytest.raises(ModelFormatError, match=r"m\.eif.*newer.*upgrade edgeinfer"):
        read_eif(p)
    with pytest.raises(ModelFormatError, match="upgrade edgeinfer"):
        describe_eif(p)
    _rewrite_meta(p, format_version="1", format="other")
    with pytest.raises(ModelFormatError, match="not an edgeinfer model"):
        read_eif(p)


def test_refuses_truncated(tmp_path):
    p = tmp_path / "m.eif"
    _write(p)
    data = p.read_bytes()
    p.write_bytes(data[:-100])
    with pytest.raises(ModelFormatError, match=r"m\.eif.*truncated.*re-convert"):
        read_eif(p)
    p.write_bytes(data[:20])
    with pytest.raises(ModelFormatError, match="m.eif"):
        read_eif(p)


def test_refuses_missing_tensor(tmp_path):
    cfg, t = tiny_model()
    del t["model.layers.1.mlp.up_proj.weight"]
    p = tmp_path / "m.eif"
    write_eif(p, cfg, t, tokenizer_json=TOKENIZER)
    with pytest.raises(ModelFormatError, match=r"m\.eif.*model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        read_eif(p)


def test_write_failure_leaves_nothing(tmp_path):
    cfg, t = tiny_model()
    t["bad"] = np.zeros(3, np.complex64)
    with pytest.raises(ValueError, match="bad"):
        write_eif(tmp_path / "m.eif", cfg, t, tokenizer_json=TOKENIZER)
    assert os.listdir(tmp_path) == []


def test_describe(tmp_path):
    p = tmp_path / "m.eif"
    cfg, t, size = _write(p)
    d = describe_eif(p)
    assert d["file_size"] == size and d["format"] == "edgeinfer" and d["format_version"] == 1
    assert d["config"]["hidden_size"] == 16 and d["special"]["add_bos_token"] is True
    assert d["provenance"]["method"] == "rtn" and d["chat_template"] == TEMPLATE
    kinds = d["bits_per_weight_by_kind"]
    # q_proj: 16x16 in groups of 16 -> 4 + 16/16 (fp16 scale) + 4/16 (zero) = 5.25 bpw
    assert kinds["embedding"] == pytest.approx(8 + 16 / 16)  # int8 + one fp16 scale per row of 16
    assert kinds["lm_head"] == pytest.approx(16.0)
    assert 4.0 < kinds["attention"] < 6.5 and 4.0 < kinds["mlp"] < 6.5
    assert d["params"] == cfg.param_count()
