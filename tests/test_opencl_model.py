"""The OpenCL backend on whole models beyond forward parity (that is
tests/test_forward.py's): prefill == token-by-token decode and prefix reuse after a trim,
no buffer allocation in the decode loop, the API's golden text, the decode plan of CPU
devices (launch count, Gemma 3's blocks, when it applies), and SmolLM2-135M RTN INT4
(greedy parity and the API's chat answer, both slow). The start-up self-check is tested
in test_selfcheck.py.

Skips with a message naming what is missing (pyopencl, an OpenCL platform, the model).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'edgeinfer[opencl]')")

from edgeinfer.backends.opencl import OpenCLBackend
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.models.config import ModelConfig
from edgeinfer.models.transformer import LINEAR_KEYS, Transformer

PROMPT = [1, 403, 407, 261, 378]  # BOS "Once upon a time"
STEPS = 64


@pytest.fixture(scope="module")
def be(opencl_backend):
    return opencl_backend


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


def test_engine_generates_golden_text_on_opencl(be, stories_dir):
    """The public API on this backend: same greedy text as the reference's golden string."""
    from edgeinfer import api
    from edgeinfer.readers import read_model

    src = read_model(str(stories_dir))
    for kv in ("f32", "f16", "int8", "k8v4"):
        m = api.Model(src, backend="opencl", n_ctx=64, kv_dtype=kv)
        assert m.backend.name == "opencl", kv  # passed the self-check (no CPU fallback)
        text = m.generate("Once upon a time", max_tokens=20)
        assert ", there was a little girl named Lily. She loved to play outside in the park.".startswith(text), text


# ---- the fused decode path (CPU devices; forced on/off here so both run on any device) ----

def _with_fused(fused: bool) -> OpenCLBackend:
    import dataclasses

    b = OpenCLBackend()
    b.caps = dataclasses.replace(b.caps, fused=fused)
    return b


def test_fused_decode_launches_six_kernels_per_layer(be, stories):
    """Per decode token: embedding, then per layer q/k/v (+norm), rope+KV write, attention,
    o_proj (+residual), gate/up/GLU (+norm), down (+residual), then norm+head: 6L + 2."""
    cfg, tensors = stories
    b = _with_fused(True)
    model = Transformer(cfg, _quantized(tensors), b)
    cache = model.new_cache(16)
    model.forward(np.asarray(PROMPT), cache)
    n0 = b.launches
    model.forward(np.array([29]), cache)
    assert b.launches - n0 == 6 * cfg.num_hidden_layers + 2
    u = _with_fused(False)
    model = Transformer(cfg, _quantized(tensors), u)
    cache = model.new_cache(16)
    model.forward(np.asarray(PROMPT), cache)
    n0 = u.launches
    model.forward(np.array([29]), cache)
    assert u.launches - n0 == 16 * cfg.num_hidden_layers + 3  # + embed, final norm, head


@pytest.mark.parametrize("kv", ["f32", "int8", "int4"])
def test_decode_plan_gemma_blocks(be, kv):
    """A Gemma-3-like model (QK-norm, sandwich norms, (1 + w) norms, GELU-tanh, ring
    layers, one KV head) through the decode plan == the unfused composition (greedy, logits
    within 1e-4); per layer 6 launches + one RMSNorm per QK-norm + (GEMV, norm, add) in
    place of each fused residual: 12."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import tiny_gemma

    cfg, tensors = tiny_gemma(vocab_size=512, hidden_size=64, intermediate_size=96,
                              num_attention_heads=4)
    out = {}
    for fused in (True, False):
        b = _with_fused(fused)
        m = Transformer(cfg, tensors, b, 64)
        cache = m.new_cache(48, kv, max_chunk=8)
        assert (m.plan(cache) is not None) == fused
        logits = m.forward(np.arange(1, 9, dtype=np.int32), cache)
        toks, logs = [], [logits[-1]]
        for _ in range(10):
            toks.append(int(np.argmax(logits[-1])))
            n0 = b.launches
            logits = m.forward(np.array(toks[-1:], np.int32), cache)
            logs.append(logits[-1])
        if fused and kv == "f32":  # (a quantized cache launches RoPE and its write apart)
            assert b.launches - n0 == 12 * cfg.num_hidden_layers + 2
        out[fused] = toks, np.stack(logs)
    assert out[True][0] == out[False][0]
    assert _nerr(out[True][1], out[False][1]) < 1e-4


def test_decode_plan_needs_row_kernels(be, stories):
    """A weight wider than the row kernels stage (``kmax``) compiles no plan: the model
    composes the single ops, with the reference's greedy tokens."""
    import dataclasses

    cfg, tensors = stories
    b = _with_fused(True)
    b.caps = dataclasses.replace(b.caps, kmax=cfg.hidden_size)  # F > kmax: w_down too wide
    m = Transformer(cfg, tensors, b)
    cache = m.new_cache(16)
    assert m.plan(cache) is None
    toks, _ = _greedy(m, PROMPT, 8)
    want, _ = _greedy(Transformer(cfg, tensors, ReferenceBackend()), PROMPT, 8)
    assert toks == want


# ---- SmolLM2-135M-Instruct, RTN INT4 g128 + INT8 embedding, quantized in-process ----------

@pytest.fixture(scope="module")
def smollm2_int4(smollm2_gguf):
    """The catalog GGUF (dequantized to float32 by the reader), requantized with the
    converter's RTN: linears INT4 g128 asymmetric, the tied embedding INT8 per row."""
    import dataclasses

    from edgeinfer.models.arch import is_linear
    from edgeinfer.quant.rtn import quantize_rtn

    from edgeinfer.readers import read_model

    src = read_model(str(smollm2_gguf)).float32()  # the GGUF's values as float32
    q = {}
    for name in src.tensors:
        t = src.tensors[name]
        if is_linear(name):
            q[name] = quantize_rtn(t, 4, 128, name=name)
        elif name == "model.embed_tokens.weight":
            q[name] = quantize_rtn(t, 8, -1, True, name=name)
        else:
            q[name] = t
    return dataclasses.replace(src, tensors=q)


@pytest.mark.slow
def test_smollm2_int4_greedy_64_identical_to_reference(be, smollm2_int4):
    """64 greedy steps, OpenCL == reference (~100 s on a loaded 2-core PoCL machine)."""
    src = smollm2_int4
    tok = __import__("edgeinfer.api", fromlist=["tokenizer_for"]).tokenizer_for(src)
    ids = tok.encode("The capital of France is", add_special=True)
    ref_toks, ref_logits = _greedy(Transformer(src.config, src.tensors, ReferenceBackend(),
                                               max_positions=128), ids, STEPS)
    toks, logits = _greedy(Transformer(src.config, src.tensors, be, max_positions=128), ids, STEPS)
    assert toks == ref_toks
    assert _nerr(logits, ref_logits) < 1e-3


@pytest.mark.slow
def test_smollm2_int4_api_chat_answers_paris(be, smollm2_int4):
    """Model(..., backend="opencl") (self-check included) through the chat template
    (~30 s on a loaded 2-core PoCL machine, most of it the in-process quantization)."""
    from edgeinfer import api

    m = api.Model(smollm2_int4, backend="opencl", n_ctx=256)
    assert m.backend.name == "opencl", "the self-check rejected the device"
    text = m.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=16)
    assert "Paris" in text, text
