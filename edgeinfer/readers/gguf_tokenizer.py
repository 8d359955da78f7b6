"""Rebuild a HF ``tokenizer.json`` from the vocabulary a GGUF file carries.

A GGUF has no ``tokenizer.json``: llama.cpp stores the vocabulary as metadata
(``tokenizer.ggml.tokens`` / ``token_type`` / ``scores`` / ``merges`` / ``pre`` …). We
turn it back into the ``tokenizers`` pipeline the original model used (same idea as HF
transformers' ``integrations/gguf`` converters; written independently here), and hand
back the JSON text so the runtime's tokenizer loads it like any HF checkpoint.

``tokenizer.ggml.model``:

* ``"gpt2"`` -- byte-level BPE. Tokens are already spelled in GPT-2's byte alphabet;
  merges come from the file. ``tokenizer.ggml.pre`` picks the pre-tokenizer split
  (:data:`PRE_TOKENIZER_SPLITS`: gpt2, smollm/starcoder = single digits + gpt2,
  qwen2, llama-bpe/llama3 …; an unknown name falls back to GPT-2's regex with a
  warning). Control tokens (type 3) become special added tokens, user-defined tokens
  (type 4, e.g. Qwen's ``<tool_call>``) non-special added tokens; both are stored in the
  GGUF as raw text and are matched whole, as llama.cpp does.
* ``"llama"`` -- SentencePiece BPE (Llama 2, stories260K, Gemma 3's 262k vocab):
  ``Metaspace`` ("▁") pre-tokenizer (prepended at the start of the text when
  ``tokenizer.ggml.add_space_prefix`` is true, the default), BPE with byte fallback
  over the ``<0xNN>`` tokens, decoder Replace/ByteFallback/Fuse(/Strip). The file has
  no merges, so they are derived: every split of a normal token into two normal tokens
  is a merge, ranked by the merged token's score (highest first), which is what
  SentencePiece's BPE encoder maximises. For Gemma the ranking is the token order
  (its scores do not follow its merge order -- transformers' finding; for Gemma 3's
  normal tokens the two orders coincide).

If the file embeds ``tokenizer.huggingface.json`` it is used as is.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from ..errors import ModelFormatError, UnsupportedModelError
from .files import parse_json
from .tokenizer_files import check_tokenizer_json

log = logging.getLogger(__name__)

__all__ = ["PRE_TOKENIZER_SPLITS", "bytes_to_unicode", "tokenizer_json_from_gguf"]

#: Longest token string, and most characters over the whole vocabulary (Gemma 3: 31 and
#: 1.5 M). The SentencePiece merge derivation below costs one step per character and
#: copies of up to a token's length, so these bound its time.
MAX_TOKEN_CHARS = 4096
MAX_VOCAB_CHARS = 1 << 24

# Token types (llama.cpp llama_token_type / gguf-py TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: ``tokenizer.ggml.pre`` -> (split regex or None for GPT-2's built-in one,
#: split digits one by one first, Unicode normalizer, BPE ignore_merges, default add_bos).
#: The regexes are the ones in each family's original tokenizer.json (and llama.cpp's
#: llama-vocab.cpp for the same pre-type).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str | None, bool, str | None, bool, bool]] = {
    "default": (None, False, None, False, False),
    "gpt-2": (None, False, None, False, False),
    "gpt2": (None, False, None, False, False),
    "smollm": (None, True, None, False, False),  # SmolLM/SmolLM2: Digits(individual) + ByteLevel
    "starcoder": (None, True, None, False, False),
    "refact": (None, True, None, False, False),
    "qwen2": (_QWEN2, False, "NFC", False, False),  # Qwen2 tokenizer.json normalizes to NFC
    "deepseek-r1-qwen": (_QWEN2, False, "NFC", False, False),
    "llama-bpe": (_LLAMA3, False, None, True, True),
    "llama3": (_LLAMA3, False, None, True, True),
    "llama-v3": (_LLAMA3, False, None, True, True),
    "smaug-bpe": (_LLAMA3, False, None, True, True),
    "falcon3": (_LLAMA3, False, None, True, True),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (256 entries).

    Printable Latin-1 bytes map to themselves; the others (controls, space, 0x7F-0xA0,
    0xAD) to U+0100 onwards, in byte order.
    """
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
            + list(range(0xAE, 0xFF + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _added(i: int, content: str, special: bool) -> dict:
    return {"id": i, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": special}


def _post_processor(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None,
                    add_bos: bool, add_eos: bool) -> dict:
    single: list[dict] = []
    pair: list[dict] = []
    specials: dict[str, dict] = {}
    if add_bos and bos is not None:
        single.append({"SpecialToken": {"id": bos, "type_id": 0}})
        specials[bos] = {"id": bos, "ids": [bos_id], "tokens": [bos]}
    pair = list(single)
    single.append({"Sequence": {"id": "A", "type_id": 0}})
    pair.append({"Sequence": {"id": "A", "type_id": 0}})
    if add_eos and eos is not None:
        single.append({"SpecialToken": {"id": eos, "type_id": 0}})
        pair.append({"SpecialToken": {"id": eos, "type_id": 0}})
        specials[eos] = {"id": eos, "ids": [eos_id], "tokens": [eos]}
    if add_bos and bos is not None:
        pair.append({"SpecialToken": {"id": bos, "type_id": 1}})
    pair.append({"Sequence": {"id": "B", "type_id": 1}})
    if add_eos and eos is not None:
        pair.append({"SpecialToken": {"id": eos, "type_id": 1}})
    return {"type": "TemplateProcessing", "single": single, "pair": pair,
            "special_tokens": specials}


def _id(md: Mapping[str, Any], key: str, n: int) -> int | None:
    v = md.get(f"tokenizer.ggml.{key}")
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n else None


def _typed_list(md: Mapping[str, Any], key: str, n: int | None, ok, what: str, where: str) -> list | None:
    """Metadata array ``key`` when present: every element passes ``ok``, length ``n``."""
    v = md.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or (n is not None and len(v) != n) or not all(ok(x) for x in v):
        size = f" of {n}" if n is not None else ""
        raise ModelFormatError(f"{where}: GGUF metadata {key} must be an array{size} {what}; the "
                               f"file is corrupt")
    return v


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def tokenizer_json_from_gguf(md: Mapping[str, Any], where: str = "GGUF",
                             vocab_size: int | None = None) -> tuple[str, bool]:
    """Build the ``tokenizer.json`` text of a GGUF's vocabulary.

    Args:
        md: the GGUF metadata (``tokenizer.ggml.*`` keys, ``general.architecture``).
        where: the file name, for error messages.
        vocab_size: rows of the model's embedding; an embedded ``tokenizer.huggingface.json``
            is checked against it (default: the token count).

    Returns:
        ``(tokenizer_json, add_bos_token)``. The JSON's post-processor prepends BOS
        exactly when ``add_bos_token`` is true (``tokenizer.ggml.add_bos_token``; when
        absent, llama.cpp's default: true for SentencePiece vocabularies and llama3-style
        BPE, false for other BPE vocabularies), so ``encode(text)`` and the runtime agree.

    Raises:
        UnsupportedModelError: no vocabulary, or a tokenizer kind other than gpt2/llama.
        ModelFormatError: ill-typed tokenizer metadata (tokens, types, scores, merges,
            pre-tokenizer name), or an embedded tokenizer.json that is invalid or does not
            fit ``vocab_size``.
    """
    kind = md.get("tokenizer.ggml.model")
    tokens = _typed_list(md, "tokenizer.ggml.tokens", None, lambda x: isinstance(x, str),
                         "of strings", where) or []
    if not tokens:
        raise UnsupportedModelError(f"{where}: the GGUF carries no vocabulary "
                                    f"(tokenizer.ggml.tokens)")
    n = len(tokens)
    longest = max(map(len, tokens))
    total = sum(map(len, tokens))
    if longest > MAX_TOKEN_CHARS or total > MAX_VOCAB_CHARS:
        raise ModelFormatError(f"{where}: tokenizer.ggml.tokens holds a token of {longest} "
                               f"characters and {total} in all (at most {MAX_TOKEN_CHARS} and "
                               f"{MAX_VOCAB_CHARS}); not a real vocabulary")
    if md.get("tokenizer.ggml.token_type") is not None:
        bad = md["tokenizer.ggml.token_type"]
        if isinstance(bad, list) and len(bad) != n:
            raise UnsupportedModelError(f"{where}: {len(bad)} token types for {n} tokens")
    types = _typed_list(md, "tokenizer.ggml.token_type", n,
                        lambda x: isinstance(x, int) and not isinstance(x, bool),
                        "of integers", where) or [NORMAL] * n
    _typed_list(md, "tokenizer.ggml.scores", n, _num, "of numbers", where)
    _typed_list(md, "tokenizer.ggml.merges", None, lambda x: isinstance(x, str), "of strings",
                where)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        if md.get(key) is not None and not isinstance(md[key], str):
            raise ModelFormatError(f"{where}: GGUF metadata {key} = {md[key]!r} is not a string")
    bos_id, eos_id, unk_id = _id(md, "bos_token_id", n), _id(md, "eos_token_id", n), _id(md, "unknown_token_id", n)
    bos = tokens[bos_id] if bos_id is not None else None
    eos = tokens[eos_id] if eos_id is not None else None
    pre_name = md.get("tokenizer.ggml.pre") or "default"
    if kind == "gpt2":
        pre = PRE_TOKENIZER_SPLITS.get(pre_name)
        default_bos = pre[4] if pre else False
    elif kind == "llama":
        default_bos = True
    else:
        raise UnsupportedModelError(f"{where}: tokenizer kind {kind!r} is not supported "
                                    f"(edgeinfer rebuilds 'gpt2' byte-level BPE and 'llama' "
                                    f"SentencePiece vocabularies)")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", default_bos))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))

    embedded = md.get("tokenizer.huggingface.json")
    if isinstance(embedded, str) and embedded.strip():
        key = f"{where}: tokenizer.huggingface.json"
        check_tokenizer_json(parse_json(embedded, key), key, vocab_size or n)
        return embedded, add_bos

    if kind == "gpt2":
        tok = _byte_level(md, tokens, types, pre_name, where)
    else:
        tok = _sentencepiece(md, tokens, types, unk_id)
    tok["post_processor"] = _post_processor(bos, bos_id, eos, eos_id, add_bos, add_eos)
    return json.dumps(tok, ensure_ascii=False), add_bos


def _vocab_and_added(tokens: list[str], types: list[int], spell) -> tuple[dict[str, int], list[dict]]:
    """Model vocab (first id wins on duplicates) and the added-token list."""
    vocab: dict[str, int] = {}
    added: list[dict] = []
    dups = 0
    for i, (t, ty) in enumerate(zip(tokens, types)):
        whole = ty in (CONTROL, USER_DEFINED, UNKNOWN)
        key = t if whole else spell(t)
        if key in vocab:
            dups += 1
            continue
        vocab[key] = i
        if whole:
            added.append(_added(i, t, special=ty != USER_DEFINED))
    if dups:
        log.warning("GGUF vocabulary has %d duplicate token strings; the first id of each is used "
                    "for encoding", dups)
    return vocab, added


def _byte_level(md: Mapping[str, Any], tokens: list[str], types: list[int], pre_name: str,
                where: str) -> dict:
    table = bytes_to_unicode()
    alphabet = set(table.values())

    def spell(t: str) -> str:
        # Normal tokens are stored in the byte alphabet already; re-spell the odd one
        # that is not (written as raw text by some converters).
        return t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8"))

    vocab, added = _vocab_and_added(tokens, types, spell)
    merges: list[list[str]] = []
    dropped = 0
    for m in md.get("tokenizer.ggml.merges") or []:
        a, sep, b = m.partition(" ")
        if not sep or a not in vocab or b not in vocab or (a + b) not in vocab:
            dropped += 1
            continue
        merges.append([a, b])
    if dropped:
        log.warning("%s: %d merges reference tokens outside the vocabulary; dropped", where, dropped)
    pre = PRE_TOKENIZER_SPLITS.get(pre_name)
    if pre is None:
        log.warning("%s: unknown tokenizer.ggml.pre %r; using GPT-2's pre-tokenizer (token ids "
                    "may differ from the original tokenizer on some text)", where, pre_name)
        pre = PRE_TOKENIZER_SPLITS["default"]
    regex, digits, norm, ignore_merges, _ = pre
    if regex is None:
        steps = [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}]
    else:
        steps = [{"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
                  "invert": False},
                 {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}]
    if digits:
        steps.insert(0, {"type": "Digits", "individual_digits": True})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": norm} if norm else None,
        "pre_tokenizer": steps[0] if len(steps) == 1 else {"type": "Sequence", "pretokenizers": steps},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                  "vocab": vocab, "merges": merges},
    }


def _sentencepiece(md: Mapping[str, Any], tokens: list[str], types: list[int],
                   unk_id: int | None) -> dict:
    arch = str(md.get("general.architecture", ""))
    add_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    scores: list[float] = list(md.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab, added = _vocab_and_added(tokens, types, lambda t: t)
    normal = {t: i for t, i in vocab.items() if types[i] == NORMAL}
    by_order = arch.startswith("gemma")
    rank = (lambda i: float(i)) if by_order else (lambda i: -float(scores[i]))
    cands = []
    get = normal.get  # hot loop: ~1.3M lookups for Gemma's 262k vocabulary
    for t, i in normal.items():
        n_chars = len(t)
        if n_chars < 2:
            continue
        r = rank(i)
        for k in range(1, n_chars):
            ia = get(t[:k])
            if ia is None:
                continue
            ib = get(t[k:])
            if ib is not None:
                # best merged token first; then longer left piece, then ids (deterministic)
                cands.append((r, -k, k - n_chars, i, ia, ib, t[:k], t[k:]))
    cands.sort()
    merges = [[c[6], c[7]] for c in cands]
    decoders: list[dict] = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                          "prepend_scheme": "first" if add_prefix else "never", "split": False},
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None,
                  "unk_token": tokens[unk_id] if unk_id is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
