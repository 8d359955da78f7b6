"""No lost data from ``convert`` / ``write_eif``: an existing file is replaced only with
``--force``, an input never (also through a hard or symbolic link); a failed, interrupted
or killed write leaves no temporary file behind (the next write sweeps a killed writer's);
a full disk, a read-only folder or a folder as target is one clear error."""
from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import STORIES
from edgeinfer import container, safe_write
from edgeinfer.container import read_eif, write_eif
from edgeinfer.errors import OutputError
from test_container import TOKENIZER, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


def write(path, **kw):
    cfg, t = tiny_model()
    return write_eif(path, cfg, t, tokenizer_json=TOKENIZER, **kw)


def temps(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(".eif-"))


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def run_cli(*args, preexec_fn=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, preexec_fn=preexec_fn)


def one_error_line(r) -> str:
    """The CLI failed with exactly one ``error: ...`` line and no traceback."""
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


# ---- overwriting ------------------------------------------------------------------------
def test_existing_target_is_replaced_only_with_overwrite(tmp_path):
    out = tmp_path / "m.eif"
    out.write_bytes(b"precious")
    with pytest.raises(OutputError, match=r"m\.eif already exists; .*--force"):
        write(out)
    assert out.read_bytes() == b"precious" and temps(tmp_path) == []
    size = write(out, overwrite=True)
    assert size == out.stat().st_size and read_eif(out).config.hidden_size == 16


def test_a_target_created_during_the_write_is_not_replaced(tmp_path, monkeypatch):
    """The final rename is a hard link, which fails if another process made the file."""
    out = tmp_path / "m.eif"
    real = container._write_safetensors

    def racing(path, header, arrays):
        real(path, header, arrays)
        out.write_bytes(b"someone else's")

    monkeypatch.setattr(container, "_write_safetensors", racing)
    with pytest.raises(OutputError, match="already exists"):
        write(out)
    assert out.read_bytes() == b"someone else's" and temps(tmp_path) == []


def test_target_that_is_a_folder_or_not_a_regular_file(tmp_path):
    with pytest.raises(OutputError, match=r"is a folder; give a file name, e\.g\. .*model\.eif"):
        write(tmp_path)
    with pytest.raises(OutputError, match="is not a regular file"):
        write("/dev/null", overwrite=True)
    with pytest.raises(OutputError, match="no such folder"):
        write(tmp_path / "absent" / "m.eif")
    assert os.listdir(tmp_path) == []
    os.symlink(tmp_path / "gone.eif", tmp_path / "dangling.eif")
    with pytest.raises(OutputError, match="a symbolic link to a missing file.*--force"):
        write(tmp_path / "dangling.eif")
    write(tmp_path / "dangling.eif", overwrite=True)  # the link is replaced, not followed
    assert not os.path.islink(tmp_path / "dangling.eif") and not (tmp_path / "gone.eif").exists()


# ---- never over the input -----------------------------------------------------------------
@pytest.fixture
def gguf_copy(tmp_path):
    gguf = STORIES / "stories260K.gguf"
    if not gguf.exists():
        pytest.skip(f"stories260K not found: {gguf}")
    src = tmp_path / "stories.gguf"
    shutil.copyfile(gguf, src)
    return src


def test_convert_never_writes_over_its_input(gguf_copy, tmp_path):
    from edgeinfer.quant.convert import convert

    before = sha(gguf_copy)
    os.link(gguf_copy, tmp_path / "hard.gguf")
    os.symlink(gguf_copy, tmp_path / "soft.gguf")
    calib = tmp_path / "calib.txt"
    calib.write_text("Once upon a time there was a girl. " * 20)
    for out, why in [(gguf_copy, "is the input;"), (tmp_path / "hard.gguf", "a link to it"),
                     (tmp_path / "soft.gguf", "a link to it")]:
        with pytest.raises(OutputError, match=why):
            convert(str(gguf_copy), str(out), method="rtn", progress=False, overwrite=True)
    with pytest.raises(OutputError, match="is the input"):  # the calibration text is an input too
        convert(str(gguf_copy), str(calib), method="awq", calib_path=str(calib), progress=False,
                overwrite=True)
    assert sha(gguf_copy) == before and os.path.islink(tmp_path / "soft.gguf")
    # positive control: the same call onto a new file works, and again with overwrite
    out = tmp_path / "s.eif"
    convert(str(gguf_copy), str(out), method="rtn", progress=False)
    convert(str(gguf_copy), str(out), method="rtn", progress=False, overwrite=True)
    assert read_eif(out).config.vocab_size == 512 and temps(tmp_path) == []


def test_convert_never_writes_over_a_file_of_its_input_folder(tmp_path):
    from edgeinfer.quant.convert import convert

    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260K not found: {STORIES}")
    folder = tmp_path / "hf"
    shutil.copytree(STORIES, folder)
    os.chmod(folder, 0o755)
    weights = sha(folder / "model.safetensors")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        with pytest.raises(OutputError, match="is the input"):
            convert(str(folder), str(folder / name), method="rtn", progress=False, overwrite=True)
    assert sha(folder / "model.safetensors") == weights
    convert(str(folder), str(folder / "model.eif"), method="rtn", progress=False)  # a new file: fine
    convert(str(folder), str(folder / "model.eif"), method="rtn", progress=False, overwrite=True)
    assert read_eif(folder / "model.eif").config.hidden_size == 64


def test_cli_convert_refuses_its_input_an_existing_file_and_a_folder(gguf_copy, tmp_path):
    before = sha(gguf_copy)
    line = one_error_line(run_cli("convert", str(gguf_copy), "-o", str(gguf_copy), "--method",
                                  "rtn", "-q", "--force"))
    assert f"{gguf_copy} is the input" in line and sha(gguf_copy) == before
    existing = tmp_path / "old.eif"
    existing.write_bytes(b"old")
    line = one_error_line(run_cli("convert", str(gguf_copy), "-o", str(existing), "-q"))
    assert "old.eif already exists" in line and "--force" in line
    assert existing.read_bytes() == b"old"
    line = one_error_line(run_cli("convert", str(gguf_copy), "-o", str(tmp_path), "-q"))
    assert "is a folder" in line
    r = run_cli("convert", str(gguf_copy), "-o", str(existing), "--method", "rtn", "-q", "--force")
    assert r.returncode == 0, r.stderr
    assert read_eif(existing).config.vocab_size == 512 and temps(tmp_path) == []


# ---- temporary files of killed writers ------------------------------------------------------------
def test_sweep_removes_only_dead_writers_files(tmp_path):
    import fcntl

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "dead": f".eif-{dead.pid}-abc.tmp",
            "live": f".eif-{live.pid}-def.tmp",
            "mine": f".eif-{os.getpid()}-ghi.tmp",  # another thread of this process may write it
            "dead_but_locked": f".eif-{dead.pid}-jkl.tmp",  # e.g. a writer in another PID namespace
            "legacy_old": ".eif-q1w2e3.tmp",
            "legacy_new": ".eif-r4t5y6.tmp",
            "not_ours": "notes.tmp",
        }
        for n in names.values():
            (tmp_path / n).write_bytes(b"x" * 100)
        os.utime(tmp_path / names["legacy_old"], (1, 1))  # unmodified for decades
        held = os.open(tmp_path / names["dead_but_locked"], os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            removed = safe_write.sweep_stale_temp_files(tmp_path)
        finally:
            os.close(held)
        assert sorted(p.name for p in removed) == sorted([names["dead"], names["legacy_old"]])
        assert sorted(os.listdir(tmp_path)) == sorted(
            names[k] for k in ("live", "mine", "dead_but_locked", "legacy_new", "not_ours"))
    finally:
        live.kill()
        live.wait()


SLOW_WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from edgeinfer import container
    from test_container import TOKENIZER, tiny_model

    def slow(path, header, arrays):  # half the file, then a long stall
        with open(path, "wb") as f:
            f.write(header)
        print(path, flush=True)
        for _ in range(600):  # in short sleeps, as a writer between chunks: a signal that
            time.sleep(0.1)   # lands on another thread (BLAS) is run by the main one soon

    container._write_safetensors = slow
    cfg, t = tiny_model()
    container.write_eif(sys.argv[1], cfg, t, tokenizer_json=TOKENIZER)
""")


def _start_slow_writer(out):
    p = subprocess.Popen([sys.executable, "-c", SLOW_WRITER.format(tests=TESTS), str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    tmp = p.stdout.readline().strip()
    assert tmp and os.path.exists(tmp), p.stderr.read() if p.poll() is not None else tmp
    assert os.path.basename(tmp).startswith(f".eif-{p.pid}-")  # the writer's PID in the name
    return p, tmp


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_during_the_write_removes_the_temporary_file(tmp_path, sig):
    out = tmp_path / "m.eif"
    p, tmp = _start_slow_writer(out)
    p.send_signal(sig)
    rc = p.wait(20)
    # the process still ends by that signal (SIGINT: Python's KeyboardInterrupt, uncaught)
    assert rc == -sig, (rc, p.stderr.read())
    assert os.listdir(tmp_path) == []


def test_a_killed_writers_file_is_swept_by_the_next_write(tmp_path):
    out = tmp_path / "m.eif"
    p, tmp = _start_slow_writer(out)
    p.kill()  # SIGKILL: nothing can clean up
    p.wait(20)
    assert temps(tmp_path) == [os.path.basename(tmp)]
    write(out)
    assert os.listdir(tmp_path) == ["m.eif"] and read_eif(out).config.hidden_size == 16


# ---- full disk, read-only folder ----------------------------------------------------------------
def test_no_space_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "m.eif"
    out.write_bytes(b"the previous model")

    class Statvfs:  # 1 MiB free: less than the file needs
        f_bavail, f_frsize = 256, 4096

    monkeypatch.setattr(safe_write.os, "statvfs", lambda p: Statvfs)
    monkeypatch.setattr(container, "_safetensors_header", lambda a, m, real=container._safetensors_header:
                        real(a, m) + b" " * (2 << 20))  # a 2 MiB header: the file needs > 2 MiB
    with pytest.raises(OutputError, match=r"m\.eif: no space left on the device \(the file needs "
                                          r"2\.\d MiB, 1\.0 MiB free\); free some space"):
        write(out, overwrite=True)
    assert out.read_bytes() == b"the previous model" and temps(tmp_path) == []


def test_disk_full_while_writing_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "m.eif"
    out.write_bytes(b"the previous model")

    def full(path, header, arrays):
        with open(path, "wb") as f:
            f.write(header)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(container, "_write_safetensors", full)
    with pytest.raises(OutputError, match=r"m\.eif: no space left on the device .*another disk") as e:
        write(out, overwrite=True)
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert out.read_bytes() == b"the previous model" and temps(tmp_path) == []


def test_cli_convert_past_the_file_size_limit(tmp_path):
    """A real short write (RLIMIT_FSIZE: Python ignores SIGXFSZ, so write() fails EFBIG)."""
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260K not found: {STORIES}")
    out = tmp_path / "s.eif"

    def limit():  # the .eif is about 250 KB
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    line = one_error_line(run_cli("convert", str(STORIES), "-o", str(out), "--method", "rtn", "-q",
                                  preexec_fn=limit))
    assert f"{out}: the file is larger than this process may write" in line and "ulimit -f" in line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("code,expect", [(errno.EROFS, "read-only file system"),
                                         (errno.EACCES, "permission denied")])
def test_read_only_or_unwritable_folder(tmp_path, monkeypatch, code, expect):
    def refuse(*a, **kw):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(safe_write.tempfile, "mkstemp", refuse)
    with pytest.raises(OutputError, match=f"^{tmp_path}: {expect}; write the output to a"):
        write(tmp_path / "m.eif")
    assert os.listdir(tmp_path) == []


def _without_dac_override() -> None:
    """preexec_fn: under root, drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the
    bounding set, so the exec'd CLI obeys file modes like any user (prctl PR_CAPBSET_DROP)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_cli_convert_into_a_read_only_folder(tmp_path):
    """A real EACCES from the file system, also under root (see _without_dac_override)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        line = one_error_line(run_cli("convert", str(STORIES), "-o", str(folder / "s.eif"),
                                      "--method", "rtn", "-q", preexec_fn=_without_dac_override))
        assert "permission denied" in line and str(folder) in line
        assert os.listdir(folder) == []
    finally:
        folder.chmod(0o755)
