"""Speculative decoding's drafting and ``auto``'s cost model (edgeinfer/speculative.py),
without a model: the n-gram index's run matching, and CostModel's on / off and k choices
from injected fake timings (noisy, with outliers), which must be right, stable (no
flapping) and deterministic. The drafting end to end runs on benchmarks/speculative.py's
ReplayEngine (a known greedy continuation, forward calls counted)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from edgeinfer.speculative import (
    EXPLORE,
    EXPLORE_MAX,
    K_MIN,
    K_START,
    LONG_RUN,
    MIN_DECODES,
    REFRESH,
    RUN_MAX,
    CostModel,
    NgramIndex,
)

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "speculative.py"
_spec = importlib.util.spec_from_file_location("bench_speculative", _BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


# ---- the n-gram index -----------------------------------------------------------------
def test_match_prefers_the_longest_run_then_the_latest():
    # "1 2 3" occurs twice before the end: at 4..6 after [7, 8, 9] (the end's run is
    # 7 8 9 1 2 3: 6 ids), and at 10..12 after [5, 6] (run 3): the longer run wins
    ids = [0, 7, 8, 9, 1, 2, 3, 40, 5, 6, 1, 2, 3, 41, 7, 8, 9, 1, 2, 3]
    idx = NgramIndex(ids)
    j, run = idx.match()
    assert (j, run) == (7, 6) and idx.ids[j] == 40
    # control: the plain latest occurrence would have continued with 41
    assert idx.maps[3][(1, 2, 3)][-1] == 13 and ids[13] == 41
    # a tie (both runs 3): the latest
    idx = NgramIndex([5, 1, 2, 3, 40, 6, 1, 2, 3, 41, 7, 1, 2, 3])
    assert idx.match() == (9, 3)
    assert NgramIndex([1, 2, 3]).match() == (-1, 0)       # the suffix never matches itself


def test_match_run_is_capped_and_candidates_bounded():
    block = list(range(100, 100 + RUN_MAX + 10))
    idx = NgramIndex(block + [1] + block)
    j, run = idx.match()
    assert run == RUN_MAX and idx.ids[j] == 1              # counted back RUN_MAX ids only
    idx = NgramIndex([1, 2] * 20)
    assert all(len(v) <= 4 for m in idx.maps[1:] for v in m.values())


def test_draft_extends_to_the_run():
    text = list(range(10, 40))
    idx = NgramIndex(text + [99] + text[:12])
    assert idx.draft(4) == text[12:16]                     # the policy's k alone
    assert idx.draft(4, k_run=32) == text[12:24]           # the 12-id run: 12 drafts
    assert idx.draft(4, k_run=8) == text[12:20]            # capped


# ---- the cost model, on injected timings ------------------------------------------------
def _noisy(rng, base, n_out=0.1):
    """``base`` seconds with 5% jitter, and 1 in 10 a 3-8x outlier (another process)."""
    t = base * (1 + 0.05 * rng.standard_normal())
    return t * rng.uniform(3, 8) if rng.random() < n_out else t


def _drive(cm, rng, calls, c1, fixed, slope, accept, k_cap=16, run=0, ons=None):
    """``calls`` decisions: each refusal times a decode step, each k > 0 a verify of k
    drafts costing c1 + fixed + slope * k (noisy) of which ``accept(k)`` are accepted.
    Returns the decisions; ``ons`` gets the on / off state after each."""
    ks = []
    for _ in range(calls):
        k = cm.best_k(k_cap, run)
        ks.append(k)
        if ons is not None:
            ons.append(cm.classes[run >= LONG_RUN].on)
        if k == 0:
            cm.decode_time(_noisy(rng, c1))
        else:
            cm.verify_time(k, _noisy(rng, c1 + fixed + slope * k), accept(k), run)
    return ks


def _flips(ons):
    return sum(a != b for a, b in zip(ons, ons[1:]))


def test_cost_model_times_decode_steps_first():
    cm = CostModel()
    for _ in range(MIN_DECODES):
        assert cm.best_k(8) == 0
        cm.decode_time(0.01)
    assert cm.best_k(8) >= K_MIN        # prior: a draft costs 0.15 of a step, alpha 2/3
    assert cm.best_k(1) == 0            # no room for K_MIN drafts


def test_cost_model_cheap_verifies_long_runs_draft_the_cap():
    rng = np.random.default_rng(0)
    cm = CostModel()
    ons = []
    ks = _drive(cm, rng, 300, 0.010, 0.002, 0.001, accept=lambda k: k, ons=ons)
    assert all(ons)                                         # on from the start, never off
    tail = ks[MIN_DECODES + 10:]
    assert set(tail) == {16, 0}                             # k grows with the evidence
    # the only decode steps: one per REFRESH verifies, to keep c1 current
    assert tail.count(0) == pytest.approx(len(tail) / (REFRESH + 1), abs=1)
    c1, fixed, slope = cm.costs()
    assert c1 == pytest.approx(0.010, rel=0.05)             # outliers move no median
    assert slope == pytest.approx(0.001, rel=0.5) and 0 <= fixed < 0.004


def test_cost_model_dear_verifies_turn_off_and_explore_ever_less():
    """A draft costing a whole decode step never pays: off after the first verifies, then
    one exploring verify per EXPLORE, 2 EXPLORE, ... EXPLORE_MAX refusals."""
    rng = np.random.default_rng(1)
    cm = CostModel()
    ks = _drive(cm, rng, 2000, 0.010, 0.0, 0.010, accept=lambda k: k // 2)
    verifies = [i for i, k in enumerate(ks) if k]
    assert len(verifies) < 16
    tail = [b - a for a, b in zip(verifies, verifies[1:])][-3:]
    assert all(EXPLORE_MAX <= g <= EXPLORE_MAX + 1 for g in tail), tail
    assert all(ks[i] == 16 for i in verifies[-5:])        # explores at the policy's k
    assert not cm.classes[0].on


def test_cost_model_near_break_even_does_not_flap():
    """Verifies that pay about 3% (inside the hysteresis band), very noisy timings: the
    state changes at most once in 1000 decisions, and the same timings give the same
    decisions (deterministic)."""
    def run(seed):
        rng = np.random.default_rng(seed)
        cm, ons = CostModel(), []
        # k = 4 fully accepted: 5 tokens for 1 + 4 * 0.96 steps -> gain 1.03
        ks = _drive(cm, rng, 1000, 0.010, 0.0, 0.0096, accept=lambda k: min(k, 4),
                    k_cap=4, ons=ons)
        return ks, ons
    for seed in range(4):
        ks, ons = run(seed)
        assert _flips(ons) <= 1, seed
        assert (ks, ons) == run(seed)
    # control: the same noise with a clear loss flips off, and stays off
    rng = np.random.default_rng(0)
    ks = _drive(CostModel(), rng, 1000, 0.010, 0.0, 0.02, accept=lambda k: min(k, 4), k_cap=4)
    assert sum(ks[-500:]) < 5 * 4


def test_cost_model_picks_k_from_the_accepted_runs():
    """Every draft run breaks after exactly 5 accepted ids: k = 5 maximizes tokens per
    second (more drafts cost rows and add nothing)."""
    rng = np.random.default_rng(2)
    cm = CostModel()
    ks = _drive(cm, rng, 200, 0.010, 0.0, 0.0005, accept=lambda k: min(k, 5), k_cap=16)
    # 5, and cheap probes past it (a row costs 0.05 of a step) once the window has
    # forgotten the breaks at 6
    tail = [k for k in ks[-100:] if k]                     # (0: a refresh decode step)
    assert min(tail) == 5 and np.median(tail) == 5 and np.mean(tail) < 7
    # a per-draft rate (one alpha) would not see the break at 5: it favours longer k
    alpha = 5 / 6
    rates = [(1 - alpha ** (k + 1)) / (1 - alpha) / (1 + 0.05 * k) for k in range(2, 17)]
    assert 2 + int(np.argmax(rates)) > 7


def test_cost_model_fits_fixed_and_per_draft_cost():
    """Verifies at k = 4, 8, 16 costing 10 ms + 3 ms + 0.5 ms * k, one 10x outlier: the
    Theil-Sen fit recovers both terms."""
    cm = CostModel()
    for _ in range(5):
        cm.decode_time(0.010)
    for i, k in enumerate([4, 8, 16] * 5):
        cm.verify_time(k, (0.013 + 0.0005 * k) * (10 if i == 7 else 1), k)
    c1, fixed, slope = cm.costs()
    assert c1 == 0.010
    assert slope == pytest.approx(0.0005, rel=1e-6) and fixed == pytest.approx(0.003, rel=1e-6)


@pytest.mark.parametrize("slope, on", [(0.001, True), (0.012, False)])
def test_cost_model_rides_out_a_load_burst(slope, on):
    """Everything 2.5x slower for 150 decisions (another process), then normal again:
    a clear choice (drafting pays 8x / loses) does not change."""
    rng = np.random.default_rng(3)
    cm, ons = CostModel(), []
    _drive(cm, rng, 100, 0.010, 0.0, slope, accept=lambda k: k, ons=ons)
    _drive(cm, rng, 150, 0.025, 0.0, 2.5 * slope, accept=lambda k: k, ons=ons)
    _drive(cm, rng, 150, 0.010, 0.0, slope, accept=lambda k: k, ons=ons)
    assert ons[20:] == [on] * 380


def test_cost_model_keeps_long_and_short_runs_apart():
    """Short matches always rejected, long ones always accepted: drafts from a short
    match turn off, drafts from a long one stay on."""
    rng = np.random.default_rng(4)
    cm = CostModel()
    for _ in range(300):
        for run, acc in ((1, lambda k: 0), (LONG_RUN, lambda k: k)):
            _drive(cm, rng, 1, 0.010, 0.0, 0.003, accept=acc, k_cap=8, run=run)
    assert not cm.classes[0].on and cm.classes[1].on
    assert cm.best_k(8, LONG_RUN) == 8


# ---- drafting end to end, replayed ----------------------------------------------------
def _copy_case():
    """A prompt holding a 200-id text, and an output that copies it with one change."""
    rng = np.random.default_rng(5)
    text = [int(t) for t in rng.integers(1000, 5000, 200)]
    prompt = [1, 2, 3] + text + [4, 5]
    output = text[:80] + [9999] + text[81:]
    return prompt, output


@pytest.mark.parametrize("mode", ["ngram", "auto"])
def test_replay_copy_drafts_long_runs(mode):
    """Copying a prompt text: the drafts grow with the matched run past the policy's k,
    so 200 tokens take few forwards; the replay checks every token (greedy identity)."""
    prompt, output = _copy_case()
    r = bench.replay(prompt, output, mode, bench.linear_cost(0.1))
    assert r["accepted"] >= 180 and r["forwards"] <= 20
    assert r["speedup"] > 4
    eng = bench.ReplayEngine(prompt, output, bench.linear_cost(0.1))
    assert eng.cost(1) == 1.0
    # control: drafting capped at the policy's first k needs many more forwards
    from edgeinfer import speculative
    capped = speculative.Speculator.__init__.__defaults__
    try:
        speculative.Speculator.__init__.__defaults__ = (K_START, *capped[1:])
        r4 = bench.replay(prompt, output, mode, bench.linear_cost(0.1))
    finally:
        speculative.Speculator.__init__.__defaults__ = capped
    assert r4["forwards"] >= 2 * r["forwards"]


def test_replay_auto_declines_when_verifies_cost_a_step_per_draft():
    prompt, output = _copy_case()
    r = bench.replay(prompt, output, "auto", bench.linear_cost(1.5))
    assert r["verifies"] <= 6 and r["speedup"] > 0.9  # the first verifies, explorations
    r = bench.replay(prompt, output, "ngram", bench.linear_cost(1.5))
    assert r["speedup"] < 0.8  # control: drafting anyway loses


def test_replay_checks_every_token(monkeypatch):
    prompt, output = _copy_case()
    eng = bench.ReplayEngine(prompt, output, bench.linear_cost(0.1))
    rows = eng.forward([output[0], *output[1:4]], eng.cache)
    assert [int(r[0]) for r in rows] == output[1:5] and eng.t == pytest.approx(1.3)
    # control: one wrong row from the speculator fails the replay
    orig, calls = bench.Speculator.next_logits, [0]

    def wrong_once(self, token):
        calls[0] += 1
        row = orig(self, token)
        return np.array([-5]) if calls[0] == 30 else row

    monkeypatch.setattr(bench.Speculator, "next_logits", wrong_once)
    with pytest.raises(AssertionError):
        bench.replay(prompt, output, "ngram", bench.linear_cost(0.1))
