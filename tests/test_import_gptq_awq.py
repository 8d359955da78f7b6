"""``edgeinfer convert`` of GPTQ and AutoAWQ GEMM checkpoints: a lossless re-layout.

The tests write their own tiny checkpoints (a 2-layer llama, hidden 64, on stories260K's
tokenizer) with numpy and safetensors, packing known codes by the published formats with
the packers below (written here from the format descriptions, not from edgeinfer's code).
The reference is :func:`ref_gptq` / :func:`ref_awq`, a numpy reading of the published
dequantization (AutoGPTQ's v1 ``zero = stored + 1`` after masking the nibble; GPTQ v2
and AWQ store ``zero``; AWQ's reverse order 0, 4, 1, 5, 2, 6, 3, 7 as in AutoAWQ's
``unpack_awq``): the ``.eif``'s dequantized weights must equal it bit for bit. No GPTQ or
AWQ loader runs here (GPTQModel needs a newer torch than the venv's; AutoAWQ needs CUDA).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from edgeinfer.backends.quantized import QuantizedTensor
from edgeinfer.container import read_eif
from edgeinfer.errors import ModelFormatError, UnsupportedModelError
from edgeinfer.quant.convert import convert
from edgeinfer.quant.export_gptq import export_gptq
from edgeinfer.quant.import_packed import import_packed, read_packed
from edgeinfer.quant.packed_formats import AWQ_ORDER, packed_layout, unpack_awq
from edgeinfer.quant.export_gptq import unpack_int32

# ---- the published formats, written independently -------------------------------------------
SHIFTS = 4 * np.arange(8)
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ's reverse_awq_order


def words(nib: np.ndarray) -> np.ndarray:
    """``[..., 8]`` nibbles -> int32 words, nibble ``k`` in bits ``4k .. 4k + 3``."""
    w = (nib.astype(np.uint64) << SHIFTS.astype(np.uint64)).sum(axis=-1)
    return w.astype(np.uint32).view(np.int32)


def nibbles(w: np.ndarray) -> np.ndarray:
    """int32 words ``[...]`` -> ``[..., 8]`` nibbles (int64)."""
    return ((w.astype(np.int64) & 0xFFFFFFFF)[..., None] >> SHIFTS) & 15


def pack_gptq(q: np.ndarray, stored_z: np.ndarray, s: np.ndarray, g_idx=None) -> dict:
    """``q`` codes ``[in, out]``, ``stored_z`` ``[G, out]`` as stored (v1: z - 1), ``s``
    ``[G, out]`` -> GPTQ arrays."""
    n_in, out = q.shape
    d = {"qweight": words(q.reshape(n_in // 8, 8, out).transpose(0, 2, 1)),
         "qzeros": words(stored_z.reshape(len(stored_z), out // 8, 8)),
         "scales": s.astype(np.float16)}
    if g_idx is not None:
        d["g_idx"] = np.asarray(g_idx, np.int32)
    return d


def pack_awq(q: np.ndarray, z: np.ndarray, s: np.ndarray) -> dict:
    """``q`` ``[in, out]``, ``z`` / ``s`` ``[G, out]`` -> AutoAWQ GEMM arrays: nibble ``k`` of
    a word holds column ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[k]``."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    pk = lambda a: words(a.reshape(a.shape[0], -1, 8)[:, :, order])  # noqa: E731
    return {"qweight": pk(q), "qzeros": pk(z), "scales": s.astype(np.float16)}


def ref_gptq(d: dict, group: int, v1: bool) -> np.ndarray:
    """float32 ``[out, in]``: ``scales[g] * (q - zero[g])``, ``g = g_idx[i]``."""
    n8, out = d["qweight"].shape
    q = nibbles(d["qweight"]).transpose(0, 2, 1).reshape(n8 * 8, out)
    z = nibbles(d["qzeros"]).reshape(len(d["qzeros"]), out) + (1 if v1 else 0)
    g = d.get("g_idx", np.arange(n8 * 8) // (group if group > 0 else n8 * 8))
    return (d["scales"].astype(np.float32)[g] * (q - z[g]).astype(np.float32)).T


def ref_awq(d: dict, group: int) -> np.ndarray:
    n_in = d["qweight"].shape[0]
    un = lambda w: nibbles(w)[:, :, AWQ_REVERSE].reshape(w.shape[0], -1)  # noqa: E731
    g = np.arange(n_in) // (group if group > 0 else n_in)
    return (d["scales"].astype(np.float32)[g] * (un(d["qweight"]) - un(d["qzeros"])[g])
            .astype(np.float32)).T


# ---- hand-packed words -----------------------------------------------------------------------
def test_gptq_word_hand_value():
    """Inputs 0..7 of one output with codes 1..8: 0x87654321 (code of input k in bits 4k)."""
    w = np.array([[np.uint32(0x87654321)]]).view(np.int32)
    assert unpack_int32(w, axis=0)[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert words(np.arange(1, 9)[None])[0] == w[0, 0]  # the test's packer agrees


def test_awq_word_hand_value():
    """Outputs 0..7 with codes 1..8 in AWQ order: nibbles 1,3,5,7,2,4,6,8 = 0x86427531."""
    w = np.array([[np.uint32(0x86427531)]]).view(np.int32)
    assert unpack_awq(w)[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert list(AWQ_ORDER) == [0, 2, 4, 6, 1, 3, 5, 7]
    assert pack_awq(np.arange(1, 9)[None], np.zeros((1, 8), int), np.ones((1, 8)))["qweight"][0, 0] \
        == w[0, 0]


def _load(layout, arrays: dict, prefix="m") -> QuantizedTensor:
    metas = {"." + k: ({"float16": "F16"}.get(str(a.dtype), "I32"), a.shape)
             for k, a in arrays.items()}
    shape = layout.shape(prefix, metas, "t")
    qt = layout.load(prefix, {"." + k: (lambda a=a: a) for k, a in arrays.items()}, "t")
    assert qt.shape == shape
    return qt


def test_gptq_v1_hand_linear():
    """8 outputs x 16 inputs, group 8: known words in, known codes / zeros / weights out."""
    q = np.zeros((16, 8), np.int64)
    q[:8, 0] = [1, 2, 3, 4, 5, 6, 7, 8]   # output 0, group 0
    q[8:, 3] = 15                          # output 3, group 1
    stored = np.full((2, 8), 6)            # v1: z = 7
    stored[1, 3] = 0                       # output 3, group 1: z = 1
    s = np.full((2, 8), 0.5)
    d = pack_gptq(q, stored, s)
    assert d["qweight"][0, 0] == np.uint32(0x87654321).view(np.int32)
    assert d["qzeros"][0, 0] == np.uint32(0x66666666).view(np.int32)
    qt = _load(packed_layout({"quant_method": "gptq", "bits": 4, "group_size": 8, "sym": False,
                              "desc_act": False}, "t"), d)
    assert qt.codes()[0, :8].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert qt.zero_points()[3].tolist() == [7, 1] and qt.zero_points()[0].tolist() == [7, 7]
    w = qt.dequantize()
    assert w[0, :8].tolist() == [-3.0, -2.5, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5]
    assert w[3, 8:].tolist() == [7.0] * 8
    np.testing.assert_array_equal(w, ref_gptq(d, 8, v1=True))


@pytest.mark.parametrize("v1", [True, False])
def test_gptq_symmetric_zero_words(v1):
    """sym: v1 stores 7 (0x77777777), v2 stores 8 (0x88888888); both read as zero point 8."""
    q = np.random.default_rng(0).integers(0, 16, (32, 16))
    d = pack_gptq(q, np.full((1, 16), 7 if v1 else 8), np.full((1, 16), 0.25))
    assert (d["qzeros"] == np.uint32(0x77777777 if v1 else 0x88888888).view(np.int32)).all()
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
           "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    qt = _load(packed_layout(cfg, "t"), d)
    assert qt.symmetric and qt.zeros is None
    np.testing.assert_array_equal(qt.dequantize(), ref_gptq(d, 32, v1))


def test_gptq_v1_zero_point_16():
    """A v1 nibble 15 reads as z = 16 (AutoGPTQ: mask, then + 1): re-expressed as z = 15 and
    codes - 1 when the group uses no code 0 (same weights), refused when it does."""
    layout = packed_layout({"quant_method": "gptq", "bits": 4, "group_size": 8, "sym": False}, "t")
    q = np.random.default_rng(1).integers(1, 16, (16, 8))
    stored = np.full((2, 8), 4)
    stored[0, 5] = 15
    d = pack_gptq(q, stored, np.full((2, 8), 0.125))
    qt = _load(layout, d)
    assert qt.zero_points()[5, 0] == 15
    np.testing.assert_array_equal(qt.dequantize(), ref_gptq(d, 8, v1=True))
    q[3, 5] = 0
    with pytest.raises(UnsupportedModelError, match=r"m.qzeros.*output 5, group 0.*16.*code 0"):
        _load(layout, pack_gptq(q, stored, np.full((2, 8), 0.125)))


# ---- whole checkpoints -----------------------------------------------------------------------
LINEARS = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64),
           "self_attn.v_proj": (32, 64), "self_attn.o_proj": (64, 64),
           "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64), "mlp.down_proj": (64, 128)}


def write_checkpoint(path: Path, stories: Path, kind: str, group: int, *, sym=False, v1=True,
                     g_idx=True, edit=None) -> dict[str, np.ndarray]:
    """A 2-layer llama (hidden 64, 8 / 4 heads, intermediate 128, untied head) on stories260K's
    tokenizer, its linears packed as ``kind`` ("gptq" / "awq"); returns the reference
    float32 weight of every linear. ``edit(arrays, qcfg)`` may damage it before saving."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(7)
    cfg = json.loads((stories / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, dtype="float16")
    if kind == "gptq":
        qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    else:
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                "zero_point": True}
    arrays: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.normal(0, 1, (512, 64)).astype(np.float16),
        "lm_head.weight": rng.normal(0, 0.1, (512, 64)).astype(np.float16),
        "model.norm.weight": rng.uniform(0.5, 1.5, 64).astype(np.float16)}
    ref = {}
    for layer in range(2):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            arrays[f"model.layers.{layer}.{norm}.weight"] = rng.uniform(0.5, 1.5, 64).astype(np.float16)
        for lin, (out, n_in) in LINEARS.items():
            p = f"model.layers.{layer}.{lin}"
            n_g = -(-n_in // group) if group > 0 else 1
            q = rng.integers(0, 16, (n_in, out))
            s = rng.uniform(0.002, 0.02, (n_g, out))
            if kind == "awq":
                d = pack_awq(q, rng.integers(0, 16, (n_g, out)), s)
                ref[p + ".weight"] = ref_awq(d, group)
            else:
                z = np.full((n_g, out), 8) if sym else rng.integers(1, 16, (n_g, out))
                gi = np.arange(n_in) // (group if group > 0 else n_in) if g_idx else None
                d = pack_gptq(q, z - 1 if v1 else z, s, gi)
                ref[p + ".weight"] = ref_gptq(d, group, v1)
            arrays.update({f"{p}.{k}": a for k, a in d.items()})
    if edit is not None:
        edit(arrays, qcfg)
    cfg["quantization_config"] = qcfg
    (path / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(stories / f, path / f)
    save_file(arrays, str(path / "model.safetensors"))
    return ref


CASES = {"gptq-v1-asym-g32": ("gptq", 32, {}), "gptq-v1-sym-g32": ("gptq", 32, {"sym": True}),
         "gptq-v2-asym-g64": ("gptq", 64, {"v1": False}),
         "gptq-v2-sym-no-g_idx": ("gptq", 32, {"v1": False, "sym": True, "g_idx": False}),
         "gptq-v1-g48-padded": ("gptq", 48, {}), "gptq-v1-per-channel": ("gptq", -1, {}),
         "awq-gemm-g32": ("awq", 32, {}), "awq-gemm-g128": ("awq", 128, {})}


@pytest.mark.parametrize("case", list(CASES))
def test_import_is_lossless(case, tmp_path, stories_dir):
    kind, group, kw = CASES[case]
    ref = write_checkpoint(tmp_path / "ckpt", stories_dir, kind, group, **kw)
    out = tmp_path / "m.eif"
    rep = convert(str(tmp_path / "ckpt"), str(out), progress=False)  # dispatches to the import
    assert rep["imported"] == {"gptq": "gptq v1" if kw.get("v1", True) else "gptq_v2",
                               "awq": "awq gemm"}[kind]
    assert rep["n_packed"] == 14
    m = read_eif(out)
    for name, w in ref.items():
        qt = m.tensors[name]
        assert isinstance(qt, QuantizedTensor) and qt.symmetric == kw.get("sym", False)
        assert qt.group_size == (group if group > 0 else qt.in_features), name
        np.testing.assert_array_equal(qt.dequantize(), w, err_msg=name)
    src = read_packed(tmp_path / "ckpt")[0]
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        a = m.tensors[name]
        assert a.dtype == (np.float16 if a.ndim == 2 else np.float32), name  # as stored
        np.testing.assert_array_equal(a.astype(np.float32), src.tensors[name])


def test_imported_model_runs_like_its_dequantized_weights(tmp_path, stories_dir):
    """Logits of the ``.eif`` on the reference backend == those of a float model holding
    :func:`ref_gptq`'s weights."""
    from edgeinfer.backends.reference import ReferenceBackend
    from edgeinfer.models.transformer import Transformer

    ref = write_checkpoint(tmp_path / "ckpt", stories_dir, "gptq", 32)
    import_packed(tmp_path / "ckpt", tmp_path / "m.eif")
    m = read_eif(tmp_path / "m.eif")
    dense = {n: (ref[n] if n in ref else np.asarray(m.tensors[n], np.float32)) for n in m.tensors}
    ids = np.array([1, 403, 407, 261, 378, 90])
    logits = []
    for tensors in (m.tensors, dense):
        model = Transformer(m.config, tensors, ReferenceBackend(), max_positions=32)
        logits.append(model.forward(ids, model.new_cache(32)))
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-5)
    assert np.isfinite(logits[0]).all() and logits[0].std() > 0.1


def test_cli_convert_imports(tmp_path, stories_dir, capsys):
    import cli

    write_checkpoint(tmp_path / "ckpt", stories_dir, "awq", 64)
    out = tmp_path / "m.eif"
    assert cli.main(["convert", str(tmp_path / "ckpt"), "-o", str(out), "-q"]) == 0
    assert "imported awq gemm (group 64, 14 linears re-laid" in capsys.readouterr().out
    assert cli.main(["convert", str(tmp_path / "ckpt"), "-o", str(out), "--method", "rtn",
                     "--force"]) == 2
    assert "--method do not apply" in capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path / "ckpt"), "-o", str(out), "--force", "--json",
                     "--embed-bits", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["imported"] == "awq gemm"
    assert read_eif(out).tensors["model.embed_tokens.weight"].bits == 8


def test_runtime_reader_points_to_convert(tmp_path, stories_dir):
    from edgeinfer.readers import read_model

    write_checkpoint(tmp_path / "ckpt", stories_dir, "gptq", 32)
    with pytest.raises(UnsupportedModelError, match=r"gptq-quantized.*edgeinfer convert .*ckpt"):
        read_model(tmp_path / "ckpt")


# ---- bad checkpoints -------------------------------------------------------------------------
P = "model.layers.1.mlp.down_proj"


def _set_cfg(**kw):
    return lambda arrays, qcfg: qcfg.update(kw)


def _drop(name):
    return lambda arrays, qcfg: arrays.pop(name)


def _replace(name, fn):
    def edit(arrays, qcfg):
        arrays[name] = fn(arrays[name])
    return edit


def _act_order(arrays, qcfg):
    qcfg["desc_act"] = True
    arrays[P + ".g_idx"] = np.random.default_rng(0).permutation(arrays[P + ".g_idx"])


BAD = {
    "bits 3": ("gptq", _set_cfg(bits=3), UnsupportedModelError, r"3-bit GPTQ.*4-bit"),
    "missing scales": ("gptq", _drop(P + ".scales"), ModelFormatError,
                       r"down_proj.scales: missing.*down_proj.qweight"),
    "scales wrong shape": ("gptq", _replace(P + ".scales", lambda a: a[:, :32]), ModelFormatError,
                           r"down_proj.scales: shape \[4, 32\], expected \[4, 64\]"),
    "qzeros wrong shape": ("awq", _replace(P + ".qzeros", lambda a: a[:2]), ModelFormatError,
                           r"down_proj.qzeros: shape \[2, 8\], expected \[4, 8\]"),
    "qweight float": ("gptq", _replace(P + ".qweight", lambda a: a.astype(np.float32)),
                      ModelFormatError, r"down_proj.qweight: F32 .*I32"),
    "g_idx out of range": ("gptq", _replace(P + ".g_idx", lambda a: np.where(a == 3, 4, a)),
                           ModelFormatError, r"down_proj.g_idx: column 96 is in group 4, outside 0..3"),
    "act-order g_idx": ("gptq", _act_order, UnsupportedModelError,
                        r"down_proj.g_idx is an act-order.*desc_act=False"),
    "nan scale": ("awq", _replace(P + ".scales", lambda a: np.where(a == a.max(), np.nan, a)
                                  .astype(np.float16)), ModelFormatError, r"scales: 1 non-finite"),
    "sym with zeros": ("gptq", _set_cfg(sym=True), ModelFormatError,
                       r"sym=true but output \d+, group \d+ has zero point"),
    "group 0": ("gptq", _set_cfg(group_size=0), ModelFormatError, r"group_size 0"),
    "marlin format": ("gptq", _set_cfg(checkpoint_format="marlin"), UnsupportedModelError,
                      r"checkpoint_format 'marlin'"),
    "awq gemv": ("awq", _set_cfg(version="gemv"), UnsupportedModelError, r"AWQ version 'gemv'"),
    "bitsandbytes": ("awq", _set_cfg(quant_method="bitsandbytes"), UnsupportedModelError,
                     r"quant_method 'bitsandbytes'.*GPTQ and AutoAWQ"),
    "packed and dense": ("gptq", lambda arrays, qcfg: arrays.update(
        {P + ".weight": np.zeros((64, 128), np.float16)}), ModelFormatError, r"appears twice"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_refused(case, tmp_path, stories_dir):
    kind, edit, exc, match = BAD[case]
    write_checkpoint(tmp_path / "ckpt", stories_dir, kind, 32, edit=edit)
    with pytest.raises(exc, match=match):
        import_packed(tmp_path / "ckpt", tmp_path / "m.eif")
    assert not (tmp_path / "m.eif").exists()


# ---- export -> import round trip -------------------------------------------------------------
@pytest.mark.parametrize("symmetric", [False, True])
def test_export_then_import_is_bit_identical(symmetric, tmp_path, stories_dir):
    """float folder -> RTN g32 ``.eif`` -> ``export --format gptq`` -> ``convert``: every
    linear comes back with the same codes, zero points, scales and group."""
    rng = np.random.default_rng(3)
    flt = tmp_path / "float"
    flt.mkdir()
    cfg = json.loads((stories_dir / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    (flt / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(stories_dir / f, flt / f)
    arrays = {"model.embed_tokens.weight": rng.normal(0, 1, (512, 64)),
              "lm_head.weight": rng.normal(0, 0.1, (512, 64)),
              "model.norm.weight": rng.uniform(0.5, 1.5, 64)}
    for layer in range(2):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            arrays[f"model.layers.{layer}.{norm}.weight"] = rng.uniform(0.5, 1.5, 64)
        for lin, shape in LINEARS.items():
            arrays[f"model.layers.{layer}.{lin}.weight"] = rng.normal(0, 0.05, shape)
    save_file({k: v.astype(np.float16).astype(np.float32) for k, v in arrays.items()},
              str(flt / "model.safetensors"))
    convert(str(flt), str(tmp_path / "a.eif"), method="rtn", group_size=32,
            symmetric=symmetric, progress=False)
    export_gptq(tmp_path / "a.eif", tmp_path / "gptq")
    rep = convert(str(tmp_path / "gptq"), str(tmp_path / "b.eif"), progress=False)
    assert rep["imported"] == "gptq v1" and rep["n_packed"] == 14
    a, b = read_eif(tmp_path / "a.eif"), read_eif(tmp_path / "b.eif")
    assert sorted(a.tensors) == sorted(b.tensors)
    for name in a.tensors:
        ta, tb = a.tensors[name], b.tensors[name]
        if isinstance(ta, QuantizedTensor) and ta.bits == 4:
            if not symmetric:  # the export re-expresses z = 0; none occurs here
                assert ta.zero_points().min() >= 1
            assert (tb.group_size, tb.in_features, tb.symmetric) == \
                (ta.group_size, ta.in_features, ta.symmetric)
            np.testing.assert_array_equal(tb.qweight, ta.qweight, err_msg=name)
            np.testing.assert_array_equal(tb.scales, ta.scales, err_msg=name)
            np.testing.assert_array_equal(tb.zeros, ta.zeros, err_msg=name)
        else:  # dense: float16 in the export (the INT8 tables dequantized, then rounded)
            da = ta.dequantize() if isinstance(ta, QuantizedTensor) else ta
            np.testing.assert_array_equal(tb, np.asarray(da, np.float32).astype(tb.dtype),
                                          err_msg=name)
