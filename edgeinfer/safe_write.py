"""Writing an output file without losing data.

The rules (every writer of a model file goes through :func:`atomic_output`):

* an existing target is refused unless ``overwrite`` (the CLI's ``--force``);
* an input is never written over, not even with ``overwrite``: the target is compared
  with each input by device and inode (so a symlink or hard link to the input counts), and
  with the model files of an input folder (:data:`INPUT_SUFFIXES`);
* a target that is a folder or not a regular file (``/dev/null``, a FIFO) is refused;
* the data goes to a temporary file ``.eif-<pid>-<random>.tmp`` in the target's folder,
  renamed into place only when complete (without ``overwrite`` through ``os.link``, which
  fails rather than replace a file another process created meanwhile);
* the temporary file is removed when the write fails, on Ctrl-C, and on SIGTERM / SIGHUP
  (handlers installed for the write's duration, main thread only, for signals still at
  their default action; SIGKILL cannot be caught: the sweep below handles it);
* before writing, temporary files of writers that are gone are removed from the folder
  (:func:`sweep_stale_temp_files`: the PID in the name is dead and no process holds the
  file's lock); a live writer's file, or this process's, is never touched;
* a full disk, a read-only or unwritable folder, or a file-size limit becomes one
  :class:`~edgeinfer.errors.OutputError` line naming the path and the fix (free space is
  checked before writing when the size is known).
"""
from __future__ import annotations

import contextlib
import errno as _errno
import os
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import OutputError

TEMP_PREFIX = ".eif-"
TEMP_SUFFIX = ".tmp"
#: Files of an input *folder* that a reader may have read (weights, configs, tokenizers,
#: templates): the target may not be one of them.
INPUT_SUFFIXES = (".safetensors", ".json", ".gguf", ".model", ".txt", ".jinja", ".bin", ".pt",
                  ".pth")
#: A temporary file without a PID in its name (older edgeinfer) counts as stale after this.
LEGACY_STALE_S = 600.0
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, n))

try:  # POSIX advisory locks: a live writer holds one on its temporary file
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


def _force_hint(what: str) -> str:
    return f"choose another {what}, or pass --force (overwrite=True in Python) to replace it"


def _input_files(inputs: Iterable[str | os.PathLike | None]) -> list[str]:
    """Each input file, and the model files directly inside each input folder."""
    out = []
    for inp in inputs:
        if inp is None:
            continue
        inp = os.fspath(inp)
        if os.path.isdir(inp):
            try:
                names = sorted(os.listdir(inp))
            except OSError:
                continue
            out += [os.path.join(inp, n) for n in names if n.endswith(INPUT_SUFFIXES)]
        elif os.path.exists(inp):
            out.append(inp)
    return out


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_output(path: str | os.PathLike, *, overwrite: bool = False,
                 inputs: Iterable[str | os.PathLike | None] = (), what: str = "output path (-o)"
                 ) -> Path:
    """Refuse a target that may not be written; returns it as an absolute path.

    Args:
        path: the file to write.
        overwrite: an existing regular file may be replaced (``--force``).
        inputs: files or folders the output is made from: never written over.
        what: how the user names the path, for the messages.

    Raises:
        OutputError: the target is a folder, not a regular file, an input (always), exists
            (without ``overwrite``), or its folder does not exist.
    """
    target = Path(os.path.abspath(os.fspath(path)))
    if target.is_dir():
        raise OutputError(f"{path} is a folder; give a file name, e.g. {target / 'model.eif'}",
                          errno=_errno.EISDIR, filename=str(target))
    if not target.parent.is_dir():
        raise OutputError(f"{target.parent}: no such folder; create it or choose another {what}",
                          errno=_errno.ENOENT, filename=str(target))
    try:
        st = os.stat(target)
    except FileNotFoundError:
        if os.path.islink(target) and not overwrite:  # a dangling symbolic link
            raise OutputError(f"{path} already exists (a symbolic link to a missing file); "
                              f"{_force_hint(what)}", errno=_errno.EEXIST,
                              filename=str(target)) from None
        return target  # absent, or a dangling link that --force replaces (not its target)
    except OSError as e:
        raise OutputError(f"{path}: cannot check the output ({e.strerror}); choose another {what}",
                          errno=e.errno, filename=str(target)) from None
    for inp in _input_files(inputs):
        try:
            same = _same_file(st, os.stat(inp))
        except OSError:
            continue
        if same:
            how = ("is the input" if os.path.abspath(inp) == str(target) else
                   f"is the same file as the input {inp} (a link to it)")
            raise OutputError(f"{path} {how}; write the output to another file (--force "
                              f"never replaces an input)",
                              errno=_errno.EEXIST, filename=str(target))
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{path} exists and is not a regular file; choose another {what}",
                          errno=_errno.EEXIST, filename=str(target))
    if not overwrite:
        raise OutputError(f"{path} already exists; {_force_hint(what)}",
                          errno=_errno.EEXIST, filename=str(target))
    return target


# ---- temporary files of writers that are gone --------------------------------------------------
def _pid_alive(pid: int) -> bool:
    if os.name != "posix":  # pragma: no cover - no safe probe: keep every file
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except OverflowError:
        return False
    return True


def _locked_by_someone(path: Path) -> bool:
    """True when another open file description holds the writer's lock on ``path``."""
    if fcntl is None:  # pragma: no cover
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # releases a lock taken here
    return False


def temp_file_pid(name: str, prefix: str = TEMP_PREFIX) -> int | None:
    """The writer's PID in a temporary file name ``<prefix><pid>-<random>.tmp``, else None."""
    if not (name.startswith(prefix) and name.endswith(TEMP_SUFFIX)):
        return None
    head, sep, _ = name[len(prefix):].partition("-")
    return int(head) if sep and head.isdigit() and len(head) < 12 else None


def sweep_stale_temp_files(folder: str | os.PathLike, prefix: str = TEMP_PREFIX) -> list[Path]:
    """Remove the temporary files that killed writers left in ``folder``.

    A file ``<prefix><pid>-*.tmp`` is removed when ``pid`` is not a live process and no
    process holds its lock; this process's own files are kept (another thread may be
    writing them). A file without a PID (older edgeinfer) is removed once unmodified for
    :data:`LEGACY_STALE_S` and unlocked. Errors (a file already gone, no permission) are
    ignored. Returns the removed paths.
    """
    removed = []
    now = time.time()
    try:
        candidates = list(Path(folder).glob(f"{prefix}*{TEMP_SUFFIX}"))
    except OSError:
        return removed
    for tmp in candidates:
        pid = temp_file_pid(tmp.name, prefix)
        try:
            if pid is not None:
                if pid == os.getpid() or _pid_alive(pid):
                    continue
            elif now - tmp.stat().st_mtime <= LEGACY_STALE_S:
                continue
            if _locked_by_someone(tmp) or not tmp.is_file():
                continue
            tmp.unlink()
            removed.append(tmp)
        except OSError:
            pass
    return removed


# ---- OS errors as one line ----------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def explain_os_error(e: OSError, target: Path, size: int | None = None) -> OutputError:
    """``e`` (raised while writing ``target``) as an OutputError naming the path and the fix."""
    folder = target.parent
    code = e.errno
    if code in (_errno.ENOSPC, getattr(_errno, "EDQUOT", -1)):
        need = f" (the file needs {_mib(size)})" if size else ""
        msg = (f"{target}: no space left on the device{need}; free some space or write to "
               f"another disk (-o)")
    elif code == _errno.EFBIG:
        msg = (f"{target}: the file is larger than this process may write (file size limit, "
               f"`ulimit -f`); raise the limit or write elsewhere (-o)")
    elif code == _errno.EROFS:
        msg = f"{folder}: read-only file system; write the output to a writable folder (-o)"
    elif code in (_errno.EACCES, _errno.EPERM):
        msg = (f"{folder}: permission denied; write the output to a folder you may write to "
               f"(-o), or fix the folder's permissions")
    elif code == _errno.EISDIR:
        msg = f"{target} is a folder; give a file name, e.g. {target / 'model.eif'}"
    elif code == _errno.ENOENT:
        msg = f"{folder}: the folder disappeared while writing; create it or choose another -o"
    else:
        msg = f"{target}: cannot write ({e.strerror or e}); choose another output path (-o)"
    return OutputError(msg, errno=code, filename=str(target))


def _check_free_space(target: Path, size: int) -> None:
    try:
        st = os.statvfs(target.parent)
    except (OSError, AttributeError):  # no statvfs (Windows) or no answer: let the write tell
        return
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise OutputError(f"{target}: no space left on the device (the file needs {_mib(size)}, "
                          f"{_mib(free)} free); free some space or write to another disk (-o)",
                          errno=_errno.ENOSPC, filename=str(target))


# ---- signals --------------------------------------------------------------------------------------
@contextlib.contextmanager
def _remove_on_signal(tmp: str, remove=os.unlink) -> Iterator[None]:
    """While active (main thread only), SIGTERM / SIGHUP (and SIGINT when Python's handler
    is not installed) remove ``tmp`` (by ``remove``) and then end the process by the same
    signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def handler(signum, frame):  # runs between bytecodes on the main thread
        with contextlib.suppress(OSError):
            remove(tmp)
        for s, h in previous.items():
            signal.signal(s, h)
        signal.raise_signal(signum)  # the default action: the process ends as it would have

    for s in _SIGNALS:
        try:
            if signal.getsignal(s) == signal.SIG_DFL:  # an ignored or app-handled one: left alone
                previous[s] = signal.signal(s, handler)
        except (ValueError, OSError):  # pragma: no cover
            pass
    try:
        yield
    finally:
        for s, h in previous.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(s, h)


# ---- the writer ---------------------------------------------------------------------------------
def _commit(tmp: str, target: Path, overwrite: bool, inputs, what: str) -> None:
    check_output(target, overwrite=overwrite, inputs=inputs, what=what)  # it may have changed
    if overwrite:
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)  # fails if the target appeared meanwhile: never replaces it
    except FileExistsError:
        raise OutputError(f"{target} already exists (created while converting); "
                          f"{_force_hint(what)}", errno=_errno.EEXIST,
                          filename=str(target)) from None
    except OSError as e:
        if e.errno not in (_errno.EPERM, _errno.EXDEV, _errno.EMLINK, _errno.ENOTSUP,
                           getattr(_errno, "EOPNOTSUPP", -1), _errno.ENOSYS):
            raise
        os.replace(tmp, target)  # no hard links here (FAT, some network mounts): checked above
        return
    os.unlink(tmp)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, overwrite: bool = False,
                  inputs: Iterable[str | os.PathLike | None] = (), size: int | None = None,
                  what: str = "output path (-o)", prefix: str = TEMP_PREFIX) -> Iterator[str]:
    """Yield a temporary file path to write; on success it becomes ``path``.

    Args:
        path: the target file.
        overwrite: replace an existing regular file (``--force``).
        inputs: files or folders never to write over (see :func:`check_output`).
        size: bytes about to be written, for a free-space check before writing.
        what: how the user names the path, for the messages.
        prefix: temporary-file prefix (``<prefix><pid>-<random>.tmp``).

    Raises:
        OutputError: a refused target (:func:`check_output`), no space, a read-only or
            unwritable folder, a file-size limit, or any other OS error while writing or
            renaming; the temporary file is removed and the target is untouched. Other
            exceptions from the body propagate after the same cleanup.
    """
    inputs = list(inputs)
    target = check_output(path, overwrite=overwrite, inputs=inputs, what=what)
    sweep_stale_temp_files(target.parent, prefix)
    if size is not None:
        _check_free_space(target, size)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", suffix=TEMP_SUFFIX,
                                   dir=target.parent)
    except OSError as e:
        raise explain_os_error(e, target, size) from None
    try:
        if fcntl is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "a live writer": see the sweep
        with _remove_on_signal(tmp):
            try:
                yield tmp
                os.fsync(fd)  # the data is on disk before the name points at it
                um = os.umask(0)
                os.umask(um)
                os.chmod(tmp, 0o666 & ~um)  # mkstemp makes 0600; a model file is an ordinary file
                _commit(tmp, target, overwrite, inputs, what)
            except OutputError:
                raise
            except OSError as e:
                raise explain_os_error(e, target, size) from None
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    finally:
        os.close(fd)


# ---- folders ------------------------------------------------------------------------------------
def _inside(path: str, folder: Path) -> bool:
    """``path`` (resolved through links) is ``folder`` or lies under it."""
    try:
        p, f = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    except OSError:
        return False
    return p == f or f in p.parents


def sweep_stale_temp_dirs(folder: str | os.PathLike, prefix: str = TEMP_PREFIX) -> list[Path]:
    """Remove the temporary folders ``<prefix><pid>-*.tmp`` in ``folder`` whose writer
    process is gone (:func:`atomic_output_dir` after a SIGKILL); this process's and live
    writers' folders are kept, errors ignored. Returns the removed paths."""
    import shutil

    removed = []
    try:
        candidates = [p for p in Path(folder).glob(f"{prefix}*{TEMP_SUFFIX}") if p.is_dir()
                      and not p.is_symlink()]
    except OSError:
        return removed
    for tmp in candidates:
        pid = temp_file_pid(tmp.name, prefix)
        if pid is None or pid == os.getpid() or _pid_alive(pid):
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, *, overwrite: bool = False,
                      inputs: Iterable[str | os.PathLike | None] = (),
                      replaceable: Iterable[str] = (), what: str = "output folder (-o)",
                      prefix: str = TEMP_PREFIX) -> Iterator[str]:
    """Yield a temporary folder to fill; on success it becomes the folder ``path``.

    The folder rules of :func:`atomic_output`: an existing ``path`` is refused unless
    ``overwrite``, and even then only when it is a folder holding nothing but names in
    ``replaceable`` (the files this writer makes: ``--force`` never deletes other files);
    no input may lie inside it; the temporary folder ``<prefix><pid>-<random>.tmp`` beside
    it is removed on failure, Ctrl-C, SIGTERM or SIGHUP, and renamed into place when
    complete (a replaced folder is moved aside first, then deleted).

    Raises:
        OutputError: the target is a file, a link, non-empty with foreign files, exists
            (without ``overwrite``), holds an input, or its parent folder is missing; an OS
            error while writing or renaming. Nothing is left behind.
    """
    import shutil

    inputs = [os.fspath(p) for p in inputs if p is not None]
    target = Path(os.path.abspath(os.fspath(path)))
    allowed = set(replaceable)

    def check() -> bool:
        """True when the target exists (and may be replaced)."""
        if not target.parent.is_dir():
            raise OutputError(f"{target.parent}: no such folder; create it or choose another "
                              f"{what}", errno=_errno.ENOENT, filename=str(target))
        for inp in inputs:
            if _inside(inp, target):
                raise OutputError(f"{path} holds the input {inp}; write the export to another "
                                  f"folder (--force never replaces an input)",
                                  errno=_errno.EEXIST, filename=str(target))
        if os.path.islink(target) or (target.exists() and not target.is_dir()):
            raise OutputError(f"{path} exists and is not a folder; choose another {what}",
                              errno=_errno.EEXIST, filename=str(target))
        if not target.exists():
            return False
        if not overwrite:
            raise OutputError(f"{path} already exists; {_force_hint(what)}",
                              errno=_errno.EEXIST, filename=str(target))
        foreign = sorted(n for n in os.listdir(target) if n not in allowed)
        if foreign:
            raise OutputError(f"{path} holds files this export does not write "
                              f"({', '.join(foreign[:5])}{' …' if len(foreign) > 5 else ''}); "
                              f"--force replaces only a previous export: choose an empty or new "
                              f"{what}", errno=_errno.EEXIST, filename=str(target))
        return True

    check()
    sweep_stale_temp_dirs(target.parent, prefix)
    try:
        tmp = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", suffix=TEMP_SUFFIX,
                               dir=target.parent)
    except OSError as e:
        raise explain_os_error(e, target) from None
    old = None
    try:
        with _remove_on_signal(tmp, remove=lambda p: shutil.rmtree(p, ignore_errors=True)):
            try:
                yield tmp
                um = os.umask(0)
                os.umask(um)
                os.chmod(tmp, 0o777 & ~um)  # mkdtemp makes 0700
                for name in os.listdir(tmp):  # some writers make 0600 files (safetensors)
                    p = os.path.join(tmp, name)
                    if os.path.isfile(p) and not os.path.islink(p):
                        os.chmod(p, 0o666 & ~um)
                if check():  # it may have changed meanwhile
                    old = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", suffix=TEMP_SUFFIX,
                                           dir=target.parent)
                    os.rename(target, os.path.join(old, "replaced"))
                os.rename(tmp, target)
            except OutputError:
                raise
            except OSError as e:
                raise explain_os_error(e, target) from None
    finally:
        for p in (tmp, old):
            if p is not None and os.path.isdir(p):  # tmp: only when not renamed into place
                shutil.rmtree(p, ignore_errors=True)
