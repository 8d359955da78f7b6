"""A cache hit never changes the greedy output (CPU backend, quantized weights).

Prefill (the integer GEMM of backends/cpu/qgemm.py) computes every token row with the
decode GEMV's numerics, and the norm / RoPE / GLU row kernels are shared by prefill and
the fused decode plan, so the logits of a position do not depend on how its prefix got
into the KV cache. Checked on real models (stories260K RTN INT4, SmolLM2-135M INT4), KV
int8 and f16:

* logits of the same rows computed whole (M = T), in chunks of 7 and token by token
  (decode steps through the compiled plan) are bit-identical, and so are the KV cache
  bytes they wrote;
* through the engine: prefill N == prefill N-k then a cache-hit prefill of the rest ==
  prefill N-k then k decode steps (logits bit-identical, greedy continuations equal);
  a chat's second turn reusing the decoded first reply == the same prompt cold.

int4 KV is left out: its K channel statistics are fixed by the first write, so a first
write shorter than their 32-row window (chunks of 7, decode steps) gives other codes
(a known open problem of the int4 cache, not of the linears).

Controls: the cache hits really happened (reused token counts), and the float-activation
path (``exact_decode``) gives different logits, so equality is not vacuous.
"""
from __future__ import annotations

import numpy as np
import pytest
from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.models.transformer import Transformer

KVS = ["int8", "f16"]


@pytest.fixture(scope="module")
def stories_int4(tmp_path_factory):
    from conftest import STORIES

    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260K not found: {STORIES}")
    from edgeinfer.quant.convert import convert
    from edgeinfer.readers import read_model

    out = tmp_path_factory.mktemp("eif") / "stories.eif"
    convert(str(STORIES), str(out), method="rtn", group_size=32, progress=False)
    return read_model(str(out))


@pytest.fixture(scope="module")
def smollm2_int4(smollm2_gguf, tmp_path_factory):
    from edgeinfer.quant.convert import convert
    from edgeinfer.readers import read_model

    out = tmp_path_factory.mktemp("eif") / "smollm2.eif"
    convert(str(smollm2_gguf), str(out), method="rtn", group_size=128, progress=False)
    return read_model(str(out))


def _prompt(src, n):
    rng = np.random.default_rng(n)
    return [int(t) for t in rng.integers(3, src.config.vocab_size, n)]


def _rows_three_ways(src, ids, kv):
    tr = Transformer(src.config, src.tensors, CpuBackend(threads=2), 128)
    cw = tr.new_cache(128, kv)
    whole = tr.forward(np.asarray(ids, np.int32), cw, all_logits=True)
    c7 = tr.new_cache(128, kv)
    chunks = np.concatenate([tr.forward(np.asarray(ids[s:s + 7], np.int32), c7, all_logits=True)
                             for s in range(0, len(ids), 7)])
    c1 = tr.new_cache(128, kv)
    steps = np.stack([np.array(tr.forward(np.asarray(ids[i:i + 1], np.int32), c1)[-1])
                      for i in range(len(ids))])
    assert tr.plan(c1) is not None  # the steps ran through the compiled decode plan
    for layer in range(src.config.num_hidden_layers):  # the same K/V bytes, however written
        for name, arr in cw.raw(layer).items():
            for other in (c7, c1):
                assert np.array_equal(arr[:len(ids)].view(np.uint8),
                                      other.raw(layer)[name][:len(ids)].view(np.uint8)), name
    return whole, chunks, steps


@pytest.mark.parametrize("kv", KVS + ["f32", "k8v4"])
@pytest.mark.parametrize("n", [5, 33, 70])  # T below / across / past the 32-token chunks
def test_rows_bit_identical_whatever_m_stories(stories_int4, kv, n):
    whole, chunks, steps = _rows_three_ways(stories_int4, _prompt(stories_int4, n), kv)
    assert whole.shape == (n, stories_int4.config.vocab_size)
    assert np.array_equal(whole, chunks) and np.array_equal(whole, steps)
    assert np.isfinite(whole).all() and whole.std() > 0.1


@pytest.mark.parametrize("kv", KVS)
def test_rows_bit_identical_whatever_m_smollm2(smollm2_int4, kv):
    whole, chunks, steps = _rows_three_ways(smollm2_int4, _prompt(smollm2_int4, 41), kv)
    assert np.array_equal(whole, chunks) and np.array_equal(whole, steps)
    assert np.isfinite(whole).all() and whole.std() > 0.1


def _engine_runs(src, kv, prompt, k, n):
    """Greedy continuations (and the logits they start from) of ``prompt`` reached four
    ways through one engine; returns [(logits, tokens)] and the reuse counts."""
    from edgeinfer import api

    model = api.Model(src, backend="cpu", n_ctx=160, kv_dtype=kv, threads=2)
    eng = model.engine

    def greedy(lg):
        lg, out = np.array(lg), []
        first = lg.copy()
        for _ in range(n):
            out.append(int(np.argmax(lg)))
            lg = eng.decode_one(out[-1])
        return first, out

    eng.reset()
    cold = greedy(eng.prefill(prompt)[0])
    eng.reset()
    eng.prefill(prompt[:-k])
    lg, reused = eng.prefill(prompt)  # a cache hit: only the last k tokens are computed
    hit = greedy(lg)
    eng.reset()
    eng.prefill(prompt[:-k])
    for t in prompt[-k:]:  # the last k prompt tokens written by decode steps
        lg = eng.decode_one(t)
    stepped = greedy(lg)
    # a chat: turn 1's reply is decoded into the cache; turn 2 reuses it
    turn2 = prompt + cold[1] + prompt[:5]
    eng.reset()
    lg, _ = eng.prefill(prompt)
    greedy(lg)  # the reply (cold[1]) is now in the cache, written by decode steps
    lg, reused2 = eng.prefill(turn2)
    chat_hit = greedy(lg)
    eng.reset()
    chat_cold = greedy(eng.prefill(turn2)[0])
    tr = Transformer(src.config, src.tensors, CpuBackend(threads=2, exact_decode=True), 160)
    exact = tr.forward(np.asarray(prompt, np.int32), tr.new_cache(160, kv))[-1]
    return [cold, hit, stepped], [chat_hit, chat_cold], (reused, reused2), exact


def _check_engine(src, kv, n_prompt, k, n):
    prompt = _prompt(src, n_prompt)
    runs, chat, (reused, reused2), exact = _engine_runs(src, kv, prompt, k, n)
    assert reused == n_prompt - k and reused2 == n_prompt + n  # the hits happened
    for lg, toks in runs[1:]:
        assert np.array_equal(lg, runs[0][0]) and toks == runs[0][1]
    assert np.array_equal(chat[0][0], chat[1][0]) and chat[0][1] == chat[1][1]
    # control: float activations (exact_decode) give other logits, so equality means
    # something; the continuation is not a degenerate repeat of one token
    assert not np.array_equal(exact, runs[0][0])
    assert len(set(runs[0][1] + chat[0][1])) > 1


@pytest.mark.parametrize("kv", KVS)
def test_engine_cache_hit_same_greedy_stories(stories_int4, kv):
    _check_engine(stories_int4, kv, n_prompt=40, k=9, n=24)


@pytest.mark.parametrize("kv", KVS)
def test_engine_cache_hit_same_greedy_smollm2(smollm2_int4, kv):
    _check_engine(smollm2_int4, kv, n_prompt=37, k=6, n=12)


@pytest.mark.slow
def test_fidelity_vs_float_activations_smollm2(smollm2_int4):
    """Real text (WikiText-2 test, one 512-token chunk, second half scored): the integer
    linears' next-token distributions against float32 activations on the same INT4
    weights reach the decode issue's bound, KL <= 5e-4 and top-1 >= 99% (measured:
    benchmarks/act_fidelity.py); KL > 0: the two paths are really different."""
    from conftest import SHARED
    from edgeinfer.api import tokenizer_for
    from edgeinfer.perplexity import divergence

    text = SHARED / "data" / "wikitext-2" / "test.txt"
    if not text.exists():
        pytest.skip(f"WikiText-2 not found: {text}")
    src = smollm2_int4
    ids = tokenizer_for(src).encode(text.read_text(encoding="utf-8")[:20000],
                                    add_special=False, parse_special=False)[:512]
    ids = np.asarray(ids, np.int32)
    assert len(ids) == 512

    def logprobs(exact):
        tr = Transformer(src.config, src.tensors, CpuBackend(threads=2, exact_decode=exact), 512)
        lg = np.asarray(tr.forward(ids, tr.new_cache(512), all_logits=True)[256:511], np.float64)
        mx = lg.max(axis=1, keepdims=True)
        return lg - (np.log(np.exp(lg - mx).sum(axis=1, keepdims=True)) + mx)

    kl, same, n = divergence(logprobs(True), logprobs(False))
    assert n == 255 and 0 < kl / n <= 5e-4 and same / n >= 0.99
