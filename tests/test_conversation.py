"""Chat overflow policy: drop whole oldest turns, keep the system prompt, re-render."""
from __future__ import annotations

import pytest

from edgeinfer.conversation import fit_messages, split_turns
from edgeinfer.errors import ContextOverflowError


def chatml_ids(messages):
    """A ChatML-like template rendered to 'tokens' (one id per character, BOS first)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    text += "<|im_start|>assistant\n"
    return [1] + [ord(ch) for ch in text]


SYS = {"role": "system", "content": "You are terse."}


def conv(n_turns, size=40):
    msgs = [SYS]
    for i in range(n_turns):
        msgs.append({"role": "user", "content": f"q{i} " + "x" * size})
        msgs.append({"role": "assistant", "content": f"a{i} " + "y" * size})
    msgs.append({"role": "user", "content": "last question"})
    return msgs


def test_fits_unchanged():
    msgs = conv(2)
    kept, dropped = fit_messages(msgs, chatml_ids, 10_000, reserve=100)
    assert kept == msgs and dropped == 0


def test_oldest_whole_turns_dropped_system_kept():
    msgs = conv(5)
    full = len(chatml_ids(msgs))
    n_ctx = full - 100  # two turns (~2 x 2 x 64 chars) must go
    kept, dropped = fit_messages(msgs, chatml_ids, n_ctx, reserve=10)
    assert kept[0] == SYS
    assert dropped % 2 == 0 and dropped > 0  # user + assistant pairs
    assert kept[1]["role"] == "user" and kept == [SYS] + msgs[1 + dropped:]
    assert len(chatml_ids(kept)) <= n_ctx - 10
    # the fewest turns were dropped: keeping one more would not fit
    assert len(chatml_ids([SYS] + msgs[1 + dropped - 2:])) > n_ctx - 10
    # the result is a re-render of whole messages, starting with BOS and a full header
    ids = chatml_ids(kept)
    assert ids[0] == 1 and "".join(map(chr, ids[1:])).startswith("<|im_start|>system\n")


def test_last_user_turn_too_long_raises():
    msgs = [SYS, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "z" * 500}]
    with pytest.raises(ContextOverflowError, match=r"renders to \d+ tokens but only 190 fit"):
        fit_messages(msgs, chatml_ids, 200, reserve=10)


def test_greeting_before_first_user_goes_with_it_and_tools_stay_in_turn():
    msgs = [SYS, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "tool", "content": "c"}, {"role": "user", "content": "d"}]
    system, turns = split_turns(msgs)
    assert system == [SYS] and len(turns) == 2 and len(turns[0]) == 4
    kept, dropped = fit_messages(msgs, chatml_ids, len(chatml_ids(msgs)) - 1)
    assert kept == [SYS, msgs[-1]] and dropped == 4


def test_without_system_prompt():
    msgs = conv(3)[1:]
    kept, dropped = fit_messages(msgs, chatml_ids, len(chatml_ids(msgs)) - 5)
    assert kept == msgs[2:] and dropped == 2


def test_with_the_real_smollm2_template_when_available():
    """Real ChatML template (SmolLM2's) through the project's template renderer."""
    try:
        from edgeinfer.chat_template import render_chat_template as render  # type: ignore
    except ImportError:
        pytest.skip("chat template renderer not available")
    tpl = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    try:
        ids = lambda m: list(render(tpl, m, add_generation_prompt=True).encode())
        ids(conv(1))
    except TypeError:
        pytest.skip("renderer has another signature")
    msgs = conv(4)
    kept, dropped = fit_messages(msgs, ids, len(ids(msgs)) - 50)
    assert kept[0] == SYS and dropped == 2


# ---- reuse of the previous reply's KV when it was sampled off the canonical tokenization ----
from edgeinfer.conversation import reuse_cached_ids

PIECES = {1: "<s>", 2: "Q", 3: "LT", 4: "QL", 5: "T", 6: "<end>", 7: " is", 8: "\n", 9: "Go",
          10: " on", 11: "A", 12: "\ufffd"}


def pieces(ids):
    return "".join(PIECES[i] for i in ids)


def test_reuse_cached_ids_splices_the_sampled_spelling():
    cached = [1, 9, 8, 2, 3, 7]            # prompt "<s>Go\n", then sampled "Q"+"LT"+" is"
    rendered = [1, 9, 8, 4, 5, 7, 6, 8, 9, 10]  # re-tokenized "QL"+"T"+" is", then more
    out = reuse_cached_ids(rendered, cached, pieces)
    assert out == [1, 9, 8, 2, 3, 7, 6, 8, 9, 10]
    assert pieces(out) == pieces(rendered)


def test_reuse_cached_ids_leaves_a_different_text_alone():
    assert reuse_cached_ids([1, 9, 4, 11, 6], [1, 9, 2, 3], pieces) == [1, 9, 4, 11, 6]
    assert reuse_cached_ids([9, 8], [1, 9], pieces) == [9, 8]   # nothing shared
    assert reuse_cached_ids([1, 9, 8], [1, 9, 8, 2], pieces) == [1, 9, 8]  # already a prefix


def test_a_reply_sampled_off_the_canonical_tokenization_is_reused_whole(smollm2_gguf):
    """SmolLM2 (INT4) sampled "(Q" "LT" for "(QLT)" where the tokenizer writes "QL" "T":
    the next turn must reuse the whole reply, not stop at "Q" and recompute the rest."""
    from edgeinfer import api
    from edgeinfer.readers import read_model

    model = api.Model(read_model(str(smollm2_gguf)), backend="reference", n_ctx=256)
    tok = model.tokenizer
    msgs = [{"role": "user", "content": "Explain quantum computing in simple terms."}]
    prompt = model.encode_chat(msgs)
    reply_ids = tok.encode("It is Quantum Leap Technology (Q") + tok.encode("LT). It works")
    reply = tok.decode(reply_ids)
    assert reply == "It is Quantum Leap Technology (QLT). It works"
    assert tok.encode(reply) != reply_ids  # the canonical spelling differs
    model.engine.reset()
    model.engine.prefill(prompt + reply_ids)  # what the cache holds after that answer
    convo = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
    rendered = model.encode_chat(convo)
    assert rendered[:len(prompt)] == prompt and rendered[len(prompt):][:len(reply_ids)] != reply_ids
    from edgeinfer.engine import common_prefix_len

    # comparing ids alone (before the splice) stops at "(": "Q" is not "QL"
    by_ids = common_prefix_len(prompt + reply_ids, rendered)
    assert by_ids == len(prompt) + len(tok.encode("It is Quantum Leap Technology (Q")) - 1
    final = list(model.chat_stream(convo, max_tokens=1))[-1]
    assert final.stats.reused_tokens == len(prompt) + len(reply_ids)  # the whole reply
    # computed afresh: only the template's end of the reply and the new user message
    tail = len(rendered) - len(prompt) - len(tok.encode(reply))
    assert final.stats.prompt_tokens - final.stats.reused_tokens == tail
