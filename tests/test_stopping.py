"""Stop conditions (case C06: Llama-3 end of turn) and stop-string hold-back."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from edgeinfer.detokenizer import StreamingDetokenizer
from edgeinfer.stopping import StopChecker, stop_strings_to_ids
from edgeinfer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def llama3() -> Tokenizer:
    """Llama-3 id layout (control tokens from 128000); the configs of case C06: the
    tokenizer config names only <|end_of_text|>, generation_config lists [128001, 128009]."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Hi! assistant user Hello there\n"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = json.loads(tok.to_str())
    vocab = d["model"]["vocab"]
    for i in range(len(vocab), 128000):
        vocab[f"<unused_{i}>"] = i
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|r0|>", "<|r1|>", "<|r2|>", "<|r3|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|r4|>", "<|eot_id|>"]
    d["added_tokens"] = [dict(id=128000 + j, content=c, single_word=False, lstrip=False, rstrip=False,
                              normalized=False, special=True) for j, c in enumerate(names)]
    return Tokenizer.from_hf_configs(
        json.dumps(d),
        tokenizer_config={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
        generation_config={"eos_token_id": [128001, 128009]})


def run_stream(tok, ids, stop=(), max_tokens=None, eos_ids=None):
    """The engine's loop over a scripted token stream; returns (text, finish reason, tokens used)."""
    checker = StopChecker(tok.eos_ids if eos_ids is None else eos_ids, stop, max_tokens)
    detok = StreamingDetokenizer(tok)
    out, reason, used = [], None, 0
    for t in ids:
        used += 1
        reason = checker.on_token(t)
        if reason != "stop":  # an EOS id is not part of the output
            safe, r = checker.feed(detok.add(t))
            out.append(safe)
            reason = reason or r
        if reason:
            break
    if not checker.stopped_by_string:
        out.append(checker.feed(detok.flush())[0])
        out.append(checker.flush())
    return "".join(out), reason, used


# ---------------------------------------------------------------- C06
def test_c06_eos_union(llama3):
    assert {128001, 128009} <= llama3.eos_ids
    assert llama3.token_to_id("<|end_of_text|>") == 128001 and llama3.token_to_id("<|eot_id|>") == 128009


def test_c06_stops_on_eot_id(llama3):
    assistant = llama3.encode("assistant")
    script = llama3.encode("Hi") + llama3.encode("!") + [128009, 128006] + assistant + \
        [128007] + llama3.encode("\n\nHello there")
    text, reason, used = run_stream(llama3, script, max_tokens=100)
    assert text == "Hi!"
    assert reason == "stop"
    assert used == len(llama3.encode("Hi!")) + 1  # stopped at the <|eot_id|> itself
    # with only the tokenizer config's EOS the model runs on into a made-up turn (the bug)
    text, reason, _ = run_stream(llama3, script, eos_ids={128001})
    assert text.startswith("Hi!assistant") and reason is None


def test_c06_control_token_as_stop_string(llama3):
    ids, texts = stop_strings_to_ids(["<|eot_id|>", "\nUser:"], llama3)
    assert ids == {128009} and texts == ("\nUser:",)
    script = llama3.encode("Hi") + [128009] + llama3.encode("Hello")
    text, reason, _ = run_stream(llama3, script, stop=texts, eos_ids=ids)
    assert (text, reason) == ("Hi", "stop")


# ---------------------------------------------------------------- token budget
def test_max_tokens_gives_length():
    checker = StopChecker({2}, (), max_tokens=3)
    assert [checker.on_token(t) for t in (5, 6, 7)] == [None, None, "length"]
    assert checker.finish_reason == "length" and checker.num_tokens == 3
    assert checker.on_token(8) == "length"  # idempotent once finished


def test_eos_at_the_last_allowed_token_is_stop():
    checker = StopChecker({2}, (), max_tokens=2)
    assert checker.on_token(5) is None
    assert checker.on_token(2) == "stop"


def test_length_keeps_the_last_token_text(llama3):
    ids = llama3.encode("Hello there")
    text, reason, used = run_stream(llama3, ids + [128009], max_tokens=len(ids))
    assert (text, reason, used) == ("Hello there", "length", len(ids))


# ---------------------------------------------------------------- stop strings
def test_stop_string_across_three_deltas():
    c = StopChecker((), ["\nUser:"])
    assert c.feed("Sure thing.") == ("Sure thing.", None)
    assert c.feed("\nUs") == ("", None)          # could start "\nUser:": held
    assert c.held_text == "\nUs"
    assert c.feed("er") == ("", None)
    assert c.feed(": hi") == ("", "stop")        # match: nothing of it is emitted
    assert c.matched_stop == "\nUser:" and c.stopped_by_string
    assert c.flush() == ""                       # text after the match is dropped
    assert c.feed("more") == ("", "stop")


def test_stop_string_cut_inside_a_delta():
    c = StopChecker((), ["STOP"])
    assert c.feed("abc ST") == ("abc ", None)
    assert c.feed("OPxyz") == ("", "stop")
    c = StopChecker((), ["STOP"])
    assert c.feed("one STOP two") == ("one ", "stop")


def test_partial_prefix_released():
    c = StopChecker((), ["\nUser:"])
    assert c.feed("Hello\nUs") == ("Hello", None)
    assert c.feed("ually") == ("\nUsually", None)   # no longer a prefix: released
    assert c.feed(" fine\n") == (" fine", None)
    assert c.flush() == "\n"                        # end of stream: released
    assert c.finish_reason is None


def test_earliest_of_several_stop_strings_wins():
    c = StopChecker((), ["world", "lo w", "xyz"])
    assert c.feed("hello world") == ("hel", "stop")
    assert c.matched_stop == "lo w"


def test_hold_back_uses_longest_possible_prefix():
    c = StopChecker((), ["abcd", "cx"])
    assert c.feed("zabc") == ("z", None)  # "abc" may grow into "abcd" (longer than "c")
    assert c.feed("x") == ("ab", "stop")  # ... but "cx" matched first


def test_no_stop_strings_passes_text_through():
    c = StopChecker({2}, ())
    assert c.feed("abc") == ("abc", None)
    assert c.flush() == ""


@pytest.mark.parametrize("kwargs, needle", [
    (dict(stop_strings=[""]), "stop strings"),
    (dict(stop_strings=[None]), "stop strings"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=1.5), "max_tokens"),
])
def test_invalid_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        StopChecker({2}, **kwargs)


def test_stream_text_is_exact_with_random_splits():
    import random
    rng = random.Random(5)
    text = "The answer is 42.\nUser: next question\nAssistant: ok"
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)]
        c = StopChecker((), ["\nUser:", "Assistant"])
        out = []
        for p in pieces:
            safe, reason = c.feed(p)
            out.append(safe)
            if reason:
                break
        out.append(c.flush())
        assert "".join(out) == "The answer is 42."


# ---------------------------------------------------------------- through the engine
def test_a_special_token_stop_string_stops_the_engine(smollm2_gguf):
    """After a ChatML system turn SmolLM2 writes "<|im_start|>user\\n..." on its own.
    <|im_start|> (id 1) is special but not an EOS id, and decodes to no text: a stop
    string "<|im_start|>" must stop on the id (it never matched the text before)."""
    from edgeinfer import api
    from edgeinfer.readers import read_model

    model = api.Model(read_model(str(smollm2_gguf)), backend="reference", n_ctx=128)
    tok = model.tokenizer
    assert tok.token_to_id("<|im_start|>") == 1 and 1 in tok.special_ids and 1 not in tok.eos_ids
    prompt = model.encode_prompt("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                                 "trained by Hugging Face<|im_end|>\n")
    free = [(ev.token, ev.text) for ev in model.engine.stream(prompt, max_tokens=4)]
    assert [t for t, _ in free[:3]] == [1, 520, 9531]  # <|im_start|> "ass" "istant"
    assert "".join(text for _, text in free).startswith("assistant\n")
    events = list(model.engine.stream(prompt, max_tokens=4, stop=["<|im_start|>"]))
    final = events[-1]
    assert (final.finish_reason, final.stats.generated_tokens) == ("stop", 1)
    assert "".join(ev.text for ev in events) == ""
    # a text stop string next to it still works on the text
    text, final = model.engine.generate(prompt, max_tokens=4, stop=["<|im_start|>", "istant"])
    assert (text, final.finish_reason, final.stats.generated_tokens) == ("", "stop", 1)
    text, final = model.engine.generate(prompt, max_tokens=4, stop=["istant"])
    assert (text, final.finish_reason, final.stats.generated_tokens) == ("ass", "stop", 3)
