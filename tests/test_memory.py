"""plan_memory: budget errors with numbers, exact max_context, the cache fits the plan."""
from __future__ import annotations

import pytest
from edgeinfer.backends.kvcache import HostKVCache
from edgeinfer.models.config import ModelConfig

from edgeinfer.errors import MemoryBudgetError
from edgeinfer.memory import MIB, format_plan, plan_memory, scratch_bytes, weight_bytes

# SmolLM2-135M geometry (MODELS.md)
SMOL = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192}
W = 98_362_432  # the GGUF's bytes


def cfg(**kw):
    return ModelConfig(**{**SMOL, **kw})


def test_too_small_for_the_weights_raises_with_the_numbers():
    with pytest.raises(MemoryBudgetError) as e:
        plan_memory(cfg(), W, 64, "int8")
    msg = str(e.value)
    assert "64 MiB" in msg and f"{W / MIB:.1f} MiB" in msg and "12060 bytes per token" in msg
    assert isinstance(e.value, MemoryError)


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8", "int4", "k8v4"])
@pytest.mark.parametrize("n", [1, 1000, 3001])
def test_budget_for_n_tokens_gives_exactly_n(dtype, n):
    c = cfg()
    probe = plan_memory(c, W, 4096, dtype, 256)
    per, scratch = probe.kv_bytes_per_token, probe.scratch_bytes
    budget = W + scratch + n * per  # bytes
    for extra in (0, per - 1):  # exact, and just short of one more token
        plan = plan_memory(c, W, (budget + extra) / MIB, dtype, 256)
        assert plan.max_context == n and plan.fits
    assert plan_memory(c, W, (budget + per) / MIB, dtype, 256).max_context == n + 1
    cache = HostKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, n, dtype)
    assert cache.nbytes <= plan.kv_bytes == n * per
    assert W + scratch + cache.nbytes <= plan.budget_bytes


def test_capped_by_model_positions_and_requested_ctx():
    plan = plan_memory(cfg(max_position_embeddings=2048), W, 4096, "int4", n_ctx=4096)
    assert plan.max_context == 2048 and not plan.fits
    text = format_plan(plan)
    assert "2048 tokens (the model's limit)" in text and "does NOT fit" in text
    assert "int4" in text and "7200 bytes/token" in text  # 30 layers x 3 heads x 80 B


def test_kv_dtype_ordering_and_scratch():
    c = cfg()
    ctx = {d: plan_memory(c, W, 420, d).max_context for d in ("f32", "f16", "int8", "int4")}
    assert ctx["f32"] < ctx["f16"] < ctx["int8"] < ctx["int4"]
    assert scratch_bytes(c, 1024) > scratch_bytes(c, 512)
    with pytest.raises(ValueError, match="dtype"):
        plan_memory(c, W, 512, "q8")


def test_windowed_layers_plan_matches_a_ring_cache():
    c = cfg(model_type="gemma3_text", sliding_window=64,
            layer_types=["sliding_attention"] * 25 + ["full_attention"] * 5)
    plan = plan_memory(c, W, 1024, "int8", 128, use_windows=True)
    full = plan_memory(c, W, 1024, "int8", 128)
    assert plan.max_context > 0 and plan.max_context >= full.max_context
    wins = [c.layer_window(i) for i in range(c.num_hidden_layers)]
    n = min(plan.max_context, 4000)
    cache = HostKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, n, "int8",
                        window_sizes=wins, max_chunk=128)
    small = plan_memory(c, W, (W + plan.scratch_bytes + cache.nbytes) / MIB, "int8", 128,
                        use_windows=True)
    assert small.max_context == n and small.kv_bytes == cache.nbytes


def test_weight_bytes_counts_arrays():
    import numpy as np
    assert weight_bytes({"a": np.zeros((3, 4), np.float32), "b": np.zeros(8, np.uint8)}) == 56


def test_one_context_rule():
    from edgeinfer.memory import DEFAULT_CONTEXT, context_length

    assert DEFAULT_CONTEXT == 4096
    assert context_length(8192) == 4096          # SmolLM2: the default, not the model's 8192
    assert context_length(2048) == 2048          # a model with fewer positions
    assert context_length(8192, memory_max=8192) == 4096  # a big budget does not raise it
    assert context_length(8192, memory_max=3000) == 3000  # a small one lowers it
    assert context_length(8192, n_ctx=8192) == 8192 and context_length(512, n_ctx=9000) == 512


def test_info_and_the_runtime_state_the_same_context(smollm2_gguf):
    """`edgeinfer info` names the context chat/serve run with (and the model's limit
    apart), with or without a memory budget."""
    import json
    import os
    import subprocess
    import sys

    from edgeinfer import api
    from edgeinfer.readers import read_model

    root = os.path.dirname(os.path.dirname(__file__))
    for extra in ([], ["--max-memory", "4000"]):
        r = subprocess.run([sys.executable, "-m", "cli", "info", str(smollm2_gguf), "--json",
                            *extra], capture_output=True, text=True, timeout=240, cwd=root)
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        assert (info["context"], info["model_context"]) == (4096, 8192)
    src = read_model(str(smollm2_gguf))
    assert api.Model(src, backend="reference", max_memory=4000).n_ctx == 4096
