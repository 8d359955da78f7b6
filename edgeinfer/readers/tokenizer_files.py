"""Load-time checks of a ``tokenizer.json`` document against the model it comes with.

``tokenizers`` reports a malformed file as a bare exception when the runtime builds the
tokenizer, and accepts files whose ids run past the model's embedding (an out-of-range
lookup at the first such token). Every reader runs :func:`check_tokenizer_json` on the
parsed document instead, so these fail at load, naming the file, the field and the fix:
not a JSON object, no ``model`` object, an unknown model type, an empty or malformed
vocabulary, an added token without an integer id, a token id >= the config's
``vocab_size``, and a BOS/EOS token string that is not in the vocabulary.
"""
from __future__ import annotations

from typing import Any

from ..errors import ModelFormatError, UnsupportedModelError

__all__ = ["TOKENIZER_MODEL_TYPES", "check_tokenizer_json", "token_id", "token_text"]

#: ``model.type`` values of the ``tokenizers`` library.
TOKENIZER_MODEL_TYPES = ("BPE", "WordPiece", "WordLevel", "Unigram")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_tokenizer_json(doc: Any, where: str, vocab_size: int,
                         specials: dict[str, str | None] | None = None) -> None:
    """Refuse a tokenizer document the model cannot run with.

    Args:
        doc: the parsed ``tokenizer.json``.
        where: its file (named in errors).
        vocab_size: rows of the model's embedding (``config.vocab_size``).
        specials: field name -> token string that must be in the vocabulary, e.g.
            ``{"tokenizer_config.json bos_token": "<s>"}`` (None values are skipped).

    Raises:
        ModelFormatError: the document is malformed, a token id is out of range, or a
            named special token is missing.
        UnsupportedModelError: a ``model.type`` the ``tokenizers`` library does not have.
    """
    if not isinstance(doc, dict):
        raise ModelFormatError(f"{where}: a tokenizer.json must be a JSON object, found a "
                               f"{type(doc).__name__}; re-download the tokenizer")
    model = doc.get("model")
    if not isinstance(model, dict):
        raise ModelFormatError(f"{where}: no 'model' object (the vocabulary); re-download the "
                               f"tokenizer")
    kind = model.get("type")
    if kind is not None and kind not in TOKENIZER_MODEL_TYPES:
        raise UnsupportedModelError(f"{where}: tokenizer model type {kind!r} is unknown "
                                    f"(tokenizers has {', '.join(TOKENIZER_MODEL_TYPES)})")
    vocab = model.get("vocab")
    max_id, max_tok = -1, None
    if kind == "Unigram" or (kind is None and isinstance(vocab, list)):
        if not isinstance(vocab, list) or not all(
                isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) for e in vocab):
            raise ModelFormatError(f"{where}: model.vocab of a Unigram tokenizer must be a list "
                                   f"of [token, score] pairs")
        if vocab:
            max_id, max_tok = len(vocab) - 1, vocab[-1][0]
    else:
        if not isinstance(vocab, dict):
            raise ModelFormatError(f"{where}: model.vocab must be a JSON object token -> id, "
                                   f"found {type(vocab).__name__}")
        ids = list(vocab.values())
        if not all(_int(i) and i >= 0 for i in ids):
            bad = next(k for k, i in vocab.items() if not (_int(i) and i >= 0))
            raise ModelFormatError(f"{where}: model.vocab[{bad!r}] = {vocab[bad]!r} is not a "
                                   f"token id (an integer >= 0)")
        if ids:
            max_id = max(ids)
    added = doc.get("added_tokens", [])
    if added is None:
        added = []
    if not isinstance(added, list):
        raise ModelFormatError(f"{where}: added_tokens must be a list")
    for t in added:
        if not (isinstance(t, dict) and _int(t.get("id")) and t["id"] >= 0
                and isinstance(t.get("content"), str)):
            raise ModelFormatError(f"{where}: added_tokens entry {str(t)[:80]} needs an integer "
                                   f"'id' >= 0 and a string 'content'")
        if t["id"] > max_id:
            max_id, max_tok = t["id"], t["content"]
    if max_id < 0:
        raise ModelFormatError(f"{where}: the vocabulary is empty; re-download the tokenizer")
    if max_id >= vocab_size:
        if max_tok is None:
            max_tok = next(k for k, i in vocab.items() if i == max_id)
        raise ModelFormatError(
            f"{where}: token {max_tok!r} has id {max_id}, but the model's embedding has "
            f"vocab_size = {vocab_size} rows; the tokenizer does not belong to these weights")
    for field, text in (specials or {}).items():
        if text is not None and token_id(doc, text) is None:
            raise ModelFormatError(f"{where}: {field} {text!r} is not in the vocabulary; fix "
                                   f"{field.split()[0]} or re-download the tokenizer")


def token_id(doc: dict, text: str | None) -> int | None:
    """Id of token ``text`` in a checked document (added tokens first), or None."""
    if text is None:
        return None
    for t in doc.get("added_tokens") or []:
        if t.get("content") == text:
            return int(t["id"])
    vocab = doc["model"].get("vocab")
    if isinstance(vocab, dict):
        return vocab.get(text)
    for i, e in enumerate(vocab or []):
        if e[0] == text:
            return i
    return None


def token_text(doc: dict, tid: Any) -> str | None:
    """Token string of id ``tid`` in a checked document, or None."""
    if not _int(tid):
        return None
    for t in doc.get("added_tokens") or []:
        if t.get("id") == tid:
            return t.get("content")
    vocab = doc["model"].get("vocab")
    if isinstance(vocab, dict):
        for k, v in vocab.items():
            if v == tid:
                return k
        return None
    return vocab[tid][0] if 0 <= tid < len(vocab or []) else None
