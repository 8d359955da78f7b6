"""Hostile HF model folders: one test per root cause (issue 14, S1/S4/S5/S6).

Each case is built in tmp_path from the real stories260K folder with one thing changed;
the reader must refuse it with a ModelFormatError / UnsupportedModelError naming the file
and the field, without opening anything outside the folder and in bounded time.
"""
from __future__ import annotations

import json
import math
import os
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from hostile import copy_folder, edit_json, safetensors_bytes

from edgeinfer import source as source_mod
from edgeinfer.api import tokenizer_for
from edgeinfer.errors import ModelFormatError, UnsupportedModelError
from edgeinfer.readers import read_model
from edgeinfer.readers.files import parse_json


@pytest.fixture
def folder(stories_dir, tmp_path) -> Path:
    return copy_folder(stories_dir, tmp_path / "models" / "stories")


def _index(folder: Path, remap: dict[str, str] | None = None) -> dict:
    """Turn model.safetensors into a one-shard index; ``remap`` redirects some tensors."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        names = list(f.keys())
    wm = {n: "model.safetensors" for n in names}
    wm.update(remap or {})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return wm


def _finishes(fn, seconds: float = 20.0):
    """Run ``fn`` in a thread; fail (instead of hanging) when it blocks, e.g. on a FIFO."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"blocked for more than {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# ---------------------------------------------------------------- S1: outside the folder
def test_index_shards_must_stay_inside_the_folder(folder, tmp_path):
    # a valid shard with the very tensors the model needs, outside the folder: it was
    # loaded (exit 0) before the fix
    outside = tmp_path / "_outside"
    outside.mkdir()
    (outside / "x.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    name = "model.layers.0.mlp.up_proj.weight"
    for target, why in (("../../_outside/x.safetensors", "outside the model folder"),
                        (str(outside / "x.safetensors"), "absolute path"),
                        ("/etc/passwd", "absolute path"),
                        ("../../../../dev/zero", "outside the model folder"),
                        ("", "not a file name")):
        _index(folder, {name: target})
        with pytest.raises(ModelFormatError, match=why) as e:
            _finishes(lambda: read_model(folder))
        assert "model.safetensors.index.json" in str(e.value) or why == "not a file name"
    # a symlink in the folder that points out is refused the same way
    (folder / "link.safetensors").symlink_to(outside / "x.safetensors")
    _index(folder, {name: "link.safetensors"})
    with pytest.raises(ModelFormatError, match=r"link\.safetensors.*outside the model folder"):
        read_model(folder)
    # a shard name that is not a string
    _index(folder, {name: 7})
    with pytest.raises(ModelFormatError, match="not a file name"):
        read_model(folder)
    # positive control: the same index pointing at the real shard reads
    _index(folder)
    assert read_model(folder).config.num_hidden_layers == 5


def test_non_regular_files_are_refused_without_blocking(folder, tmp_path):
    fifo = folder / "fifo.safetensors"
    os.mkfifo(fifo)
    _index(folder, {"model.norm.weight": "fifo.safetensors"})
    with pytest.raises(ModelFormatError, match=r"fifo\.safetensors.*not a regular file"):
        _finishes(lambda: read_model(folder))
    (folder / "model.safetensors.index.json").unlink()
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").mkdir()
    with pytest.raises(ModelFormatError, match=r"generation_config\.json.*not a regular file"):
        read_model(folder)
    # a model path that is itself a FIFO or a device
    with pytest.raises(ModelFormatError, match="not a regular file"):
        _finishes(lambda: read_model(fifo))
    with pytest.raises(ModelFormatError, match="not a regular file"):
        read_model("/dev/zero")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json",
                                  "chat_template.jinja", "generation_config.json"])
def test_every_folder_file_is_confined(folder, tmp_path, name):
    secret = tmp_path / "secret.txt"
    secret.write_text('{"a": 1}')
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(secret)
    with pytest.raises(ModelFormatError, match=rf"{name}.*outside the model folder"):
        read_model(folder)


def test_hf_cache_layout_resolves_within_the_repo(stories_dir, tmp_path):
    """``models--org--name/snapshots/<rev>/`` of relative symlinks into ``../../blobs/``
    (the Hugging Face cache) reads, and equals the plain folder; a link into another
    repository's blobs is refused."""
    repo = tmp_path / "hub" / "models--karpathy--stories260K"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in stories_dir.iterdir() if p.suffix != ".gguf")):
        (blobs / f"blob{i}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    got, want = read_model(snap), read_model(stories_dir)
    assert got.config == want.config and got.tokenizer_json == want.tokenizer_json
    np.testing.assert_array_equal(got.tensors["model.layers.2.mlp.down_proj.weight"],
                                  want.tensors["model.layers.2.mlp.down_proj.weight"])
    other = tmp_path / "hub" / "models--evil--x" / "blobs"
    other.mkdir(parents=True)
    (other / "cfg").write_bytes((stories_dir / "config.json").read_bytes())
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(other / "cfg")
    with pytest.raises(ModelFormatError, match="outside the model folder"):
        read_model(snap)


# ---------------------------------------------------------------- bounded JSON
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json", "model.safetensors.index.json"])
def test_json_depth_big_ints_and_duplicates_refused(folder, name):
    for text, why in (("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                      ('{"hidden_size": ' + "9" * 5000 + "}", "more than 4300 digits"),
                      ('{"a": 1, "a": 2}', "duplicate key 'a'"),
                      ('{"a": "\\ud800"}', "lone surrogate")):
        (folder / name).write_text(text)
        with pytest.raises(ModelFormatError, match=rf"{name}.*{why}"):
            read_model(folder)


def test_duplicate_keys_in_config_and_tokenizer(folder):
    raw = (folder / "config.json").read_text()
    (folder / "config.json").write_text(raw.replace('"hidden_size": 64', '"hidden_size": 64, "hidden_size": 128'))
    with pytest.raises(ModelFormatError, match=r"config\.json.*duplicate key 'hidden_size'"):
        read_model(folder)
    (folder / "config.json").write_text(raw)
    tok = (folder / "tokenizer.json").read_text()
    assert '"<s>": 1' in tok
    (folder / "tokenizer.json").write_text(tok.replace('"<s>": 1', '"<s>": 1, "<s>": 5', 1))
    with pytest.raises(ModelFormatError, match=r"tokenizer\.json.*duplicate key '<s>'"):
        read_model(folder)


def test_config_like_json_nests_at_most_32_levels(folder):
    """Values of config-like files reach recursive code (dataclasses.asdict, json.dumps
    when converting): 40 levels, well inside the parser's own limit, are refused."""
    edit_json(folder / "generation_config.json", extra=json.loads("[" * 40 + "]" * 40))
    with pytest.raises(ModelFormatError, match=r"generation_config\.json: JSON nested too deeply "
                                               r"\(more than 32 levels\)"):
        read_model(folder)


def test_parse_json_controls():
    # positive controls: what the limits must not refuse
    assert parse_json('{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}', "x") == {"a": "😀", "b": "\\ud800"}
    assert parse_json("[" * 200 + "]" * 200, "x") is not None  # no max_depth: tokenizer.json
    assert parse_json("[" * 32 + "]" * 32, "x", max_depth=32) is not None
    with pytest.raises(ModelFormatError, match="more than 32 levels"):
        parse_json("[" * 33 + "]" * 33, "x", max_depth=32)
    assert parse_json('{"n": ' + "9" * 4000 + "}", "x")["n"] > 10 ** 3999


# ---------------------------------------------------------------- S4/S6: config sizes
@pytest.mark.parametrize("changes,exc,why", [
    ({"num_key_value_heads": 0}, ModelFormatError, "num_key_value_heads must be an integer"),
    ({"num_key_value_heads": 3}, ModelFormatError, "not a multiple of num_key_value_heads 3"),
    ({"num_attention_heads": 0}, ModelFormatError, "num_attention_heads must be an integer"),
    ({"head_dim": 7}, ModelFormatError, "RoPE needs a positive even number"),
    ({"rope_parameters": {"rope_theta": 0.0}}, ModelFormatError, "rope_theta must be positive"),
    ({"rope_parameters": {"rope_theta": -1e4}}, ModelFormatError, "rope_theta must be positive"),
    ({"rms_norm_eps": float("nan")}, ModelFormatError, "rms_norm_eps must be a finite number"),
    ({"rms_norm_eps": -1e-5}, ModelFormatError, "rms_norm_eps must be positive"),
    ({"hidden_size": "64"}, ModelFormatError, "hidden_size must be an integer"),
    ({"hidden_size": 64.5}, ModelFormatError, "hidden_size must be an integer"),
    ({"vocab_size": True}, ModelFormatError, "vocab_size must be an integer"),
    ({"tie_word_embeddings": "false"}, ModelFormatError, "tie_word_embeddings must be true or false"),
    ({"bos_token_id": 512}, ModelFormatError, "bos_token_id 512 is not below vocab_size 512"),
    ({"eos_token_id": "2"}, ModelFormatError, "eos_token_id must be"),
    ({"hidden_act": "relu"}, ModelFormatError, "hidden_act: activation 'relu' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedModelError, "yarn"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, ModelFormatError, "factor must be"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                       "high_freq_factor": 4}}, ModelFormatError, "must exceed low_freq_factor"),
    ({"text_config": 5, "hidden_size": None}, ModelFormatError, "text_config must be"),
    ({"vocab_size": None}, ModelFormatError, "required key 'vocab_size' is missing"),
    ({"num_hidden_layers": 10 ** 9}, ModelFormatError, "num_hidden_layers must be an integer in 1..65536"),
])
def test_invalid_config_values_are_named(folder, changes, exc, why):
    edit_json(folder / "config.json", **changes)
    with pytest.raises(exc, match=rf"config\.json.*{why}"):
        read_model(folder)


def test_layer_count_is_checked_before_any_expansion(folder, monkeypatch):
    """60000 layers (under the hard cap) with tensors for 5: refused from the names alone,
    never expanding 60000 x 16 tensor specs."""
    edit_json(folder / "config.json", num_hidden_layers=60000)
    real = source_mod.tensor_specs

    def guarded(cfg):
        assert cfg.num_hidden_layers <= 5, "tensor_specs expanded an unchecked layer count"
        return real(cfg)

    monkeypatch.setattr(source_mod, "tensor_specs", guarded)
    with pytest.raises(ModelFormatError, match=r"num_hidden_layers = 60000 layers.*tensors for 5"
                                               r".*layer 5"):
        read_model(folder)
    edit_json(folder / "config.json", num_hidden_layers=5)
    assert read_model(folder).config.num_hidden_layers == 5  # positive control


# ---------------------------------------------------------------- S6: tokenizer at load
def _edit_tokenizer(folder: Path, fn) -> None:
    d = json.loads((folder / "tokenizer.json").read_text())
    d = fn(d)
    (folder / "tokenizer.json").write_text(json.dumps(d))


def _set_model(**kw):
    def fn(d):
        d["model"].update(kw)
        return d
    return fn


@pytest.mark.parametrize("fn,exc,why", [
    (lambda d: [d], ModelFormatError, "must be a JSON object, found a list"),
    (lambda d: {**d, "model": "BPE"}, ModelFormatError, "no 'model' object"),
    (_set_model(type="Sentencepiece"), UnsupportedModelError, "model type 'Sentencepiece' is unknown"),
    (lambda d: {**d, "model": {**d["model"], "vocab": {}}, "added_tokens": []},
     ModelFormatError, "vocabulary is empty"),
    (_set_model(vocab={"a": 0, "b": 512}), ModelFormatError, "'b' has id 512.*vocab_size = 512"),
    (_set_model(vocab={"a": 0, "b": -1}), ModelFormatError, r"model\.vocab\['b'\] = -1"),
    (lambda d: {**d, "added_tokens": [{"id": 9999, "content": "<x>"}]}, ModelFormatError,
     "'<x>' has id 9999"),
    (lambda d: {**d, "added_tokens": [{"content": "<x>"}]}, ModelFormatError, "needs an integer 'id'"),
])
def test_tokenizer_problems_are_named_at_load(folder, fn, exc, why):
    _edit_tokenizer(folder, fn)
    with pytest.raises(exc, match=rf"tokenizer\.json.*{why}"):
        read_model(folder)


def test_special_tokens_must_be_in_the_vocabulary(folder):
    edit_json(folder / "tokenizer_config.json", bos_token="<not-there>")
    with pytest.raises(ModelFormatError, match=r"tokenizer_config\.json bos_token '<not-there>' "
                                               r"is not in the vocabulary"):
        read_model(folder)
    edit_json(folder / "tokenizer_config.json", bos_token=["<s>"])
    with pytest.raises(ModelFormatError, match=r"bos_token must be a string"):
        read_model(folder)
    edit_json(folder / "tokenizer_config.json", bos_token="<s>", add_bos_token="yes")
    with pytest.raises(ModelFormatError, match=r"add_bos_token must be true or false"):
        read_model(folder)
    edit_json(folder / "tokenizer_config.json", add_bos_token=None)
    edit_json(folder / "generation_config.json", eos_token_id=["2"])
    with pytest.raises(ModelFormatError, match=r"generation_config\.json: eos_token_id must be"):
        read_model(folder)


def test_chat_template_size_and_type(folder):
    edit_json(folder / "tokenizer_config.json", chat_template="{{ x }}" * 700_000)
    with pytest.raises(ModelFormatError, match=r"a chat template of 4900000 characters"):
        read_model(folder)
    edit_json(folder / "tokenizer_config.json", chat_template=5)
    with pytest.raises(ModelFormatError, match=r"tokenizer_config\.json.*chat template must be"):
        read_model(folder)
    (folder / "chat_template.jinja").write_bytes(b"x" * (4 * 1024 * 1024 + 1))
    with pytest.raises(ModelFormatError, match=r"chat_template\.jinja: 4194305 bytes, more than"):
        read_model(folder)
    (folder / "chat_template.jinja").write_text("{{ bos_token }}")
    assert read_model(folder).chat_template == "{{ bos_token }}"  # positive control


def test_tokenizer_refused_by_the_library_is_a_model_error(folder):
    """What only ``tokenizers`` itself refuses (here a merge of unknown tokens) comes out of
    the model load as a ModelFormatError naming the folder, not a bare exception."""
    _edit_tokenizer(folder, _set_model(merges=[["zz", 5]]))
    src = read_model(folder)
    with pytest.raises(ModelFormatError, match=r"stories: the tokenizer cannot be loaded"):
        tokenizer_for(src)


# ---------------------------------------------------------------- safetensors headers
def _with_header(folder: Path, mutate) -> None:
    raw = (folder / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = mutate(header, data)  # edits the header in place, or returns the whole file
    (folder / "model.safetensors").write_bytes(out if isinstance(out, bytes) else
                                               safetensors_bytes(header, data))


_NAME = "model.layers.1.mlp.up_proj.weight"


def _entry(**kw):
    def mutate(h, d):
        h[_NAME].update(kw)
    return mutate


def _dup_entry(h, d):
    text = json.dumps(h).replace(f'"{_NAME}"', f'"{_NAME}": {json.dumps(h[_NAME])}, "{_NAME}"', 1)
    return safetensors_bytes(text.encode(), d)


@pytest.mark.parametrize("mutate,why", [
    (_entry(data_offsets=[-4, 100]), r"data_offsets \[-4, 100\] are not"),
    (_entry(data_offsets=[0, 44032]), "overlaps the previous tensor"),
    (_entry(dtype="Q4"), "unknown dtype 'Q4'"),
    (_entry(shape=[172, -64]), "not a list of at most"),
    (_entry(shape=[172, 65]), "bytes of data for shape"),
    (_entry(extra=1), "exactly 'dtype', 'shape'"),
    (_dup_entry, f"duplicate key '{_NAME}'"),
    (lambda h, d: struct.pack("<Q", 2 ** 63) + b"{}", "header length"),
    (lambda h, d: safetensors_bytes(h, d + b"\0" * 16), "16 bytes after the last tensor"),
    (lambda h, d: safetensors_bytes(h, d[:-8]), "truncated"),
    (lambda h, d: h.update(__metadata__={"format": 1}), "'__metadata__' must map strings"),
])
def test_safetensors_header_is_checked_before_data(folder, mutate, why):
    _with_header(folder, mutate)
    with pytest.raises(ModelFormatError, match=rf"model\.safetensors.*{why}"):
        read_model(folder)


def test_nan_and_inf_weights_are_named_when_loaded(folder):
    name = "model.layers.3.self_attn.v_proj.weight"

    def poison(h, d):
        b, _ = h[name]["data_offsets"]
        buf = bytearray(d)
        struct.pack_into("<f", buf, b + 4 * 7, math.inf)
        return safetensors_bytes(h, bytes(buf))

    _with_header(folder, poison)
    src = read_model(folder)  # reading the header is enough to know the shapes
    with pytest.raises(ModelFormatError, match=rf"{name}.*1 non-finite values.*first at \(0, 7\)"):
        src.tensors[name]
    np.asarray(src.tensors["model.layers.3.self_attn.q_proj.weight"])  # others still load
