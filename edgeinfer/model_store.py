"""The models cache as ollama users know it: named variants, list, rm, ps.

Files in the cache folder (:func:`edgeinfer.catalog.models_dir`), one model NAME::

    NAME.gguf (+ NAME.gguf.sha256)   variant "gguf": the pulled catalog file (the default)
    NAME.int4.eif                    variant "int4": RTN INT4, made on first use of NAME:int4
    NAME.gptq.eif, NAME.awq.eif, ... variant "gptq", "awq", "rtn": `edgeinfer convert NAME
                                     --method M` without -o

``NAME:VARIANT`` names one of them wherever a model is taken (``-m``, ``info``,
``convert``, ``serve``, ``edgeinfer.load``); a bare ``NAME`` is ``NAME:gguf``, the pulled
file, run at its own quality. :func:`list_models` describes every file, :func:`remove` deletes a
model or one variant, :func:`record_use` stamps "last used" (``.usage.json`` beside the
files). A running ``edgeinfer serve`` writes ``run/serve-PID.json`` beside the models
folder while it runs (:func:`server_state`), which :func:`running_servers` reads
(``edgeinfer ps``), checking that the process is alive and reading its memory from
``/proc``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import CatalogError

__all__ = ["DEFAULT_VARIANT", "ModelEntry", "ServerEntry", "list_models", "parse_ref",
           "record_use", "remove", "running_servers", "server_state", "variant_path"]

log = logging.getLogger("edgeinfer")

DEFAULT_VARIANT = "gguf"
_VARIANT_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_USAGE = ".usage.json"


def _dir(cache_dir) -> Path:
    from .catalog import models_dir

    return Path(cache_dir) if cache_dir is not None else models_dir()


def parse_ref(ref: str) -> tuple[str, str | None]:
    """``NAME[:VARIANT]`` -> (NAME, VARIANT or None).

    Raises:
        CatalogError: an empty name or a variant that is not lowercase letters, digits, _.
    """
    name, sep, variant = str(ref).partition(":")
    if not name or (sep and not _VARIANT_RE.match(variant)):
        raise CatalogError(f"{ref!r} is not NAME or NAME:VARIANT (a variant is lowercase "
                           f"letters and digits: gguf, int4, gptq, awq, rtn)")
    return name, (variant if sep else None)


def variant_path(name: str, variant: str | None = None, cache_dir=None) -> Path:
    """Where ``NAME:VARIANT`` lives in the cache (``gguf`` -> NAME.gguf, else
    NAME.VARIANT.eif; None is :data:`DEFAULT_VARIANT`); nothing is checked or made."""
    variant = variant or DEFAULT_VARIANT
    suffix = ".gguf" if variant == "gguf" else f".{variant}.eif"
    return _dir(cache_dir) / f"{name}{suffix}"


def _split(filename: str) -> tuple[str, str] | None:
    """(name, variant) of a cache file name, or None for other files."""
    if filename.endswith(".gguf"):
        return filename[:-5], "gguf"
    if filename.endswith(".eif"):
        stem, _, variant = filename[:-4].rpartition(".")
        if stem and _VARIANT_RE.match(variant):
            return stem, variant
        return filename[:-4], "eif"
    return None


# ---- last used --------------------------------------------------------------------------
def _usage(folder: Path) -> dict:
    try:
        data = json.loads((folder / _USAGE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def record_use(path: str | os.PathLike, cache_dir=None) -> None:
    """Stamp ``path`` as used now, when it is a file of the cache (else do nothing).
    Best effort: a read-only cache is logged, not raised."""
    folder = _dir(cache_dir)
    p = Path(path)
    try:
        if p.resolve().parent != folder.resolve():
            return
        usage = _usage(folder)
        usage[p.name] = time.time()
        fd, tmp = tempfile.mkstemp(prefix=".usage-", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(usage, f)
        os.replace(tmp, folder / _USAGE)
    except OSError as e:
        log.debug("could not record the use of %s: %s", p, e)


# ---- list / rm --------------------------------------------------------------------------
@dataclass
class ModelEntry:
    """One file of the cache, as ``edgeinfer list`` shows it.

    Attributes:
        name, variant: ``NAME:VARIANT`` (what ``-m`` takes).
        size: bytes.
        format: "gguf" or "eif".
        method: how the weights are stored: the GGUF's file type (catalog models) or the
            converter's method and bits ("rtn int4 g128", "gptq int4 g128").
        path: the file.
        last_used: seconds since the epoch of the last load, or None.
    """

    name: str
    variant: str
    size: int
    format: str
    method: str
    path: str
    last_used: float | None

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.variant}"

    def as_dict(self) -> dict:
        return {**asdict(self), "ref": self.ref}


def _method(path: Path, name: str, fmt: str) -> str:
    if fmt == "gguf":
        from .catalog import CATALOG

        entry = CATALOG.get(name)
        return f"gguf {entry.file_type}" if entry is not None and entry.file_type else "gguf"
    try:
        from .container import describe_eif

        prov = describe_eif(path).get("provenance") or {}
    except Exception as e:  # noqa: BLE001  a damaged file is still listed
        return f"unreadable ({type(e).__name__})"
    method, bits, group = prov.get("method"), prov.get("bits"), prov.get("group_size")
    if not method:
        return "eif"
    return f"{method} int{bits} g{group}" if bits and group else str(method)


def list_models(cache_dir=None) -> list[ModelEntry]:
    """Every model file of the cache, sorted by name then variant."""
    folder = _dir(cache_dir)
    if not folder.is_dir():
        return []
    usage = _usage(folder)
    out = []
    for p in sorted(folder.iterdir()):
        parsed = _split(p.name)
        if parsed is None or p.name.startswith(".") or not p.is_file():
            continue
        name, variant = parsed
        fmt = "gguf" if variant == "gguf" else "eif"
        out.append(ModelEntry(name, variant, p.stat().st_size, fmt, _method(p, name, fmt),
                              str(p), usage.get(p.name)))
    return sorted(out, key=lambda e: (e.name, e.variant))


def remove(ref: str, cache_dir=None) -> list[Path]:
    """Delete ``NAME`` (every variant and its side files: ``.sha256`` marker, conversion
    lock) or one ``NAME:VARIANT`` from the cache; returns the paths removed.

    Raises:
        CatalogError: nothing of that name (or variant) is in the cache; the message lists
            what is.
    """
    name, variant = parse_ref(ref)
    folder = _dir(cache_dir)
    entries = [e for e in list_models(folder) if e.name == name
               and (variant is None or e.variant == variant)]
    if not entries:
        have = ", ".join(e.ref for e in list_models(folder)) or "nothing"
        raise CatalogError(f"{ref!r} is not in the models cache ({folder}); it holds: {have}")
    removed = []
    for e in entries:
        p = Path(e.path)
        for side in (p, p.with_name(p.name + ".sha256"), p.with_name(p.name + ".lock")):
            with contextlib.suppress(FileNotFoundError):
                side.unlink()
                removed.append(side)
    usage = _usage(folder)
    if any(usage.pop(Path(e.path).name, None) is not None for e in entries):
        with contextlib.suppress(OSError):
            (folder / _USAGE).write_text(json.dumps(usage))
    return removed


# ---- running servers ----------------------------------------------------------------------
def _run_dir(cache_dir=None) -> Path:
    return _dir(cache_dir).parent / "run"


@dataclass
class ServerEntry:
    """A running ``edgeinfer serve``, as ``edgeinfer ps`` shows it.

    Attributes:
        pid, model (the served id), path (the model file), url, backend, n_ctx,
        kv_dtype, started (epoch seconds), weights_bytes, kv_bytes: from the state file;
        rss_bytes: the process's resident memory now (``/proc``; None where unreadable).
    """

    pid: int
    model: str
    path: str
    url: str
    backend: str
    n_ctx: int
    kv_dtype: str
    started: float
    weights_bytes: int
    kv_bytes: int
    rss_bytes: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def server_state(model, model_id: str, url: str, cache_dir=None):
    """While the block runs, ``run/serve-PID.json`` describes this server (``model``: an
    :class:`edgeinfer.api.Model`); removed when the block ends, however it ends."""
    folder = _run_dir(cache_dir)
    path = folder / f"serve-{os.getpid()}.json"
    state = {
        "pid": os.getpid(), "model": model_id,
        "path": str(getattr(model.source, "path", "") or ""), "url": url,
        "backend": model.backend.name, "n_ctx": int(model.n_ctx),
        "kv_dtype": str(model.engine.kv_dtype), "started": time.time(),
        "weights_bytes": _weights(model),
        "kv_bytes": int(model.engine.cache.nbytes),
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".serve-", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not write the server state file %s (edgeinfer ps will not list "
                    "this server): %s", path, e)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def _weights(model) -> int:
    return int(getattr(model, "weight_bytes", 0) or 0)  # a figure for display only


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def running_servers(cache_dir=None) -> list[ServerEntry]:
    """The ``edgeinfer serve`` processes running on this cache; state files of processes
    that are gone (killed with SIGKILL) are removed."""
    folder = _run_dir(cache_dir)
    out = []
    for p in sorted(folder.glob("serve-*.json")) if folder.is_dir() else ():
        try:
            data = json.loads(p.read_text())
            entry = ServerEntry(**{k: data[k] for k in ServerEntry.__dataclass_fields__
                                   if k != "rss_bytes"})
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not _alive(entry.pid):
            with contextlib.suppress(OSError):
                p.unlink()
            continue
        entry.rss_bytes = _rss_bytes(entry.pid)
        out.append(entry)
    return out
