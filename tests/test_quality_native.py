"""``benchmarks/quality.py --gguf-native --native-ftypes``: llama.cpp's pure quantizations
of the F32 GGUF (what it writes per tensor where a row is not a multiple of 256) and the
bits per weight the CPU backend holds each at (the README's per-format quality table)."""
from __future__ import annotations

import importlib.util
import os

import pytest


def _quality():
    spec = importlib.util.spec_from_file_location(
        "quality", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "quality.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smollm2_f32(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from edgeinfer.catalog import model_path
    path = str(model_path("smollm2-135m-instruct"))
    if not os.path.exists(path):
        pytest.skip("SmolLM2 not pulled (edgeinfer pull smollm2-135m-instruct)")
    q = _quality()
    return q, q.f32_gguf(path, str(tmp_path_factory.mktemp("h19") / "smollm2.F32.gguf"))


# SmolLM2's rows are 576 or 1536 wide: only ffn_down (1536 = 6 x 256) takes a K type,
# the 576-wide tensors fall back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0).
# In RAM: Q4_0 / Q5_0 / Q8_0 at their files' sizes (fp16 scales kept as fp16, the zero
# terms of Q4_0 and Q5_0 implicit), Q4_K's factored scales (4.75 against 4.5: 5.312 with
# the Q5_0 rest), Q6_K's lane scales (6.625 against 6.5625: 8.031 with the Q8_0 rest).
CASES = {
    "Q4_0": ({"linear": (4.5, ["Q4_0"]), "embedding/head": (4.5, ["Q4_0"])},
             {"linear": 4.5, "embedding/head": 4.5}),
    "Q4_K_S": ({"linear": (5.25, ["Q4_K", "Q5_0"]), "embedding/head": (5.5, ["Q5_0"])},
               {"linear": 5.312, "embedding/head": 5.5}),
    "Q6_K": ({"linear": (8.016, ["Q6_K", "Q8_0"]), "embedding/head": (8.5, ["Q8_0"])},
             {"linear": 8.031, "embedding/head": 8.5}),
}


@pytest.mark.slow
@pytest.mark.parametrize("ftype", sorted(CASES))
def test_pure_ftype_types_and_bits(smollm2_f32, tmp_path, ftype):
    q, f32 = smollm2_f32
    out = q.llama_quantize(f32, str(tmp_path / f"{ftype}.pure.gguf"), ftype, pure=True)
    file_bpw, ram_bpw = CASES[ftype]
    got = q.gguf_bpw(out)
    assert {k: (got[k]["bpw"], got[k]["types"]) for k in file_bpw} == file_bpw
    assert got["other"]["types"] == ["F32"]  # norms stay float
    assert q.cpu_bpw(out) == ram_bpw
