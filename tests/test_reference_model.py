"""The reference path: golden text on a real model, all-position logits, a Mistral
sliding window (decode == recompute, and the window matters). Prefill/decode parity with
HF: tests/test_forward.py, tests/test_hf_parity.py."""
from __future__ import annotations

import numpy as np
import pytest
from edgeinfer.backends.reference import ReferenceBackend
from edgeinfer.models.transformer import Transformer
from greedy import greedy

GOLDEN = ", there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module")
def stories_sources(stories_dir, stories_gguf):
    from edgeinfer.readers import read_model

    return read_model(str(stories_dir)), read_model(str(stories_gguf))


def test_golden_greedy_text_from_hf_folder_and_gguf(stories_sources):
    from edgeinfer.api import tokenizer_for

    outs = []
    for src in stories_sources:
        tok = tokenizer_for(src)
        ids = tok.encode("Once upon a time", add_special=True)
        assert ids[0] == 1, "stories260K prompts start with BOS (id 1)"
        model = Transformer(src.config, src.tensors, ReferenceBackend())
        gen = greedy(model, ids, 32)
        text = tok.decode(gen)
        assert text.startswith(GOLDEN), text
        outs.append(gen)
    assert outs[0] == outs[1], "HF folder and GGUF must give identical token ids"


def test_all_logits_match_last_logits(stories_sources):
    src = stories_sources[0]
    model = Transformer(src.config, src.tensors, ReferenceBackend())
    ids = np.array([1, 403, 407, 261, 378])
    allv = model.forward(ids, model.new_cache(8), all_logits=True)
    last = model.forward(ids, model.new_cache(8))
    assert allv.shape == (5, src.config.vocab_size)
    np.testing.assert_allclose(allv[-1], last[0], rtol=0, atol=1e-5)


def test_sliding_window_decode_equals_full_recompute():
    """Mistral, W=4: query i sees keys j with 0 <= i - j <= 3; cached decode == recompute."""
    from edgeinfer.models.arch import tensor_specs
    from edgeinfer.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(dict(
        model_type="mistral", vocab_size=32, hidden_size=16, intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        sliding_window=4, tie_word_embeddings=True))
    rng = np.random.default_rng(0)
    tensors = {s.name: rng.standard_normal(s.shape(cfg)).astype(np.float32) * 0.5
               for s in tensor_specs(cfg)}
    model = Transformer(cfg, tensors, ReferenceBackend())
    ids = rng.integers(0, 32, 15)
    cache = model.new_cache(32)
    model.forward(ids[:10], cache)
    for n in range(10, 15):
        step = model.forward(ids[n:n + 1], cache)[-1]
        full = model.forward(ids[:n + 1], model.new_cache(32))[-1]
        np.testing.assert_allclose(step, full, atol=1e-4)
    # the window matters: with W=4 the logits differ from global attention
    cfg_global = ModelConfig.from_hf_dict({**cfg.to_hf_dict(), "sliding_window": None})
    glob = Transformer(cfg_global, tensors, ReferenceBackend())
    a = model.forward(ids[:10], model.new_cache(32))[-1]
    b = glob.forward(ids[:10], glob.new_cache(32))[-1]
    assert np.max(np.abs(a - b)) > 1e-3
