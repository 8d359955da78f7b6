"""Samplers on hand-built distributions (case C24 and the HF semantics of each filter)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from edgeinfer.sampling import (
    SamplingParams, apply_presence_frequency_penalty, apply_repetition_penalty,
    apply_temperature, make_rng, min_p_filter, sample, top_k_filter, top_p_filter,
)


def kept(x: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(x)).tolist())


def draws(logits, params, n=400, seed=0) -> set[int]:
    rng = make_rng(seed)
    return {sample(logits, params, rng) for _ in range(n)}


# ---------------------------------------------------------------- C24
def test_c24_temperature_before_min_p():
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


def test_c24_temperature_zero_is_argmax_whatever_top_p_and_seed():
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
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.01), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(penalty_last_n=-2), "penalty_last_n"),
    (dict(seed=-1), "seed"),
    (dict(presence_penalty=float("inf")), "presence_penalty"),
])
def test_invalid_params_raise(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_defaults_are_llama_cpp_like():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.seed) == \
        (0.8, 40, 0.95, 0.05, 1.0, None)


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
