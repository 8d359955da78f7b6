"""Tokenizers rebuilt from GGUF vocabularies vs independent references.

References: stories260K's own tokenizer.json (SentencePiece BPE with byte fallback),
and HF transformers' tokenizer loaded from the same GGUF file (transformers builds it
with its own GGUF converters). The default run builds the transformers tokenizer
with the two functions ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` calls
for it (``get_gguf_tokenizer`` + ``convert_gguf_tokenizer``): the full AutoTokenizer
also parses the whole file through ``gguf.GGUFReader`` for the model config (8-20 s
here); the ``slow`` test goes through AutoTokenizer itself.
"""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from edgeinfer.readers.gguf import GGUFFile, read_gguf
from edgeinfer.readers.gguf_tokenizer import bytes_to_unicode, tokenizer_json_from_gguf

MIXED = [
    "Hello world! The year 2024 had 366 days; π≈3.14159, 1000000 users.",
    "  two leading spaces, then\n\nnewlines\tand a tab\r\nCRLF",
    "emoji 😀🎉 👨‍👩‍👧 flags 🇫🇷 CJK 你好，世界。日本語のテキスト 한국어 텍스트",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # O(2^n)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 2; }\n\n\n",
    "Ünïcödé çàfé naïve — “quotes” … ¿qué? Ελληνικά кириллица العربية",
    "don't I'll we've THEY'RE",
    "     many    spaces   ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "",
]


def _hf_gguf_tokenizer(path):
    """transformers' tokenizer for a GGUF: (tokenizers.Tokenizer, tokenizer_config dict)."""
    pytest.importorskip("transformers", reason="transformers is the reference tokenizer")
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:  # other transformers versions: the public (slower) path
        from transformers import AutoTokenizer

        t = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return t.backend_tokenizer, {"add_bos_token": getattr(t, "add_bos_token", None)}
    arch, tok_dict, tok_cfg = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(arch, tok_dict)
    return backend, tok_cfg


def _check_parity(ours: Tokenizer, ref: Tokenizer, texts=MIXED):
    for text in texts:
        a = ours.encode(text, add_special_tokens=False).ids
        b = ref.encode(text, add_special_tokens=False).ids
        assert a == b, f"ids differ on {text!r}"
        # decoding round-trips (special tokens kept as text)
        assert ours.decode(a, skip_special_tokens=False) == text


def test_bytes_to_unicode_is_gpt2s_table():
    t = bytes_to_unicode()
    assert len(set(t.values())) == 256
    assert t[ord(" ")] == "Ġ" and t[ord("\n")] == "Ċ" and t[ord("A")] == "A" and t[0xAD] == "Ń"


def test_stories_gguf_tokenizer_equals_its_tokenizer_json(stories_dir, stories_gguf):
    ref_json = json.loads((stories_dir / "tokenizer.json").read_text())
    g = GGUFFile(stories_gguf)
    ours_text, add_bos = tokenizer_json_from_gguf(g.metadata)
    ours_json = json.loads(ours_text)
    # merges derived from the SentencePiece scores == the merges HF wrote
    assert [tuple(m) for m in ours_json["model"]["merges"]] == \
        [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in ref_json["model"]["merges"]]
    assert ours_json["model"]["vocab"] == ref_json["model"]["vocab"]
    ours, ref = Tokenizer.from_str(ours_text), Tokenizer.from_str(json.dumps(ref_json))
    assert add_bos is True
    stories = ["Once upon a time, there was a little girl named Lily.",
               "She saw a big, red ball!\nIt was 3 feet high.", " leading space", "x"]
    for text in stories + MIXED:
        assert ours.encode(text).ids == ref.encode(text).ids, text  # BOS included
        ids = ours.encode(text).ids
        assert ours.decode(ids) == ref.decode(ids)
    assert ours.encode("Once upon a time").ids == [1, 403, 407, 261, 378]
    # byte fallback: 😀 (F0 9F 98 80) is not in the 512-token vocab
    assert ours.encode("😀", add_special_tokens=False).tokens[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]


def test_smollm2_parity_with_transformers(smollm2_gguf):
    ours = Tokenizer.from_str(read_gguf(smollm2_gguf).tokenizer_json)
    ref, cfg = _hf_gguf_tokenizer(smollm2_gguf)
    _check_parity(ours, ref)
    assert cfg["add_bos_token"] is False
    ids = ours.encode("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == 1 and ids[-1] == 2  # control tokens stay whole
    assert ours.encode("12345", add_special_tokens=False).tokens == ["1", "2", "3", "4", "5"]
    assert ours.decode(ids, skip_special_tokens=True) == "user\nHi"


def test_qwen_parity_with_transformers(qwen_gguf):
    src = read_gguf(qwen_gguf)
    ours = Tokenizer.from_str(src.tokenizer_json)
    ref, cfg = _hf_gguf_tokenizer(qwen_gguf)
    _check_parity(ours, ref, MIXED + ["<tool_call>\n{\"name\": \"f\"}\n</tool_call>"])
    assert src.add_bos_token is False and cfg["add_bos_token"] is False
    assert ours.encode("<tool_call>", add_special_tokens=False).ids == [151657]
    assert ours.encode("12345", add_special_tokens=False).ids == [16, 17, 18, 19, 20]


@pytest.mark.slow
def test_full_autotokenizer_parity(smollm2_gguf, qwen_gguf):
    transformers = pytest.importorskip("transformers")
    for path in (smollm2_gguf, qwen_gguf):
        ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        src = read_gguf(path)
        ours = Tokenizer.from_str(src.tokenizer_json)
        for text in MIXED:
            assert ours.encode(text).ids == ref(text)["input_ids"], (path.name, text)
        assert src.eos_token == ref.eos_token


@pytest.mark.slow
def test_gemma3_parity_with_transformers(gemma_gguf):
    src = read_gguf(gemma_gguf)
    assert src.add_bos_token is True
    ours = Tokenizer.from_str(src.tokenizer_json)
    ref, _ = _hf_gguf_tokenizer(gemma_gguf)
    _check_parity(ours, ref)
    assert ours.encode("hi").ids[0] == 2  # <bos>
    assert ours.encode("\n\n", add_special_tokens=False).ids == [108]
