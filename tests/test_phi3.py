"""Phi-3, added as one family entry plus fixups, against HF transformers' Phi3ForCausalLM.

Two tiny random models built here (``tiny_models.tiny_phi3_folder``): "plain" and
"longrope" (partial rotary 0.5, sliding window 12, LongRoPE switching at 16 tokens,
tied head). The LongRoPE reference is HF's: every step's logits equal a from-scratch
forward over the current sequence (short factors up to 16 tokens, long beyond), which
HF's own ``generate`` reaches by dropping its cache at the switch.

Bounds reached (float32 weights, logits up to ~±40): max |Δlogit| 1.5e-5 on the
reference backend, 1.7e-5 on the CPU backend; the greedy top-1/top-2 margins are >= 0.03.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.engine import Engine
from edgeinfer.errors import ModelFormatError, UnsupportedModelError
from edgeinfer.models.families import LAYER, family
from edgeinfer.models.transformer import RopeSwitchError, Transformer
from edgeinfer.readers import read_model
from tiny_models import PHI3_TEXT, PHI3_VARIANTS, tiny_phi3_folder

torch = pytest.importorskip("torch", reason="torch (CPU) is needed for HF parity")
transformers = pytest.importorskip("transformers", reason="transformers is needed for HF parity")

BOUND = {"reference": 1e-4, "cpu": 1e-4}
PROMPT_LEN, TOTAL = 10, 24  # the longrope variant crosses its switch (16) while decoding


@pytest.fixture(scope="module")
def phi3_models(tmp_path_factory):
    """variant -> (variant, HF folder, HF model), built once."""
    out = {}
    for v in PHI3_VARIANTS:
        folder = tmp_path_factory.mktemp(f"phi3-{v}")
        out[v] = (v, folder, tiny_phi3_folder(folder, v))
    return out


@pytest.fixture(params=list(PHI3_VARIANTS))
def phi3(request, phi3_models):
    return phi3_models[request.param]


@pytest.fixture
def phi3_long(phi3_models):
    """The variant with LongRoPE, partial rotary and a sliding window."""
    return phi3_models["longrope"]


def _prompt(folder) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PHI3_TEXT).ids
    return [0] + ids[:PROMPT_LEN - 1]  # BOS + text


def _hf_last_logits(hf, ids) -> np.ndarray:
    """HF's logits of the last position, from scratch over the whole sequence."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float().numpy()


def _backend(name):
    if name == "reference":
        return ReferenceBackend()
    from edgeinfer.backends.cpu import CpuBackend

    return CpuBackend()


def test_config_is_the_family_entry(phi3):
    variant, folder, hf = phi3
    cfg = read_model(folder).config
    assert cfg.model_type == "phi3" and cfg.arch == "phi3" and cfg.activation == "silu"
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    if variant == "longrope":
        assert cfg.rotary_dim == 8 and cfg.sliding_window == 12 and cfg.layer_window(1) == 12
        assert cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rope_scaling["original_max_position_embeddings"] == 16
    else:
        assert cfg.rotary_dim == 16 and cfg.sliding_window is None and cfg.rope_scaling is None


def test_fused_tensors_split_in_hf_row_order(phi3):
    _, folder, hf = phi3
    src = read_model(folder)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    q, kv, f = 4 * 16, 2 * 16, 96
    for i in range(2):
        p = f"model.layers.{i}."
        qkv, gu = sd[p + "self_attn.qkv_proj.weight"], sd[p + "mlp.gate_up_proj.weight"]
        for name, want in (("self_attn.q_proj", qkv[:q]), ("self_attn.k_proj", qkv[q:q + kv]),
                           ("self_attn.v_proj", qkv[q + kv:]), ("mlp.gate_proj", gu[:f]),
                           ("mlp.up_proj", gu[f:])):
            np.testing.assert_array_equal(src.tensors[f"{p}{name}.weight"], want)
            assert src.shapes[f"{p}{name}.weight"] == want.shape
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in src.tensors)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_logits_and_greedy_tokens_match_hf(phi3, backend):
    """Prefill logits at every position, then each greedy step's logits, against HF from
    scratch; the greedy tokens against HF's own ``generate`` (its cache-dropping path)."""
    variant, folder, hf = phi3
    src = read_model(folder)
    model = Transformer(src.config, src.tensors, _backend(backend), max_positions=64)
    ids = _prompt(folder)
    with torch.no_grad():
        hf_all = hf(torch.tensor([ids])).logits[0].numpy()
    ours_all = model.forward(np.asarray(ids, np.int32), model.new_cache(64), all_logits=True)
    assert np.abs(ours_all - hf_all).max() < BOUND[backend]

    eng = Engine(model, None, n_ctx=64)
    logits, _ = eng.prefill(ids)
    seq, errs = list(ids), []
    while len(seq) < TOTAL:
        errs.append(float(np.abs(logits - _hf_last_logits(hf, seq)).max()))
        seq.append(int(np.argmax(logits)))
        logits = eng.decode_one(seq[-1])
    assert max(errs) < BOUND[backend], errs
    assert eng.cached_ids == seq and eng.cache.length == TOTAL
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=TOTAL - PROMPT_LEN,
                          do_sample=False, eos_token_id=None, pad_token_id=1)
    assert gen[0].tolist() == seq
    if variant == "longrope":
        assert eng._cache_long  # the run crossed the switch


def test_longrope_switch_is_what_makes_them_equal(phi3_long):
    """Negative controls on the longrope variant: continuing the short-factor cache past
    the switch, short factors throughout, or no sliding window all leave HF's logits."""
    _, folder, hf = phi3_long
    src = read_model(folder)
    model = Transformer(src.config, src.tensors, ReferenceBackend(), max_positions=64)
    seq = _prompt(folder) + list(range(2, 2 + 14))  # 24 tokens
    ref17, ref24 = _hf_last_logits(hf, seq[:17]), _hf_last_logits(hf, seq)

    cache = model.new_cache(64)
    model.forward(np.asarray(seq[:16], np.int32), cache)
    with pytest.raises(RopeSwitchError, match="re-run the whole sequence"):
        model.forward(np.asarray(seq[16:17], np.int32), cache)
    stale = model.forward(np.asarray(seq[16:17], np.int32), cache, long_rope=True)[0]
    assert np.abs(stale - ref17).max() > 100 * BOUND["reference"]  # keys need re-prefill

    fresh = model.forward(np.asarray(seq[:17], np.int32), model.new_cache(64))[0]
    assert np.abs(fresh - ref17).max() < BOUND["reference"]  # positive control
    short = model.forward(np.asarray(seq, np.int32), model.new_cache(64), long_rope=False)[0]
    assert np.abs(short - ref24).max() > 100 * BOUND["reference"]

    no_window = dataclasses.replace(src.config, sliding_window=None)
    m2 = Transformer(no_window, src.tensors, ReferenceBackend(), max_positions=64)
    full = m2.forward(np.asarray(seq, np.int32), m2.new_cache(64))[0]
    assert np.abs(full - ref24).max() > 100 * BOUND["reference"]


def test_engine_prefix_reuse_keeps_the_regime(phi3_long):
    """A cached long-factor prefix is not reused for a prompt short enough for the short
    factors (and vice versa): the logits equal HF from scratch either way."""
    _, folder, hf = phi3_long
    src = read_model(folder)
    model = Transformer(src.config, src.tensors, ReferenceBackend(), max_positions=64)
    eng = Engine(model, None, n_ctx=64, prefill_chunk=5)  # chunks end below the switch
    seq = _prompt(folder) + list(range(2, 2 + 14))
    for n, switched in ((20, True), (12, True), (14, False), (22, True), (18, False)):
        logits, reused = eng.prefill(seq[:n])
        assert np.abs(logits - _hf_last_logits(hf, seq[:n])).max() < BOUND["reference"], n
        assert (reused == 0) if switched else (reused > 0), (n, reused)


def _hf_with(hf, tensors):
    """A copy of the HF model holding ``tensors`` (dequantized), re-fused as HF stores them."""
    import copy

    def dense(name):
        t = tensors[name]
        return torch.from_numpy(np.array(t.dequantize() if hasattr(t, "dequantize") else t,
                                           np.float32))

    m = copy.deepcopy(hf)
    sd = {}
    for name in m.state_dict():
        p = name.rsplit(".", 2)[0] + "."
        if name.endswith("qkv_proj.weight"):
            sd[name] = torch.cat([dense(p + f"{x}_proj.weight") for x in "qkv"])
        elif name.endswith("gate_up_proj.weight"):
            sd[name] = torch.cat([dense(p + f"{x}_proj.weight") for x in ("gate", "up")])
        elif name == "lm_head.weight" and name not in tensors:
            sd[name] = dense("model.embed_tokens.weight")
        else:
            sd[name] = dense(name)
    m.load_state_dict(sd)
    return m


def test_convert_rtn_int4_runs_on_both_backends(phi3, tmp_path):
    """``edgeinfer convert`` (RTN, INT4 group 32) of the HF folder: the split linears are
    stored quantized, the config survives the round trip, the reference backend on the
    INT4 weights equals HF holding the same (dequantized) weights, and the CPU backend
    equals the reference."""
    _, folder, hf = phi3
    out = tmp_path / "phi3.eif"
    r = subprocess.run([sys.executable, "-m", "cli", "convert", str(folder), "-o", str(out),
                        "--method", "rtn", "--group-size", "32", "-q", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["method"] == "rtn"
    src = read_model(out)
    assert src.config == read_model(folder).config
    from edgeinfer.backends.quantized import QuantizedTensor

    for i in range(2):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            qt = src.tensors[f"model.layers.{i}.{name}.weight"]
            assert isinstance(qt, QuantizedTensor) and qt.bits == 4 and qt.group_size == 32
    ids = _prompt(folder) + list(range(2, 2 + 10))  # 20 tokens: past the longrope switch
    got = {}
    for be in ("reference", "cpu"):
        m = Transformer(src.config, src.tensors, _backend(be), max_positions=64)
        got[be] = m.forward(np.asarray(ids, np.int32), m.new_cache(64), all_logits=True)
    with torch.no_grad():
        same = _hf_with(hf, src.tensors)(torch.tensor([ids])).logits[0].numpy()
        float_ = hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got["reference"] - same).max() < BOUND["reference"]
    assert np.abs(got["reference"] - float_).max() > 100 * BOUND["reference"]  # it is INT4
    rel = np.linalg.norm(got["cpu"] - got["reference"]) / np.linalg.norm(got["reference"])
    assert rel < 2e-2  # the CPU kernels quantize activations to int8 for INT4 weights


def test_awq_uses_the_family_groups(phi3):
    """AWQ on Phi-3 searches exactly the table's groups (no v->o under GQA) and quantizes
    every split linear."""
    from edgeinfer.quant.calibrate import quantize_layers

    _, folder, hf = phi3
    src = read_model(folder)
    ids = np.asarray([_prompt(folder) + list(range(2, 2 + 22))] * 2, np.int32)  # 2 x 32
    q, info = quantize_layers(src, ids, "awq", group_size=32)
    want = {"+".join(g.linears) for g in family("phi3").awq_groups if g.when(src.config)}
    assert want == {"q_proj+k_proj+v_proj", "gate_proj+up_proj", "down_proj"}
    for i in range(2):
        assert set(info["awq_alpha"][i]) >= want
        assert not any("o_proj" in k and not k.startswith("clip:") for k in info["awq_alpha"][i])
        for short in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            assert q[f"model.layers.{i}.{LAYER[short].name.split('}.', 1)[1]}"].method == "awq"


def _edit_config(folder, tmp_path, **changes):
    import shutil

    dst = tmp_path / f"edited{len(list(tmp_path.iterdir()))}"
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_fused_tensor_is_named(phi3, tmp_path):
    """A fused tensor of the wrong width, or one stored beside its parts, is refused with
    the tensor's name."""
    from safetensors.numpy import load_file, save_file

    _, folder, _ = phi3
    dst = _edit_config(folder, tmp_path)
    t = load_file(str(dst / "model.safetensors"))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    good = t[name]
    t[name] = good[:-16]
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"qkv_proj.weight.*expected \(128, 64\)"):
        read_model(dst)
    t[name] = good
    t["model.layers.1.self_attn.k_proj.weight"] = good[64:96]
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match="both .*qkv_proj.* and .*k_proj"):
        read_model(dst)


def test_bad_longrope_config_is_refused(phi3_long, tmp_path):
    _, folder, _ = phi3_long
    rp = json.loads((folder / "config.json").read_text())["rope_parameters"]
    dst = _edit_config(folder, tmp_path, rope_parameters={**rp, "long_factor": [1.0, 2.0]})
    with pytest.raises(ModelFormatError, match="long_factor must be a list of 4 positive"):
        read_model(dst)


def test_old_style_su_rope_scaling_reads_as_longrope(phi3_long, tmp_path):
    """Phi-3-mini-128k's original config: ``rope_scaling`` {"type": "su", ...} beside a
    top-level original_max_position_embeddings (which HF gives priority)."""
    _, folder, _ = phi3_long
    rp = json.loads((folder / "config.json").read_text())["rope_parameters"]
    dst = _edit_config(folder, tmp_path, rope_parameters=None, partial_rotary_factor=0.5,
                       rope_theta=10000.0, rope_scaling={
                           "type": "su", "short_factor": rp["short_factor"],
                           "long_factor": rp["long_factor"],
                           "original_max_position_embeddings": 999})
    cfg, want = read_model(dst).config, read_model(folder).config
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 16
    m1 = Transformer(cfg, read_model(dst).tensors, ReferenceBackend(), max_positions=64)
    m2 = Transformer(want, read_model(folder).tensors, ReferenceBackend(), max_positions=64)
    ids = np.arange(2, 22, dtype=np.int32)
    np.testing.assert_array_equal(m1.forward(ids, m1.new_cache(64)),
                                  m2.forward(ids, m2.new_cache(64)))


def test_unknown_activation_is_refused(phi3, tmp_path):
    _, folder, _ = phi3
    with pytest.raises(ModelFormatError, match="activation 'gelu' is not supported"):
        read_model(_edit_config(folder, tmp_path, hidden_act="gelu"))
    with pytest.raises(UnsupportedModelError, match="phi3"):  # the message lists the families
        read_model(_edit_config(folder, tmp_path, model_type="phi4mm"))


def _write_phi3_gguf(folder, path, drop=()):
    """The tiny HF folder as an F32 phi3 GGUF, written as llama.cpp's converter
    (convert_hf_to_gguf.py ``Phi3MiniModel``) does: tensor names from gguf-py's own
    HF -> GGUF map (fused ``attn_qkv`` and ``ffn_up`` kept fused), no ``output`` for a
    tied head, LongRoPE as ``rope_factors_long/short`` plus the original context and
    ``sqrt(1 + ln(s) / ln(L0))`` as attn_factor; a gpt2 vocabulary from tokenizer.json.
    Tensors named in ``drop`` are left out (negative tests)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    rp = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_rope_dimension_count(int(hd * rp.get("partial_rotary_factor", 1.0)))
    w.add_rope_freq_base(rp.get("rope_theta", 10000.0))
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if rp.get("rope_type") == "longrope":
        orig = cfg["original_max_position_embeddings"]
        s = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(s) / np.log(orig))))
        w.add_rope_scaling_orig_ctx_len(orig)
        for name, key in (("rope_factors_long.weight", "long_factor"),
                          ("rope_factors_short.weight", "short_factor")):
            if name not in drop:
                w.add_tensor(name, np.asarray(rp[key], np.float32))
    vocab = tok["model"]["vocab"]
    special = {a["id"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(sorted(vocab, key=vocab.get))
    w.add_token_types([3 if i in special else 1 for i in range(len(vocab))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, cfg["num_hidden_layers"])
    for n, a in load_file(str(folder / "model.safetensors")).items():
        if n == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        w.add_tensor(names.get_name(n, try_suffixes=(".weight",)), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_phi3_reads_as_the_hf_folder(phi3, tmp_path):
    """The same model as a phi3 GGUF: the split tensors equal the HF folder's bit for bit,
    the config agrees (LongRoPE from the factor tensors), and the logits equal HF's. (The
    llama.cpp peer wheel stops with an illegal instruction on this CPU, so the file's
    layout rests on gguf-py's name map and the converter's conventions.)"""
    variant, folder, hf = phi3
    gsrc, hsrc = read_model(_write_phi3_gguf(folder, tmp_path / "phi3.gguf")), read_model(folder)
    assert gsrc.format == "gguf" and set(gsrc.tensors) == set(hsrc.tensors)
    for name in hsrc.tensors:
        np.testing.assert_array_equal(gsrc.tensors[name], hsrc.tensors[name])
    g, h = gsrc.config.to_hf_dict(), hsrc.config.to_hf_dict()
    assert g.pop("rms_norm_eps") == pytest.approx(h.pop("rms_norm_eps"), rel=1e-6)  # F32 in GGUF
    grs, hrs = g.pop("rope_scaling"), h.pop("rope_scaling")
    assert g == h
    m = Transformer(gsrc.config, gsrc.tensors, ReferenceBackend(), max_positions=64)
    if variant == "longrope":
        assert m.rope_switch == 16 and grs["long_factor"] == hrs["long_factor"]
        assert grs["short_factor"] == hrs["short_factor"]
    else:
        assert grs is hrs is None
    ids = _prompt(folder) + list(range(2, 2 + 10))  # 20 tokens: past the longrope switch
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    got = m.forward(np.asarray(ids, np.int32), m.new_cache(64), all_logits=True)
    assert np.abs(got - want).max() < BOUND["reference"]


def test_gguf_with_one_longrope_factor_tensor_is_refused(phi3_long, tmp_path):
    _, folder, _ = phi3_long
    path = _write_phi3_gguf(folder, tmp_path / "half.gguf", drop=("rope_factors_short.weight",))
    with pytest.raises(ModelFormatError, match=r"half\.gguf.*only one of rope_factors_long"):
        read_model(path)
