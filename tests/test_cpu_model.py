"""Which decode path the CPU backend takes on stories260K (the values of every path:
tests/test_forward.py): dense weights decode through the step-wise halves of
backends/cpu/stepwise.py, RTN INT4 weights through the fused halves and attention kernels
of the decode plan (backends/cpu/plan.py), ``exact_decode=True`` through no plan (the
model's composition), over every KV dtype.
"""
from __future__ import annotations

from conftest import SHARED  # the shared folder (models, data) beside the checkout
import json
from pathlib import Path

import numpy as np
import pytest
from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.backends.quantized import QuantizedTensor, pack_nibbles
from edgeinfer.models.config import ModelConfig
from edgeinfer.models.transformer import Transformer

MODEL_DIR = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
if not MODEL_DIR.exists():
    MODEL_DIR = SHARED / "models" / "stories260K"
PROMPT = np.array([1, 400, 35, 22, 7, 301], np.int32)

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


def stepwise_decode(m: Transformer, cache) -> bool:
    """Whether ``m``'s decode plan for ``cache`` runs every layer step-wise (dense)."""
    p = m.plan(cache)
    return p is not None and all(lp.qkv is None and lp.steps is not None for lp in p.layers)


@pytest.mark.parametrize("kv", ["f32", "f16", "int8", "int4", "k8v4"])
def test_decode_paths(model, kv):
    cfg, dense, quant = model
    for tensors, be, path in ((dense, CpuBackend(), "stepwise"), (quant, CpuBackend(), "fused"),
                              (quant, CpuBackend(exact_decode=True), None)):
        m = Transformer(cfg, tensors, be, 64)
        cache = m.new_cache(32, kv)
        logits = m.forward(PROMPT, cache)
        m.forward(np.array([int(logits[-1].argmax())], np.int32), cache)
        p = m.plan(cache)
        if path is None:
            assert p is None
        elif path == "stepwise":
            assert stepwise_decode(m, cache)
        else:
            assert all(lp.qkv is not None and lp.mlp is not None and lp.attn is not None
                       for lp in p.layers)
