"""Streaming detokenizer: cases C01 (byte-level BPE) and C02 (SentencePiece byte fallback).

The invariant under test: the streamed chunks concatenate to ``tokenizer.decode(ids)``
byte for byte, no chunk ends inside a character, and the per-token work stays bounded.
"""
from __future__ import annotations

from conftest import SHARED  # the shared folder (models, data) beside the checkout
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from edgeinfer.detokenizer import HARD_HOLD, StreamingDetokenizer
from edgeinfer.tokenizer import Tokenizer

STORIES_TOKENIZER = SHARED / "models" / "stories260K" / "tokenizer.json"
FFFD = "\ufffd"
TEXT = "hi 😀 你好世界 ok"  # 4-byte emoji, 3-byte CJK


def _byte_level_json() -> str:
    """A GPT-2-style byte-level BPE trained on a tiny corpus; few merges, so that
    multi-byte characters stay split over several ids."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["hello world, hi there. 你好 ok ok 世界 and 😀 again"] * 20
    trainer = trainers.BpeTrainer(vocab_size=290, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.from_json_text(_byte_level_json(), eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    if not STORIES_TOKENIZER.exists():
        pytest.skip(f"{STORIES_TOKENIZER} not present")
    return Tokenizer.from_json_text(STORIES_TOKENIZER.read_text(encoding="utf-8"),
                                    bos_token="<s>", eos_token="</s>", add_bos_token=True)


def stream(tok, ids, **kw) -> tuple[list[str], str]:
    """Feed ids one at a time; return (chunks from add, flush text)."""
    d = StreamingDetokenizer(tok, **kw)
    chunks = [d.add(i) for i in ids]
    tail = d.flush()
    assert d.text == "".join(chunks) + tail
    return chunks, tail


# ---------------------------------------------------------------- C01: byte-level BPE
def test_c01_some_character_spans_several_ids(bpe):
    ids = bpe.encode(TEXT)
    assert bpe.decode(ids) == TEXT
    # decoding ids one by one breaks characters: the precondition of the case
    assert any(FFFD in bpe.decode([i]) for i in ids)
    assert len(ids) > len(bpe.encode("hi  ok")) + 5  # emoji and CJK really cost extra ids


def test_c01_stream_equals_full_decode(bpe):
    ids = bpe.encode(TEXT)
    chunks, tail = stream(bpe, ids)
    assert "".join(chunks) + tail == TEXT
    assert ("".join(chunks) + tail).encode("utf-8") == bpe.decode(ids).encode("utf-8")
    assert tail == ""  # the text ends on a complete character: nothing left to flush
    for c in chunks:
        assert FFFD not in c  # never a partial character in a chunk
    assert sum(1 for c in chunks if c == "") >= 1  # some ids were held back


def test_c01_cut_mid_character_flushes_one_replacement(bpe):
    ids = bpe.encode("ok 😀")
    assert len(ids) >= 3 and FFFD in bpe.decode(ids[-1:])  # the emoji's last bytes are their own id
    cut = ids[:-1]  # a max_tokens cut inside the emoji
    full = bpe.decode(cut)
    assert full.endswith(FFFD) and full.count(FFFD) == 1
    chunks, tail = stream(bpe, cut)
    assert "".join(chunks) in ("ok", "ok ")  # the partial emoji is held back ...
    assert tail.endswith(FFFD) and tail.count(FFFD) == 1  # ... and comes out once, as U+FFFD
    assert "".join(chunks) + tail == full


def test_c01_flush_is_once(bpe):
    d = StreamingDetokenizer(bpe)
    for i in bpe.encode("a😀")[:-1]:
        d.add(i)
    assert d.flush() == FFFD
    assert d.flush() == ""
    assert d.text == "a" + FFFD


def test_special_tokens_skipped_by_default(bpe):
    eot = bpe.token_to_id("<|endoftext|>")
    ids = bpe.encode("hello") + [eot] + bpe.encode(" world")
    chunks, tail = stream(bpe, ids)
    assert "".join(chunks) + tail == "hello world" == bpe.decode(ids)
    chunks, tail = stream(bpe, ids, skip_special=False)
    assert "".join(chunks) + tail == "hello<|endoftext|> world" == bpe.decode(ids, skip_special=False)


# ---------------------------------------------------------------- C02: SPM byte fallback
def test_c02_byte_fallback_ids(spm):
    ids = spm.encode("こん私は")
    byte = lambda b: spm.token_to_id(f"<0x{b:02X}>")  # noqa: E731
    watashi = [byte(0xE7), byte(0xA7), byte(0x81)]  # 私 = U+79C1 = E7 A7 81
    assert any(ids[i:i + 3] == watashi for i in range(len(ids)))
    assert spm.decode(ids) == "こん私は"
    chunks, tail = stream(spm, ids)
    out = "".join(chunks) + tail
    assert out == "こん私は" == spm.decode(ids)
    assert "ç" not in out and FFFD not in out  # bytes never read as Latin-1 code points


def test_c02_byte_run_closed_by_a_piece(spm):
    # a byte-fallback run followed by ordinary pieces: the run comes out as soon as it closes
    ids = spm.encode("私 the")
    chunks, tail = stream(spm, ids)
    assert "".join(chunks) + tail == "私 the" == spm.decode(ids)
    assert "私" in "".join(chunks)  # released before the end of the stream
    assert all(FFFD not in c for c in chunks)


def test_spm_metaspace_spaces_and_first_token_strip(spm):
    text = "Once upon a time, there was a little girl."
    ids = spm.encode(text, add_special=True)
    assert ids[0] == spm.bos_id
    chunks, tail = stream(spm, ids)
    assert "".join(chunks) + tail == spm.decode(ids) == text  # no leading space, all inner spaces
    assert len([c for c in chunks if c]) > 5  # really streamed, word by word


def test_leading_space_restores_the_first_pieces_stripped_space(spm, bpe):
    """A completion's first piece "▁there" keeps its space (llama.cpp prints it); the
    rest of the text, and byte-level BPE, are unchanged; off by default."""
    ids = spm.encode("there was a girl.")  # "▁there ▁was ...": the dummy-prefix mark
    assert spm.id_to_token(ids[0]) == "\u2581there"
    chunks, tail = stream(spm, ids, leading_space=True)
    assert "".join(chunks) + tail == " " + spm.decode(ids) == " there was a girl."
    chunks, tail = stream(spm, ids)  # default: the decode's own text
    assert "".join(chunks) + tail == "there was a girl."
    ing = spm.encode("playing")[1:]  # "ing": a piece without the ▁ mark gets no space
    assert spm.id_to_token(ing[0]) == "ing"
    assert "".join(stream(spm, ing, leading_space=True)[0]) == "ing"
    ids = bpe.encode(" hello world")
    chunks, tail = stream(bpe, ids, leading_space=True)
    assert "".join(chunks) + tail == bpe.decode(ids) == " hello world"


def test_spm_cut_inside_byte_run(spm):
    ids = spm.encode("a私")
    cut = ids[:-1]  # E7 A7: an incomplete character
    chunks, tail = stream(spm, cut)
    assert FFFD not in "".join(chunks)
    assert "".join(chunks) + tail == spm.decode(cut)
    assert tail.endswith(FFFD)  # byte fallback renders each leftover byte token as U+FFFD


# ---------------------------------------------------------------- properties
@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_property_random_ids_stream_equals_decode(which, request):
    tok = request.getfixturevalue(which)
    rng = random.Random(1234)
    special = sorted(tok.special_ids)
    for _ in range(600):
        n = rng.randint(1, 40)
        ids = [rng.choice(special) if special and rng.random() < 0.05 else rng.randrange(tok.vocab_size)
               for _ in range(n)]
        chunks, tail = stream(tok, ids)
        assert "".join(chunks) + tail == tok.decode(ids), ids
        full = tok.decode(ids)
        # no chunk holds a U+FFFD the full decode does not have at the same spot
        pos = 0
        for c in chunks:
            for k, ch in enumerate(c):
                if ch == FFFD:
                    assert full[pos + k] == FFFD
            pos += len(c)


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_property_encoded_text_stream(which, request):
    tok = request.getfixturevalue(which)
    rng = random.Random(99)
    alphabet = list("abc xyz,.\n") + list("你好世界私はこん") + ["😀", "🎉", "é"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = tok.encode(text)
        chunks, tail = stream(tok, ids)
        assert "".join(chunks) + tail == tok.decode(ids)
        assert all(FFFD not in c for c in chunks) and tail.count(FFFD) == 0


class _CountingTokenizer:
    """Wraps a Tokenizer and records the length of every window the detokenizer decodes."""

    def __init__(self, tok):
        self._tok = tok
        self.special_ids = tok.special_ids
        self.byte_fallback_ids = tok.byte_fallback_ids
        self.window_lengths: list[int] = []

    def decode(self, ids, skip_special=True):
        self.window_lengths.append(len(ids))
        return self._tok.decode(ids, skip_special)


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_work_per_token_is_bounded(which, request):
    tok = request.getfixturevalue(which)
    ids = tok.encode("Once upon a time 你好 😀 there was a dog. " * 60)
    assert len(ids) > 1000
    counting = _CountingTokenizer(tok)
    d = StreamingDetokenizer(counting)
    for i in ids:
        d.add(i)
    d.flush()
    assert d.text == tok.decode(ids)
    assert len(counting.window_lengths) <= 2 * len(ids) + 1  # at most two decodes per token
    assert max(counting.window_lengths) <= 16  # short windows, never the whole history


def test_invalid_utf8_forever_is_bounded(bpe):
    # a byte that can never complete a character (0xFF), repeated: the hold is capped
    ff = bpe.token_to_id(bytes_to_unicode_char(0xFF))
    ids = [ff] * 300
    counting = _CountingTokenizer(bpe)
    d = StreamingDetokenizer(counting)
    emitted = "".join(d.add(i) for i in ids) + d.flush()
    assert set(emitted) == {FFFD} and len(emitted) == 300 == len(bpe.decode(ids))
    assert max(counting.window_lengths) <= 2 * HARD_HOLD


def bytes_to_unicode_char(b: int) -> str:
    """GPT-2's byte → printable-character map (the ByteLevel alphabet), for one byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))
