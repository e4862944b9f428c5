"""Input and output files: inputs read bounded from regular files only, outputs checked before any
work starts and written atomically.

Inputs (``--model``, ``--cluster``, ``--profile``, ``--calibration``, ``trial --config``, ...) go
through :func:`check_input` / :func:`read_input`, the one place that opens them: a path is read
only when it is a regular file (or a pipe from the shell, ``--model <(...)``, whose writer already
runs); a FIFO, a device, a socket, a directory, a symlink loop or a missing file is one line. The
file is opened with ``O_NONBLOCK`` and checked again on the opened descriptor (``fstat``), so a FIFO
swapped in after the check cannot block the read either; at most ``max_bytes + 1`` bytes are read.

Outputs: ``check_file`` / ``check_dir`` run before a search, a verify or a profile starts, so an
unwritable ``--emit``, ``--calibrate``, ``--out`` or ``--storage`` is one line at once, not after
every trial ran. An output file must be absent, a regular file or a symlink to one: ``os.replace``
would otherwise swap a FIFO or a device (``--cluster-out /dev/null``, as root) for a regular file.
A directory output must not be one of :data:`SYSTEM_DIRS`. ``write_text`` writes a temp file beside
the target and renames it over, after checking the target again; on any failure (a full disk, an
interrupt) the temp file is removed and the previous file, if any, stays.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile

from autoconf.errors import UserError

SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/opt",
               "/proc", "/run", "/sbin", "/srv", "/sys", "/usr", "/usr/bin", "/usr/lib", "/usr/lib32",
               "/usr/lib64", "/usr/libexec", "/usr/local", "/usr/sbin", "/usr/share", "/var", "/var/lib",
               "/var/log")
"""Directories a directory output (``--emit DIR``, ``--plot DIR``) may not be: the root and the
directories the system's own files live in (FHS), where launch scripts or pictures would land among
them. Compared on the real path (symlinks and '..' resolved); their subdirectories are the user's
choice. Left out: /tmp, /mnt, /media (scratch space) and /root (a home directory, often the working
directory in a container)."""

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (a named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
_PIPEFS: list[int] = []


def _kind(st: os.stat_result) -> str:
    """What a non-regular file is ('a FIFO (a named pipe)', ...); '' for a regular file."""
    return next((name for test, name in _KINDS if test(st.st_mode)), "" if stat.S_ISREG(st.st_mode) else "a special file")


def _shell_pipe(st: os.stat_result) -> bool:
    """An anonymous pipe (``<(...)``, a piped stdin), not a named FIFO: the shell started its writer."""
    if not stat.S_ISFIFO(st.st_mode):
        return False
    if not _PIPEFS:  # anonymous pipes live on one pseudo file system; a named FIFO on its directory's
        r, w = os.pipe()
        _PIPEFS.append(os.fstat(r).st_dev)
        os.close(r)
        os.close(w)
    return st.st_dev == _PIPEFS[0]


def _unreachable(path: str, what: str, e: OSError, verb: str = "read") -> str:
    """One line for a path that stat or open refused."""
    if e.errno == errno.ELOOP:
        return f"{what} {path!r} is a symlink loop (its links lead back to themselves)"
    if e.errno == errno.ENOENT:
        if os.path.islink(path):
            return f"{what} {path!r} is a symlink to {os.path.realpath(path)!r}, which does not exist"
        return f"{what} {path!r} does not exist"
    return f"cannot {verb} {what} {path!r}: {e.strerror or e}"


def _refuse_special(st: os.stat_result, path: str, what: str) -> None:
    kind = _kind(st)
    if kind and not _shell_pipe(st):
        raise UserError(f"{what} {path!r} is {kind}, not a regular file")


def check_input(path: str, what: str) -> os.stat_result:
    """``path`` is a file to read: a regular file, or a pipe from the shell; else one line (does
    not exist, is a symlink loop, is a FIFO, a character device, a directory, a socket). ``what``
    names it in the message ('cluster file', '--config')."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UserError(_unreachable(path, what, e)) from None
    _refuse_special(st, path, what)
    return st


def read_input(path: str, what: str, max_bytes: int) -> bytes:
    """The bytes of the input file ``path`` (:func:`check_input`), at most ``max_bytes`` of them:
    opened non-blocking and checked again on the descriptor, so a FIFO or a device swapped in after
    the check is refused without blocking; a larger file is refused unread."""
    check_input(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UserError(_unreachable(path, what, e)) from None
    try:
        st = os.fstat(fd)
        _refuse_special(st, path, what)
        if stat.S_ISREG(st.st_mode) and st.st_size > max_bytes:
            raise UserError(f"{what} {path!r} is {st.st_size:,} bytes; at most {max_bytes:,} are read "
                            "(is this the right file?)")
        os.set_blocking(fd, True)  # a regular file, or a shell pipe whose writer runs
        data = _read_at_most(fd, max_bytes + 1)
    except OSError as e:
        raise UserError(f"cannot read {what} {path!r}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew since fstat, or a pipe
        raise UserError(f"{what} {path!r} is larger than {max_bytes:,} bytes (is this the right file?)")
    return data


def _read_at_most(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(1 << 20, n - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# -- outputs ----------------------------------------------------------------------------------------

def _writable_dir(directory: str, flag: str, shown: str) -> None:
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UserError(f"{flag} {shown!r}: {directory!r} is not a directory")
    if not os.path.isdir(directory):
        raise UserError(f"{flag} {shown!r}: directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {shown!r}: directory {directory!r} is not writable")


def _check_target(path: str, flag: str) -> None:
    """An output file may be replaced: it is absent, a regular file, or a symlink to one."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return  # a new file (its directory is checked by the caller, or by mkstemp)
    except OSError as e:
        raise UserError(_unreachable(path, flag, e, "write")) from None
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return  # a link to a file not made yet (a database a search creates through it)
        except OSError as e:
            raise UserError(_unreachable(path, flag, e, "write")) from None
    kind = _kind(st)
    if kind == "a directory":
        raise UserError(f"{flag} {path!r} is a directory; expected a file name")
    if kind:
        raise UserError(f"{flag} {path!r} is {kind}, not a regular file: it is not replaced; name a regular "
                        "file or a new one")


def check_file(path: str, flag: str) -> None:
    """The file can be created or replaced: it is absent, a regular file or a symlink to one (not a
    FIFO, a device, a socket or a directory), and its directory exists and is writable."""
    _check_target(path, flag)
    _writable_dir(os.path.dirname(os.path.abspath(path)), flag, path)


def check_dir(path: str, flag: str) -> None:
    """The directory exists and is writable, or can be created (its nearest existing parent is a
    writable directory); it is not one of :data:`SYSTEM_DIRS`."""
    real = os.path.realpath(path)
    if real in {os.path.realpath(d) for d in SYSTEM_DIRS}:
        shown = f" ({real})" if real != os.path.normpath(os.path.abspath(path)) else ""
        raise UserError(f"{flag} {path!r}{shown} is a system directory; name a directory of your own, e.g. ./launch")
    if os.path.lexists(path):
        try:
            st = os.stat(path)
        except OSError as e:
            raise UserError(_unreachable(path, flag, e, "write")) from None
        if not stat.S_ISDIR(st.st_mode):
            raise UserError(f"{flag} {path!r} exists and is {_kind(st) or 'a file'}, not a directory")
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
    permission bits (default: as a new file, by the umask). A target that exists and is not a
    regular file (or a symlink to one) is refused before anything is written and again right
    before the rename: a FIFO or a device is never replaced."""
    write_all_or_none([(path, write, binary, mode)])


def write_texts_all_or_none(files) -> list[str]:
    """Write every ``(path, text, mode)``, or none of them: each is staged in a temp file beside its
    target first, and only once every one is written whole (a full disk fails here) are they
    renamed into place (renames take no space). On any failure every staged file is removed and
    every target keeps its old content. Returns the paths."""
    write_all_or_none([(path, (lambda f, t=text: f.write(t)), False, mode) for path, text, mode in files])
    return [path for path, _text, _mode in files]


def write_all_or_none(files) -> None:
    """:func:`write_texts_all_or_none` for ``(path, write(f), binary, mode)`` items."""
    staged: list[tuple[str, str]] = []
    try:
        for path, write, binary, mode in files:
            _check_target(path, "output file")
            staged.append((_stage(path, write, binary, mode), path))
        for tmp, path in staged:
            _check_target(path, "output file")  # what may have appeared while writing
        for tmp, path in staged:
            os.replace(tmp, path)
    except BaseException:
        for tmp, _path in staged:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise


def _stage(path: str, write, binary: bool, mode: int | None) -> str:
    """``write(f)`` into a new temp file beside ``path``, flushed to disk; its name (removed on failure)."""
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
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return tmp


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
