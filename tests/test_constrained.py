"""Constrained output (edgeinfer.constrained, llguidance): the token mask in the sampler,
bit for bit against the numpy reference; JSON-schema / Lark output on a real model that
always parses and validates (jsonschema); the errors of bad grammars."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from edgeinfer import sampling_steps as ref
from edgeinfer.constrained import Grammar, allowed_ids, mask_words
from edgeinfer.errors import GrammarError
from edgeinfer.sampling import Sampler, SamplingParams, sample

jsonschema = pytest.importorskip("jsonschema", reason="pip install -e '.[test]'")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


def _mask_of(allowed: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.zeros(32 * mask_words(vocab), np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32).copy()


# ---------------------------------------------------------------- the mask in the sampler
def test_apply_token_mask_layout():
    """Bit i % 32 of word i // 32 allows id i; ids past the mask's words are masked."""
    x = np.arange(70, dtype=np.float32)
    mask = _mask_of(np.array([0, 31, 32, 63]), 64)  # 2 words: ids 64..69 fall outside
    out = ref.apply_token_mask(x, mask)
    assert np.flatnonzero(out > -np.inf).tolist() == [0, 31, 32, 63]
    assert out[63] == 63.0 and out.dtype == np.float64
    assert allowed_ids(mask, 64).tolist() == [0, 31, 32, 63]
    with pytest.raises(ValueError, match="int32"):
        ref.apply_token_mask(x, mask.astype(np.int64))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.5),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_masked_sampler_picks_the_references_ids_and_only_allowed_ones(params, dtype):
    g = np.random.default_rng(7)
    vocab = 1000
    s = Sampler(vocab)
    for trial in range(40):
        logits = (g.standard_normal(vocab) * 3).astype(dtype)
        allowed = np.sort(g.choice(vocab, size=int(g.integers(1, 60)), replace=False))
        if trial % 4 == 0:  # the unmasked argmax is disallowed: the mask must matter
            allowed = allowed[allowed != int(np.argmax(logits))]
            if allowed.size == 0:
                allowed = np.array([(int(np.argmax(logits)) + 1) % vocab])
        mask = _mask_of(allowed, vocab)
        history = g.integers(0, vocab, 20).tolist()
        s.start(params, history)
        got = s.sample(logits, np.random.default_rng(trial), mask)
        want = sample(logits, params, np.random.default_rng(trial), history, mask)
        assert got == want
        assert got in set(allowed.tolist())
    # positive control: without the mask, the argmax (disallowed above) is what greedy picks
    if params.temperature == 0 and not params.penalized:
        s.start(params)
        assert s.sample(logits, np.random.default_rng(0)) == int(np.argmax(logits))


def test_masked_greedy_refuses_nan_among_the_allowed_and_an_empty_mask():
    x = np.zeros(64, np.float32)
    x[5] = np.nan
    s = Sampler(64)
    s.start(SamplingParams(temperature=0.0))
    assert s.sample(x, None, _mask_of(np.array([3, 9]), 64)) == 3  # NaN outside the mask
    with pytest.raises(ValueError, match="NaN"):
        s.sample(x, None, _mask_of(np.array([5, 9]), 64))
    with pytest.raises(ValueError, match="every logit is -inf"):
        s.sample(np.zeros(64, np.float32), None, np.zeros(2, np.int32))


# ---------------------------------------------------------------- grammars
def test_bad_grammars_are_clear_errors():
    with pytest.raises(GrammarError, match="not valid JSON"):
        Grammar.from_json_schema("{nope")
    with pytest.raises(GrammarError, match="JSON object"):
        Grammar.from_json_schema(["type", "object"])
    with pytest.raises(GrammarError):
        Grammar.from_json_schema({"type": "no-such-type"})
    with pytest.raises(GrammarError):
        Grammar.from_lark("start: undefined_rule")
    assert Grammar.json_object().kind == "json_schema"


@pytest.fixture(scope="module")
def stories(stories_dir):
    import edgeinfer

    return edgeinfer.load(stories_dir, backend="reference")


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_parses_and_validates(stories, seed):
    """A 260K-parameter story model, sampled, writes a schema-valid object every time."""
    evs = list(stories.stream("Once upon a time", max_tokens=150, temperature=0.9, seed=seed,
                              json_schema=PERSON))
    text = "".join(e.text for e in evs)
    assert evs[-1].finish_reason == "stop", text
    obj = json.loads(text)
    jsonschema.validate(obj, PERSON)
    assert text.startswith('{"name": "')  # json.dumps's spacing
    # negative control: the same sampling without the schema is prose, not JSON
    free = stories.generate("Once upon a time", max_tokens=40, temperature=0.9, seed=seed)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)


def test_lark_grammar_and_json_object(stories):
    text = stories.generate("Once upon a time", max_tokens=20,
                            grammar='start: "Code " /[0-9]{3}-[A-Z]{2}/')
    assert re.fullmatch(r"Code [0-9]{3}-[A-Z]{2}", text), text
    obj = stories.generate("Once upon a time", max_tokens=60, temperature=0.7, seed=1,
                           json_schema={"type": "object", "properties": {
                               "ok": {"type": "boolean"}}, "required": ["ok"],
                               "additionalProperties": False})
    assert json.loads(obj) in ({"ok": True}, {"ok": False})
    with pytest.raises(GrammarError, match="not both"):
        stories.generate("x", json_schema={"type": "object"}, grammar='start: "a"')


def test_a_stream_cut_by_max_tokens_says_length(stories):
    evs = list(stories.stream("Once upon a time", max_tokens=5, json_schema=PERSON))
    assert evs[-1].finish_reason == "length"
    assert evs[-1].stats.generated_tokens == 5
