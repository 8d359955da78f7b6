"""Tiny random models for tests that need an architecture's shape, not its weights."""
from __future__ import annotations

import numpy as np
from edgeinfer.models.arch import tensor_specs
from edgeinfer.models.config import ModelConfig


def tiny_gemma(vocab_size: int = 64, hidden_size: int = 32, intermediate_size: int = 48,
               num_attention_heads: int = 2) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A 3-layer Gemma-3-like model (two sliding-window layers of 6, one global; QK-norm,
    sandwich norms, (1 + w) norms, GELU-tanh, tied head, one KV head of 16): its config
    and float32 tensors (N(0, 0.4²), seed 1)."""
    cfg = ModelConfig.from_hf_dict({
        "model_type": "gemma3_text", "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": 3,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": 1, "head_dim": 16,
        "sliding_window": 6, "query_pre_attn_scalar": 16, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True})
    rng = np.random.default_rng(1)
    tensors = {s.name: (rng.standard_normal(s.shape(cfg)) * 0.4).astype(np.float32)
               for s in tensor_specs(cfg)}
    return cfg, tensors


#: Tiny Phi-3 variants: "plain" (untied head, full rotary, no scaling, no window) and
#: "longrope" (CASES C17's switch: L0 = 16, max 64, short factors 1, long 1 -> 8; partial
#: rotary 0.5; sliding window 12; tied head, as Phi-4-mini).
PHI3_VARIANTS = {
    "plain": dict(tie_word_embeddings=False),
    "longrope": dict(
        tie_word_embeddings=True, sliding_window=12, original_max_position_embeddings=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5, "short_factor": [1.0] * 4,
                         "long_factor": [1.0, 3.0, 5.5, 8.0]}),
}
PHI3_TEXT = ("Once upon a time there was a little robot who liked to count the stars. "
             "Every night it climbed the hill and counted one, two, three. ") * 4


def byte_level_bpe(path, text: str, specials: list[str]):
    """A byte-level BPE tokenizer (320 ids, ``specials`` first) trained on ``text`` and
    saved as ``path/tokenizer.json`` (``path`` is created); returns it."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models as tmodels, pre_tokenizers, trainers

    Path(path).mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(tmodels.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(Path(path) / "tokenizer.json"))
    return tok


def tiny_phi3_folder(path, variant: str = "plain"):
    """Write a tiny random ``Phi3ForCausalLM`` (2 layers, hidden 64, 4 query / 2 KV heads
    of 16, intermediate 96, max 64 positions; fused ``qkv_proj`` / ``gate_up_proj`` as HF
    saves them) with a byte-level BPE ``tokenizer.json`` (trained on :data:`PHI3_TEXT`,
    specials ``<s>`` 0, ``</s>`` 1) into ``path``; returns the HF model (float32, eager
    attention, eval mode). Weights N(0, 0.15²), embeddings N(0, 1), norms 1 + N(0, 0.1²),
    seed 0: peaked enough that greedy tokens are stable."""
    import torch
    import transformers

    from pathlib import Path

    path = Path(path)
    tok = byte_level_bpe(path, PHI3_TEXT, ["<s>", "</s>"])
    hc = transformers.Phi3Config(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        **PHI3_VARIANTS[variant])
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(hc)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    hf.config._attn_implementation = "eager"
    hf.save_pretrained(str(path))
    return hf.eval()
