"""Files with fixed names, created and read without following symlinks.

A run directory may come from elsewhere (a bucket, a colleague's run, a bug report) or
sit on shared storage, so a name such as ``events.jsonl`` or ``report.html`` in it may be
a symlink someone planted, pointing at a file outside the directory. Opening it by name
would then append to, overwrite or read that file. The functions here never follow the
last component of a path:

* :func:`open_nofollow` opens with ``O_NOFOLLOW`` (a symlink is an :class:`UnsafePathError`);
* :func:`atomic_write_text` / :func:`atomic_write_json` write a fresh temporary file
  (``O_CREAT | O_EXCL | O_NOFOLLOW`` on a unique name in the same directory), fsync it,
  rename it over the target (``os.replace`` replaces a symlink, it never writes through
  one) and fsync the directory;
* :func:`read_text` reads a regular file only (not a symlink, FIFO or device, which could
  block the reader forever);
* :func:`refuse_symlinks` checks a directory's special entries before anything is written.

Folders above the last component are the caller's choice and are followed as usual.

:class:`RunFiles` owns every file of a run directory that is not a checkpoint, on a local
disk (the functions above) or an object store (``gs://``: :class:`PartLog`,
:class:`DirectoryLock`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import json
import os
import pathlib
import re
import secrets
import shutil
import socket
import stat
import threading
import time
from collections.abc import Iterable
from typing import Any

__all__ = [
    "DirectoryLock",
    "PartLog",
    "RunFiles",
    "UnsafePathError",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "is_remote",
    "open_nofollow",
    "read_text",
    "refuse_symlinks",
    "run_path",
]

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafePathError(ValueError):
    """A fixed-name file of a run directory is a symlink or not a regular file."""


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_NOFOLLOW)``: a descriptor, never through a symlink.

    Args:
      path: the file; its last component must not be a symlink.
      flags: ``os.O_*`` flags (``O_NOFOLLOW`` and ``O_CLOEXEC`` are added).
      mode: permissions of a file that ``O_CREAT`` creates.

    Returns:
      An open file descriptor (the caller closes it).

    Raises:
      stabljax.control.checkpoint.fsutil.UnsafePathError: ``path`` is a symlink (nothing was opened or created).

    Example:
      >>> import os, tempfile
      >>> from stabljax.control.checkpoint.fsutil import open_nofollow
      >>> d = tempfile.mkdtemp()
      >>> os.symlink("/etc/hostname", os.path.join(d, "events.jsonl"))
      >>> open_nofollow(os.path.join(d, "events.jsonl"), os.O_WRONLY | os.O_APPEND)
      Traceback (most recent call last):
      ...
      stabljax.control.checkpoint.fsutil.UnsafePathError: refusing to follow the symlink .../events.jsonl ...
    """
    path = os.fspath(path)
    try:
        return os.open(path, flags | NOFOLLOW | CLOEXEC, mode)
    except OSError as e:
        if os.path.islink(path):
            raise UnsafePathError(
                f"refusing to follow the symlink {path} (a file stabljax writes or reads by a "
                "fixed name must be a plain file; remove the link)"
            ) from e
        raise


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY | CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically, through a fresh temporary file."""
    path = os.fspath(path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
    fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def atomic_write_text(path: str | os.PathLike, text: str, *, errors: str = "strict") -> None:
    """Writes ``text`` as UTF-8 to ``path`` atomically, never through a symlink.

    The bytes go to a new file with a unique name in the same directory (created with
    ``O_EXCL | O_NOFOLLOW``, so neither a planted symlink nor an existing file is opened),
    are fsynced, and the file is renamed over ``path``; then the directory is fsynced. A
    symlink at ``path`` is replaced by the new file, its target left untouched. On any
    error the temporary file is removed and ``path`` keeps its old content.

    Args:
      path: the target file.
      text: its content.
      errors: the UTF-8 encoder's error handler (``"backslashreplace"`` writes a lone
        surrogate, as ``os.fsdecode`` makes from a non-UTF-8 file name, as ``\\udcff``).

    Example:
      >>> import os, tempfile
      >>> from stabljax.control.checkpoint.fsutil import atomic_write_text
      >>> d = tempfile.mkdtemp()
      >>> atomic_write_text(os.path.join(d, "a.txt"), "caf\\udce9", errors="backslashreplace")
      >>> open(os.path.join(d, "a.txt")).read(), os.listdir(d)
      ('caf\\\\udce9', ['a.txt'])
    """
    atomic_write_bytes(path, text.encode("utf-8", errors))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Writes ``obj`` as strict JSON (``ValueError`` on NaN or infinity) atomically.

    The same guarantees as :func:`atomic_write_text`.

    Example:
      >>> import json, os, tempfile
      >>> from stabljax.control.checkpoint.fsutil import atomic_write_json
      >>> path = os.path.join(tempfile.mkdtemp(), "stabljax-rollback.json")
      >>> atomic_write_json(path, {"rollbacks": 1})
      >>> json.load(open(path))
      {'rollbacks': 1}
    """
    atomic_write_text(path, json.dumps(obj, allow_nan=False))


def read_text(path: str | os.PathLike, *, follow: bool = False) -> str:
    """The content of a regular file, decoded as UTF-8 (invalid bytes replaced).

    Args:
      path: the file.
      follow: whether a symlink at ``path`` is followed (for a path the user named;
        a fixed name inside a run directory is read with ``follow=False``).

    Raises:
      stabljax.control.checkpoint.fsutil.UnsafePathError: ``path`` is a symlink (with ``follow=False``), a FIFO, a device or
        a folder: nothing is read from it, so a planted FIFO cannot block the reader.
      FileNotFoundError: ``path`` does not exist.
    """
    path = os.fspath(path)
    if is_remote(path):
        return _read_remote(path).decode("utf-8", errors="replace")
    flags = os.O_RDONLY | NONBLOCK | CLOEXEC
    fd = open_nofollow(path, flags) if not follow else os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(f"{path} is not a regular file; refusing to read it")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def refuse_symlinks(directory: str | os.PathLike, names: Iterable[str]) -> None:
    """Raises :class:`UnsafePathError` if any of ``names`` in ``directory`` is a symlink.

    For a directory's special entries (``events.jsonl``, ``stabljax.lock``, the rollback
    record, the trash folder), checked before anything is written there. Missing names are
    fine.

    Example:
      >>> import os, tempfile
      >>> from stabljax.control.checkpoint.fsutil import refuse_symlinks
      >>> d = tempfile.mkdtemp()
      >>> refuse_symlinks(d, ["events.jsonl"])
      >>> os.symlink("/tmp", os.path.join(d, "stabljax-trash"))
      >>> refuse_symlinks(d, ["events.jsonl", "stabljax-trash"])
      Traceback (most recent call last):
      ...
      stabljax.control.checkpoint.fsutil.UnsafePathError: .../stabljax-trash is a symlink ...
    """
    directory = os.fspath(directory)
    for name in names:
        path = os.path.join(directory, name)
        if os.path.islink(path):
            raise UnsafePathError(
                f"{path} is a symlink (to {os.readlink(path)!r}); stabljax refuses to write "
                "through it: remove the link or choose another directory"
            )


# ------------------------------------------------------------------------ the run directory
# Every file of a run directory that is not a checkpoint, on a local disk or an object store.

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
PARTS = ".parts"  # a log NAME on an object store: the objects NAME.parts/<seq>, in order
PROBE = ".stabljax-probe-"
# A run directory's fixed names (with stabljax.lock* and stabljax-trash.*).
SPECIAL = ("events.jsonl", "stabljax-rollback.json", "stabljax-trash", "stabljax-corrupt")


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an object store (``gs://...``, any ``scheme://`` but ``file``).

    Example:
      >>> from stabljax.control.checkpoint.fsutil import is_remote
      >>> is_remote("gs://bkt/run"), is_remote("runs/gs:/x"), is_remote("/tmp/run")
      (True, False, False)
    """
    m = _SCHEME.match(os.fspath(path))
    return m is not None and m[1].lower() != "file"


def run_path(directory: str | os.PathLike) -> Any:
    """The run directory as Orbax takes it: an ``etils.epath.Path`` for an object store
    (``gs://`` is never read as a local relative path), an absolute ``pathlib.Path`` else.

    Example:
      >>> from stabljax.control.checkpoint.fsutil import run_path
      >>> str(run_path("gs://bkt/run1")), run_path("/tmp/run1")
      ('gs://bkt/run1', PosixPath('/tmp/run1'))
    """
    if is_remote(directory):
        from etils import epath

        return epath.Path(os.fspath(directory))
    return pathlib.Path(directory).absolute()


def _fs(path: str | os.PathLike) -> tuple[Any, str]:  # (fsspec filesystem, key)
    import fsspec

    path = os.fspath(path)
    if path.startswith("gs://"):  # epath's (so Orbax's) instance: one listing cache
        return fsspec.filesystem("gcs", finalize_on_close=True), path[len("gs://") :]
    return fsspec.core.url_to_fs(path)


def _parts(fs: Any, key: str) -> list[str]:
    """The part objects of the log ``key``, in write order."""
    try:
        names = fs.ls(key + PARTS, detail=False, refresh=True)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.rsplit("/", 1)[-1].isdigit())


def _read_remote(path: str) -> bytes:  # an object, or a log's parts joined (PartLog)
    fs, key = _fs(path)
    try:
        return fs.cat_file(key)
    except FileNotFoundError:
        parts = _parts(fs, key)
        if not parts:
            raise FileNotFoundError(errno.ENOENT, "no such object", path) from None
        return b"".join(fs.cat_file(p) for p in parts)


class PartLog:
    """A log on an object store (no append): lines buffered, one new object per flush.

    Lines wait in memory until :meth:`flush` (save points, close) or a line arrives
    ``flush_every`` s after the oldest unflushed one; a flush writes them as a new object
    ``NAME.parts/<seq>``, created only if absent (two writers never overwrite a part). A
    flushed line survives a crash (SIGKILL too); a crash loses at most the unflushed tail.
    Between flushes no request is made; a failed flush keeps the lines for the next.

    Args:
      path: the log (``gs://bkt/run/events.jsonl``).
      flush_every: the most seconds a line waits while more lines arrive.
    """

    def __init__(self, path: str | os.PathLike, *, flush_every: float = 60.0):
        self.path, self.flush_every = os.fspath(path), float(flush_every)
        self._lines: list[str] = []
        self._since: float | None = None
        self._seq: int | None = None
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        """Buffers one line (no newline in it); flushes if the oldest waited too long."""
        with self._lock:
            self._lines.append(line)
            self._since = time.monotonic() if self._since is None else self._since
            due = time.monotonic() - self._since >= self.flush_every
        if due:
            self.flush()

    def flush(self) -> None:
        """Writes the buffered lines as one new object (nothing if none is buffered)."""
        with self._lock:
            if not self._lines:
                return
            fs, key = _fs(self.path)
            if self._seq is None:
                parts = _parts(fs, key)
                self._seq = int(parts[-1].rsplit("/", 1)[-1]) + 1 if parts else 0
            data = "".join(line + "\n" for line in self._lines).encode("utf-8", "backslashreplace")
            while True:
                try:
                    fs.pipe_file(f"{key}{PARTS}/{self._seq:010d}", data, mode="create")
                    break
                except FileExistsError:
                    self._seq += 1
            self._seq += 1
            self._lines, self._since = [], None


class DirectoryLock:
    """An exclusive lock on ``directory/stabljax.lock[.<process>]``.

    On a local disk an advisory ``fcntl.flock`` (each process its own file), which the
    kernel drops when its holder dies. On an object store an object created only if none
    exists (GCS ``ifGenerationMatch=0``), held by process 0 alone and deleted by
    :meth:`release`; a job that was killed leaves it behind, and the next one is refused
    with the holder's name and the way to take a stale lock over: delete the object.
    """

    def __init__(self, directory: Any, process: int = 0):
        name = "stabljax.lock" if process == 0 else f"stabljax.lock.{process}"
        self.remote = is_remote(directory)
        self.directory = os.fspath(directory)
        self.path = f"{self.directory}/{name}" if self.remote else pathlib.Path(directory) / name
        self._active = not self.remote or process == 0
        self._fd: int | None = None
        self._token: bytes | None = None

    def acquire(self) -> None:
        if not self._active:
            return
        if self.remote:
            return self._acquire_object()
        for attempt in range(2):
            fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                if attempt == 0:
                    gc.collect()  # an unreachable controller of this process may hold it
                    continue
                try:
                    holder = read_text(self.path).strip() or "unknown"
                except OSError:
                    holder = "unknown"
                raise RuntimeError(self._held_message(holder)) from e
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
            self._fd = fd
            return

    def _held_message(self, holder: str) -> str:
        msg = (
            f"checkpoint directory {self.directory!r} is already in use by another "
            f"RollbackController (lock {os.path.basename(self.path)} held by {holder}); two jobs on one directory "
            "would race on saves and deletes. Stop the other job, close() the other "
            "controller, or use another directory."
        )
        if self.remote:  # a killed job's lock stays behind
            msg += f" Once sure its holder is dead, take it over: gcloud storage rm {self.path}"
        return msg

    def _acquire_object(self) -> None:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        who = f"pid {os.getpid()} on {socket.gethostname()}"
        token = f"{who} since {since} ({secrets.token_hex(4)})".encode()
        fs, key = _fs(self.path)
        try:
            fs.pipe_file(key, token, mode="create")
        except FileExistsError:
            try:
                holder = fs.cat_file(key).decode("utf-8", "replace").strip() or "unknown"
            except FileNotFoundError:
                holder = "a job that just released it"
            raise RuntimeError(self._held_message(holder)) from None
        self._token = token

    def release(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        token, self._token = getattr(self, "_token", None), None
        if token is not None:
            fs, key = _fs(self.path)
            try:
                if fs.cat_file(key) == token:  # not a lock someone took over meanwhile
                    fs.rm_file(key)
            except FileNotFoundError:
                pass

    @property
    def held(self) -> bool:
        return self._fd is not None or self._token is not None

    def __del__(self):  # a controller dropped without close() frees its directory
        with contextlib.suppress(Exception):  # at interpreter exit os/fcntl may be gone
            self.release()


def special_entries(directory: pathlib.Path) -> list[str]:
    """The names in ``directory`` that stabljax writes, moves or deletes by a fixed name."""
    names = os.listdir(directory)
    prefixed = ("stabljax.lock", "stabljax-trash.")
    return sorted(n for n in names if n in SPECIAL or n.startswith(prefixed))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's process
        pass
    return True


def clean_probes(directory: pathlib.Path) -> None:
    """Removes probe files left by processes that died between writing and removing them
    (harmless for a live one on another host: its writer removes it with ``missing_ok``)."""
    for path in directory.glob(f"{PROBE}*-*"):
        try:
            pid = int(path.name[len(PROBE) :].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            path.unlink(missing_ok=True)


class RunFiles:
    """The one owner of a run directory's own files: probe, lock, records and logs.

    Checkpoints are Orbax's; everything else the controller keeps in the directory goes
    through here. On a local disk (a path without ``scheme://``): no symlink followed,
    atomic renames, nothing outside the directory touched. On an object store
    (``gs://bucket/dir``, through fsspec, as etils' ``epath`` and so Orbax): no append,
    rename or symlink; a log is whole objects ``NAME.parts/<seq>`` (:class:`PartLog`),
    read back in order by :func:`read_text`; a record is one upload, visible only once
    complete; the lock is created only if absent (GCS ``ifGenerationMatch=0``). The
    controller's own objects are written by process 0 only.

    Args:
      directory: a local path or ``scheme://bucket/dir`` (:func:`run_path`).
      process: this process's index (``jax.process_index()``).
    """

    def __init__(self, directory: str | os.PathLike, *, process: int = 0):
        self.path = run_path(directory)
        self.remote = is_remote(self.path)
        self.process = process
        self.lock = DirectoryLock(self.path, process)

    def file(self, name: str) -> str:
        """The entry ``name``'s full name (a local path or an object URL)."""
        return f"{os.fspath(self.path)}/{name}" if self.remote else os.fspath(self.path / name)

    def check(self) -> None:
        """Creates the directory if need be and checks that it can be written.

        Raises:
          FileNotFoundError: a bucket that does not exist (named). OSError: cannot be
            created or written (named). UnsafePathError: a fixed-name entry is a symlink.
        """
        if self.remote:
            return self._check_bucket()
        directory = self.path
        probe = directory / f"{PROBE}{os.getpid()}-{self.process}"
        try:
            if directory.exists() and not directory.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "a file is in the way", str(directory))
            directory.mkdir(parents=True, exist_ok=True)
            mode = directory.stat().st_mode
            if not mode & 0o222:  # root writes anywhere; respect the operator's intent anyway
                raise PermissionError(errno.EACCES, f"read-only (mode {oct(mode & 0o777)})")
            refuse_symlinks(directory, special_entries(directory))
            fd = open_nofollow(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                os.write(fd, b"ok")
            finally:
                os.close(fd)
            probe.unlink(missing_ok=True)
            clean_probes(directory)
        except OSError as e:
            raise OSError(
                e.errno,
                f"checkpoint directory {str(directory)!r} cannot be created or written "
                f"({type(e).__name__}: {e}); pass a writable directory",
            ) from e

    def _check_bucket(self) -> None:
        fs, key = _fs(self.path)
        bucket = key.split("/", 1)[0]
        try:
            found = fs.exists(bucket)
        except OSError as e:
            raise OSError(
                e.errno, f"cannot reach the bucket {bucket!r} of {os.fspath(self.path)!r}: {e}"
            ) from e
        if not found:
            raise FileNotFoundError(
                errno.ENOENT,
                f"the bucket {bucket!r} of checkpoint directory {os.fspath(self.path)!r} does "
                f"not exist or is not visible with these credentials; create it (gcloud "
                f"storage buckets create gs://{bucket}) or pass another directory",
            )
        if self.process != 0:
            return  # process 0 probes; the others write only Orbax's arrays
        probe = f"{key}/{PROBE}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fs.pipe_file(probe, b"ok")
            fs.rm_file(probe)
        except OSError as e:
            raise OSError(
                e.errno,
                f"checkpoint directory {os.fspath(self.path)!r} cannot be written (bucket "
                f"{bucket!r}: {type(e).__name__}: {e}); pass a writable directory",
            ) from e

    def write(self, name: str, data: bytes) -> None:
        """Writes ``name`` whole or not at all (:func:`atomic_write_bytes`; one upload)."""
        if not self.remote:
            return atomic_write_bytes(self.path / name, data)
        fs, key = _fs(self.file(name))
        fs.pipe_file(key, data)

    def refresh(self) -> None:  # forgets an object store's cached listings (others write)
        if self.remote:
            _fs(self.path)[0].invalidate_cache()

    def exists(self, name: str, *, log: bool = False) -> bool:
        """Whether the entry ``name`` exists; ``log``: as a file or symlink (which a reader
        then refuses by name), or as an object store's parts (:class:`PartLog`)."""
        if not self.remote:
            return os.path.lexists(self.path / name) if log else (self.path / name).exists()
        fs, key = _fs(self.file(name))
        return fs.exists(key) or (log and bool(_parts(fs, key)))

    def move(self, name: str, to: str) -> None:
        """Moves the entry ``name`` to ``to`` (local: an atomic rename; object store: a
        copy, then the delete, object by object)."""
        if not self.remote:
            (self.path / to).parent.mkdir(exist_ok=True)
            os.replace(self.path / name, self.path / to)
            return
        fs, key = _fs(self.file(name))
        fs.mv(key, _fs(self.file(to))[1], recursive=True)

    def remove(self, name: str) -> None:
        """Removes the entry ``name`` and all it holds (a folder's objects, on a store)."""
        if not self.remote:
            return shutil.rmtree(self.path / name)
        fs, key = _fs(self.file(name))
        fs.rm(key, recursive=True)
