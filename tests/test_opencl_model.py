"""The OpenCL backend on whole models: stories260K greedy parity with the reference
backend (dense and RTN INT4), prefill/decode consistency, no buffer allocation in the
decode loop, and the start-up self-check.

Skips with a message naming what is missing (pyopencl, an OpenCL platform, the model).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'edgeinfer[opencl]')")

from edgeinfer.backends.opencl import OpenCLBackend, OpenCLUnavailableError, self_check
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.models.config import ModelConfig
from edgeinfer.models.transformer import LINEAR_KEYS, Transformer

PROMPT = [1, 403, 407, 261, 378]  # BOS "Once upon a time"
STEPS = 64


@pytest.fixture(scope="module")
def be():
    try:
        return OpenCLBackend()
    except OpenCLUnavailableError as e:
        pytest.skip(f"no usable OpenCL device: {e}")


@pytest.fixture(scope="module")
def stories(stories_dir):
    """(ModelConfig, tensors) of stories260K (``stories_dir`` from conftest skips if absent)."""
    from safetensors.numpy import load_file

    cfg = ModelConfig.from_hf_dict(json.loads((stories_dir / "config.json").read_text()))
    return cfg, load_file(str(stories_dir / "model.safetensors"))


def _quantized(tensors, group_size=32, symmetric=False):
    """stories260K with every linear RTN-quantized to INT4, embedding/head to INT8."""
    from edgeinfer.quant.rtn import quantize_rtn

    out = {}
    for name, t in tensors.items():
        short = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if short in LINEAR_KEYS:
            out[name] = quantize_rtn(t, 4, group_size, symmetric, name=name)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = quantize_rtn(t, 8, -1, name=name)
        else:
            out[name] = t
    return out


def _greedy(model, ids, n, kv="f32"):
    cache = model.new_cache(len(ids) + n + 1, kv)
    logits = model.forward(np.asarray(ids), cache)
    toks, all_logits = [], [logits[-1]]
    for _ in range(n):
        t = int(np.argmax(logits[-1]))
        toks.append(t)
        logits = model.forward(np.asarray([t]), cache)
        all_logits.append(logits[-1])
    return toks, np.stack(all_logits)


def _nerr(a, b):
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1.0))


@pytest.mark.parametrize("kind", ["dense", "int4_g32", "int4_sym_g64"])
def test_stories_greedy_64_identical_to_reference(be, stories, kind):
    cfg, tensors = stories
    if kind != "dense":
        tensors = _quantized(tensors, 32 if kind == "int4_g32" else 64, kind == "int4_sym_g64")
    ref_toks, ref_logits = _greedy(Transformer(cfg, tensors, ReferenceBackend()), PROMPT, STEPS)
    toks, logits = _greedy(Transformer(cfg, tensors, be), PROMPT, STEPS)
    assert toks == ref_toks
    assert _nerr(logits, ref_logits) < 1e-4


@pytest.mark.parametrize("kv", ["f16", "int8", "int4"])
def test_stories_kv_dtypes_match_reference_same_dtype(be, stories, kv):
    """Each KV storage format against the reference backend's host cache of that format.

    Quantized caches round: a float32-level difference upstream (1e-7) can move a K/V
    code by one step (int8: ~1/127 of a head's range), so logits may differ by ~1e-3
    after a few dozen steps (measured max: int8 3e-3, int4 1e-2) while tokens agree."""
    cfg, tensors = stories
    ref_toks, ref_logits = _greedy(Transformer(cfg, tensors, ReferenceBackend()), PROMPT, 32, kv)
    toks, logits = _greedy(Transformer(cfg, tensors, be), PROMPT, 32, kv)
    assert toks == ref_toks
    assert _nerr(logits, ref_logits) < {"f16": 1e-3, "int8": 2e-2, "int4": 5e-2}[kv]


def test_prefill_equals_token_by_token_and_all_logits(be, stories):
    cfg, tensors = stories
    model = Transformer(cfg, tensors, be)
    ids = np.array([1, 403, 407, 261, 378, 29, 445, 270, 260, 300, 411])
    full = model.forward(ids, model.new_cache(32), all_logits=True)
    ref = Transformer(cfg, tensors, ReferenceBackend()).forward(ids, ReferenceBackend().new_kv_cache(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 32), all_logits=True)
    assert _nerr(full, ref) < 1e-4
    cache = model.new_cache(32)
    for t in ids:
        last = model.forward(np.array([t]), cache)[-1]
    assert _nerr(last, full[-1]) < 1e-4
    # prefix reuse: trim the cache and re-run the tail
    cache.trim(6)
    again = model.forward(ids[6:], cache)[-1]
    assert _nerr(again, full[-1]) < 1e-4


def test_decode_loop_creates_no_buffers(be, stories):
    cfg, tensors = stories
    model = Transformer(cfg, _quantized(tensors), be)
    cache = model.new_cache(40)
    model.forward(np.asarray(PROMPT), cache)
    model.forward(np.array([29]), cache)  # warm-up step fills the pool
    before = be.pool.created
    for t in range(20):
        model.forward(np.array([300 + t]), cache)
    assert be.pool.created == before


def test_self_check_passes_and_flags_a_broken_kernel(be, stories):
    cfg, tensors = stories
    ok, err = self_check(cfg, _quantized(tensors), be)
    assert ok and err < 1e-4
    for kv in ("f16", "int8", "int4"):
        ok, err = self_check(cfg, tensors, be, kv_dtype=kv)
        assert ok, (kv, err)

    # a device that splits long KV ranges (GPU default): the check exercises that path
    import dataclasses

    sb = OpenCLBackend()
    sb.caps = dataclasses.replace(sb.caps, split_kv_chunk=512)
    ok, err = self_check(cfg, tensors, sb)
    assert ok and err < 1e-4 and sb.caps.split_kv_chunk == 512
    assert any(key[1] == "attention_split" for key in sb._dc._kernels)

    class Broken(OpenCLBackend):
        def glu(self, gate, up, act="silu"):
            return super().glu(up, gate, act)  # swapped operands: plausible, wrong

    with pytest.warns(RuntimeWarning, match="self-check failed"):
        ok, err = self_check(cfg, tensors, Broken())
    assert not ok and err > 0.1


def test_engine_generates_golden_text_on_opencl(be, stories_dir):
    """The public API on this backend: same greedy text as the reference's golden string."""
    from edgeinfer import api
    from edgeinfer.readers import read_model

    src = read_model(str(stories_dir))
    for kv in ("f32", "f16", "int8"):
        m = api.Model(src, backend="opencl", n_ctx=64, kv_dtype=kv)
        text = m.generate("Once upon a time", max_tokens=20)
        assert ", there was a little girl named Lily. She loved to play outside in the park.".startswith(text), text
