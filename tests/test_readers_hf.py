"""HF-folder reader: real stories260K values, config/tokenizer variants, strictness (C15)."""
from __future__ import annotations

import json
import logging
import shutil
import struct

import numpy as np
import pytest

from edgeinfer.errors import ModelFormatError, UnsupportedModelError
from edgeinfer.readers import read_model
from edgeinfer.readers.hf import read_hf_folder


@pytest.fixture(scope="module")
def stories(stories_dir):
    return read_hf_folder(stories_dir)


@pytest.fixture
def copy_dir(stories_dir, tmp_path):
    """A writable copy of the stories260K folder (without the GGUF)."""
    dst = tmp_path / "stories"
    dst.mkdir()
    for f in stories_dir.iterdir():
        if f.suffix != ".gguf":
            shutil.copy(f, dst / f.name)
            (dst / f.name).chmod(0o644)
    return dst


def _edit_json(path, **changes):
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))


def _write_safetensors(path, tensors: dict[str, tuple[str, tuple, bytes]]):
    """Minimal safetensors writer (lets tests write BF16 without torch)."""
    header, off, blobs = {}, 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def _all_f32(src) -> dict[str, np.ndarray]:
    return {n: np.asarray(src.tensors[n]) for n in src.shapes}


def test_stories_config_tokenizer_and_tensors(stories, stories_dir):
    c = stories.config
    assert (c.model_type, c.hidden_size, c.num_hidden_layers) == ("llama", 64, 5)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (8, 4, 8)
    assert (c.vocab_size, c.intermediate_size, c.rope_theta) == (512, 172, 10000.0)
    assert c.tie_word_embeddings is False and c.eos_token_ids == [2] and c.bos_token_id == 1
    assert stories.format == "hf" and stories.bos_token == "<s>" and stories.eos_token == "</s>"
    # tokenizer_config.json has no add_bos_token: inferred from the TemplateProcessing
    # post-processor, which prepends <s>.
    assert "add_bos_token" not in json.loads((stories_dir / "tokenizer_config.json").read_text())
    assert stories.add_bos_token is True
    assert stories.generation["eos_token_id"] == [2]
    assert stories.chat_template is None
    assert len(stories.shapes) == 3 + 5 * 9
    w = stories.tensors["model.layers.0.self_attn.k_proj.weight"]
    assert w.dtype == np.float32 and w.shape == (32, 64) == stories.shapes[
        "model.layers.0.self_attn.k_proj.weight"]
    assert stories.shapes["lm_head.weight"] == (512, 64)
    assert abs(float(stories.tensors["model.norm.weight"].mean()) - 1.0) < 2.0  # real, not zeros
    assert stories.provenance["dtypes"] == {"F32": 48}


def test_read_model_dispatches_folder(stories_dir):
    assert read_model(stories_dir).format == "hf"


def test_classic_rope_theta_equals_rope_parameters(copy_dir, stories):
    _edit_json(copy_dir / "config.json", rope_parameters=None, rope_theta=10000.0)
    assert read_hf_folder(copy_dir).config == stories.config


def test_bf16_and_sharded_checkpoints(copy_dir, stories):
    ref = _all_f32(stories)
    # bf16: round-to-nearest-even of the fp32 weights, written raw
    bf16 = {}
    for n, a in ref.items():
        b = a.astype(np.float32).view(np.uint32)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype("<u2")
        bf16[n] = ("BF16", a.shape, b.tobytes())
    names = sorted(bf16)
    (copy_dir / "model.safetensors").unlink()
    _write_safetensors(copy_dir / "model-00001-of-00002.safetensors", {n: bf16[n] for n in names[:20]})
    _write_safetensors(copy_dir / "model-00002-of-00002.safetensors", {n: bf16[n] for n in names[20:]})
    wm = {n: f"model-0000{1 if i < 20 else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (copy_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    src = read_hf_folder(copy_dir)
    assert src.provenance["dtypes"] == {"BF16": 48}
    for n, a in ref.items():
        got = src.tensors[n]
        assert got.dtype == np.float32
        want = (np.frombuffer(bf16[n][2], "<u2").astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(got.reshape(-1), want)
        np.testing.assert_allclose(got, a, rtol=2 ** -8, atol=1e-30)


def test_tokenizer_config_variants(copy_dir):
    (copy_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    _edit_json(copy_dir / "tokenizer_config.json", add_bos_token=False,
               chat_template="ignored: the .jinja file wins",
               eos_token={"content": "</s>", "lstrip": False, "normalized": False,
                          "rstrip": False, "single_word": False, "special": True})
    _edit_json(copy_dir / "generation_config.json", eos_token_id=[2, 5])
    src = read_hf_folder(copy_dir)
    assert src.chat_template == "{{ messages[0]['content'] }}"
    assert src.add_bos_token is False and src.eos_token == "</s>"
    assert src.config.eos_token_ids == [2, 5]
    assert src.generation["eos_token_id"] == [2, 5]
    (copy_dir / "chat_template.jinja").unlink()
    (copy_dir / "chat_template.json").write_text(json.dumps({"chat_template": "T"}))
    assert read_hf_folder(copy_dir).chat_template == "T"


def _rewrite_tensors(folder, edit):
    from safetensors.numpy import load_file, save_file

    t = load_file(str(folder / "model.safetensors"))
    edit(t)
    save_file(t, str(folder / "model.safetensors"))


def test_extraneous_inv_freq_is_ignored(copy_dir):
    _rewrite_tensors(copy_dir, lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}))
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in read_hf_folder(copy_dir).shapes


def test_tied_true_ignores_lm_head_and_warns_if_different(copy_dir, caplog):
    # stories260K comes from llama2.c, whose head *is* the embedding: a redundant copy
    _edit_json(copy_dir / "config.json", tie_word_embeddings=True)
    with caplog.at_level(logging.WARNING, logger="edgeinfer.readers.hf"):
        src = read_hf_folder(copy_dir)
    assert "lm_head.weight" not in src.shapes and src.config.tie_word_embeddings
    assert caplog.text == ""  # identical copy: nothing to warn about

    def perturb(t):
        t["lm_head.weight"] = t["lm_head.weight"] + np.float32(0.5)

    _rewrite_tensors(copy_dir, perturb)
    with caplog.at_level(logging.WARNING, logger="edgeinfer.readers.hf"):
        src = read_hf_folder(copy_dir)
    assert "lm_head.weight" not in src.shapes
    assert "differs from model.embed_tokens.weight" in caplog.text


def test_tied_key_absent_defaults_to_tied(copy_dir):
    _edit_json(copy_dir / "config.json", tie_word_embeddings=None)
    _rewrite_tensors(copy_dir, lambda t: t.pop("lm_head.weight"))
    src = read_hf_folder(copy_dir)
    assert src.config.tie_word_embeddings and "lm_head.weight" not in src.shapes


def test_untied_without_lm_head_is_an_error(copy_dir):
    _rewrite_tensors(copy_dir, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelFormatError, match=r"tie_word_embeddings=false.*lm_head\.weight"):
        read_hf_folder(copy_dir)


def test_missing_tensor_names_it(copy_dir):
    _rewrite_tensors(copy_dir, lambda t: t.pop("model.layers.3.mlp.up_proj.weight"))
    with pytest.raises(ModelFormatError, match=r"model\.layers\.3\.mlp\.up_proj\.weight.*missing"):
        read_hf_folder(copy_dir)


def test_wrong_shape_names_tensor_and_shapes(copy_dir):
    _edit_json(copy_dir / "config.json", intermediate_size=128)
    with pytest.raises(ModelFormatError, match=r"mlp\.gate_proj\.weight.*\(172, 64\).*\(128, 64\)"):
        read_hf_folder(copy_dir)


def test_unknown_architecture(copy_dir):
    _edit_json(copy_dir / "config.json", model_type="mamba", architectures=["MambaForCausalLM"])
    with pytest.raises(UnsupportedModelError, match=r"config\.json.*'mamba'"):
        read_hf_folder(copy_dir)


def test_unexpected_decoder_tensor_is_an_error(copy_dir):
    _rewrite_tensors(copy_dir, lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}))
    with pytest.raises(ModelFormatError, match=r"q_proj\.bias"):
        read_hf_folder(copy_dir)


def test_truncated_safetensors_names_the_file(copy_dir):
    f = copy_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFormatError, match=r"model\.safetensors.*truncated"):
        read_model(copy_dir)


def test_missing_files_and_foreign_paths(tmp_path, copy_dir):
    with pytest.raises(ModelFormatError, match="no such file"):
        read_model(tmp_path / "nope")
    with pytest.raises(ModelFormatError, match="no config.json"):
        read_model(tmp_path)
    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelFormatError, match=r"weights\.bin.*expected a HF model folder"):
        read_model(junk)
    (copy_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        read_model(copy_dir)
