"""Each allocation-free step of :class:`edgeinfer.sampling.Sampler` against its numpy
reference in :mod:`edgeinfer.sampling_steps`, bit for bit, on random inputs: logits
(ties, -inf, huge, float16/32/64), candidate sets, settings, histories and generator
states. Together with test_sampling's chain test, this is what keeps the Sampler's
token choices those of :func:`edgeinfer.sampling.sample`."""
from __future__ import annotations

import math

import numpy as np
import pytest
from sampling_cases import KINDS, bits, candidates, random_logits, random_params

from edgeinfer import sampling_steps as ref
from edgeinfer.sampling import Sampler, SamplingParams

DTYPES = (np.float32, np.float64, np.float16)


def _sampler(vocab: int, params: SamplingParams, history=()) -> Sampler:
    s = Sampler(vocab)
    s.start(params, history)
    return s


# ---------------------------------------------------------------- penalty window
@pytest.mark.parametrize("vocab", [1, 5, 300])
def test_window_kernel_holds_the_reference_window(vocab):
    """_window_push / _window_clear (start + accept) keep counts and the distinct-id list
    of ``penalty_window(history, last_n)`` as ids arrive and leave the ring."""
    g = np.random.default_rng(vocab)
    s = Sampler(vocab)
    for _ in range(150):
        last_n = int(g.choice([-1, 1, 2, 7, 64]))
        params = SamplingParams(repetition_penalty=1.1, penalty_last_n=last_n)
        history = g.integers(0, vocab, size=int(g.integers(0, 90))).tolist()
        s.start(params, history)  # one workspace for every stream: clear must be complete
        for step in range(int(g.integers(0, 40))):
            if step:
                tok = int(g.integers(vocab))
                history.append(tok)
                s.accept(tok)
            window = ref.penalty_window(history, last_n, vocab)
            np.testing.assert_array_equal(s.counts, np.bincount(window, minlength=vocab))
            nd = int(s.state[0])
            distinct = s.distinct[:nd]
            np.testing.assert_array_equal(np.sort(distinct), np.unique(window))
            np.testing.assert_array_equal(s.where[distinct], np.arange(nd))


def test_penalty_window_reference():
    assert ref.penalty_window([1, 2, 3, 2], 2, 4).tolist() == [3, 2]
    assert ref.penalty_window([1, 2, 3, 2], -1, 4).tolist() == [1, 2, 3, 2]
    assert ref.penalty_window([1, 2, 3, 2], 0, 4).tolist() == []
    assert ref.penalty_window([1, 2], 9, 4).tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        ref.penalty_window([4], 2, 4)


# ---------------------------------------------------------------- penalties
def _ref_penalize(logits, params, history) -> np.ndarray | str:
    """The references' penalty step, or the error message it ends in."""
    x = np.asarray(logits)
    if np.isnan(x).any() or np.isposinf(x).any():
        return ref.BAD_LOGITS
    if params.penalized:
        ids = ref.penalty_window(history, params.penalty_last_n, x.size)
        x = ref.apply_repetition_penalty(x, ids, params.repetition_penalty)
        x = ref.apply_presence_frequency_penalty(x, ids, params.presence_penalty,
                                                 params.frequency_penalty)
        if np.isnan(x).any():
            return ref.BAD_LOGITS
    x = np.asarray(x, np.float64)
    return ref.ALL_MASKED if x.max() == -np.inf else x


@pytest.mark.parametrize("vocab, cases", [(1, 60), (3, 300), (50, 600), (4099, 60)])
def test_penalty_kernel_matches_the_references(vocab, cases):
    """_load_penalize (load as float64, reject NaN/+inf, repetition then presence /
    frequency over the window) == apply_repetition_penalty -> apply_presence_frequency_
    penalty, bitwise; the same errors (NaN, +inf, all -inf, penalties overflowing)."""
    g = np.random.default_rng(100 + vocab)
    seen = set()
    for case in range(cases):
        dtype = DTYPES[case % 3]
        kind = KINDS[case % len(KINDS)]
        params = random_params(g, vocab)
        x = random_logits(g, vocab, kind, dtype)
        if case % 7 == 0:  # NaN / +inf from the model
            x[g.integers(vocab)] = g.choice([np.nan, np.inf])
        history = g.integers(0, vocab, size=int(g.integers(0, 20))).tolist()
        if case % 4 == 0:  # extreme penalties on every id twice: overflow to -inf (all
            # masked), to +inf, and NaN from -inf - -inf
            params = SamplingParams(repetition_penalty=float(g.choice([1e-300, 1e300, 2.0])),
                                    presence_penalty=float(g.choice([0.0, 1e308, -1e308])),
                                    frequency_penalty=float(g.choice([0.0, -1e308, 1e308])),
                                    penalty_last_n=-1)
            history = g.permutation(2 * list(range(vocab))).tolist()
        s = _sampler(vocab, params, history)
        if params.temperature == 0 and not params.penalized:
            continue  # the greedy path has no penalty step
        with np.errstate(all="ignore"):
            want = _ref_penalize(x, params, history)
            try:
                s._penalize(x)
                got = s.x[:vocab]
            except ValueError as e:
                got = str(e)
        if isinstance(want, str):
            assert got == want, (case, params)
            seen.add("bad input" if np.isnan(x).any() or np.isposinf(x).any() else want)
        else:
            assert not isinstance(got, str), (case, got, params)
            np.testing.assert_array_equal(bits(got), bits(want))
            seen.add("ok")
    if vocab >= 3:  # every outcome was met (not only the easy one)
        assert seen >= {"ok", "bad input", ref.BAD_LOGITS, ref.ALL_MASKED}, seen


# ---------------------------------------------------------------- temperature + top-k
@pytest.mark.parametrize("vocab, cases", [(1, 30), (2, 100), (9, 400), (200, 400), (49152, 12)])
def test_temperature_top_k_kernel_matches_the_references(vocab, cases):
    """_temper_top_k: the tempered vector == apply_temperature, bitwise; its candidates
    (ids, values) == top_k_filter's survivors; the max it returns is theirs."""
    g = np.random.default_rng(200 + vocab)
    heap, idx, vals, scratch = np.zeros(vocab + 5), np.zeros(vocab, np.int64), \
        np.zeros(vocab), np.zeros(vocab)
    from edgeinfer._sampling_kernels import _temper_top_k
    reciprocal = 0
    for case in range(cases):
        x = random_logits(g, vocab, KINDS[case % len(KINDS)], np.float64)
        if case % 5 == 0 and vocab > 1:
            x = x[::-1].copy()  # descending: the heap's early exits
        temperature = float(g.choice([0.25, 0.7, 1.0, 1.7, 3e-5]))
        k = int(g.choice([0, 1, 2, 3, 40, 1000, vocab - 1, vocab, vocab + 5]))
        with np.errstate(all="ignore"):
            tempered = ref.apply_temperature(x, temperature)
            want_ids, want_vals = candidates(ref.top_k_filter(tempered, k))
            xw = x.copy()
            n, m = _temper_top_k(xw, temperature, k, heap, idx, vals, scratch)
        np.testing.assert_array_equal(bits(xw), bits(tempered))
        np.testing.assert_array_equal(idx[:n], want_ids, err_msg=f"{case} k={k}")
        np.testing.assert_array_equal(bits(vals[:n]), bits(want_vals))
        assert m == (want_vals.max() if n else -np.inf)
        with np.errstate(all="ignore"):  # negative control: the bitwise check sees a
            reciprocal += (bits(x * (1.0 / temperature)) != bits(tempered)).any()  # 1-ulp change
    assert reciprocal > 0 or vocab < 200


@pytest.mark.parametrize("order", ["ascending", "descending", "organ"])
def test_top_k_kernel_adversarial_orders(order):
    """Ascending logits make every id replace the heap's minimum (the quickselect
    fallback runs); descending and organ-pipe ones stress the heap's early exits."""
    from edgeinfer._sampling_kernels import _temper_top_k
    g = np.random.default_rng(1)
    x = np.sort(np.round(g.normal(size=49152) * 3, 2))
    x = {"ascending": x, "descending": x[::-1].copy(),
         "organ": np.concatenate([x[::2], x[1::2][::-1]])}[order]
    idx, vals, scratch = np.zeros(x.size, np.int64), np.zeros(x.size), np.zeros(x.size)
    for k in (1, 40, 1000):
        xw = x.copy()
        n, m = _temper_top_k(xw, 0.7, k, np.zeros(k), idx, vals, scratch)
        want_ids, want_vals = candidates(ref.top_k_filter(ref.apply_temperature(x, 0.7), k))
        np.testing.assert_array_equal(idx[:n], want_ids)
        np.testing.assert_array_equal(bits(vals[:n]), bits(want_vals))


def test_kth_largest_quickselect_matches_partition():
    """The quickselect behind top-k's fallback == np.partition's k-th largest."""
    from edgeinfer._sampling_kernels import _kth_largest
    g = np.random.default_rng(9)
    for _ in range(400):
        n = int(g.integers(1, 300))
        a = np.round(g.normal(size=n) * g.choice([0.3, 5.0]))  # many ties
        a[g.random(n) < 0.2] = -np.inf
        if g.random() < 0.3:
            a = np.sort(a)[::-1 if g.random() < 0.5 else 1].copy()
        k = int(g.integers(1, n + 1))
        assert _kth_largest(a.copy(), k) == np.partition(a, n - k)[n - k]


# ---------------------------------------------------------------- top-p, min-p
def _random_candidates(g, vocab, kind):
    """A random candidate set as the Sampler holds it (ascending ids, their values) and
    the same set as a [V] vector with -inf elsewhere."""
    x = random_logits(g, vocab, kind, np.float64)
    x[g.random(vocab) < g.choice([0.0, 0.5, 0.95])] = -np.inf
    if not (x > -np.inf).any():
        x[g.integers(vocab)] = float(g.normal())
    if kind == "huge":
        x = np.clip(x, -1e300, 1e300)
    return x, *candidates(x)


def _load_candidates(s: Sampler, ids, vals) -> tuple[int, float]:
    s.idx[:ids.size] = ids
    s.vals[:ids.size] = vals
    return ids.size, float(vals.max())


@pytest.mark.parametrize("vocab, cases", [(1, 20), (2, 100), (13, 600), (500, 300), (49152, 10)])
def test_top_p_step_matches_top_p_filter(vocab, cases):
    """Sampler._top_p (numpy out= softmax, cumsum and sort; Numba gather and compaction)
    keeps exactly top_p_filter's survivors, ties at the boundary included."""
    g = np.random.default_rng(300 + vocab)
    s = _sampler(vocab, SamplingParams(temperature=1.0))
    for case in range(cases):
        x, ids, vals = _random_candidates(g, vocab, KINDS[case % len(KINDS)])
        top_p = float(g.choice([0.999, 0.95, 0.9, 0.5, 0.3, 0.05, 1e-9]))
        n, m = s._top_p(*_load_candidates(s, ids, vals), top_p)
        want_ids, want_vals = candidates(ref.top_p_filter(x, top_p))
        np.testing.assert_array_equal(s.idx[:n], want_ids, err_msg=f"{case} top_p={top_p}")
        np.testing.assert_array_equal(bits(s.vals[:n]), bits(want_vals))
        assert m == want_vals.max()


@pytest.mark.parametrize("vocab, cases", [(1, 20), (7, 500), (3000, 100)])
def test_min_p_kernel_matches_min_p_filter(vocab, cases):
    from edgeinfer._sampling_kernels import _min_p_compact
    g = np.random.default_rng(400 + vocab)
    s = _sampler(vocab, SamplingParams(temperature=1.0))
    for case in range(cases):
        x, ids, vals = _random_candidates(g, vocab, KINDS[case % len(KINDS)])
        min_p = float(g.choice([1e-12, 0.05, 0.1, 0.5, 0.99, 1.0]))
        n, m = _load_candidates(s, ids, vals)
        n, m = _min_p_compact(s.idx, s.vals, n, m + math.log(min_p))
        want_ids, want_vals = candidates(ref.min_p_filter(x, min_p))
        np.testing.assert_array_equal(s.idx[:n], want_ids)
        np.testing.assert_array_equal(bits(s.vals[:n]), bits(want_vals))
        assert m == want_vals.max()


# ---------------------------------------------------------------- the draw, greedy
class _Fixed:
    """A stand-in generator whose one ``random()`` is ``u``."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize("vocab, cases", [(1, 20), (4, 300), (100, 300), (49152, 8)])
def test_draw_step_matches_draw(vocab, cases):
    """Sampler._draw == draw for random candidate sets and generator states: the same id,
    and the same support (ids and cumulative weights, bitwise), so no uniform number
    could pick differently. Also at u = 0 and the largest float below 1."""
    g = np.random.default_rng(500 + vocab)
    s = _sampler(vocab, SamplingParams(temperature=1.0))
    for case in range(cases):
        x, ids, vals = _random_candidates(g, vocab, KINDS[case % len(KINDS)])
        seed = int(g.integers(2**63))
        want_ids, want_cdf = ref.draw_support(x)
        for u_rng, ref_rng in [(np.random.default_rng(seed), np.random.default_rng(seed)),
                               (_Fixed(0.0), _Fixed(0.0)),
                               (_Fixed(1 - 2**-53), _Fixed(1 - 2**-53))]:
            got = s._draw(*_load_candidates(s, ids, vals), u_rng.random())
            assert got == ref.draw(x, ref_rng), case
            got_ids, got_cdf = s.support()
            np.testing.assert_array_equal(got_ids, want_ids)
            np.testing.assert_array_equal(bits(got_cdf), bits(want_cdf))
        assert u_rng.random() == ref_rng.random()  # (stand-ins: same u; else same state)


def test_draw_frequencies_follow_the_softmax():
    """Positive control for the reference draw itself."""
    x = np.log(np.array([0.6, 0.3, 0.1, 0.0]))
    rng = np.random.default_rng(42)
    counts = np.bincount([ref.draw(x, rng) for _ in range(6000)], minlength=4)
    np.testing.assert_allclose(counts / 6000, [0.6, 0.3, 0.1, 0.0], atol=0.02)
    assert counts[3] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_step_matches_argmax(dtype):
    """The unpenalized greedy path (argmax into a 0-d buffer, the logits' own dtype) and
    the penalized one (argmax of the float64 working copy) == argmax of float64 logits."""
    g = np.random.default_rng(7)
    vocab = 257
    plain = _sampler(vocab, SamplingParams(temperature=0.0))
    pen = SamplingParams(temperature=0.0, repetition_penalty=1.3, penalty_last_n=-1)
    for case in range(300):
        x = random_logits(g, vocab, KINDS[case % len(KINDS)], dtype)
        want = int(np.argmax(x.astype(np.float64)))
        assert plain.sample(x, None) == ref.greedy(x) == want
        hist = g.integers(0, vocab, size=3).tolist()
        want = _ref_penalize(x, pen, hist)
        got = _sampler(vocab, pen, hist).sample(x, None)
        assert got == int(np.argmax(want))
    with pytest.raises(ValueError, match="NaN"):
        ref.greedy(np.array([0.0, np.nan], dtype))
    with pytest.raises(ValueError, match="-inf"):
        ref.greedy(np.full(3, -np.inf, dtype))
