"""The README's Python API example, run as written; and cancellation from another thread.

``README_EXAMPLE`` is pasted verbatim into README.md ("Python API"); this test runs it
(with the model path pointed at the test copy) and checks what it prints, so the README
cannot drift from the API.
"""
from __future__ import annotations

import contextlib
import io
import threading
from pathlib import Path

import pytest

README_EXAMPLE = '''\
import threading
import edgeinfer

model = edgeinfer.load("../shared/models/stories260K", backend="reference")  # or /work/shared/...

# One call: the completion as a string (greedy unless you pass temperature).
print(model.generate("Once upon a time", max_tokens=12))  # , there was a little girl named Lily. She

# Stream: text deltas as they are decoded, then a final event with stats. Sampled, so
# another story, the same for the same seed: ", there was a big cat named Tom. T".
for ev in model.stream("Once upon a time", max_tokens=12, temperature=0.8, seed=5):
    print(ev.text, end="", flush=True)
    if ev.finish_reason:
        print(f"\\n[{ev.finish_reason}: {ev.stats.generated_tokens} tokens]")

# Cancel from another thread (say, a Stop button): the stream ends within one token.
cancel, started = threading.Event(), threading.Event()
reply = []

def worker():
    for ev in model.chat_stream([{"role": "user", "content": "Tell me a story."}],
                                max_tokens=400, cancel=cancel):
        reply.append(ev)
        started.set()

t = threading.Thread(target=worker)
t.start()
started.wait()
cancel.set()           # the Stop button
t.join()
print(reply[-1].finish_reason, reply[-1].stats.generated_tokens)   # cancelled, a few
'''

MODEL_IN_EXAMPLE = '"../shared/models/stories260K"'


def test_readme_example_runs_and_prints_what_it_says(stories_dir):
    assert MODEL_IN_EXAMPLE in README_EXAMPLE
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert README_EXAMPLE in readme, "README.md's Python API example differs from this test's"
    code = README_EXAMPLE.replace(MODEL_IN_EXAMPLE, repr(str(stories_dir)))
    out = io.StringIO()
    env: dict = {"__name__": "__readme__"}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<README example>", "exec"), env)
    text = out.getvalue()
    # greedy, then sampled at temperature 0.8 with seed 5: another (reproducible) story,
    # as the README's comments say, then the stream's final event line
    assert text.startswith(", there was a little girl named Lily. She\n"
                           ", there was a big cat named Tom. T\n[length: 12 tokens]\n"), text
    reason, n = text.splitlines()[-1].split()
    assert reason == "cancelled", text
    # set after the first event; the worker may decode a few steps before the main thread runs
    assert 1 <= int(n) < 400, text
    assert env["reply"][-1].stats.generated_tokens == int(n)


@pytest.fixture(scope="module")
def model(stories_dir):
    from edgeinfer import api
    from edgeinfer.readers import read_model

    return api.Model(read_model(str(stories_dir)), backend="reference", n_ctx=512)


def test_cancel_from_another_thread_stops_within_one_decode_step(model):
    """The engine checks ``cancel`` before each sample: once set, at most the step in
    flight completes. The consumer blocks the generator after the 3rd token until the
    other thread has set the event, so the count is exact."""
    cancel = threading.Event()
    events = []
    stream = model.stream("Once upon a time", max_tokens=200, cancel=cancel)
    for ev in stream:
        events.append(ev)
        if sum(e.token is not None for e in events) == 3:
            setter = threading.Thread(target=cancel.set)
            setter.start()
            setter.join()
    tokens = [e for e in events if e.token is not None]
    assert len(tokens) == 3
    assert events[-1].finish_reason == "cancelled"
    assert events[-1].stats.generated_tokens == 3
    # the model is free again at once: the next call is not blocked by the cancelled one
    assert model.generate("Once upon a time", max_tokens=4).startswith(", there")


def test_cancel_while_decoding_frees_the_model_lock_promptly(model):
    """Set from another thread while tokens are being produced (no handshake)."""
    cancel = threading.Event()
    got_first = threading.Event()
    final = {}

    def consume():
        for ev in model.stream("Once upon a time", max_tokens=480, temperature=0.0, cancel=cancel):
            got_first.set()
            if ev.finish_reason:
                final["ev"] = ev

    t = threading.Thread(target=consume)
    t.start()
    assert got_first.wait(10)
    cancel.set()
    t.join(5)
    assert not t.is_alive()
    ev = final["ev"]
    assert ev.finish_reason == "cancelled" and ev.stats.generated_tokens < 480


def test_warm_up_runs_the_kernels_and_leaves_an_empty_cache(model):
    seconds = model.warm_up()
    assert seconds > 0
    assert model.engine.cached_ids == [] and model.engine.cache.length == 0
    assert model.generate("Once upon a time", max_tokens=8).startswith(", there was a little")


def test_warm_up_runs_every_prefill_shape_and_a_verify(stories_q):
    """Prompts of 3, 8 and 20 new tokens (on a CPU with AMX: the row kernels, the
    few-token and the 16-token tiles, each compiled before the first answer, not in it), a
    4-token forward with every row's logits (a speculative verify), then decode steps."""
    from edgeinfer import api

    m = api.Model(stories_q, backend="cpu", n_ctx=256)
    seen = []
    forward = m.engine.model.forward

    def spy(ids, cache, all_logits=False, **kw):
        seen.append((len(ids), bool(all_logits)))
        return forward(ids, cache, all_logits=all_logits, **kw)

    m.engine.model.forward = spy
    m.warm_up()
    assert seen[:4] == [(3, False), (8, False), (20, False), (4, True)]
    assert seen[4:] == [(1, False)] * 3
    assert m.engine.cached_ids == [] and m.engine.cache.length == 0


#: llama.cpp's greedy completion of "Once upon a time," on stories260K.gguf (12 tokens);
#: checked against the live peer by the slow test below
LLAMA_CPP_COMPLETION = " there was a little girl named Lily. She lo"


def test_a_completion_keeps_the_space_that_begins_its_first_word(model):
    """stories260K's SentencePiece decoder strips the first piece's space; a completion of
    "Once upon a time," still starts " there", as llama.cpp prints it (same GGUF)."""
    assert model.generate("Once upon a time,", max_tokens=12) == LLAMA_CPP_COMPLETION
    # a chat reply starts at its first character
    reply = model.chat([{"role": "user", "content": "Once upon a time,"}], max_tokens=4)
    assert reply == "there was a little"


@pytest.mark.slow
def test_the_completion_equals_llama_cpp_on_the_same_gguf(model, stories_gguf):
    """The recorded completion above is what the peer prints (llama-cpp-python from
    ../shared/peer, installed by hand: it is not a test dependency)."""
    import llama_cpp

    peer = llama_cpp.Llama(model_path=str(stories_gguf), n_ctx=128, verbose=False)
    theirs = peer.create_completion("Once upon a time,", max_tokens=12, temperature=0)
    assert theirs["choices"][0]["text"] == LLAMA_CPP_COMPLETION
    assert model.generate("Once upon a time,", max_tokens=12) == LLAMA_CPP_COMPLETION


def test_a_stream_cancelled_while_waiting_for_the_model_ends_with_stats(model):
    """The README's ``reply[-1].stats.generated_tokens`` holds even when the stream never
    got the model: cancelled while another call held its lock."""
    cancel = threading.Event()
    with model._lock:  # another call is generating
        events = model.stream("Once upon a time", max_tokens=8, cancel=cancel)
        cancel.set()
        evs = list(events)
    assert len(evs) == 1 and evs[0].finish_reason == "cancelled"
    st = evs[0].stats
    assert st.generated_tokens == 0 and st.prompt_tokens == 5 and st.peak_rss_mb > 0


def test_load_warm_runs_the_warm_up_and_reports_its_stages(stories_dir):
    import edgeinfer

    said = []
    m = edgeinfer.load(stories_dir, backend="reference", warm=True, notify=said.append)
    assert said == ["warming up: prefill", "warming up: decode", "warming up: sampling"]
    assert m.engine.cache.length == 0
    assert m.generate("Once upon a time", max_tokens=4).startswith(", there")
