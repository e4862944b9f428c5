"""The study's storage: SQLite paths and locks, study names and the digests that decide whether a
stored study was made by the same inputs and cost model.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re

from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig

_COST_MODEL_SOURCES = ("cost", "space", "specs/frameworks.py", "specs/recipes.py", "specs/devices.py", "specs/model.py",
                       "trainer/moe.py",
                       "trainer/fp8.py", "data/devices.json", "data/models.json")


_SIGNATURE_WHAT = {"model": "model", "cost_model": "cost model (autoconf was updated since)",
                   "global_batch": "global batch", "devices": "devices", "framework": "framework",
                   "max_micro_batch": "max micro-batch", "cluster": "cluster file", "profile": "profile",
                   "calibration": "calibration", "placement": "placement search",
                   "cp": "context-parallel degrees", "precisions": "precisions"}


def _digest(d: dict) -> str:
    import hashlib
    import json
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


_SQLITE = re.compile(r"sqlite(\+\w+)?://")
_MEMORY = ("", ":memory:", "file::memory:")
_NAME_MAX = 200


def sqlite_path(storage: str | None) -> str | None:
    """The database file of a ``sqlite:///`` storage URL (None for other storages or in memory)."""
    m = _SQLITE.match(storage or "")
    if m is None or not storage[m.end():].startswith("/"):
        return None
    path = storage[m.end() + 1:].split("?", 1)[0]
    return None if path in _MEMORY else path


def check_storage(storage: str | None) -> str | None:
    """The storage a search writes to, or None to keep the trials in memory: ``sqlite://``,
    ``sqlite:///:memory:`` and ``sqlite:///file::memory:`` are in memory (nothing written). A SQLite
    URL's only option is ``timeout=SECONDS``; one that cannot hold a search (read-only, a URI
    filename) or that SQLite would ignore is refused in one line."""
    m = _SQLITE.match(storage or "")
    if m is None:
        return storage
    path, _, query = storage[m.end():].partition("?")
    if (not path.startswith("/") and path) or path == "/":
        raise UserError(f"--storage {storage!r}: expected sqlite:///FILE.db (relative), sqlite:////PATH.db "
                        "(absolute) or sqlite:// (in memory)")
    if path.startswith("/file:") and path != "/file::memory:":
        raise UserError(f"--storage {storage!r}: SQLite URI filenames are not supported (give the file path: "
                        "sqlite:///FILE.db, or sqlite:// to keep the study in memory)")
    for option in filter(None, query.split("&")):
        key, _, value = option.partition("=")
        if key == "mode" and value in ("ro", "memory"):
            why = ("read-only: a search writes its trials" if value == "ro" else
                   "use sqlite:// to keep the study in memory")
            raise UserError(f"--storage {storage!r}: mode={value} is refused ({why})")
        if key != "timeout" or not _positive(value):
            raise UserError(f"--storage {storage!r}: option {option!r} is not supported (the only SQLite option "
                            "is timeout=SECONDS, a positive number)")
    return None if path[1:] in _MEMORY else storage


def _positive(text: str) -> bool:
    try:
        return 0 < float(text) < float("inf")
    except ValueError:
        return False


def check_study_name(name: str | None) -> None:
    """A study name is at most ``_NAME_MAX`` printable characters (no control characters)."""
    if name is None:
        return
    if not name or len(name) > _NAME_MAX or not name.isprintable():
        shown = repr(name[:40]) + ("..." if len(name) > 40 else "")
        raise UserError(f"--study-name {shown} ({len(name)} characters): expected 1 to {_NAME_MAX} printable "
                        "characters (no control characters)")


def storage_failure(e: BaseException) -> str:
    """Why a storage write or open failed, in a few words: "the disk is full" where that is the
    cause at the bottom of the SQLAlchemy / Optuna chain, else the innermost error's first line."""
    chain, cur = [], e
    while cur is not None and len(chain) < 12:
        chain.append(cur)
        cur = getattr(cur, "orig", None) or cur.__cause__ or cur.__context__
    for c in chain:
        if (isinstance(c, OSError) and c.errno == errno.ENOSPC) or getattr(c, "sqlite_errorcode", None) == 13 \
                or "disk is full" in str(c):
            return "the disk is full"
    root = chain[-1]
    return f"{type(root).__name__}: {(str(root).splitlines() or [''])[0][:160]}"


def _lock_file(storage: str) -> tuple[str, str]:
    """(the database's resolved path, its lock file): every spelling of a database (a symbolic
    link, a relative path) shares one lock file."""
    real = os.path.realpath(sqlite_path(storage))
    return real, real + ".lock"


def _open_lock(storage: str, lock: str) -> tuple[int, tuple, bool]:
    """(fd, (device, inode) of the lock file, whether this call created it). The process keeps
    every fd it opens on a lock file until its last study there is released: closing one would
    drop all of the process's locks on the file (POSIX record locks belong to the process)."""
    try:
        try:
            fd, made = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:
            fd, made = os.open(lock, os.O_RDWR), False
    except OSError as e:
        raise UserError(f"--storage {storage!r}: cannot open the study (cannot create {lock!r}: "
                        f"{e.strerror})") from None
    st = os.fstat(fd)
    entry = _lock_fds.setdefault((st.st_dev, st.st_ino), {"fds": [], "users": 0})
    entry["fds"].append(fd)
    entry["users"] += 1
    return fd, (st.st_dev, st.st_ino), made


def _close_lock(key: tuple) -> None:
    entry = _lock_fds[key]
    entry["users"] -= 1
    if entry["users"] == 0:
        del _lock_fds[key]
        for fd in entry["fds"]:
            os.close(fd)  # releases the locks


@contextlib.contextmanager
def study_lock(storage: str | None, name: str):
    """Hold a study for this process: a second search on the same SQLite study (another process)
    is refused in one line instead of storing every trial twice. The lock is a byte-range lock on
    ``<database>.lock`` beside the database's resolved path (so ``link.db`` -> ``s.db`` is the same
    study; released by the kernel when the process ends, however it ends); creating the
    database's tables is serialised through the same file. Other storages are not locked."""
    if sqlite_path(storage) is None:
        yield
        return
    import fcntl
    import hashlib

    real, lock = _lock_file(storage)
    fd, key, made = _open_lock(storage, lock)
    try:
        if (*key, name) in _held_locks:  # this process holds it already
            yield
            return
        offset = 1 + int(hashlib.sha256(name.encode()).hexdigest()[:12], 16) % (2**40)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
        except OSError:
            raise UserError(f"study {name!r} in {storage} is in use by another search; wait for it to finish "
                            "or pass another --study-name") from None
        _held_locks[(*key, name)] = {"created": not os.path.exists(real), "lock_made": made}
        try:
            yield
        finally:
            del _held_locks[(*key, name)]
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)
    finally:
        _close_lock(key)


def _held_fd(storage: str | None) -> tuple[int, tuple] | None:
    """(an fd on the lock file of a database this process holds a study of, its key), or None."""
    if sqlite_path(storage) is None:
        return None
    try:
        st = os.stat(_lock_file(storage)[1])
    except OSError:
        return None
    key = (st.st_dev, st.st_ino)
    return (_lock_fds[key]["fds"][0], key) if key in _lock_fds else None


@contextlib.contextmanager
def _schema_lock(storage: str | None):
    """Serialise creating a new SQLite database's tables between processes (optuna's table
    creation races: 'table studies already exists')."""
    held = _held_fd(storage)
    if held is None:
        yield
        return
    import fcntl

    fcntl.lockf(held[0], fcntl.LOCK_EX, 1, 0)
    try:
        yield
    finally:
        fcntl.lockf(held[0], fcntl.LOCK_UN, 1, 0)


def _discard_new_database(storage: str | None) -> None:
    """Remove what a failed creation of a SQLite study left (the database, its journal, the lock
    file), only where this run created them and no other process holds a study of the database."""
    import fcntl

    held = _held_fd(storage)
    if held is None:
        return
    mine = [h for (d, i, _), h in _held_locks.items() if (d, i) == held[1]]
    if not mine or not all(h["created"] for h in mine):
        return
    try:  # the whole file: refused while another process holds any study there
        fcntl.lockf(held[0], fcntl.LOCK_EX | fcntl.LOCK_NB, 0, 0)
    except OSError:
        return
    real, lock = _lock_file(storage)
    made = (lock,) if any(h["lock_made"] for h in mine) else ()
    for path in (real, real + "-journal", real + "-wal", real + "-shm", *made):
        with contextlib.suppress(OSError):
            os.unlink(path)


def default_study_name(model, world: int, global_batch: int, cluster_name: str, framework: str = "reference",
                       signature: dict | None = None) -> str:
    """The study name a search uses when none is given: readable parts, then a fingerprint of
    everything the stored values depend on (``signature``: model, cluster, profile content,
    calibration, framework, batch, devices, space options), so the same inputs resume the same
    study and changed ones (a new profile) start a fresh one."""
    name = f"{model.name}-{cluster_name}-{world}gpus-gb{global_batch}"
    name = name if framework == "reference" else f"{name}-{framework}"
    return f"{name}-{_digest(signature)[:8]}" if signature is not None else name


@functools.lru_cache(maxsize=1)
def cost_model_digest() -> str:
    """A digest of the code and data that price a configuration (``_COST_MODEL_SOURCES``): a study
    stored by another version of the cost model is not resumed as if its times still held (the
    default study name changes with it)."""
    import hashlib
    from importlib import resources
    h = hashlib.sha256()
    root = resources.files("autoconf")
    for name in _COST_MODEL_SOURCES:
        node = root.joinpath(name)
        files = sorted((f for f in node.iterdir() if f.name.endswith(".py")), key=lambda f: f.name) \
            if node.is_dir() else [node]
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _difference(stored: dict, now: dict) -> str:
    """What differs between a study's inputs and this search's, in a few words each."""
    out = []
    for k in sorted(set(stored) | set(now)):
        a, b = stored.get(k), now.get(k)
        if a == b:
            continue
        what = _SIGNATURE_WHAT.get(k, k)
        if k == "model" and isinstance(a, dict) and isinstance(b, dict) and a.get("name") != b.get("name"):
            out.append(f"model ({a.get('name')} in the study, {b.get('name')} now)")
        elif k in ("cluster", "profile", "calibration", "model", "cost_model"):
            out.append(f"{what} ({'none' if a is None else 'other content' if b is not None else 'one'} in the study, "
                       f"{'none' if b is None else 'this one'} now)")
        else:
            out.append(f"{what} ({a if a is not None else 'none'} in the study, {b if b is not None else 'none'} now)")
    return "; ".join(out)


def config_digest(c: ParallelConfig) -> str:
    """A configuration's identity in the study's records."""
    return _digest(c.to_dict())


_held_locks: dict = {}
"""(device, inode of the lock file, study name) -> {"created": the database did not exist when the
study was taken, "lock_made": this process created the lock file}"""
_lock_fds: dict = {}
"""(device, inode) of a lock file -> {"fds": this process's fds on it, "users": study_lock calls}"""
