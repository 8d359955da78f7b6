"""The generation engine on a real tiny model: events, stops, prefix reuse, cancel."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from edgeinfer.errors import ContextOverflowError

GOLDEN = ", there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module")
def model(stories_dir):
    import edgeinfer.api as api
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
    text, final = model.engine.generate(ids, max_tokens=50)
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
