"""The forward pass: model × backend × weights × KV dtype, against the numpy reference
backend, and the reference against HF transformers.

Models: tiny random Llama (untied head), Qwen2 (q/k/v biases, tied head, one KV head),
Gemma 3 (``tiny_models.tiny_gemma``: QK-norm, sandwich and (1 + w) norms, GELU-tanh,
sliding-window ring layers of 6 beside a global one), Phi-3 (partial rotary 0.5, sliding
window 12, tied head; its LongRoPE switch is tests/test_phi3.py's), and the real
stories260K (skipped, naming the path, where the shared folder is absent). Weights:
float32, or RTN int4 g32 asymmetric linears with an int8 per-row embedding / head.

Each run: the whole prompt prefilled (every position's logits), then the prompt again in
chunks (``max_chunk``: longer than Gemma's window for f32 / int4 / k8v4, shorter for f16 /
int8), then greedy decode steps teacher-forced with the reference's tokens. Metric: NMSE
(``tests/parity.py``), the worst row; one threshold per dtype class (:data:`THRESHOLD`),
set from the worst value seen over this matrix (in brackets) with a margin:

* ``f32``: float32 weights or activations and a float32 KV cache: 1e-9 [2e-12], and
  every greedy token equal (so free-running greedy decoding is identical too);
* ``kv16`` / ``k8`` / ``k4``: an f16 cache / 8-bit K (int8, k8v4) / 4-bit K (int4). A
  float32-level difference upstream can move a stored value across a rounding step, and
  the model carries that on: 1e-6 [2e-7] / 1e-5 [3e-6] / 5e-3 [6e-4];
* ``act8``: the CPU decode GEMV's int8 activations on int4 weights, over f32 / f16 /
  int8 caches: 1e-2 [4e-3]. (With 4-bit K the two roundings compound, up to 0.3 at one
  step of stories260K, so that pairing is checked in parts: int4 weights with float
  activations (``cpu-exact``) over every cache, int8 activations op by op in
  tests/test_ops.py.)

Outside ``f32`` a greedy token must equal the reference's where the reference's top-2
margin exceeds 5 % of its logit range. The reference itself: float32 weights and KV
against HF (``AutoModelForCausalLM`` on the same tensors, eager attention, from scratch
at each step): ``f32``.
"""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from conftest import STORIES
from edgeinfer.models.arch import tensor_specs
from edgeinfer.models.config import ModelConfig
from edgeinfer.models.families import LINEAR_KEYS
from edgeinfer.models.transformer import Transformer
from parity import backend, nmse
from tiny_models import tiny_gemma

THRESHOLD = {"f32": 1e-9, "kv16": 1e-6, "k8": 1e-5, "k4": 5e-3, "act8": 1e-2}
MARGIN = 0.05  # of the reference's logit range, where a looser class must keep the token

_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
_TINY = {
    "llama": ({**_BASE, "model_type": "llama", "tie_word_embeddings": False}, 0),
    "qwen2": ({**_BASE, "model_type": "qwen2", "num_key_value_heads": 1,
               "tie_word_embeddings": True}, 1),
    "phi3": ({**_BASE, "model_type": "phi3", "partial_rotary_factor": 0.5,
              "sliding_window": 12, "tie_word_embeddings": True}, 3),
}
MODELS = ["llama", "qwen2", "gemma3", "phi3", "stories260k"]
KV_DTYPES = ["f32", "f16", "int8", "int4", "k8v4"]
STEPS = {"stories260k": 48}  # decode steps; tiny models 12
PROMPT_LEN = 13  # > 2 x Gemma's window of 6, > Phi-3's 12


@functools.cache
def dense_model(name: str):
    """(ModelConfig, float32 tensors) of model ``name``."""
    if name == "gemma3":
        return tiny_gemma()
    if name == "stories260k":
        if not (STORIES / "model.safetensors").exists():
            pytest.skip(f"real-model test data not found: {STORIES}")
        from safetensors.numpy import load_file

        cfg = ModelConfig.from_hf_dict(json.loads((STORIES / "config.json").read_text()))
        return cfg, load_file(str(STORIES / "model.safetensors"))
    hf, seed = _TINY[name]
    cfg = ModelConfig.from_hf_dict(hf)
    rng = np.random.default_rng(seed)
    return cfg, {s.name: (rng.standard_normal(s.shape(cfg)) * 0.4).astype(np.float32)
                 for s in tensor_specs(cfg)}


@functools.cache
def model_tensors(name: str, weights: str):
    cfg, dense = dense_model(name)
    if weights == "f32":
        return cfg, dense
    from edgeinfer.quant.rtn import quantize_rtn

    out = {}
    for key, t in dense.items():
        short = key.rsplit(".", 2)[-2] if key.endswith(".weight") else ""
        if short in LINEAR_KEYS:
            out[key] = quantize_rtn(t, 4, 32, False, name=key)
        elif key in ("model.embed_tokens.weight", "lm_head.weight"):
            out[key] = quantize_rtn(t, 8, -1, True, name=key)
        else:
            out[key] = t
    return cfg, out


def prompt(name: str) -> np.ndarray:
    if name == "stories260k":  # BOS "Once upon a time there was ..."
        return np.array([1, 403, 407, 261, 378, 29, 445, 270, 260, 300, 411, 35, 22], np.int32)
    cfg, _ = dense_model(name)
    return np.random.default_rng(2).integers(0, cfg.vocab_size, PROMPT_LEN).astype(np.int32)


def chunk_for(kv: str) -> int:
    return 8 if kv in ("f32", "int4", "k8v4") else 4


def run(name: str, be, weights: str, kv: str, tokens: list[int] | None):
    """(prefill logits [P, V], chunked-prefill-then-decode logits [1 + n, V], tokens):
    decode fed ``tokens`` (teacher forcing), or its own greedy tokens when None."""
    cfg, tensors = model_tensors(name, weights)
    ids = prompt(name)
    n = STEPS.get(name, 12)
    m = Transformer(cfg, tensors, be, max_positions=ids.size + n + 8)
    full = m.forward(ids, m.new_cache(ids.size + 1, kv), all_logits=True)
    chunk = chunk_for(kv)
    cache = m.new_cache(ids.size + n + 1, kv, max_chunk=chunk)
    if name == "gemma3":  # windowed layers keep a ring of window - 1 + chunk slots
        assert cache.slots == [5 + chunk, 5 + chunk, ids.size + n + 1]
    for s in range(0, ids.size, chunk):
        logits = m.forward(ids[s:s + chunk], cache)
    steps, own = [logits[-1]], []
    for i in range(n):
        own.append(int(np.argmax(steps[-1])))
        t = own[-1] if tokens is None else tokens[i]
        steps.append(m.forward(np.array([t], np.int32), cache)[-1])
    return full, np.stack(steps), own


@functools.cache
def reference(name: str, weights: str, kv: str):
    return run(name, backend("reference"), weights, kv, None)


def _worst(a, b) -> float:
    return max(nmse(x, y) for x, y in zip(a, b))


def _class(be_name: str, weights: str, kv: str) -> str:
    if be_name == "cpu" and weights == "int4":
        return "act8"
    return {"f32": "f32", "f16": "kv16", "int8": "k8", "k8v4": "k8", "int4": "k4"}[kv]


def _params():
    combos = [("cpu", "f32", kv) for kv in KV_DTYPES]
    combos += [("cpu", "int4", kv) for kv in ("f32", "f16", "int8")]
    combos += [("cpu-exact", "int4", kv) for kv in KV_DTYPES]  # float activations
    combos += [("opencl-fused", w, kv) for w in ("f32", "int4") for kv in KV_DTYPES]
    combos += [("opencl-unfused", w, "f32") for w in ("f32", "int4")]  # per-op kernels
    for name in MODELS:
        for be, w, kv in combos:
            yield pytest.param(name, be, w, kv, id=f"{name}-{be}-{w}-{kv}")


@pytest.mark.parametrize("name,be_name,weights,kv", list(_params()))
def test_forward_matches_reference(name, be_name, weights, kv):
    be = backend(be_name)
    ref_full, ref_steps, ref_toks = reference(name, weights, kv)
    full, steps, own = run(name, be, weights, kv, ref_toks)
    cls = _class(be_name, weights, kv)
    err = max(_worst(full, ref_full), _worst(steps, ref_steps))
    assert err <= THRESHOLD[cls], f"NMSE {err:.3g} > {THRESHOLD[cls]:g} ({cls})"
    if cls == "f32":
        assert own == ref_toks
    else:
        for i, (tok, lr) in enumerate(zip(own, ref_steps)):
            top2 = np.sort(lr)[-2:]
            if top2[1] - top2[0] > MARGIN * (lr.max() - lr.min()):
                assert tok == ref_toks[i], (i, tok, ref_toks[i])


# ---- the reference against HF transformers ------------------------------------------------
def _hf_model(cfg: ModelConfig, tensors: dict):
    """HF's model of ``cfg`` (AutoModelForCausalLM, eager attention) holding ``tensors``,
    Phi-3's q/k/v and gate/up re-fused as HF stores them."""
    import torch
    import transformers

    hd = cfg.to_hf_dict()
    if cfg.arch == "gemma3":  # HF's field types and per-layer-type RoPE parameters
        hd["query_pre_attn_scalar"] = int(hd["query_pre_attn_scalar"])
        hd["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq}}
    hc = transformers.AutoConfig.for_model(**hd)
    hc._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hc).eval()
    sd = {k: torch.from_numpy(v) for k, v in tensors.items()}
    for key in list(hf.state_dict()):
        p = key.rsplit(".", 2)[0] + "."
        if key.endswith("qkv_proj.weight"):
            sd[key] = torch.cat([sd.pop(p + f"{x}_proj.weight") for x in "qkv"])
        elif key.endswith("gate_up_proj.weight"):
            sd[key] = torch.cat([sd.pop(p + f"{x}_proj.weight") for x in ("gate", "up")])
        elif key == "lm_head.weight" and key not in sd:
            sd[key] = sd["model.embed_tokens.weight"]
    hf.load_state_dict(sd, strict=True)
    if hasattr(hf.model.embed_tokens, "embed_scale"):  # Gemma: sqrt(D) rounded to bf16
        hf.model.embed_tokens.embed_scale.fill_(cfg.embed_scale)
    return hf


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3", "phi3"])
def test_reference_matches_hf(name):
    """Every prefill position, then each greedy step from scratch over the sequence so
    far (past Gemma's and Phi-3's windows, with the chunked ring cache): NMSE ``f32``."""
    torch = pytest.importorskip("torch", reason="torch (CPU) is needed for HF parity")
    pytest.importorskip("transformers", reason="transformers is needed for HF parity")
    cfg, tensors = dense_model(name)
    if name == "phi3":  # the partial rotary and the window are really on
        assert cfg.rotary_dim == 8 and cfg.layer_window(0) == 12
    hf = _hf_model(cfg, tensors)
    ref_full, ref_steps, toks = reference(name, "f32", "f32")
    seq = list(prompt(name))
    with torch.no_grad():
        hf_full = hf(torch.tensor([seq])).logits[0].numpy()
        assert np.abs(hf_full).max() > 1.0
        hf_steps = [hf_full[-1]]
        for t in toks:
            seq.append(t)
            hf_steps.append(hf(torch.tensor([seq])).logits[0, -1].numpy())
    err = max(_worst(ref_full, hf_full), _worst(ref_steps, hf_steps))
    assert err <= THRESHOLD["f32"], err
    assert [int(np.argmax(s)) for s in hf_steps[:-1]] == toks


def test_metric_sees_a_small_model_change():
    """Negative control: one norm weight off by 0.1 % takes the logits past ``f32``."""
    cfg, tensors = dense_model("llama")
    bent = dict(tensors)
    key = "model.layers.1.input_layernorm.weight"
    bent[key] = tensors[key].copy()
    bent[key][5] *= 1.001
    m = Transformer(cfg, bent, backend("reference"))
    ids = prompt("llama")
    got = m.forward(ids, m.new_cache(ids.size), all_logits=True)
    assert _worst(got, reference("llama", "f32", "f32")[0]) > THRESHOLD["f32"]
