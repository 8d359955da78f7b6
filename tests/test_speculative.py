"""Prompt-lookup speculative decoding (edgeinfer/speculative.py) gives the tokens plain
decoding gives, greedy and seeded-sampled, and leaves the KV cache as plain decoding does.

Models: stories260K converted to RTN INT4 (CPU backend, integer numerics: a verify
forward's rows equal decode steps bit for bit), SmolLM2-135M Q4_1 (slow), KV f32 / f16 /
int8 / int4 / k8v4. Controls: every identity test also asserts that drafts were verified
and some accepted (``stats.drafted`` / ``accepted``), so it is not vacuous; where the
numerics are not row-invariant (dense float32 weights, the reference backend) speculation
is off and the rows really differ.
"""
from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
from edgeinfer import api
from edgeinfer.sampling import Sampler, SamplingParams, make_rng
from edgeinfer.sampling_steps import min_p_filter, top_k_filter, top_p_filter
from edgeinfer.speculative import (
    K_MAX,
    K_MIN,
    K_START,
    PAUSE_START,
    WINDOW,
    DraftPolicy,
    NgramIndex,
    exactness_problem,
)

KVS = ["f32", "f16", "int8", "int4", "k8v4"]
PROMPT = ("Once upon a time, there was a little girl named Lily. She liked to play with her "
          "ball. Once upon a time, there was a little")


@pytest.fixture(scope="module")
def stories_src(tmp_path_factory):
    from conftest import STORIES

    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260K not found: {STORIES}")
    from edgeinfer.quant.convert import convert
    from edgeinfer.readers import read_model

    out = tmp_path_factory.mktemp("eif") / "stories.eif"
    convert(str(STORIES), str(out), method="rtn", group_size=32, progress=False)
    return read_model(str(out))


_MODELS: dict = {}


def _model(src, kv, n_ctx=512):
    key = (id(src), kv, n_ctx)
    if key not in _MODELS:
        _MODELS[key] = api.Model(src, backend="cpu", n_ctx=n_ctx, kv_dtype=kv, threads=2)
    return _MODELS[key]


def _run(model, ids, speculate, **kw):
    model.engine.reset()
    evs = list(model.stream_ids(ids, speculate=speculate, **kw))
    return [e.token for e in evs if e.token is not None], evs[-1]


def _cache_bytes(model):
    cache, n = model.engine.cache, model.engine.cache.length
    return {(layer, name): arr[:n].tobytes() if arr.shape[0] == cache.slots[layer]
            else arr.tobytes()  # int4's per-layer K statistics
            for layer in range(cache.n_layers) for name, arr in cache.raw(layer).items()}


# ---- drafting and policy --------------------------------------------------------------
def test_ngram_index_drafts_the_latest_continuation():
    idx = NgramIndex([5, 6, 7, 8, 5, 6, 9, 5, 6])
    assert idx.draft(3) == [9, 5, 6]      # "5 6" last seen before the suffix at 4..5
    idx.append(9)
    assert idx.draft(2) == [5, 6]         # "5 6 9" (n = 3) -> continuation at 7
    idx = NgramIndex([1, 2, 3])
    assert idx.draft(4) == []             # the suffix never matches itself
    idx.append(1)
    assert idx.draft(4) == [2, 3, 1]      # n = 1 fallback; capped by what exists


def test_draft_policy_grows_shrinks_and_pauses():
    p = DraftPolicy(k_max=K_MAX)
    assert p.k == K_START
    p.update(p.k, p.k)
    assert p.k == K_START + 2                 # full acceptance grows
    for _ in range(K_MAX):
        p.update(p.k, p.k)
    assert p.k == K_MAX                       # capped
    p.update(K_MAX, 3)
    assert p.k == 4                           # shrinks to accepted + 1
    p.update(4, 0)
    assert p.k == K_MIN
    p = DraftPolicy()
    for _ in range(WINDOW):                   # a window that does not pay: pause
        assert p.allows()
        p.update(4, 0)
    assert [p.allows() for _ in range(PAUSE_START)] == [False] * PAUSE_START
    assert p.allows()
    for _ in range(WINDOW):
        p.update(4, 0)
    assert p.paused == 2 * PAUSE_START        # consecutive pauses double


class _ModelClock:
    """Fake seconds: a decode step costs 1, a verify 1 + ``row`` per extra token
    (read off the cache length between the calls around a forward)."""

    def __init__(self, engine, row):
        self.engine, self.row, self.t, self.last = engine, row, 0.0, 0

    def __call__(self):
        n = self.engine.cache.length
        self.t += 1 + self.row * max(0, n - self.last - 1)
        self.last = n
        return self.t


def test_auto_follows_cost_same_tokens(stories_src, monkeypatch):
    """auto drafts while verifies are cheap and mostly stops when they are dear; the
    tokens are those of "off" either way."""
    from edgeinfer import speculative

    model = _model(stories_src, "int8")
    ids = model.encode_prompt(PROMPT)
    off, _ = _run(model, ids, "off", max_tokens=120)
    orig = speculative.Speculator.__init__
    drafted = {}
    for row in (0.01, 5.0):
        def init(self, engine, *a, _row=row, **kw):
            orig(self, engine, *a, **kw)
            self.clock = _ModelClock(engine, _row)

        monkeypatch.setattr(speculative.Speculator, "__init__", init)
        on, fin = _run(model, ids, "auto", max_tokens=120)
        assert on == off
        drafted[row] = fin.stats.drafted
    assert drafted[0.01] > 3 * max(drafted[5.0], 1)


# ---- the rejection rule --------------------------------------------------------------
def _filtered_probs(logits, params):
    x = logits / params.temperature
    x = min_p_filter(top_p_filter(top_k_filter(x, params.top_k), params.top_p), params.min_p)
    p = np.exp(x - x.max())
    return p / p.sum()


def _chi2_fits(counts, probs, z=3.09):
    """Pearson's chi-square of ``counts`` against ``probs`` below its upper 0.001
    quantile (z = 3.09; Wilson-Hilferty approximation of the chi-square quantile)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    crit = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return stat < crit


def test_sample_and_compare_is_leviathans_rule():
    """With a one-hot draft q = [d], Leviathan et al.'s rule accepts d with probability
    p(d) and otherwise samples from norm(max(0, p - q)). The engine samples x ~ p with
    its Sampler and accepts iff x == d: over 40000 draws the acceptance rate and the
    distribution of the rejected outputs match that rule (chi-square at the 0.001 level)."""
    rng0 = np.random.default_rng(3)
    logits = rng0.normal(0, 0.8, 64).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.05, seed=11)
    p = _filtered_probs(logits.astype(np.float64), params)
    d = int(np.argsort(p)[-2])  # a draft that is likely but not the argmax
    s = Sampler(64)
    s.start(params)
    rng = make_rng(params.seed)
    n = 40000
    out = np.array([s.sample(logits, rng) for _ in range(n)])
    accepted = out == d
    se = np.sqrt(p[d] * (1 - p[d]) / n)
    assert abs(accepted.mean() - p[d]) < 4 * se
    residual = np.maximum(p - np.eye(64)[d], 0)
    residual /= residual.sum()
    support = residual > 0
    assert residual[d] == 0 and support.sum() > 3
    counts = np.bincount(out[~accepted], minlength=64)
    assert counts[~support].sum() == 0
    assert _chi2_fits(counts[support], residual[support])
    # control: the same test rejects a near miss, the residual at temperature 1
    near = _filtered_probs(logits.astype(np.float64),
                           SamplingParams(temperature=1.0, top_k=20, top_p=0.95, min_p=0.05))
    near[d] = 0
    assert not _chi2_fits(counts[support], near[support] / near[support].sum())


# ---- identity through the engine -------------------------------------------------------
@pytest.mark.parametrize("kv", KVS)
def test_greedy_identical_and_cache_identical_stories(stories_src, kv):
    model = _model(stories_src, kv)
    ids = model.encode_prompt(PROMPT)
    off, fin_off = _run(model, ids, "off", max_tokens=160)
    cache_off = _cache_bytes(model)
    on, fin_on = _run(model, ids, "ngram", max_tokens=160)
    assert on == off and fin_on.finish_reason == fin_off.finish_reason
    st = fin_on.stats
    assert st.drafted > 0 and 0 < st.accepted <= st.drafted  # speculation really ran
    assert fin_off.stats.drafted == fin_off.stats.accepted == 0
    assert st.generated_tokens == fin_off.stats.generated_tokens == len(on)
    # the rollbacks left exactly the bytes plain decoding wrote (int4: its statistics too)
    assert model.engine.cache.length == len(model.engine.cached_ids)
    assert _cache_bytes(model) == cache_off
    assert len(set(off)) > 5  # not a degenerate repeat


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_seeded_sampling_identical_with_penalties(stories_src, kv):
    """A seeded sampled request gives the same tokens with and without speculation
    (one rng draw per token either way), penalties included: so the output distribution
    is unchanged. 12 seeds; control: the seeds give different outputs."""
    model = _model(stories_src, kv)
    ids = model.encode_prompt(PROMPT)
    outs, drafted, accepted = set(), 0, 0
    for seed in range(12):
        kw = dict(max_tokens=60, temperature=0.7, top_k=30, top_p=0.95, min_p=0.02,
                  repetition_penalty=1.1, seed=seed)
        off, _ = _run(model, ids, "off", **kw)
        on, fin = _run(model, ids, "ngram", **kw)
        assert on == off, seed
        outs.add(tuple(off))
        drafted += fin.stats.drafted
        accepted += fin.stats.accepted
    assert len(outs) > 6 and drafted > 0 and accepted > 0


def test_constrained_identical(stories_src):
    """A grammar mask applies at each verified position as in plain decoding."""
    model = _model(stories_src, "int8")
    grammar = 'start: ("Once upon a time, there was a " WORD ". ")+\nWORD: /[a-z]+/'
    ids = model.encode_prompt(PROMPT)
    off, _ = _run(model, ids, "off", max_tokens=80, grammar=grammar)
    on, fin = _run(model, ids, "ngram", max_tokens=80, grammar=grammar)
    assert on == off and fin.stats.accepted > 0
    text = model.tokenizer.decode(on)
    assert text.startswith("Once upon a time, there was a ")


def test_context_end_and_max_tokens_identical(stories_src):
    model = _model(stories_src, "f16", n_ctx=64)
    ids = model.encode_prompt(PROMPT)
    off, fin_off = _run(model, ids, "off", max_tokens=200)
    on, fin_on = _run(model, ids, "ngram", max_tokens=200)
    assert on == off and fin_on.finish_reason == fin_off.finish_reason == "length"
    assert len(ids) + len(on) == 64 + 1  # the last sampled token is never written
    assert model.engine.cache.length == len(model.engine.cached_ids) <= 64
    for n in (1, 3, 17):
        off, _ = _run(model, ids, "off", max_tokens=n)
        on, _ = _run(model, ids, "ngram", max_tokens=n)
        assert on == off and len(on) == n


def _forwards(model, fn):
    """(fn(), [(cache length before, M)] of every forward call fn makes)."""
    tr, log = model.engine.model, []

    def counted(feed, cache, *a, **kw):
        log.append((cache.length, len(feed)))
        return type(tr).forward(tr, feed, cache, *a, **kw)

    tr.forward = counted  # instance attribute: shadows the method
    try:
        return fn(), log
    finally:
        del tr.forward


def test_long_drafts_hit_the_context_end_identical(stories_src):
    """Drafts longer than the policy's k (a long matched run) run into the end of the
    context: a verify is clipped to fill it exactly, and the tokens, finish reason and
    cache bytes are those of plain decoding."""
    n_ctx = 150  # a run of 17 drafts starts at 141 (n_ctx 512): clipped to 8 here
    model = _model(stories_src, "int8", n_ctx=n_ctx)
    ids = model.encode_prompt(PROMPT)
    off, fin_off = _run(model, ids, "off", max_tokens=400)
    cache_off = _cache_bytes(model)
    (on, fin_on), log = _forwards(model, lambda: _run(model, ids, "ngram", max_tokens=400))
    assert on == off and fin_on.finish_reason == fin_off.finish_reason == "length"
    verifies = [(p, m) for p, m in log if m > 1 and p >= len(ids) - 1]
    assert max(m for _, m in verifies) - 1 > K_START + 2   # drafts past the policy's k
    assert any(p + m == n_ctx and m > K_START + 2 for p, m in verifies)  # clipped at the end
    assert model.engine.cache.length == len(model.engine.cached_ids) <= n_ctx
    assert _cache_bytes(model) == cache_off


def test_stop_string_inside_a_draft_identical(stories_src, monkeypatch):
    """A stop string completed by an accepted draft token ends the stream there, as in
    plain decoding: same tokens, text and finish reason; the verify's rest is trimmed off
    the cache. Control: some of the stops really fall inside a pending verify."""
    from edgeinfer import speculative

    model = _model(stories_src, "int8")
    ids = model.encode_prompt(PROMPT * 2)
    full, _ = _run(model, ids, "off", max_tokens=120)
    pending = []
    close = speculative.Speculator.close

    def spy(self):
        pending.append(self._rows is not None and self._i < len(self._drafts))
        close(self)

    monkeypatch.setattr(speculative.Speculator, "close", spy)
    inside = 0
    for i in range(12, 100, 8):
        stop = model.tokenizer.decode(full[i:i + 2]).strip()
        if len(stop) < 3:
            continue
        model.engine.reset()
        ev_off = list(model.stream_ids(ids, max_tokens=120, stop=[stop], speculate="off"))
        cache_off = _cache_bytes(model)
        pending.clear()
        model.engine.reset()
        ev_on = list(model.stream_ids(ids, max_tokens=120, stop=[stop], speculate="ngram"))
        assert [e.token for e in ev_on] == [e.token for e in ev_off], stop
        assert "".join(e.text for e in ev_on) == "".join(e.text for e in ev_off)
        assert ev_on[-1].finish_reason == ev_off[-1].finish_reason == "stop"
        assert model.engine.cache.length == len(model.engine.cached_ids)
        assert _cache_bytes(model) == cache_off
        inside += pending == [True]
    assert inside >= 2


def test_chat_reuse_after_speculation(stories_src):
    """A second call reusing the cache after a speculative one equals it cold."""
    model = _model(stories_src, "int8")
    ids = model.encode_prompt(PROMPT)
    first, _ = _run(model, ids, "ngram", max_tokens=50)
    turn2 = ids + first + ids[:9]
    evs = list(model.stream_ids(turn2, max_tokens=40, speculate="ngram"))
    assert evs[-1].stats.reused_tokens >= len(ids) + len(first) - 1
    warm = [e.token for e in evs if e.token is not None]
    cold, _ = _run(model, turn2, "off", max_tokens=40)
    assert warm == cold


def test_cancel_mid_speculation(stories_src):
    model = _model(stories_src, "int8")
    ids = model.encode_prompt(PROMPT)
    full, _ = _run(model, ids, "off", max_tokens=120)
    cancel = threading.Event()
    model.engine.reset()
    got, final, pending_seen = [], None, False
    spec_tokens = 0
    for ev in model.stream_ids(ids, max_tokens=120, cancel=cancel, speculate="ngram"):
        if ev.token is not None:
            got.append(ev.token)
            # drafts beyond the accepted tokens are in the cache right now
            pending_seen |= model.engine.cache.length > len(model.engine.cached_ids)
            if pending_seen and not cancel.is_set():
                spec_tokens = len(got)
                cancel.set()
        final = ev
    assert pending_seen and final.finish_reason == "cancelled"
    assert got == full[:spec_tokens]
    assert model.engine.cache.length == len(model.engine.cached_ids)
    # the cache is consistent: a generation reusing it equals a cold one
    on = [e.token for e in model.stream_ids(ids, max_tokens=120, speculate="ngram")
          if e.token is not None]
    assert on == full


def test_stats_count_drafts(stories_src):
    model = _model(stories_src, "int8")
    ids = model.encode_prompt(PROMPT * 3)
    _, fin = _run(model, ids, "ngram", max_tokens=100)
    st = fin.stats
    assert st.drafted >= st.accepted > 0 and st.as_dict()["drafted"] == st.drafted
    _, fin = _run(model, ids, "off", max_tokens=100)
    assert fin.stats.drafted == fin.stats.accepted == 0


def test_bad_mode_refused(stories_src):
    model = _model(stories_src, "int8")
    with pytest.raises(ValueError, match="speculate must be one of auto, ngram, off"):
        model.stream_ids([1, 2, 3], speculate="yes")


# ---- where it is off ------------------------------------------------------------------
def test_off_where_not_exact(stories_dir, caplog):
    """Dense float32 weights (the HF folder) and the reference backend: an M = 5 forward's
    rows differ from 5 decode steps (the reason), so speculation is off, logged."""
    for backend in ("cpu", "reference"):
        model = api.load(str(stories_dir), backend=backend, kv_dtype="f32")
        reason = exactness_problem(model.transformer)
        assert reason is not None
        tr = model.transformer
        ids = np.arange(5, 40, dtype=np.int32)
        c = tr.new_cache(64, "f32")
        tr.forward(ids[:30], c)
        whole = tr.forward(ids[30:], c, all_logits=True)
        c = tr.new_cache(64, "f32")
        tr.forward(ids[:30], c)
        steps = np.stack([np.asarray(tr.forward(ids[i:i + 1], c))[-1] for i in range(30, 35)])
        assert not np.array_equal(whole, steps)  # why it is off
        with caplog.at_level(logging.INFO, logger="edgeinfer"):
            evs = list(model.stream(PROMPT, max_tokens=40, speculate="ngram"))
        assert evs[-1].stats.drafted == 0
        assert f"speculative decoding off: {reason}" in caplog.text


# ---- SmolLM2 ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kv", ["f32", "f16", "int8", "int4"])
def test_greedy_identical_smollm2(smollm2_gguf, kv):
    model = api.load(str(smollm2_gguf), kv_dtype=kv, n_ctx=1024, threads=2)
    assert exactness_problem(model.transformer) is None
    code = ("def total(items):\n    s = 0\n    for item in items:\n        s += item.price\n"
            "    return s\n")
    # a reply that copies the prompt's code, so drafts are accepted on every KV dtype
    msgs = [{"role": "user", "content": "Rewrite this function with the name subtotal. "
             "Reply with the code only.\n" + code}]
    ids, _ = model.chat_ids(msgs)
    model.engine.reset()
    off, fin_off = _run(model, ids, "off", max_tokens=80)
    cache_off = _cache_bytes(model)
    on, fin_on = _run(model, ids, "ngram", max_tokens=80)
    assert on == off and fin_on.finish_reason == fin_off.finish_reason
    assert fin_on.stats.accepted > 0
    assert _cache_bytes(model) == cache_off


def test_cli_and_server_take_the_mode():
    import cli
    from edgeinfer.server import create_app

    p = cli.build_parser()
    for cmd in (["generate", "-p", "x"], ["chat"], ["serve"]):
        assert p.parse_args(cmd).speculate == "auto"
        assert p.parse_args([*cmd, "--speculate", "off"]).speculate == "off"
        with pytest.raises(SystemExit):
            p.parse_args([*cmd, "--speculate", "maybe"])
    with pytest.raises(ValueError, match="speculate must be one of"):
        create_app(None, "m", speculate="maybe")
