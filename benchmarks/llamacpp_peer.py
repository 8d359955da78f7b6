"""llama.cpp's side of the CPU benchmark: its environment, its files, its runs.

* :func:`peer_env`: the environment llama.cpp runs in: the user's, as captured before
  anything of edgeinfer was imported, plus only the tuning the user asked both sides for.
* :func:`f32_gguf`: the catalog GGUF dequantized to an F32 GGUF with the ``gguf`` package
  (every metadata key, tokenizer included, so llama.cpp loads it), the baseline weights
  both sides quantize from; :func:`q4_0_gguf`: llama.cpp's own Q4_0 of it
  (``llama_model_quantize``). Both are cached under :func:`cache_dir` and reused.
* :func:`run_peer`: one ``peer_bench.py`` run in its own process.

Everything that loads llama.cpp runs in a subprocess: a wheel built for another CPU dies
with SIGILL, which is reported as :class:`PeerError` with the fix.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

PEER = Path("/work/shared/peer/peer_bench.py")
REBUILD = "CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python==0.3.36"
#: llama.cpp's ``enum llama_ftype`` values (include/llama.h)
FTYPE_ALL_F32, FTYPE_Q4_0 = 0, 2


class PeerError(RuntimeError):
    """llama.cpp could not run; the message says why and what to do."""


def peer_env(user_env: dict[str, str], wait_policy: str | None = None) -> dict[str, str]:
    """The environment for a process of either side: ``user_env`` (a copy), plus
    ``OMP_WAIT_POLICY=wait_policy`` when the user tunes it for both sides."""
    env = dict(user_env)
    if wait_policy is not None:
        env["OMP_WAIT_POLICY"] = wait_policy
    return env


def cache_dir() -> Path:
    """Where the derived GGUFs live: ``<edgeinfer's model cache>/../bench`` (outside git)."""
    from edgeinfer.catalog import models_dir
    d = models_dir().parent / "bench"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _failure(what: str, r: subprocess.CompletedProcess) -> PeerError:
    if r.returncode == -signal.SIGILL:
        return PeerError(
            f"{what}: llama.cpp died with SIGILL (illegal instruction): the installed "
            f"llama-cpp-python was built for another CPU. Rebuild it on this machine: {REBUILD}")
    tail = (r.stderr or "").strip()[-600:]
    return PeerError(f"{what}: exit status {r.returncode}\n{tail}")


def _publish(tmp: str, out: Path) -> None:
    """Rename the finished temporary file to ``out`` with the umask's ordinary file mode
    (``mkstemp`` makes 0600)."""
    um = os.umask(0)
    os.umask(um)
    os.chmod(tmp, 0o666 & ~um)
    os.replace(tmp, out)


def f32_gguf(src: Path, out: Path) -> Path:
    """Write ``src`` dequantized to float32 as the GGUF ``out`` (skipped when it exists).

    Every key-value field is copied as typed in ``src`` (``general.file_type`` becomes,
    or is added as, ALL_F32; the quantization version is dropped); every tensor keeps its name and GGUF
    layout. Written to a temporary file renamed at the end.
    """
    if out.exists():
        return out
    import gguf
    from gguf import GGUFValueType

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    fd, tmp = tempfile.mkstemp(prefix=".f32-", suffix=".gguf.tmp", dir=out.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        for name, field in r.fields.items():
            if name.startswith("GGUF.") or name in ("general.architecture",
                                                    "general.quantization_version"):
                continue  # the writer adds the header and the architecture itself
            val = FTYPE_ALL_F32 if name == "general.file_type" else field.contents()
            vtype = field.types[0]
            sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            w.add_key_value(name, val, vtype, sub_type=sub)
        if "general.file_type" not in r.fields:
            w.add_key_value("general.file_type", FTYPE_ALL_F32, GGUFValueType.UINT32)
        for t in r.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            w.add_tensor(t.name, a.reshape([int(d) for d in reversed(t.shape)]))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        _publish(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


QUANTIZE_CODE = """
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = int(sys.argv[3])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""


def q4_0_gguf(f32: Path, out: Path, env: dict[str, str]) -> Path:
    """llama.cpp's Q4_0 of the F32 GGUF (``llama_model_quantize`` in a subprocess),
    written to a temporary file renamed at the end; skipped when ``out`` exists.

    Raises:
        PeerError: llama.cpp failed (SIGILL: the message gives the rebuild command).
    """
    if out.exists():
        return out
    fd, tmp = tempfile.mkstemp(prefix=".q4_0-", suffix=".gguf.tmp", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([sys.executable, "-c", QUANTIZE_CODE, str(f32), tmp,
                            str(FTYPE_Q4_0)], env=env, capture_output=True, text=True,
                           check=False)
        if r.returncode != 0:
            raise _failure(f"quantizing {f32.name} to Q4_0", r)
        _publish(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def gguf_format(path: Path) -> str:
    """The file's llama.cpp format name from ``general.file_type`` (e.g. ``MOSTLY_Q4_0``)."""
    import gguf
    r = gguf.GGUFReader(path)
    f = r.fields.get("general.file_type")
    if f is None:
        return "unknown"
    try:
        return gguf.LlamaFileType(int(f.contents())).name
    except ValueError:
        return f"file_type {int(f.contents())}"


def run_peer(path: Path, n_prompt: int, n_gen: int, threads: int, env: dict[str, str],
             script: Path = PEER) -> dict:
    """One ``peer_bench.py`` run on ``path`` in its own process with exactly ``env``.

    Returns its JSON line (``prefill_tok_s``, ``decode_tok_s``, ...).

    Raises:
        PeerError: the run failed (SIGILL: the message gives the rebuild command).
    """
    r = subprocess.run([sys.executable, str(script), str(path), str(n_prompt), str(n_gen),
                        str(threads)], env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise _failure(f"llama.cpp on {path.name}", r)
    return json.loads(r.stdout.strip().splitlines()[-1])
