"""The family table (edgeinfer.models.families): consistent with itself and with HF's
config classes, and the one activation normalisation."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.models.config import ConfigError, ModelConfig
from edgeinfer.models.families import (
    BY_GGUF_ARCH,
    BY_MODEL_TYPE,
    CAPTURE_GROUPS,
    FAMILIES,
    LAYER,
    LINEAR_KEYS,
    activation,
)
from edgeinfer.models.rope import attention_factor, inv_frequencies, rope_switch

SMALL = {"vocab_size": 32, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def test_activation_names_normalise_once():
    assert {activation(n) for n in ("silu", "swish")} == {"silu"}
    assert {activation(n) for n in ("gelu_pytorch_tanh", "gelu_new", "gelu_tanh")} == {"gelu_tanh"}
    for bad in ("gelu", "relu", None):  # exact-erf GELU is not the tanh approximation
        with pytest.raises(ValueError, match="not supported"):
            activation(bad)
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelConfig.from_hf_dict({**SMALL, "model_type": "llama", "hidden_act": "gelu"})
    cfg = ModelConfig.from_hf_dict({**SMALL, "model_type": "gemma3_text"})
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.activation == "gelu_tanh"


def test_every_entry_names_real_tensors_and_captures():
    names = set()
    for fam in FAMILIES:
        assert fam.model_types and not names & set(fam.model_types)
        names |= set(fam.model_types)
        for g in fam.awq_groups:
            assert g.prev in LAYER and set(g.linears) <= set(LINEAR_KEYS)
            assert set(g.linears) <= set(CAPTURE_GROUPS[g.capture])
        for ft in fam.fused:
            assert set(ft.parts) <= set(LINEAR_KEYS) and "{i}" in ft.name
        for mt in fam.architectures.values():
            assert BY_MODEL_TYPE[mt] is fam
        if fam.gguf_arch:
            assert BY_GGUF_ARCH[fam.gguf_arch] is fam
    assert sorted(m for ms in CAPTURE_GROUPS.values() for m in ms) == sorted(LINEAR_KEYS)


def test_defaults_are_the_hf_config_classes_defaults():
    transformers = pytest.importorskip("transformers")
    hf = {"phi3": transformers.Phi3Config(), "gemma3": transformers.Gemma3TextConfig()}
    for name, hc in hf.items():
        fam = next(f for f in FAMILIES if f.name == name)
        for key, value in fam.defaults.items():
            hf_key = "hidden_activation" if (name, key) == ("gemma3", "hidden_act") else key
            if hasattr(hc, hf_key):
                assert getattr(hc, hf_key) == value, (name, key)
    cfg = ModelConfig.from_hf_dict({**SMALL, "model_type": "phi3"})  # keys absent
    assert not cfg.tie_word_embeddings and cfg.max_position_embeddings == 4096
    assert ModelConfig.from_hf_dict({**SMALL, "model_type": "qwen2"}).attention_bias


@pytest.mark.parametrize("use,window,first", [(False, 4096, 28), (True, 8, 2), (True, 8, 0)])
def test_qwen2_sliding_window_as_hf(use, window, first):
    """Qwen2Config windows layers >= max_window_layers only with use_sliding_window."""
    transformers = pytest.importorskip("transformers")
    d = {**SMALL, "model_type": "qwen2", "use_sliding_window": use, "sliding_window": window,
         "max_window_layers": first}
    hc = transformers.Qwen2Config(**{k: v for k, v in d.items() if k != "model_type"})
    cfg = ModelConfig.from_hf_dict(d)
    want = [hc.sliding_window if t == "sliding_attention" else None for t in hc.layer_types]
    assert [cfg.layer_window(i) for i in range(4)] == want
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg  # the .eif round trip


@pytest.mark.parametrize("max_pos,attn", [(64, None), (16, None), (64, 1.25)])
@pytest.mark.parametrize("long", [False, True])
def test_longrope_frequencies_and_scale_as_hf(max_pos, attn, long):
    """inv_freq and the cos/sin factor of HF's ``_compute_longrope_parameters``."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
          "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [1.0, 3.0, 5.5, 8.0]}
    if attn is not None:
        rp["attention_factor"] = attn
    hc = transformers.Phi3Config(**SMALL, max_position_embeddings=max_pos,
                                 original_max_position_embeddings=16, rope_parameters=dict(rp))
    inv_hf, scale_hf = ROPE_INIT_FUNCTIONS["longrope"](hc, None, seq_len=17 if long else 16)
    cfg = ModelConfig.from_hf_dict({**SMALL, "model_type": "phi3", "max_position_embeddings":
                                    max_pos, "original_max_position_embeddings": 16,
                                    "rope_parameters": rp})
    assert rope_switch(cfg) == 16
    np.testing.assert_allclose(inv_frequencies(cfg.rotary_dim, 1e4, cfg.rope_scaling, long),
                               inv_hf.numpy(), rtol=1e-6)
    assert attention_factor(cfg) == pytest.approx(scale_hf, rel=1e-12)
    assert (attention_factor(cfg) == 1.0) == (max_pos == 16 and attn is None)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
