"""The sampling chain: each filter's HF semantics on hand-built distributions, the
order of the chain (temperature before min-p, temperature 0 greedy), the defaults, and
the allocation-free Sampler picking the chain's tokens. The chain order and its
temperature-0 rule: https://github.com/ggml-org/llama.cpp/issues/4091."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
from sampling_cases import KINDS, bits, random_logits, random_params

from edgeinfer.sampling import (
    DEFAULTS,
    MODEL_FIELDS,
    Sampler,
    SamplingParams,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    apply_temperature,
    make_rng,
    min_p_filter,
    sample,
    sampling_defaults,
    top_k_filter,
    top_p_filter,
)


def kept(x: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(x)).tolist())


def draws(logits, params, n=400, seed=0) -> set[int]:
    rng = make_rng(seed)
    return {sample(logits, params, rng) for _ in range(n)}


# ---------------------------------------------------------------- the chain's order
def test_temperature_before_min_p():
    logits = np.log(np.array([0.80, 0.15, 0.05]))
    tempered = apply_temperature(logits, 2.0)
    p = np.exp(tempered - tempered.max())
    p /= p.sum()
    np.testing.assert_allclose(p, [0.594, 0.257, 0.149], atol=1e-3)
    # HF order (ours): temperature first -> min-p keeps all three
    assert kept(min_p_filter(tempered, 0.1)) == {0, 1, 2}
    # llama.cpp's order would keep {0, 1}: the set this runtime must NOT produce
    assert kept(min_p_filter(logits, 0.1)) == {0, 1}
    params = SamplingParams(temperature=2.0, min_p=0.1, top_k=0, top_p=1.0)
    assert draws(logits, params, n=600) == {0, 1, 2}


def test_temperature_zero_is_argmax_whatever_top_p_and_seed():
    logits = np.log(np.array([0.80, 0.15, 0.05]))
    for seed in (None, 0, 1, 12345):
        for top_p in (0.9, 0.01, 1.0):
            for top_k in (0, 1, 2):
                p = SamplingParams(temperature=0.0, top_p=top_p, top_k=top_k, seed=seed)
                assert sample(logits, p, make_rng(seed)) == 0
    # no division by zero, no warnings turned errors
    with np.errstate(all="raise"):
        assert sample(logits, SamplingParams(temperature=0.0), make_rng(0)) == 0


def test_greedy_equals_argmax_random_logits():
    rng = np.random.default_rng(7)
    params = SamplingParams(temperature=0.0)
    for _ in range(50):
        logits = rng.normal(size=1000).astype(np.float32)
        assert sample(logits, params, make_rng(None)) == int(np.argmax(logits))


def test_greedy_does_not_consume_randomness():
    logits = np.array([0.0, 3.0, 1.0])
    rng = make_rng(5)
    state = rng.bit_generator.state
    sample(logits, SamplingParams(temperature=0.0), rng)
    assert rng.bit_generator.state == state


# ---------------------------------------------------------------- filters
def test_top_k_kept_set():
    logits = np.array([1.0, 5.0, 3.0, 4.0, 2.0])
    assert kept(top_k_filter(logits, 2)) == {1, 3}
    assert kept(top_k_filter(logits, 1)) == {1}
    assert kept(top_k_filter(logits, 0)) == {0, 1, 2, 3, 4}  # disabled
    assert kept(top_k_filter(logits, 10)) == {0, 1, 2, 3, 4}
    # ties with the k-th value are kept (HF TopKLogitsWarper)
    assert kept(top_k_filter(np.array([3.0, 2.0, 2.0, 1.0]), 2)) == {0, 1, 2}
    out = top_k_filter(logits, 2)
    assert out[1] == 5.0 and out[3] == 4.0 and out.dtype == np.float64


def test_top_p_kept_set():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert kept(top_p_filter(logits, 0.75)) == {0, 1}    # 0.5 + 0.3 >= 0.75
    assert kept(top_p_filter(logits, 0.9)) == {0, 1, 2}  # 0.95 >= 0.9
    assert kept(top_p_filter(logits, 0.4)) == {0}        # the top token alone is enough
    assert kept(top_p_filter(logits, 0.01)) == {0}       # never empty
    assert kept(top_p_filter(logits, 1.0)) == {0, 1, 2, 3}
    # unsorted input, large vocabulary with a long flat tail
    big = np.full(50_000, -20.0)
    big[[17, 4242, 999]] = np.log([0.6, 0.3, 0.05])
    assert kept(top_p_filter(big, 0.85)) == {17, 4242}


def test_min_p_kept_set():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.04, 0.01]))
    assert kept(min_p_filter(logits, 0.1)) == {0, 1, 2}   # threshold 0.05
    assert kept(min_p_filter(logits, 0.5)) == {0, 1}      # threshold 0.25
    assert kept(min_p_filter(logits, 1.0)) == {0}
    assert kept(min_p_filter(logits, 0.0)) == {0, 1, 2, 3, 4}


def test_filters_do_not_modify_input():
    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    before = logits.copy()
    top_k_filter(logits, 1)
    top_p_filter(logits, 0.5)
    min_p_filter(logits, 0.5)
    apply_temperature(logits, 0.5)
    apply_repetition_penalty(logits, [0, 2], 1.3)
    sample(logits, SamplingParams(repetition_penalty=1.3), make_rng(0), history=[2])
    np.testing.assert_array_equal(logits, before)


def test_chain_top_k_then_top_p_sampling_support():
    # probs 0.4 0.3 0.2 0.1 ; top_k 3 -> renormalized 4/9 3/9 2/9 ; top_p 0.7 -> {0, 1}
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.7, min_p=0.0)
    assert draws(logits, params) == {0, 1}


def test_sampling_frequencies_follow_probabilities():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    rng = make_rng(42)
    counts = np.bincount([sample(logits, params, rng) for _ in range(6000)], minlength=3)
    np.testing.assert_allclose(counts / 6000, [0.6, 0.3, 0.1], atol=0.02)


# ---------------------------------------------------------------- determinism
def test_seed_determinism():
    logits = np.random.default_rng(3).normal(size=5000)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=2024)
    a = [sample(logits, params, r) for r in [make_rng(params.seed)] for _ in range(50)]
    b = [sample(logits, params, r) for r in [make_rng(params.seed)] for _ in range(50)]
    c = [sample(logits, params, r) for r in [make_rng(params.seed + 1)] for _ in range(50)]
    assert a == b
    assert a != c
    assert len(set(a)) > 10  # really random, not stuck on one id


# ---------------------------------------------------------------- penalties
def test_repetition_penalty_values():
    logits = np.array([2.0, -2.0, 1.0, -1.0, 0.5])
    out = apply_repetition_penalty(logits, [0, 1, 0, 1, 1], 2.0)  # repeats counted once
    np.testing.assert_array_equal(out, [1.0, -4.0, 1.0, -1.0, 0.5])
    np.testing.assert_array_equal(apply_repetition_penalty(logits, [], 2.0), logits)
    np.testing.assert_array_equal(apply_repetition_penalty(logits, [2, 3], 1.0), logits)
    with pytest.raises(ValueError, match="0, 5"):
        apply_repetition_penalty(logits, [5], 1.2)


def test_presence_frequency_penalty_values():
    logits = np.zeros(4)
    out = apply_presence_frequency_penalty(logits, [1, 1, 1, 2], presence=0.5, frequency=0.25)
    np.testing.assert_allclose(out, [0.0, -(3 * 0.25 + 0.5), -(0.25 + 0.5), 0.0])


def test_penalties_apply_in_greedy_and_respect_last_n():
    logits = np.array([3.0, 2.9, 0.0])
    history = [0] + [2] * 10
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5, penalty_last_n=-1)
    assert sample(logits, p, make_rng(0), history=history) == 1  # 3.0/1.5 = 2.0 < 2.9
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5, penalty_last_n=5)
    assert sample(logits, p, make_rng(0), history=history) == 0  # id 0 is outside the window
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5, penalty_last_n=0)
    assert sample(logits, p, make_rng(0), history=history) == 0  # penalties off


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"penalty_last_n": -2}, "penalty_last_n"),
    ({"seed": -1}, "seed"),
    ({"presence_penalty": float("inf")}, "presence_penalty"),
])
def test_invalid_params_raise(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_defaults_are_llama_cpp_like():
    assert SamplingParams() == DEFAULTS
    p = DEFAULTS
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
            p.frequency_penalty, p.penalty_last_n, p.seed) == (0.8, 40, 0.95, 0.05, 1.0, 0.0,
                                                              0.0, 64, None)


def test_sampling_defaults_lay_the_generation_config_over_defaults():
    assert sampling_defaults(None) == sampling_defaults({}) == {
        "temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.0}
    got = sampling_defaults({"temperature": 0.2, "top_p": 0.9, "eos_token_id": [2]})
    assert got == {**sampling_defaults(None), "temperature": 0.2, "top_p": 0.9}
    assert sampling_defaults({"do_sample": False, "temperature": 0.6})["temperature"] == 0.0
    # a value the sampler refuses is ignored, not fatal; the others still apply
    assert sampling_defaults({"temperature": -1, "top_k": 20}) == {**sampling_defaults(None),
                                                                   "top_k": 20}
    assert sampling_defaults({"top_k": True, "min_p": "0.2"}) == sampling_defaults(None)
    # another base: the keys the config does not set come from it
    base = SamplingParams(temperature=0.3, repetition_penalty=1.1)
    assert sampling_defaults({"temperature": 0.7}, base) == {
        "temperature": 0.7, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}
    assert set(sampling_defaults(None)) == set(MODEL_FIELDS)


def test_bad_logits_raise():
    params = SamplingParams()
    with pytest.raises(ValueError, match="NaN"):
        sample(np.array([0.0, math.nan]), params, make_rng(0))
    with pytest.raises(ValueError, match="1-D"):
        sample(np.zeros((2, 3)), params, make_rng(0))
    with pytest.raises(ValueError, match="-inf"):
        sample(np.full(3, -np.inf), params, make_rng(0))
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(np.zeros(3), 0.0)


def test_large_vocab_is_fast_enough():
    import time
    logits = np.random.default_rng(0).normal(size=262_144).astype(np.float32) * 3
    params = SamplingParams(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, seed=1)
    rng = make_rng(1)
    t0 = time.perf_counter()
    for _ in range(5):
        tok = sample(logits, params, rng)
    per_call = (time.perf_counter() - t0) / 5
    assert 0 <= tok < 262_144
    assert per_call < 0.5  # generous: the full-vocabulary nucleus path, no top-k


# ---------------------------------------------------------------- Sampler == the chain
# ``sample`` is the chain of the numpy references (edgeinfer/sampling_steps.py);
# test_sampling_kernels checks each of the Sampler's kernels against its reference.
@pytest.mark.parametrize("vocab, cases", [(1, 40), (2, 80), (7, 300), (100, 200), (49152, 30)])
def test_sampler_picks_the_reference_chains_tokens(vocab, cases):
    """Same ids as the chain of references, for random logits (ties, -inf, huge values,
    float16 / 32 / 64), settings and seeds, over several steps whose ids feed the penalty
    window (short windows make ids leave it). Each draw's support (ids and cumulative
    weights) is bit-identical too, so no draw can differ, not only these ones."""
    from edgeinfer.sampling_steps import draw_support
    g = np.random.default_rng(vocab)
    for case in range(cases):
        dtype = [np.float32, np.float64, np.float16][case % 3]
        kind = KINDS[case % len(KINDS)]
        params = random_params(g, vocab)
        history = g.integers(0, vocab, size=int(g.integers(0, 12))).tolist()
        seed = int(g.integers(2**32))
        ref_rng, rng = make_rng(seed), make_rng(seed)
        s = Sampler(vocab)
        s.start(params, history)
        for step in range(6):
            logits = random_logits(g, vocab, kind, dtype)
            try:
                want = sample(logits, params, ref_rng, history)
            except ValueError as e:  # (overflow of huge logits at a low temperature)
                with pytest.raises(ValueError, match=re.escape(str(e))):
                    s.sample(logits, rng)
                break
            assert s.sample(logits, rng) == want, (case, step, kind, params)
            if params.temperature > 0:
                ids, cdf = s.support()
                x = _chain_last_vector(logits, params, history)
                want_ids, want_cdf = draw_support(x)
                np.testing.assert_array_equal(ids, want_ids)
                np.testing.assert_array_equal(bits(cdf), bits(want_cdf))
            history.append(want)
            s.accept(want)
        assert rng.bit_generator.state == ref_rng.bit_generator.state  # same draws


def _chain_last_vector(logits, params, history):
    """The vector the chain draws from (every step before ``draw``), for support checks."""
    from edgeinfer import sampling_steps as ref
    ids = ref.penalty_window(history, params.penalty_last_n, logits.size)
    x = ref.apply_repetition_penalty(logits, ids, params.repetition_penalty)
    x = ref.apply_presence_frequency_penalty(x, ids, params.presence_penalty,
                                             params.frequency_penalty)
    x = ref.apply_temperature(x, params.temperature)
    return ref.min_p_filter(ref.top_p_filter(ref.top_k_filter(x, params.top_k), params.top_p),
                            params.min_p)


def test_sampler_reuse_across_streams_and_errors_match():
    g = np.random.default_rng(5)
    s = Sampler(50)
    for _ in range(30):  # one workspace, many streams with different settings
        params = random_params(g, 50)
        history = g.integers(0, 50, size=int(g.integers(0, 80))).tolist()
        s.start(params, history)
        logits = g.normal(size=50)
        assert s.sample(logits, make_rng(1)) == sample(logits, params, make_rng(1), history)
    pen = SamplingParams(repetition_penalty=1.2, penalty_last_n=-1)
    for bad, needle in (([0.0, math.nan], "NaN"), ([0.0, math.inf], "NaN or \\+inf"),
                        ([-math.inf, -math.inf], "-inf")):
        with pytest.raises(ValueError, match=needle):
            sample(np.array(bad), pen, make_rng(0), [1])
        s = Sampler(2)
        s.start(pen, [1])
        with pytest.raises(ValueError, match=needle):
            s.sample(np.array(bad), make_rng(0))
    # penalties that push every finite logit to -inf: both refuse
    huge = np.array([-1e308, -1e308])
    params = SamplingParams(repetition_penalty=2.0, penalty_last_n=-1)
    with pytest.raises(ValueError, match="-inf"), np.errstate(all="ignore"):
        sample(huge, params, make_rng(0), [0, 1])
    s.start(params, [0, 1])
    with pytest.raises(ValueError, match="-inf"):
        s.sample(huge, make_rng(0))
    with pytest.raises(ValueError, match="0, 2"):
        s.accept(2)
    with pytest.raises(ValueError, match=r"\[2\]"):
        s.sample(np.zeros(3), make_rng(0))


def test_overflow_after_temperature_raises_a_clear_error():
    """float64 logits near 1e308 divided by a temperature < 1 overflow to +inf: both the
    chain and the Sampler refuse with the same message (not an IndexError, not NaNs)."""
    logits = np.array([1.7e308, 1.0, 0.0])
    params = SamplingParams(temperature=0.5, top_k=0, top_p=0.9, min_p=0.0)
    with pytest.raises(ValueError, match="overflow"), np.errstate(all="ignore"):
        sample(logits, params, make_rng(0))
    s = Sampler(3)
    s.start(params)
    with pytest.raises(ValueError, match="overflow"):
        s.sample(logits, make_rng(0))
