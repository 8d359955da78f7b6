"""Opening a model folder's files safely: path confinement and bounded JSON parsing.

Every file a reader opens from a model folder goes through :func:`folder_file`, and every
JSON document a reader parses (``config.json``, the shard index, tokenizer files,
safetensors headers, ``.eif`` metadata) goes through :func:`parse_json` /
:func:`read_json`. Both raise :class:`~edgeinfer.errors.ModelFormatError` naming the file,
the field and the fix.

Confinement: a name must be relative, and it must resolve (symlinks followed) to a regular
file inside the model folder. In the Hugging Face cache layout
(``models--org--name/snapshots/<rev>/`` holding symlinks to ``../../blobs/<sha>``) the
root is the repository folder ``models--org--name/``, so its own blobs are reachable and
nothing else is. The check resolves the path once and the caller opens the resolved path
(a file swapped for a symlink between the two steps by someone with write access to the
folder is outside this threat model).

JSON limits: file size (:data:`MAX_JSON_BYTES`, :data:`MAX_TOKENIZER_JSON_BYTES`), nesting
(:data:`MAX_JSON_DEPTH` levels for config-like files),
duplicate keys refused (both the first and the last occurrence are plausible readings),
integers of at most 4300 digits (Python's own limit; :data:`MAX_INT_DIGITS` when that
limit is switched off), lone UTF-16 surrogate escapes refused,
and for any document the interpreter's recursion limit (about 1000 levels: the C parser
raises ``RecursionError``, reported as a ModelFormatError).
"""
from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

from ..errors import ModelFormatError

__all__ = ["MAX_INT_DIGITS", "MAX_JSON_BYTES", "MAX_JSON_DEPTH", "MAX_TEXT_BYTES",
           "MAX_TOKENIZER_JSON_BYTES", "check_template", "folder_file", "model_root", "parse_json",
           "read_json", "read_text"]

#: Largest JSON file read from a model folder (config, index, tokenizer_config ...).
MAX_JSON_BYTES = 64 * 1024 * 1024
#: Largest ``tokenizer.json`` (Gemma 3's, 262k tokens, is 33 MB).
MAX_TOKENIZER_JSON_BYTES = 512 * 1024 * 1024
#: Largest text file read from a model folder (``chat_template.jinja``), and the longest
#: chat template accepted from any source (real ones are under 64 KB).
MAX_TEXT_BYTES = 4 * 1024 * 1024
#: Deepest nesting of a config-like JSON document (config, index, tokenizer_config,
#: generation_config, .eif metadata; real files nest at most 4 levels). Values kept from
#: them reach recursive code (``dataclasses.asdict``, ``json.dumps`` when converting).
MAX_JSON_DEPTH = 32
#: Longest integer literal accepted in JSON when the interpreter's own limit
#: (``sys.set_int_max_str_digits``, default 4300 digits) is switched off or raised.
MAX_INT_DIGITS = 40

#: A ``\\uD800``-``\\uDFFF`` escape (a UTF-16 surrogate); :func:`_lone_surrogate` checks
#: whether it is half of a pair.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


#: CPython's default ``sys.get_int_max_str_digits()``.
_PYTHON_INT_DIGITS = 4300


def _int_digit_limit() -> int:
    get = getattr(sys, "get_int_max_str_digits", None)
    return get() if get is not None else 0


class _Refused(Exception):
    """Raised inside the JSON parser's hooks; carries the message."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Refused(f"duplicate key {k!r} (a JSON object may name a key once)")
            seen.add(k)
    return d


def _bounded_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"integer literal of {len(s)} digits ({s[:12]}…); at most "
                       f"{MAX_INT_DIGITS} digits are accepted")
    return int(s)


def _lone_surrogate(text: str) -> int | None:
    """Offset of the first ``\\uD8xx``-``\\uDFxx`` escape that is not half of a surrogate
    pair, or None. A match preceded by an odd number of backslashes is literal text."""
    for m in _SURROGATE_ESCAPE.finditer(text):
        i = m.start()
        k = i
        while k > 0 and text[k - 1] == "\\":
            k -= 1
        if (i - k) % 2:
            continue  # "\\\\uD800" is a backslash then the letters uD800
        high = text[i + 2] in "dD" and text[i + 3] in "89abAB"
        if high:
            nxt = text[i + 6:i + 12]
            if (len(nxt) == 6 and nxt[:2] == "\\u" and nxt[2] in "dD"
                    and nxt[3] in "cdefCDEF"):
                continue
            return i
        prev = text[i - 6:i] if i >= 6 else ""
        if not (prev[:2] == "\\u" and prev[2] in "dD" and prev[3] in "89abAB"):
            return i
    return None


def _depth_exceeds(doc: Any, limit: int) -> bool:
    """Whether lists/objects nest more than ``limit`` deep (iterative: no recursion)."""
    stack = [(doc, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        if d >= limit:
            return True
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return False


def parse_json(text: str | bytes, where: str, max_depth: int | None = None) -> Any:
    """Parse a JSON document with duplicate-key, integer-size and nesting limits.

    Args:
        text: the document (bytes are decoded as UTF-8).
        where: the file (and field) it came from, named in errors.
        max_depth: deepest nesting accepted (None: the parser's recursion limit, about
            1000; used for large documents such as tokenizer.json, walked by nothing
            recursive here).

    Raises:
        ModelFormatError: invalid UTF-8 or JSON, a duplicate key, an over-long integer,
            a lone surrogate escape, or nesting past ``max_depth`` / the recursion limit.
    """
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFormatError(f"{where}: not UTF-8 text (byte {e.start}); the file is "
                                   f"damaged or not JSON") from None
    bad = _lone_surrogate(text) if "\\u" in text else None
    if bad is not None:
        raise ModelFormatError(f"{where}: invalid JSON: lone surrogate escape "
                               f"{text[bad:bad + 6]!r} at character {bad} (not a Unicode "
                               f"character); fix or re-download the file")
    hooks: dict[str, Any] = {"object_pairs_hook": _no_duplicates}
    if not 0 < _int_digit_limit() <= _PYTHON_INT_DIGITS:
        hooks["parse_int"] = _bounded_int  # the interpreter's own limit is off or raised
    try:
        doc = json.loads(text, **hooks)
    except _Refused as e:
        raise ModelFormatError(f"{where}: invalid JSON: {e}; fix or re-download the file") from None
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{where}: invalid JSON ({e}); fix or re-download the file") from None
    except ValueError:  # int() past sys.get_int_max_str_digits()
        raise ModelFormatError(f"{where}: invalid JSON: an integer literal of more than "
                               f"{_int_digit_limit()} digits; not a model file") from None
    except RecursionError:
        raise ModelFormatError(f"{where}: JSON nested too deeply (past the parser's recursion "
                               f"limit); not a model file") from None
    if max_depth is not None and _depth_exceeds(doc, max_depth):
        raise ModelFormatError(f"{where}: JSON nested too deeply (more than {max_depth} levels); "
                               f"not a model file")
    return doc


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise ModelFormatError(f"{path}: {size} bytes, more than the {limit} a {what} "
                                       f"may have; not a model file")
            data = f.read(limit + 1)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) > limit:  # grew while read
        raise ModelFormatError(f"{path}: more than the {limit} bytes a {what} may have")
    return data


def read_json(path: Path, limit: int = MAX_JSON_BYTES, *, object_required: bool = True,
              max_depth: int | None = MAX_JSON_DEPTH) -> Any:
    """Read and parse a JSON file of at most ``limit`` bytes and ``max_depth`` levels (see
    :func:`parse_json`).

    Raises:
        ModelFormatError: unreadable, too large, invalid, or (``object_required``) not a
            JSON object.
    """
    doc = parse_json(_read_bounded(path, limit, "JSON file"), str(path), max_depth)
    if object_required and not isinstance(doc, dict):
        raise ModelFormatError(f"{path}: expected a JSON object {{...}}, found a "
                               f"{type(doc).__name__}; fix or re-download the file")
    return doc


def read_text(path: Path, limit: int = MAX_TEXT_BYTES) -> str:
    """A UTF-8 text file of at most ``limit`` bytes.

    Raises:
        ModelFormatError: unreadable, too large, or not UTF-8.
    """
    data = _read_bounded(path, limit, "text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelFormatError(f"{path}: not UTF-8 text (byte {e.start}); fix or re-download "
                               f"the file") from None


def check_template(text: Any, where: str) -> str | None:
    """A chat template read from a model file: None, or a string of at most
    :data:`MAX_TEXT_BYTES` characters.

    Raises:
        ModelFormatError: not a string, or longer than the limit.
    """
    if text is None:
        return None
    if not isinstance(text, str):
        raise ModelFormatError(f"{where}: the chat template is a {type(text).__name__}, not a "
                               f"string")
    if len(text) > MAX_TEXT_BYTES:
        raise ModelFormatError(f"{where}: a chat template of {len(text)} characters (at most "
                               f"{MAX_TEXT_BYTES}); not a model's template")
    return text


def model_root(folder: Path) -> Path:
    """The folder files of ``folder`` may resolve into: the resolved folder itself, or the
    repository folder ``models--org--name/`` when ``folder`` is (inside) a snapshot of the
    Hugging Face cache (``models--org--name/snapshots/<rev>/``).

    Raises:
        ModelFormatError: the folder cannot be resolved.
    """
    try:
        real = Path(folder).resolve(strict=True)
    except (OSError, RuntimeError) as e:
        raise ModelFormatError(f"{folder}: cannot open the folder ({e})") from None
    for p in (real, *real.parents):
        if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
            return p.parent.parent
    return real


def folder_file(folder: Path, name: Any, *, root: Path | None = None, required: bool = False,
                field: str | None = None) -> Path | None:
    """The resolved path of file ``name`` of a model folder, checked before it is opened.

    Args:
        folder: the model folder (as the user gave it).
        name: a path relative to the folder (a ``weight_map`` entry, ``"config.json"`` ...).
        root: :func:`model_root` of the folder (computed when omitted).
        required: a missing file is an error (else None is returned).
        field: where the name came from (``"model.safetensors.index.json weight_map"``),
            named in errors.

    Returns:
        The resolved path (open this one), or None when absent and not required.

    Raises:
        ModelFormatError: the name is not a non-empty relative path string, it resolves
            outside the model folder (``..``, an absolute path, a symlink pointing out),
            or to something that is not a regular file (a folder, ``/dev/zero``, a FIFO).
    """
    src = f" ({field})" if field else ""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ModelFormatError(f"{folder}: file name {name!r}{src} is not a file name; fix the "
                               f"entry")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise ModelFormatError(f"{folder}: {name!r}{src} is an absolute path; model files must "
                               f"be named relative to the model folder")
    root = model_root(folder) if root is None else root
    p = Path(folder) / name
    # lexically first: a name climbing out with ".." is refused whether or not its target
    # exists (a "missing" answer would reveal what exists outside)
    lexical = Path(os.path.normpath(Path(folder).resolve() / name))
    if not lexical.is_relative_to(root):
        raise ModelFormatError(
            f"{p}{src}: points outside the model folder {root}; edgeinfer reads only files "
            f"inside the model folder")
    try:
        real = p.resolve(strict=True)
    except FileNotFoundError:
        if required:
            raise ModelFormatError(f"{p}: missing{src}; the model folder is incomplete (download "
                                   f"it again)") from None
        return None
    except (OSError, RuntimeError) as e:  # a symlink loop, a component that is a file
        raise ModelFormatError(f"{p}{src}: cannot resolve ({e})") from None
    if not real.is_relative_to(root):
        raise ModelFormatError(
            f"{p}{src}: resolves to {real}, outside the model folder {root}; edgeinfer reads only "
            f"files inside the model folder (copy the file into it)")
    try:
        mode = os.stat(real).st_mode
    except OSError as e:
        raise ModelFormatError(f"{p}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise ModelFormatError(f"{p}{src}: not a regular file (a folder, device or pipe); "
                               f"expected a model file")
    return real
