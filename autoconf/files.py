"""Output files: checked before any work starts, written atomically.

``check_file`` / ``check_dir`` run before a search, a verify or a profile starts, so an unwritable
``--emit``, ``--calibrate``, ``--out`` or ``--storage`` is one line at once, not after every trial
ran. ``write_text`` writes a temp file beside the target and renames it over; on any failure (a
full disk, an interrupt) the temp file is removed and the previous file, if any, stays.
"""

from __future__ import annotations

import os
import tempfile

from autoconf.errors import UserError


def _writable_dir(directory: str, flag: str, shown: str) -> None:
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UserError(f"{flag} {shown!r}: {directory!r} is not a directory")
    if not os.path.isdir(directory):
        raise UserError(f"{flag} {shown!r}: directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {shown!r}: directory {directory!r} is not writable")


def check_file(path: str, flag: str) -> None:
    """The file can be created or replaced (its directory exists and is writable; it is not a
    directory itself)."""
    if os.path.isdir(path):
        raise UserError(f"{flag} {path!r} is a directory; expected a file name")
    _writable_dir(os.path.dirname(os.path.abspath(path)), flag, path)


def check_dir(path: str, flag: str) -> None:
    """The directory exists and is writable, or can be created (its nearest existing parent is a
    writable directory)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise UserError(f"{flag} {path!r} exists and is not a directory")
        _writable_dir(path, flag, path)
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    _writable_dir(parent, flag, path)


def write_text(path: str, text: str, mode: int | None = None) -> None:
    """Write ``text`` to ``path`` atomically (temp file in the same directory, then rename); no
    temp file is left behind on failure. ``mode``: permission bits (default: as a new file)."""
    write_atomic(path, lambda f: f.write(text), mode=mode)


def write_atomic(path: str, write, binary: bool = False, mode: int | None = None) -> None:
    """``write(f)`` into a temp file in ``path``'s directory, then rename it to ``path``: readers see
    the old file or the whole new one, and no temp file is left behind on failure. ``mode``:
    permission bits (default: as a new file, by the umask)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask  # mkstemp creates 0600
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def side_output(flag: str, target: str, write, default=None):
    """Run ``write()`` for a file a command writes beside its result (plots, launch files, a
    cluster file): (its value, None), or (``default``, the one-line reason) where it could not be
    written (a full disk, a read-only file). The command prints its result first and fails with
    the reasons after it (:func:`fail_after`), so a finished search or plan is not lost to a file
    it could not write."""
    try:
        return write(), None
    except OSError as e:
        return default, f"{flag} {target!r}: cannot write ({e.strerror or e})"
    except UserError as e:
        return default, str(e)


def fail_after(errors) -> None:
    """Raise the reasons :func:`side_output` collected, as one line."""
    errors = [e for e in errors if e]
    if errors:
        raise UserError("; ".join(errors))
