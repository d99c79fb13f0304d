"""Where the compile cache and the native queue library live, and whether that place is trusted.

Both are code: compiled kernels and the native queue library are loaded from the cache location
and run inside this process, so the location is treated the way ssh treats key files.

* It is created private to the user: missing directories 0700, files 0600, whatever the umask.
* It is refused when it cannot be used (a file in the way, ``/proc``, a read-only file system),
  when the directory or a cache file in it is owned by another user or writable by group or
  others, or when a directory above it would let another user swap it (owned by someone other
  than the user or root, or group- or other-writable without the sticky bit ``/tmp`` has).
  Existing files that are merely readable by others (0644) are used.
* A refused location gives one ``RuntimeWarning`` per process and directory, naming the reason,
  and the cache moves to a private fallback: ``$TMPDIR/aiotinyrt-<uid>`` when that passes the
  same checks (later processes share it), else a fresh ``mkdtemp`` directory removed at exit.
  Where not even that exists, :func:`resolve` returns None: compiling goes on without the
  persistent cache, and the queues run on the Python worker.

Checks run when a cache file is first opened (once per process for the native library, once per
path for the compile cache): a few ``stat`` calls, never on the launch path.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

#: Permission bits that let someone other than the owner change a file or directory.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH

_lock = threading.Lock()
_warned: set[Path] = set()
_fallbacks: dict[Path, Path | None] = {}  # temp directory -> the fallback chosen in it


def resolve(path: Path, companions: Sequence[str] = ()) -> Path | None:
    """The path to use for the cache file ``path`` (and its ``companions``, suffixes of files
    that go with it, such as sqlite's ``-wal``): ``path`` itself when its directory is private
    (created if missing) and the existing files are trusted; else the same name in the private
    fallback directory, with one warning; None when there is no private location at all."""
    reason = directory_refusal(path.parent)
    if reason is None:
        reason = _files_refusal(path, companions)
    if reason is None:
        return path
    fallback = fallback_dir()
    alternative = None if fallback is None else fallback / path.name
    if alternative is not None and _files_refusal(alternative, companions) is not None:
        alternative = None
    where = f"using {fallback} instead" if alternative is not None else "no private location is left"
    _warn_once(path.parent, f"aiotinyrt: cache location {path.parent} refused: {reason}; {where}")
    return alternative


def create_private_file(path: Path) -> None:
    """Create ``path`` empty with mode 0600 (whatever the umask) unless it exists. Raises OSError."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def directory_refusal(path: Path) -> str | None:
    """Create ``path`` (0700) if missing; None when it is a private directory this process can
    write, else why it is refused."""
    try:
        _make_private_dirs(path)
        real = path.resolve(strict=True)
        st = os.stat(real)
    except OSError as exc:
        return f"cannot be created ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{real} is not a directory"
    reason = _untrusted(st, real)
    if reason is not None:
        return reason
    for parent in real.parents:
        try:
            pst = os.stat(parent)
        except OSError as exc:
            return f"{parent} cannot be examined ({exc.strerror or exc})"
        if pst.st_uid not in (os.geteuid(), 0):
            return f"its parent {parent} is owned by uid {pst.st_uid}"
        if pst.st_mode & _OTHERS_WRITE and not pst.st_mode & stat.S_ISVTX:
            return f"its parent {parent} is writable by group or others"
    if not os.access(real, os.W_OK | os.X_OK):
        return f"{real} is not writable"
    return None


def file_refusal(path: Path) -> str | None:
    """None when ``path`` does not exist or is a regular file of this user that nobody else can
    write, else why it is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path} cannot be examined ({exc.strerror or exc})"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    return _untrusted(st, path)


def fallback_dir() -> Path | None:
    """The private directory used when the configured location is refused (see the module
    docstring), or None when none can be had. Chosen once per temporary directory."""
    base = Path(tempfile.gettempdir())
    with _lock:
        if base in _fallbacks:
            return _fallbacks[base]
        shared = base / f"aiotinyrt-{os.geteuid()}"
        chosen: Path | None = shared
        try:
            _make_private_dirs(shared)
            if not stat.S_ISDIR(os.lstat(shared).st_mode):  # a symlink planted there: not ours
                chosen = None
        except OSError:
            chosen = None
        if chosen is None or directory_refusal(shared) is not None:
            try:
                chosen = Path(tempfile.mkdtemp(prefix="aiotinyrt-cache-"))
                atexit.register(shutil.rmtree, chosen, True)
            except OSError:
                chosen = None
        _fallbacks[base] = chosen
        return chosen


def _files_refusal(path: Path, companions: Sequence[str]) -> str | None:
    for suffix in ("", *companions):
        reason = file_refusal(Path(f"{path}{suffix}"))
        if reason is not None:
            return reason
    return None


def _untrusted(st: os.stat_result, path: Path) -> str | None:
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}"
    if st.st_mode & _OTHERS_WRITE:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _make_private_dirs(path: Path) -> None:
    """``mkdir -p`` with every directory it creates 0700 (chmod after mkdir: the umask may have
    taken away the owner's own bits)."""
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)


def _warn_once(key: Path, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
