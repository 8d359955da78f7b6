"""Whole-model parity of the CPU backend with the reference on stories260K.

* dense float32 weights: 64 greedy tokens identical (decode through the step-wise halves
  of backends/cpu/stepwise.py), also over f16 / int8 / int4 / k8v4 caches;
* RTN INT4 (g32 asymmetric, padded 172 -> 192) with an 8-bit per-row head:
  identical with ``exact_decode=True`` (float activations); on the default int8-activation
  decode path, teacher-forced logits within 3e-2 normalized error every step and the
  argmax identical wherever the reference's top-2 margin exceeds that error;
* prefill of N tokens == prefill N-1 + decode 1 (last logits within 1e-4 relative).

Quantized decode runs through the fused halves of the CPU backend's decode plan
(backends/cpu/plan.py); the teacher-forced test checks they ran.
"""
from __future__ import annotations

from conftest import SHARED  # the shared folder (models, data) beside the checkout
import json
from pathlib import Path

import numpy as np
import pytest
from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.backends.quantized import QuantizedTensor, pack_nibbles
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.models.config import ModelConfig
from edgeinfer.models.transformer import Transformer

MODEL_DIR = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
if not MODEL_DIR.exists():
    MODEL_DIR = SHARED / "models" / "stories260K"
PROMPT = np.array([1, 400, 35, 22, 7, 301], np.int32)
STEPS = 64

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").exists(),
                                reason="stories260K not available")


def rtn4(w: np.ndarray, g: int) -> QuantizedTensor:
    """Test-local round-to-nearest asymmetric INT4 in the QuantizedTensor layout."""
    out, n_in = w.shape
    kp = -(-n_in // g) * g
    wp = np.zeros((out, kp), np.float32)
    wp[:, :n_in] = w
    wg = wp.reshape(out, -1, g)
    lo, hi = np.minimum(wg.min(-1), 0), np.maximum(wg.max(-1), 0)
    s = np.maximum((hi - lo) / 15, 1e-8).astype(np.float16)
    sf = s.astype(np.float32)
    z = np.clip(np.round(-lo / sf), 0, 15)
    q = np.clip(np.round(wg / sf[..., None]) + z[..., None], 0, 15).astype(np.uint8)
    return QuantizedTensor(pack_nibbles(q.reshape(out, kp)), s,
                           pack_nibbles(z.astype(np.uint8)), 4, g, n_in)


def rtn8_rows(w: np.ndarray) -> QuantizedTensor:
    """Test-local symmetric per-row INT8."""
    s = np.maximum(np.abs(w).max(axis=1, keepdims=True) / 127, 1e-8).astype(np.float16)
    q = np.clip(np.round(w / s.astype(np.float32)), -127, 127).astype(np.int8)
    return QuantizedTensor(q, s, None, 8, w.shape[1], w.shape[1])


@pytest.fixture(scope="module")
def model():
    from safetensors.numpy import load_file
    cfg = ModelConfig.from_hf_dict(json.loads((MODEL_DIR / "config.json").read_text()))
    dense = load_file(str(MODEL_DIR / "model.safetensors"))
    quant = {}
    for k, v in dense.items():
        if k == "lm_head.weight":
            quant[k] = rtn8_rows(v)
        elif v.ndim == 2 and "embed" not in k:
            quant[k] = rtn4(v, 32)
        else:
            quant[k] = v
    return cfg, dense, quant


def greedy(m: Transformer, steps: int = STEPS, kv: str = "f32", caches=None) -> list[int]:
    """Greedy tokens after PROMPT; the cache is appended to ``caches`` when given."""
    cache = m.new_cache(PROMPT.size + steps + 1, kv)
    if caches is not None:
        caches.append(cache)
    logits = m.forward(PROMPT, cache)
    out = []
    for _ in range(steps):
        tok = int(logits[-1].argmax())
        out.append(tok)
        logits = m.forward(np.array([tok], np.int32), cache)
    return out


def stepwise_decode(m: Transformer, cache) -> bool:
    """Whether ``m``'s decode plan for ``cache`` runs every layer step-wise (dense)."""
    p = m.plan(cache)
    return p is not None and all(lp.qkv is None and lp.steps is not None for lp in p.layers)


@pytest.mark.parametrize("weights,exact", [("dense", False), ("quant", True)])
def test_greedy_identical(model, weights, exact):
    cfg, dense, quant = model
    tensors = dense if weights == "dense" else quant
    ref = greedy(Transformer(cfg, tensors, ReferenceBackend(), 256))
    mc = Transformer(cfg, tensors, CpuBackend(exact_decode=exact), 256)
    caches = []
    assert greedy(mc, caches=caches) == ref
    if weights == "dense":  # decode ran through backends/cpu/stepwise.py
        assert stepwise_decode(mc, caches[0])
    else:  # exact_decode: no plan, the model's composition
        assert mc.plan(caches[0]) is None


def test_quant_fast_decode_teacher_forced(model):
    cfg, _, quant = model
    mr = Transformer(cfg, quant, ReferenceBackend(), 256)
    mc = Transformer(cfg, quant, CpuBackend(), 256)
    toks = greedy(mr)
    cr, cc = mr.new_cache(128), mc.new_cache(128)
    lr, lc = mr.forward(PROMPT, cr), mc.forward(PROMPT, cc)
    agree = 0
    for tok in toks:
        e = np.linalg.norm(lc - lr) / np.linalg.norm(lr)
        assert e < 3e-2
        top2 = np.sort(lr[-1])[-2:]
        if top2[1] - top2[0] > 3e-2 * np.abs(lr[-1]).max():
            assert int(lc[-1].argmax()) == int(lr[-1].argmax())
        agree += int(lc[-1].argmax()) == int(lr[-1].argmax())
        ids = np.array([tok], np.int32)
        lr, lc = mr.forward(ids, cr), mc.forward(ids, cc)
    assert agree >= STEPS - 4
    # decode ran through the fused halves and attention kernels (backends/cpu/plan.py)
    p = mc.plan(cc)
    assert all(lp.qkv is not None and lp.mlp is not None and lp.attn is not None
               for lp in p.layers)


@pytest.mark.parametrize("weights", ["dense", "quant"])
def test_prefill_equals_prefill_plus_decode(model, weights):
    cfg, dense, quant = model
    tensors = dense if weights == "dense" else quant
    ids = np.array([1, 45, 300, 12, 99, 7, 250, 31, 5, 410, 77], np.int32)
    m = Transformer(cfg, tensors, CpuBackend(exact_decode=True), 64)
    full = m.forward(ids, m.new_cache(64))[-1]
    c = m.new_cache(64)
    m.forward(ids[:-1], c)
    step = m.forward(ids[-1:], c)[-1]
    assert np.abs(step - full).max() <= 1e-4 * np.abs(full).max()
    ref = Transformer(cfg, tensors, ReferenceBackend(), 64).forward(ids, ReferenceBackend()
                                                                     .new_kv_cache(5, 4, 8, 64))
    assert np.abs(full - ref[-1]).max() <= 1e-4 * np.abs(ref[-1]).max()
    if weights == "quant":  # the int8-activation decode step, looser
        mf = Transformer(cfg, tensors, CpuBackend(), 64)
        c = mf.new_cache(64)
        mf.forward(ids[:-1], c)
        fast = mf.forward(ids[-1:], c)[-1]
        assert np.linalg.norm(fast - full) / np.linalg.norm(full) < 3e-2


@pytest.mark.parametrize("kv", ["int8", "int4", "k8v4", "f16"])
def test_greedy_identical_quantized_kv(model, kv):
    """Dense weights, quantized (or f16) KV cache (int8 = the engine default): the CPU
    backend's in-place quantized attention gives the reference backend's greedy tokens
    exactly."""
    cfg, dense, _ = model
    ref = greedy(Transformer(cfg, dense, ReferenceBackend(), 256), kv=kv)
    mc = Transformer(cfg, dense, CpuBackend(), 256)
    caches = []
    assert greedy(mc, kv=kv, caches=caches) == ref
    assert stepwise_decode(mc, caches[0])  # the dense decode halves ran
