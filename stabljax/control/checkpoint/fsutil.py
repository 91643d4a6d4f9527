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
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Iterable
from typing import Any

__all__ = [
    "UnsafePathError",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "open_nofollow",
    "read_text",
    "refuse_symlinks",
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
