"""GGUF reader: stories260K HF == GGUF bit for bit, real SmolLM2/Qwen/Gemma metadata,
hand-decoded quant blocks, and strictness (truncation, unknown arch, missing tensors)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from edgeinfer.errors import ModelFormatError, UnsupportedModelError
from edgeinfer.readers import config_from_dict, read_model
from edgeinfer.readers.gguf import (
    GGUFFile,
    _unpermute_rows,
    gguf_config_dict,
    gguf_tensors,
    read_gguf,
)


@pytest.fixture(scope="module")
def stories_pair(stories_dir, stories_gguf):
    return read_model(stories_dir), read_model(stories_gguf)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):  # dequantized (the native re-layout: test_gguf_native.py)
    return read_gguf(smollm2_gguf, native=False)


@pytest.fixture(scope="module")
def qwen(qwen_gguf):
    return read_gguf(qwen_gguf, native=False)


# ---- stories260K: the HF folder and the original GGUF are the same model -------------------
def test_stories_config_fields_equal(stories_pair):
    hf, gg = stories_pair
    assert gg.format == "gguf"
    for f in dataclasses.fields(hf.config):
        if f.name == "pad_token_id":
            # config.json says 0 (<unk>); the GGUF's padding_token_id is 0xFFFFFFFF = unset
            assert (hf.config.pad_token_id, gg.config.pad_token_id) == (0, None)
            continue
        assert getattr(gg.config, f.name) == getattr(hf.config, f.name), f.name
    assert (gg.bos_token, gg.eos_token, gg.add_bos_token) == ("<s>", "</s>", True)


def test_stories_every_tensor_equal(stories_pair):
    hf, gg = stories_pair
    assert set(gg.shapes) == set(hf.shapes) and gg.shapes == hf.shapes
    for name in hf.shapes:
        a, b = hf.tensors[name], gg.tensors[name]
        assert b.dtype == np.float32
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_stories_qk_unpermutation_is_what_makes_them_equal(stories_pair, stories_gguf):
    hf, _ = stories_pair
    g = GGUFFile(stories_gguf)
    for gname, hname, heads in (("blk.2.attn_q.weight", "model.layers.2.self_attn.q_proj.weight", 8),
                                ("blk.2.attn_k.weight", "model.layers.2.self_attn.k_proj.weight", 4)):
        raw = g.dequantize(g.tensors[gname])
        want = hf.tensors[hname]
        assert not np.array_equal(raw, want)  # the file really is permuted
        np.testing.assert_array_equal(_unpermute_rows(raw, heads), want)
        # and llama.cpp's forward permute (convert_hf_to_gguf.py LlamaModel.permute) maps back
        fwd = want.reshape(heads, 2, want.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(want.shape)
        np.testing.assert_array_equal(fwd, raw)
    # V / O / MLP rows are not permuted
    np.testing.assert_array_equal(g.dequantize(g.tensors["blk.2.attn_v.weight"]),
                                  hf.tensors["model.layers.2.self_attn.v_proj.weight"])


def test_stories_tokenizer_ids_equal(stories_pair):
    from tokenizers import Tokenizer

    hf, gg = stories_pair
    a, b = Tokenizer.from_str(hf.tokenizer_json), Tokenizer.from_str(gg.tokenizer_json)
    text = "Once upon a time, there was a little girl named Lily. She said: \"Hi!\" 42"
    assert a.encode(text).ids == b.encode(text).ids
    assert b.encode(text).ids[:6] == [1, 403, 407, 261, 378, 432]


def test_stories_padding_id_out_of_range_is_absent(stories_gguf):
    g = GGUFFile(stories_gguf)
    assert g.metadata["tokenizer.ggml.padding_token_id"] == 0xFFFFFFFF
    assert gguf_config_dict(g)["pad_token_id"] is None


# ---- strictness -------------------------------------------------------------------------------
@pytest.mark.parametrize("cut", [10, 30, 5000, -100])
def test_truncated_gguf_is_a_format_error_naming_the_file(stories_gguf, tmp_path, cut):
    data = stories_gguf.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(ModelFormatError, match=r"cut\.gguf.*(truncated|too short)"):
        read_model(bad)
    if cut < 0:  # cut inside the data section: the message names the tensor too
        with pytest.raises(ModelFormatError, match=r"tensor 'blk\.4\.ffn_norm\.weight' needs bytes"):
            read_model(bad)


def test_not_a_gguf(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(ModelFormatError, match=r"model\.gguf.*GGUF magic"):
        read_model(f)


def _write_gguf(path, md, tensors, arch=None):
    """Write a GGUF (F32 tensors given in row-major HF orientation) with gguf.GGUFWriter."""
    import gguf

    V = gguf.GGUFValueType
    src_arch = md["general.architecture"]
    arch = arch or src_arch
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in md.items():
        if k == "general.architecture" or (isinstance(v, int) and v >= 2 ** 31 and "token_id" in k):
            continue
        if k.startswith(src_arch + "."):
            k = arch + k[len(src_arch):]
        if isinstance(v, bool):
            w.add_key_value(k, v, V.BOOL)
        elif isinstance(v, int):
            w.add_key_value(k, v, V.UINT32)
        elif isinstance(v, float):
            w.add_key_value(k, v, V.FLOAT32)
        elif isinstance(v, str):
            w.add_key_value(k, v, V.STRING)
        else:
            sub = V.STRING if isinstance(v[0], str) else V.FLOAT32 if isinstance(v[0], float) else V.INT32
            w.add_key_value(k, v, V.ARRAY, sub_type=sub)
    for n, a in tensors.items():
        w.add_tensor(n, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def stories_raw(stories_gguf):
    g = GGUFFile(stories_gguf)
    return dict(g.metadata), {n: g.dequantize(i) for n, i in g.tensors.items()}


def test_synthetic_copy_reads_back(stories_raw, stories_pair, tmp_path):
    md, t = stories_raw
    src = read_gguf(_write_gguf(tmp_path / "copy.gguf", md, t))
    np.testing.assert_array_equal(src.tensors["model.layers.1.self_attn.q_proj.weight"],
                                  stories_pair[0].tensors["model.layers.1.self_attn.q_proj.weight"])


def test_unknown_architecture_gguf(stories_raw, tmp_path):
    md, t = stories_raw
    with pytest.raises(UnsupportedModelError, match=r"bad\.gguf.*'falcon'"):
        read_gguf(_write_gguf(tmp_path / "bad.gguf", md, t, arch="falcon"))


def test_missing_tensor_gguf(stories_raw, tmp_path):
    md, t = stories_raw
    t = {k: v for k, v in t.items() if k != "blk.4.ffn_up.weight"}
    with pytest.raises(ModelFormatError, match=r"model\.layers\.4\.mlp\.up_proj\.weight.*missing"):
        read_gguf(_write_gguf(tmp_path / "m.gguf", md, t))


def test_wrong_shape_gguf(stories_raw, tmp_path):
    md, t = stories_raw
    md = {**md, "llama.feed_forward_length": 160}
    with pytest.raises(ModelFormatError, match=r"mlp\.gate_proj\.weight.*\(172, 64\).*\(160, 64\)"):
        read_gguf(_write_gguf(tmp_path / "s.gguf", md, t))


def test_unknown_tensor_is_not_dropped(stories_raw, tmp_path):
    md, t = stories_raw
    t = {**t, "blk.0.ffn_gate_exps.weight": np.zeros((4, 64), np.float32)}
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_gate_exps\.weight"):
        read_gguf(_write_gguf(tmp_path / "u.gguf", md, t))


def test_llama3_rope_freqs_become_hf_rope_scaling(stories_raw, tmp_path):
    # the factors llama.cpp's converter bakes for rope_type llama3 (factor 8, low 1,
    # high 4, original context 8192), for head_dim 8 and theta 1e4 ... 5e5
    md, t = stories_raw
    theta, dim, factor, old = 500000.0, 8, 8.0, 8192
    md = {**md, "llama.rope.freq_base": theta}
    freqs = []
    for f in 1.0 / theta ** (np.arange(0, dim, 2) / dim):
        wl = 2 * math.pi / f
        if wl < old / 4:
            freqs.append(1.0)
        elif wl > old:
            freqs.append(factor)
        else:
            s = (old / wl - 1) / 3
            freqs.append(1 / ((1 - s) / factor + s))
    src = read_gguf(_write_gguf(tmp_path / "r.gguf", md, {**t, "rope_freqs.weight": np.array(freqs)}))
    assert src.config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in src.shapes


# ---- SmolLM2-135M-Instruct (llama arch, Q4_1 + Q8_0) ------------------------------------------
def test_smollm2_config(smollm2):
    c = smollm2.config
    assert (c.model_type, c.hidden_size, c.num_hidden_layers) == ("llama", 576, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.rope_theta) == (49152, 1536, 100000.0)
    assert c.tie_word_embeddings is True and "lm_head.weight" not in smollm2.shapes
    assert c.max_position_embeddings == 8192 and c.attention_bias is False
    assert smollm2.provenance["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


def test_smollm2_chat_template_and_eos(smollm2):
    import jinja2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(smollm2.tokenizer_json)
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end == 2 and im_end in smollm2.config.eos_token_ids
    assert smollm2.eos_token == "<|im_end|>" and smollm2.bos_token == "<|im_start|>"
    assert smollm2.add_bos_token is False
    t = jinja2.Environment().from_string(smollm2.chat_template)
    out = t.render(messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
                   add_generation_prompt=True)
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"


def _f16(b: np.ndarray) -> np.ndarray:
    return b.view(np.float16).astype(np.float32)


def test_smollm2_q8_0_and_q4_1_blocks_decoded_by_hand(smollm2, smollm2_gguf):
    g = GGUFFile(smollm2_gguf)
    # Q8_0 block: fp16 scale d, 32 x int8 -> x = d * q. Row 7 of the embedding.
    raw = g.raw(g.tensors["token_embd.weight"])[7]  # [18 blocks * 34 bytes]
    blk = raw.reshape(-1, 34)
    want = _f16(blk[:, :2].copy())[:, :1] * blk[:, 2:].view(np.int8).astype(np.float32)
    np.testing.assert_array_equal(smollm2.tensors["model.embed_tokens.weight"][7], want.reshape(-1))
    # Q4_1 block: fp16 d, fp16 m, 16 bytes: low nibbles = x[0:16], high = x[16:32]; x = d*q + m
    raw = g.raw(g.tensors["blk.3.ffn_gate.weight"])[100].reshape(-1, 20)
    d, m = _f16(raw[:, 0:2].copy()), _f16(raw[:, 2:4].copy())
    q = np.concatenate([raw[:, 4:] & 15, raw[:, 4:] >> 4], axis=1).astype(np.float32)
    got = smollm2.tensors["model.layers.3.mlp.gate_proj.weight"]
    assert got.shape == (1536, 576)
    np.testing.assert_allclose(got[100], (d * q + m).reshape(-1), rtol=1e-6, atol=1e-7)


def test_smollm2_qk_rows_are_unpermuted(smollm2, smollm2_gguf):
    g = GGUFFile(smollm2_gguf)
    raw = g.dequantize(g.tensors["blk.0.attn_k.weight"])
    np.testing.assert_array_equal(smollm2.tensors["model.layers.0.self_attn.k_proj.weight"],
                                  _unpermute_rows(raw, 3))


# ---- Qwen2.5-Coder-0.5B-Instruct (qwen2 arch, Q4_K_M mix) ---------------------------------------
def test_qwen_config_and_biases(qwen):
    c = qwen.config
    assert (c.model_type, c.hidden_size, c.num_hidden_layers) == ("qwen2", 896, 24)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (14, 2, 64)
    assert c.vocab_size == 151936 and c.rope_theta == 1e6
    assert c.attention_bias is True and c.tie_word_embeddings is False
    assert qwen.shapes["lm_head.weight"] == (151936, 896)
    assert qwen.shapes["model.layers.5.self_attn.q_proj.bias"] == (896,)
    assert qwen.shapes["model.layers.5.self_attn.k_proj.bias"] == (128,)
    assert 151645 in c.eos_token_ids and 151643 in c.eos_token_ids  # <|im_end|>, <|endoftext|>
    assert set(qwen.provenance["tensor_types"]) == {"Q5_0", "F32", "Q8_0", "Q6_K", "Q4_K"}
    assert "<|im_start|>assistant" in qwen.chat_template


def test_qwen_k_quant_dequantization_and_no_permutation(qwen, qwen_gguf):
    g = GGUFFile(qwen_gguf)
    info = g.tensors["blk.0.ffn_down.weight"]
    assert g.metadata["general.architecture"] == "qwen2"
    w = qwen.tensors["model.layers.0.mlp.down_proj.weight"]
    assert w.shape == (896, 4864) and w.dtype == np.float32 and np.isfinite(w).all()
    assert 0.005 < float(w.std()) < 0.2
    q = qwen.tensors["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(q, g.dequantize(g.tensors["blk.0.attn_q.weight"]))
    assert info.qtype != 0  # really quantized


# ---- Gemma 3 270M (gemma3 arch): config facts llama.cpp hard-codes, norm convention ------------
def test_gemma3_config_and_norms(gemma_gguf):
    g = GGUFFile(gemma_gguf)
    cfg = config_from_dict(gguf_config_dict(g), str(gemma_gguf))
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("gemma3_text", 640, 18)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 1, 256)
    assert cfg.vocab_size == 262144 and cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.sliding_window == 512 and cfg.rope_local_base_freq == 10000.0 and cfg.rope_theta == 1e6
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.query_pre_attn_scalar == 256 and cfg.norm_unit_offset and cfg.qk_norm
    loaders, _ = gguf_tensors(g, cfg, native=False)
    for gname, hname in (("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                         ("blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"),
                         ("blk.0.post_attention_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
                         ("blk.0.post_ffw_norm.weight", "model.layers.0.post_feedforward_layernorm.weight"),
                         ("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight"),
                         ("output_norm.weight", "model.norm.weight")):
        # GGUF stores 1 + w (llama.cpp uses a plain RMSNorm); HF's Gemma3RMSNorm wants w
        np.testing.assert_array_equal(loaders[hname](), g.dequantize(g.tensors[gname]) - 1.0)
    # q rows are not permuted for gemma3
    np.testing.assert_array_equal(loaders["model.layers.0.self_attn.q_proj.weight"](),
                                  g.dequantize(g.tensors["blk.0.attn_q.weight"]))
