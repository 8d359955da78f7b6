"""The generation engine on a real tiny model: events, stops, prefix reuse, cancel."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from edgeinfer.errors import ContextOverflowError

GOLDEN = ", there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module")
def model(stories_dir):
    from edgeinfer import api
    from edgeinfer.readers import read_model

    return api.Model(read_model(str(stories_dir)), backend="reference", n_ctx=128)


def test_generate_golden_and_final_event(model):
    events = list(model.stream("Once upon a time", max_tokens=20))
    text = "".join(e.text for e in events)
    assert GOLDEN.startswith(text) or text.startswith(GOLDEN[:40]), text
    final = events[-1]
    assert final.finish_reason == "length"
    assert final.stats.generated_tokens == 20
    assert final.stats.prompt_tokens == 5
    assert final.stats.ttft_s > 0 and final.stats.decode_tok_s > 0
    assert final.stats.kv_bytes > 0
    assert all(e.finish_reason is None for e in events[:-1])


def test_stop_string_is_not_emitted_and_ends_generation(model):
    text = model.generate("Once upon a time", max_tokens=40, stop=["Lily"])
    assert text == ", there was a little girl named "
    events = list(model.stream("Once upon a time", max_tokens=40, stop=["Lily"]))
    assert events[-1].finish_reason == "stop"


def test_prefix_reuse_gives_identical_tokens_and_skips_work(model):
    eng = model.engine
    prompt = model.encode_prompt("Once upon a time, there was a little girl")
    eng.reset()
    fresh_text, fresh_final = eng.generate(prompt + [29], max_tokens=12)
    # first call with only the prompt, then a longer prompt sharing it
    eng.reset()
    eng.generate(prompt, max_tokens=5)
    text, final = eng.generate(prompt + [29], max_tokens=12)
    assert final.stats.reused_tokens == len(prompt)
    assert text == fresh_text
    assert fresh_final.stats.reused_tokens == 0


def test_prompt_longer_than_context_is_a_clear_error(model):
    with pytest.raises(ContextOverflowError, match="context holds 128"):
        model.engine.generate(list(np.full(200, 300)), max_tokens=2)


def test_generation_stops_at_end_of_context(model):
    ids = [1] + [300] * 120
    _text, final = model.engine.generate(ids, max_tokens=50)
    assert final.finish_reason == "length"
    assert final.stats.generated_tokens == 128 - 121 + 1


def test_cancel_from_another_thread_stops_within_one_step(model):
    cancel = threading.Event()
    n = 0
    final = None
    for ev in model.stream("Once upon a time", max_tokens=60, cancel=cancel):
        if ev.token is not None:
            n += 1
            if n == 3:
                threading.Thread(target=cancel.set).start()
                threading.Event().wait(0.05)
        final = ev
    assert final.finish_reason == "cancelled"
    assert n <= 4


def test_max_memory_sizes_the_context_and_refuses_what_cannot_fit(stories_dir):
    from edgeinfer import api
    from edgeinfer.errors import MemoryBudgetError
    from edgeinfer.memory import plan_memory
    from edgeinfer.readers import read_model

    src = read_model(str(stories_dir))
    wb = api.source_weight_bytes(src, "reference")
    with pytest.raises(MemoryBudgetError, match="too small"):
        api.Model(src, backend="reference", max_memory=1.0)
    # a budget that allows exactly 300 tokens of int8 KV
    base = plan_memory(src.config, wb, 10_000, "int8", 512)
    budget_b = base.weights_bytes + base.scratch_bytes + 300 * base.kv_bytes_per_token
    m = api.Model(src, backend="reference", max_memory=budget_b / 2**20, kv_dtype="int8")
    assert m.n_ctx == 300
    assert m.engine.cache.max_tokens == 300
    # 300 tokens fit, 301 are refused with the documented error
    m.engine.check_prompt([1] * 300)
    with pytest.raises(ContextOverflowError):
        m.engine.check_prompt([1] * 301)
    with pytest.raises(MemoryBudgetError, match="does not fit"):
        api.Model(src, backend="reference", max_memory=budget_b / 2**20, n_ctx=301)


def test_chat_drops_oldest_turns_when_the_context_is_full(stories_dir):
    from edgeinfer import api
    from edgeinfer.readers import read_model

    m = api.Model(read_model(str(stories_dir)), backend="reference", n_ctx=64)
    long = "Once upon a time there was a girl who liked to play in the park with her dog"
    msgs = []
    for _ in range(4):
        msgs += [{"role": "user", "content": long}, {"role": "assistant", "content": long}]
    msgs.append({"role": "user", "content": "Tell me"})
    events = list(m.chat_stream(msgs, max_tokens=8))
    final = events[-1]
    assert final.finish_reason in ("length", "stop")
    assert final.stats.prompt_tokens + 8 <= 64


def test_chat_session_keeps_the_kv_cache_between_turns(stories_dir):
    import edgeinfer
    from edgeinfer.readers import read_model

    src = read_model(str(stories_dir))
    # stories260K has no chat template: give it one that concatenates the turns, so the
    # re-rendered conversation tokenizes like the cached one (as ChatML models do)
    src.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model = edgeinfer.Model(src, backend="reference", n_ctx=512, kv_dtype="f32")
    chat = edgeinfer.ChatSession(model)
    first = chat.send("Once upon a time", max_tokens=16)
    assert first.startswith(", there was a little girl")
    second = chat.send("The girl", max_tokens=8)
    stats = chat.last_stats
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    assert chat.messages[3]["content"] == second
    # the whole first turn (prompt + reply) came from the cache
    assert stats.reused_tokens >= stats.prompt_tokens - 8
    # and the tokens equal a fresh run of the whole conversation
    model.engine.reset()
    fresh = model.chat(chat.messages[:3], max_tokens=8)
    assert fresh == second
    chat.reset()
    assert chat.messages == []


def test_sampled_stream_matches_the_numpy_chain_and_reuses_its_sampler(model):
    """Engine.stream with penalties and every truncation picks the ids the chain of numpy
    references (``edgeinfer.sampling.sample``) picks from the same logits, history and
    seed; its sampling workspace is made once and reused by later streams."""
    from edgeinfer.sampling import SamplingParams, sample

    eng = model.engine
    prompt = model.encode_prompt("Once upon a time")
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05,
                            repetition_penalty=1.1, presence_penalty=0.2,
                            frequency_penalty=0.1, penalty_last_n=8, seed=11)
    eng.reset()
    got = [ev.token for ev in eng.stream(prompt, params, max_tokens=24) if ev.token is not None]
    sampler = eng._sampler
    assert sampler is not None and len(got) > 1
    eng.reset()
    rng = np.random.default_rng(params.seed)
    history = list(prompt)
    logits, _ = eng.prefill(history)
    want = []
    for _ in got:
        want.append(sample(logits, params, rng, history))
        history.append(want[-1])
        logits = eng.decode_one(want[-1])
    assert got == want
    list(eng.stream(prompt, params, max_tokens=3))
    assert eng._sampler is sampler
