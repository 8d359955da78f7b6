"""``export --format gptq``: the HF GPTQ folder against an independent reading of the format.

No GPTQ loader runs here: GPTQModel 7.7 (the maintained loader; sdist only) needs
torch >= 2.14.1 and transformers' GPTQ path needs it, while the venv has torch 2.13 (CPU);
AutoGPTQ 0.7.1 builds CUDA kernels against transformers 4 APIs. So the folder is read back
by :func:`dequantize_gptq` below, written from the published format (AutoGPTQ's v1
dequantization: unpack ``qweight``/``qzeros`` by shifts of 4 bits, ``zero = stored + 1``,
``W = scales[g_idx] * (q - zero)``), and run by HF transformers' own model class built
from the exported ``config.json``; its logits are compared with edgeinfer's on the ``.eif``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from edgeinfer.backends.quantized import QuantizedTensor, pack_nibbles
from edgeinfer.errors import OutputError, UnsupportedModelError
from edgeinfer.quant.export_gptq import FILES, export_gptq, gptq_tensors, pack_int32, unpack_int32
from edgeinfer.quant.rtn import quantize_rtn
from tiny_models import byte_level_bpe

WIKI = "/work/shared/data/wikitext-2"


# ---- the independent reader ------------------------------------------------------------------
def _unpack_words(words: np.ndarray) -> np.ndarray:
    """int32 [..., n] -> int64 [..., n, 8]: nibble k of each word (AutoGPTQ's shift table)."""
    w = words.astype(np.int64) & 0xFFFFFFFF
    return (w[..., None] >> (4 * np.arange(8))) & 15


def dequantize_gptq(qweight, qzeros, scales, g_idx) -> np.ndarray:
    """float32 ``[out, in]`` from GPTQ v1 arrays (``qweight [in/8, out]``, ``qzeros
    [G, out/8]``, ``scales [G, out]``, ``g_idx [in]``)."""
    n8, out = qweight.shape
    q = _unpack_words(qweight).transpose(0, 2, 1).reshape(n8 * 8, out)  # [in, out]
    z = _unpack_words(qzeros).reshape(qzeros.shape[0], -1) + 1  # [G, out]
    s = scales.astype(np.float32)
    return (s[g_idx] * (q - z[g_idx]).astype(np.float32)).T


# ---- packing against hand-computed words ------------------------------------------------------
def test_pack_int32_hand_values():
    codes = np.arange(1, 9, dtype=np.uint8)[:, None]  # one output column, inputs 0..7
    assert pack_int32(codes, axis=0).tolist() == [[np.int32(np.uint32(0x87654321).view(np.int32))]]
    assert np.uint32(pack_int32(codes, 0)[0, 0].view(np.uint32)) == 0x87654321
    assert pack_int32(np.full((1, 8), 7), axis=1)[0, 0] == 0x77777777  # symmetric v1 zeros
    two = np.zeros((16, 1), np.uint8)
    two[8] = 15  # second word, lowest nibble
    assert pack_int32(two, 0)[:, 0].tolist() == [0, 15]
    with pytest.raises(ValueError):
        pack_int32(np.full((8, 1), 16), 0)
    with pytest.raises(ValueError):
        pack_int32(np.zeros((12, 1)), 0)


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(0)
    c = rng.integers(0, 16, (64, 24)).astype(np.uint8)
    for axis in (0, 1):
        packed = pack_int32(c, axis)
        assert packed.dtype == np.int32
        assert packed.shape == ((8, 24) if axis == 0 else (64, 3))
        np.testing.assert_array_equal(unpack_int32(packed, axis), c)


# ---- one linear ------------------------------------------------------------------------------
@pytest.mark.parametrize("symmetric", [False, True])
def test_linear_dequantizes_exactly(symmetric):
    w = np.random.default_rng(1).normal(0, 0.05, (48, 256)).astype(np.float32)
    qt = quantize_rtn(w, 4, 64, symmetric)
    g = gptq_tensors(qt, "x.weight")
    assert g["qweight"].shape == (32, 48) and g["qweight"].dtype == np.int32
    assert g["qzeros"].shape == (4, 6) and g["qzeros"].dtype == np.int32
    assert g["scales"].shape == (4, 48) and g["scales"].dtype == np.float16
    np.testing.assert_array_equal(g["g_idx"], np.arange(256) // 64)
    if symmetric:
        assert (g["qzeros"] == 0x77777777).all()
    np.testing.assert_array_equal(dequantize_gptq(**g), qt.dequantize())


def _with_zero_point_zero(top_code: int) -> QuantizedTensor:
    """8 x 16 weight, group 8, row 0 group 0 with zero point 0 and codes up to ``top_code``."""
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 15, (8, 16)).astype(np.uint8)
    codes[0, :8] = np.minimum(codes[0, :8], top_code)
    codes[0, 3] = top_code
    zeros = rng.integers(1, 16, (8, 2)).astype(np.uint8)
    zeros[0, 0] = 0
    scales = rng.uniform(0.01, 0.02, (8, 2)).astype(np.float16)
    return QuantizedTensor(pack_nibbles(codes), scales, pack_nibbles(zeros), 4, 8, 16, "gptq")


def test_zero_point_zero_is_re_expressed_or_refused():
    qt = _with_zero_point_zero(14)  # codes <= 14: z = 1, codes + 1 is the same weight
    g = gptq_tensors(qt, "m.weight")
    np.testing.assert_array_equal(dequantize_gptq(**g), qt.dequantize())
    assert unpack_int32(g["qzeros"], 1)[0, 0] == 0  # stored z - 1 = 0
    with pytest.raises(UnsupportedModelError, match=r"'m.weight'.*row 0, group 0.*--symmetric"):
        gptq_tensors(_with_zero_point_zero(15), "m.weight")


def test_unexportable_layouts_are_refused():
    codes = np.zeros((8, 32), np.uint8)
    s = np.ones((8, 1), np.float16)
    mins = QuantizedTensor(pack_nibbles(codes), s, None, 4, 32, 32, "gguf:Q4_1",
                           mins=np.zeros((8, 1), np.float16))
    with pytest.raises(UnsupportedModelError, match="'a.weight'.*mins"):
        gptq_tensors(mins, "a.weight")
    eight = QuantizedTensor(codes.astype(np.int8), s, None, 8, 32, 32, "rtn")
    with pytest.raises(UnsupportedModelError, match="'b.weight'.*8-bit"):
        gptq_tensors(eight, "b.weight")
    padded = quantize_rtn(np.ones((8, 40), np.float32), 4, 32)
    with pytest.raises(UnsupportedModelError, match="'c.weight'.*padded.*--group-size"):
        gptq_tensors(padded, "c.weight")
    f32 = QuantizedTensor(pack_nibbles(codes), np.full((8, 1), 1e6, np.float32), None, 4, 32, 32)
    with pytest.raises(UnsupportedModelError, match="'d.weight'.*float16"):
        gptq_tensors(f32, "d.weight")


# ---- a whole model ---------------------------------------------------------------------------
TEXT = ("The quick brown fox jumps over the lazy dog. A model is exported to another format and "
        "read back by an independent reader. ") * 8


def tiny_qwen2_folder(path: Path):
    """A tiny random HF Qwen2 (2 layers, hidden 64, 4 / 2 heads of 16, intermediate 128,
    q/k/v biases, untied head) with a byte-level BPE tokenizer, saved to ``path``."""
    import torch
    import transformers

    tok = byte_level_bpe(path, TEXT, ["<|endoftext|>"])
    hc = transformers.Qwen2Config(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(hc)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name or "bias" in name:
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else 0.1))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    hf.save_pretrained(str(path))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))



@pytest.fixture
def tiny_eif(tmp_path) -> tuple[Path, Path]:
    """(:func:`tiny_qwen2_folder` at ``tmp_path/hf``, its RTN group-32 ``.eif`` at
    ``tmp_path/m.eif``); skips without torch."""
    pytest.importorskip("torch")
    from edgeinfer.quant.convert import convert

    src = tmp_path / "hf"
    tiny_qwen2_folder(src)
    eif = tmp_path / "m.eif"
    convert(str(src), str(eif), method="rtn", group_size=32, progress=False)
    return src, eif

def hf_from_export(folder: Path):
    """HF's own model class from the exported ``config.json`` (quantization_config
    removed), holding the weights :func:`dequantize_gptq` reads from ``model.safetensors``."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    q = cfg.pop("quantization_config")
    assert q["quant_method"] == "gptq" and q["checkpoint_format"] == "gptq" and not q["desc_act"]
    hc = transformers.AutoConfig.for_model(**cfg)
    hc._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hc, dtype=torch.float32).eval()
    arrays = load_file(str(folder / "model.safetensors"))
    sd = {}
    for k, v in arrays.items():
        if k.endswith(".qweight"):
            p = k[: -len(".qweight")]
            g = {s: arrays[f"{p}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
            assert (g["g_idx"] == np.arange(len(g["g_idx"])) // q["group_size"]).all()
            sd[p + ".weight"] = torch.from_numpy(dequantize_gptq(**g))
        elif not k.endswith((".qzeros", ".scales", ".g_idx")):
            assert v.dtype == np.float16, k
            sd[k] = torch.from_numpy(v.astype(np.float32))
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    hf.load_state_dict(sd, strict=True)
    return hf


def edgeinfer_logits(eif: Path, ids: np.ndarray) -> np.ndarray:
    from edgeinfer.backends.reference import ReferenceBackend
    from edgeinfer.container import read_eif
    from edgeinfer.models.transformer import Transformer

    src = read_eif(eif)
    model = Transformer(src.config, dict(src.tensors), ReferenceBackend(), max_positions=len(ids))
    return model.forward(ids.astype(np.int32), model.new_cache(len(ids)), all_logits=True)


def _compare(eif: Path, folder: Path, ids: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement, max |Δlogit| / logit range) of HF on ``folder`` vs edgeinfer."""
    import torch

    hf = hf_from_export(folder)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids[None].astype(np.int64))).logits[0].numpy()
    ours = edgeinfer_logits(eif, ids)
    agree = float((ref.argmax(-1) == ours.argmax(-1)).mean())
    return agree, float(np.abs(ref - ours).max() / (ref.max() - ref.min()))


def test_tiny_qwen2_export_matches_edgeinfer(tmp_path, tiny_eif):
    _src, eif = tiny_eif
    out = tmp_path / "gptq"
    rep = export_gptq(eif, out)
    assert rep["group_size"] == 32 and rep["n_quantized"] == 14 and not rep["sym"]
    assert sorted(os.listdir(out)) == sorted(FILES)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["torch_dtype"] == "float16"
    assert cfg["quantization_config"] == {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
        "checkpoint_format": "gptq", "lm_head": False}
    import transformers
    from tokenizers import Tokenizer

    ids = np.asarray(Tokenizer.from_file(str(out / "tokenizer.json")).encode(TEXT).ids)[:200]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))  # HF reads the folder
    assert hf_tok.encode(TEXT, add_special_tokens=False)[:200] == ids.tolist()
    assert hf_tok.eos_token == "<|endoftext|>"
    assert len(ids) >= 150
    agree, rel = _compare(eif, out, ids)
    assert agree >= 0.99, agree
    assert rel < 2e-3, rel  # fp16 rounding of the dense tables only
    # control: a corrupted packing (one nibble order flipped) is caught by the comparison
    from safetensors.numpy import load_file, save_file

    arr = load_file(str(out / "model.safetensors"))
    for k in [k for k in arr if k.endswith(".qweight")]:
        arr[k] = np.ascontiguousarray(arr[k][::-1])
    save_file(arr, str(out / "model.safetensors"))
    bad_agree, bad_rel = _compare(eif, out, ids)
    assert bad_rel > 10 * rel and bad_agree < agree


def test_export_refusals(tmp_path, stories_dir):
    """stories260K cannot be exported: its 172-wide MLP rows do not pack 8 to a word, and at
    group 128 its linears get groups of 64 and 128 (padded)."""
    from edgeinfer.quant.convert import convert

    eif = tmp_path / "s.eif"
    convert(str(stories_dir), str(eif), method="rtn", group_size=32, progress=False)
    with pytest.raises(UnsupportedModelError, match="gate_proj.*(172, 64).*multiple of 8"):
        export_gptq(eif, tmp_path / "out")
    eif128 = tmp_path / "s128.eif"
    convert(str(stories_dir), str(eif128), method="rtn", group_size=128, progress=False)
    with pytest.raises(UnsupportedModelError, match=r"different group sizes \(64 .*128 .*no group"):
        export_gptq(eif128, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


def test_export_overwrite_rules(tmp_path, tiny_eif):
    _src, eif = tiny_eif
    out = tmp_path / "gptq"
    export_gptq(eif, out)
    um = os.umask(0o022)
    os.umask(um)  # every file an ordinary one (safetensors writes 0600), the folder too
    modes = {p.name: p.stat().st_mode & 0o777 for p in [out, *out.iterdir()]}
    assert modes == {**{n: 0o666 & ~um for n in modes}, "gptq": 0o777 & ~um}, modes
    before = (out / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(OutputError, match="already exists.*--force"):
        export_gptq(eif, out)
    export_gptq(eif, out, overwrite=True)  # a previous export is replaced
    assert (out / "model.safetensors").stat().st_mtime_ns != before
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="notes.txt"):  # --force never deletes other files
        export_gptq(eif, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    with pytest.raises(OutputError, match="holds the input"):
        export_gptq(eif, tmp_path, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="not a folder"):
        export_gptq(eif, tmp_path / "file", overwrite=True)
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


@pytest.mark.slow
def test_smollm2_export_top1_vs_edgeinfer(tmp_path, smollm2_gguf):
    """SmolLM2-135M, RTN group 64 (divides its 576- and 1536-wide rows): HF on the export
    agrees with edgeinfer's top-1 on >= 99% of 320 WikiText-2 positions."""
    pytest.importorskip("torch")
    from tokenizers import Tokenizer

    from edgeinfer.quant.convert import convert

    eif = tmp_path / "s.eif"
    convert(str(smollm2_gguf), str(eif), method="rtn", group_size=64, progress=False)
    out = tmp_path / "gptq"
    export_gptq(eif, out)
    text = Path(WIKI, "test.txt").read_text(encoding="utf-8")[:4000]
    ids = np.asarray(Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids)[:320]
    agree, rel = _compare(eif, out, ids)
    assert agree >= 0.99, agree


def test_cli_export(tmp_path, tiny_eif, capsys):
    import cli

    src, eif = tiny_eif
    out = tmp_path / "gptq"
    assert cli.main(["export", str(eif), "--format", "gptq", "-o", str(out)]) == 0
    assert "14 4-bit linears, group 32, asymmetric" in capsys.readouterr().out
    assert cli.main(["export", str(eif), "--format", "gptq", "-o", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["export", str(eif), "--format", "gptq", "-o", str(out), "--force",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["group_size"] == 32
    assert cli.main(["export", str(src / "config.json"), "--format", "gptq", "-o",
                     str(tmp_path / "x")]) == 2
    assert "not an .eif" in capsys.readouterr().err
