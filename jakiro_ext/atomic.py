"""Durable artifacts: every file and head directory this package writes appears whole or not at all.

- A file is written to a temporary sibling, flushed to disk (fsync) and renamed over its name.
- A directory (a draft head) is written complete into a temporary sibling and swapped with the
  old one in one step (Linux ``renameat2(RENAME_EXCHANGE)``; where that is missing, two renames,
  undone at the next start if a kill falls between them). Files of the old directory that the
  new one does not write (a training checkpoint, a user's notes) are carried over; the files the
  writer owns are never carried, so no stale one survives beside new weights.
- Temporaries are named ``.NAME.tmp-PID-XXXXXX``; :func:`remove_stale_temporaries` (called when a
  run starts writing into a directory) removes those whose process is gone.
- SIGINT and SIGTERM that arrive during a write are held until the write is done, then delivered.
- A write that fails (full disk, read-only directory, file-size limit) leaves nothing behind and
  raises :class:`WriteError` naming the file; what was there before is untouched.
- A cache written often (the live tree choice's, at the end of a generation) may be written
  behind the caller, by a thread the interpreter waits for at exit (:func:`write_text_behind`).

:func:`check_output_dir` checks, before a long run, that its output directory can be written and
has room for what the run will write.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import signal
import threading
from pathlib import Path
from typing import Callable, Collection, Dict, Iterator, Optional, Tuple

TEMP_PATTERN = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{6}")
MB = 1 << 20


class WriteError(OSError):
    """An artifact could not be written; nothing was replaced and no temporary was left."""


# ----------------------------------------------------------------------------- signals
@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the duration (main thread only; elsewhere a no-op), then
    deliver the first one that came to the handler that was in place."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), caught[0])


# ----------------------------------------------------------------------------- helpers
def _temp_sibling(path: Path, kind: str = "tmp") -> Path:
    return path.parent / f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(3)}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:  # some filesystems cannot sync a directory; the rename is still atomic
        pass


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


_libc = None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the system or filesystem cannot."""
    global _libc
    if not hasattr(os, "uname") or os.uname().sysname != "Linux":
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def os_error(cls, code: Optional[int], message: str) -> OSError:
    """An OSError whose text is ``message`` alone (``OSError(code, text)`` would prefix the code)."""
    error = cls(message)
    error.errno = code
    return error


def _failed(path: Path, exc: BaseException) -> WriteError:
    """The failure of a writer as one sentence, with the system's reason: the OSError itself,
    the one torch.save raised from (its ``__context__``), or the code safetensors quotes."""
    cause = exc
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    code = cause.errno if isinstance(cause, OSError) else None
    if code is None:
        m = re.search(r"os error (\d+)", str(exc))
        code = int(m[1]) if m else None
    reason = os.strerror(code) if code else str(exc).strip().splitlines()[0]
    hint = " (is the disk full?)" if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else ""
    return os_error(WriteError, code or errno.EIO, f"{path} could not be written: {reason}{hint}; nothing was replaced")


def _is_write_failure(exc: BaseException) -> bool:
    """OSError, or what the tensor writers make of one (torch.save's RuntimeError, safetensors'
    SafetensorError): the data are checked before they reach a writer, so these are I/O."""
    return isinstance(exc, (OSError, RuntimeError)) or type(exc).__name__ == "SafetensorError"


# ----------------------------------------------------------------------------- writing
@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temporary sibling of ``path`` to build the replacement in, with SIGINT and SIGTERM held;
    on failure it is removed (an I/O failure becomes a WriteError naming ``path``)."""
    tmp = _temp_sibling(path)
    with signals_held():
        try:
            yield tmp
        except BaseException as exc:
            _remove(tmp)
            if _is_write_failure(exc):
                raise _failed(path, exc) from exc
            raise
        _fsync_dir(path.parent)


def write_file(path, write: Callable[[Path], None]) -> None:
    """Write ``path`` atomically: ``write(tmp)`` fills a temporary sibling, which is then synced
    and renamed over ``path``. On failure the temporary is removed and a :class:`WriteError`
    names ``path``."""
    path = Path(path)
    with _replacing(path) as tmp:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)


def write_text(path, text: str) -> None:
    write_file(path, lambda tmp: tmp.write_text(text))


class _WritesBehind:
    """Files written by one background thread (:func:`write_text_behind`), the newest text of
    each path; the thread lives while there is something to write."""

    def __init__(self):
        self.changed = threading.Condition()
        self.pending: Dict[Path, Tuple[str, Callable[[OSError], None]]] = {}
        self.busy = False  # a writer thread runs

    def submit(self, path: Path, text: str, on_error: Callable[[OSError], None]) -> None:
        with self.changed:
            self.pending[path] = (text, on_error)
            if not self.busy:
                self.busy = True
                # Not a daemon: the interpreter waits for it at exit, so nothing submitted is lost.
                threading.Thread(target=self._drain, name="jakiro-write-behind").start()

    def _drain(self) -> None:
        while True:
            with self.changed:
                if not self.pending:
                    self.busy = False
                    self.changed.notify_all()
                    return
                path = next(iter(self.pending))
                text, on_error = self.pending.pop(path)
            try:
                write_text(path, text)
            except OSError as exc:
                on_error(exc)

    def wait(self) -> None:
        with self.changed:
            self.changed.wait_for(lambda: not self.busy)


_writes_behind = _WritesBehind()


def write_text_behind(path, text: str, on_error: Callable[[OSError], None]) -> None:
    """:func:`write_text` in a background thread: the caller does not wait for the disk (a cache
    kept at the end of a generation, whose fsync cost 1-2 ms, 0.5-1% of a 64-token call). A newer
    text for a path replaces one not yet written; ``on_error(exc)`` is called (in that thread)
    when a write fails; :func:`wait_for_writes_behind` waits for what is submitted, and so does
    the interpreter at exit."""
    _writes_behind.submit(Path(path), text, on_error)


def wait_for_writes_behind() -> None:
    """Wait until every :func:`write_text_behind` submitted so far is written (or failed)."""
    _writes_behind.wait()


def write_directory(path, write: Callable[[Path], None], owned: Collection[str]) -> None:
    """Replace the directory ``path`` atomically by what ``write(tmp)`` puts into an empty
    temporary sibling. ``owned``: the file names this kind of directory is made of; the old
    directory's other entries are carried over (hard links where possible), its owned files
    that ``write`` did not write are dropped."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    with _replacing(path) as tmp:
        tmp.mkdir()
        write(tmp)
        for entry in tmp.iterdir():
            if entry.is_file():
                _fsync(entry)
        if path.is_dir():
            for entry in path.iterdir():
                if entry.name not in owned and not (tmp / entry.name).exists():
                    _carry(entry, tmp / entry.name)
        _fsync_dir(tmp)
        if not path.exists():
            os.rename(tmp, path)
        elif _exchange(tmp, path):
            _remove(tmp)  # now the old directory
        else:  # two renames: a kill between them is undone at the next start
            old = _temp_sibling(path, "old")
            os.rename(path, old)
            os.rename(tmp, path)
            _remove(old)


def link_or_copy(src, dst) -> None:
    """``dst`` as a hard link to ``src`` (no bytes copied), or a copy where links are not possible."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry(src: Path, dst: Path) -> None:
    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, copy_function=link_or_copy, symlinks=True)
    elif src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        link_or_copy(src, dst)


def remove_stale_temporaries(directory) -> None:
    """Remove the temporaries of writers that were killed (their process is gone); put back an
    old directory whose replacement never arrived (a kill between the two renames)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        m = TEMP_PATTERN.fullmatch(entry.name)
        if m is None or _alive(int(m["pid"])):
            continue
        final = directory / m["name"]
        if m["kind"] == "old" and not final.exists():
            os.rename(entry, final)
        else:
            _remove(entry)


# ----------------------------------------------------------------------------- checks
def check_output_dir(directory, needed_bytes: int = 0, what: str = "the output") -> Path:
    """Create ``directory`` (and its parents), prove it writable by writing a probe file, and
    compare its free space with ``needed_bytes``; an OSError says which of these failed, before
    any work is done."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = _temp_sibling(directory / "probe")
        try:
            with open(probe, "wb") as f:
                f.write(b"\0")
                f.flush()
                os.fsync(f.fileno())
        finally:
            _remove(probe)
    except OSError as exc:
        raise os_error(OSError, exc.errno, f"{directory} cannot hold {what}: {exc.strerror or exc}") from None
    free = shutil.disk_usage(directory).free
    if needed_bytes > free:
        raise os_error(OSError, errno.ENOSPC, f"{directory} has {free / MB:.0f} MB free, but {what} needs about "
                                              f"{needed_bytes / MB:.0f} MB: free some space or choose another directory")
    return directory
