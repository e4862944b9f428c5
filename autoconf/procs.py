"""procs: every process autoconf starts dies with it (trial, search --verify, profile).

A :class:`ProcessTree` starts one command (torchrun) and owns everything it starts:

- the command runs in a session of its own (a Ctrl-C in the terminal reaches autoconf only, and
  autoconf decides), with a parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux):
  if autoconf itself dies, even by SIGKILL, so does torchrun;
- every descendant inherits the environment variable ``AUTOCONF_PROC_TREE=<token>``; the tree's
  members are found by that mark in ``/proc/<pid>/environ``, so a rank that torchrun put in a
  session of its own, or that was re-parented to init, is still found. The ranks call
  :func:`die_with_parent` at start-up, so they die with torchrun too;
- :meth:`ProcessTree.kill` sends SIGTERM and SIGCONT (a stopped process cannot act on SIGTERM
  until continued) to every member, waits ``grace_s``, then SIGKILLs what is left (SIGKILL also
  ends a stopped process) and waits until no member is alive.

With ``private_tmp=True`` the tree gets a temporary directory of its own as ``TMPDIR`` (torchrun
creates its ``torchelastic_*`` log directory there), removed once every member is gone; the ranks
get the caller's ``TMPDIR`` back at start-up (:func:`die_with_parent_if_launched`), so what they
write with ``tempfile`` is where it would have been.

Cleanup runs with SIGINT / SIGTERM / SIGHUP held back (:func:`deferred_signals`): a second Ctrl-C
during it is acted on afterwards, so it cannot cut the cleanup short and leave orphans.
:func:`install_terminate_handler` turns SIGTERM and SIGHUP into :class:`Terminated` (a
KeyboardInterrupt), so ``finally`` blocks run for them as for Ctrl-C.

No torch here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

MARK_ENV = "AUTOCONF_PROC_TREE"
OUTER_TMPDIR_ENV = "AUTOCONF_OUTER_TMPDIR"
"""Set with ``private_tmp``: the caller's TMPDIR ('' where unset), restored in the ranks."""
PR_SET_PDEATHSIG = 1
_HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
_live: set = set()
_prctl = None


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so that cleanup runs; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def install_terminate_handler() -> None:
    """SIGTERM / SIGHUP raise :class:`Terminated` in the main thread (exit code 128 + signal)."""
    def handler(signum, frame):
        raise Terminated(signum)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handler)


_deferring = False


@contextlib.contextmanager
def deferred_signals(reraise: bool = True):
    """Hold SIGINT, SIGTERM and SIGHUP back for the duration: they are noted, and raised again
    once it ends (``reraise=False``: dropped, for the exit path that is already handling one).
    Python-level (handlers run in the main thread whichever thread the kernel picks), so it also
    holds when other threads exist; nested uses are one."""
    global _deferring
    if _deferring or threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list = []
    old = {s: signal.getsignal(s) for s in _HELD}
    for s in _HELD:
        signal.signal(s, lambda signum, frame: got.append(signum))
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        for s, handler in old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if got and reraise:
            signal.raise_signal(got[0])  # now acted on as usual (KeyboardInterrupt, Terminated)


def _load_prctl():
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        try:
            import ctypes

            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
    return _prctl or None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; no-op
    elsewhere). Called by the ranks autoconf launches (only when they carry the tree mark)."""
    prctl = _load_prctl()
    if prctl is None:
        return
    parent = os.getppid()
    prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(128 + int(sig))


def die_with_parent_if_launched() -> None:
    """At a rank's start-up: die with torchrun, and get the caller's TMPDIR back (see
    ``ProcessTree(private_tmp=True)``)."""
    if os.environ.get(MARK_ENV):
        die_with_parent()
    restore_tmpdir()


def restore_tmpdir(environ=None) -> None:
    """Undo a private TMPDIR that a :class:`ProcessTree` set for torchrun (no-op without one), so
    that this process and what it starts write temporary files where the caller would."""
    environ = os.environ if environ is None else environ
    if OUTER_TMPDIR_ENV not in environ:
        return
    outer = environ.pop(OUTER_TMPDIR_ENV)
    if outer:
        environ["TMPDIR"] = outer
    else:
        environ.pop("TMPDIR", None)
    if environ is os.environ:
        tempfile.tempdir = None  # gettempdir() looks again


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")
    except (OSError, ValueError):
        return False


class ProcessTree:
    """One started command and all its descendants; a context manager that kills them on exit."""

    def __init__(self, cmd: list, *, env: dict | None = None, stdout=None, stderr=None, cwd=None,
                 private_tmp: bool = False):
        """``private_tmp``: the tree's TMPDIR is a new directory, removed with the tree (by
        :meth:`kill`, which the context manager calls): torchrun's ``torchelastic_*`` log
        directory goes with it."""
        self.token = f"{os.getpid()}-{uuid.uuid4().hex}"
        env = dict(os.environ if env is None else env)
        env[MARK_ENV] = self.token
        self.tmp_dir = None
        if private_tmp:
            try:
                self.tmp_dir = tempfile.mkdtemp(prefix="autoconf-run-")
            except OSError:
                pass  # no temporary directory at all: the command meets the same problem and says so
            else:
                env.setdefault(OUTER_TMPDIR_ENV, env.get("TMPDIR", ""))  # the outermost caller's, when nested
                env["TMPDIR"] = self.tmp_dir
        self._mark = f"{MARK_ENV}={self.token}".encode()
        prctl, parent = _load_prctl(), os.getpid()

        def child_setup():  # runs in the child between fork and exec
            if prctl is not None:
                prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
                if os.getppid() != parent:
                    os._exit(137)

        with deferred_signals():  # registered as soon as started
            try:
                self.proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, cwd=cwd,
                                             start_new_session=True, preexec_fn=child_setup)
            except BaseException:
                self._remove_tmp()
                raise
            _live.add(self)

    def _remove_tmp(self) -> None:
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float | None = None) -> int | None:
        """The command's exit code, or None if it is still running after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def members(self) -> set[int]:
        """Live processes of the tree: the command and everything carrying its mark."""
        out = {self.proc.pid} if self.proc.poll() is None else set()
        try:
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        except OSError:
            return out
        for pid in pids:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if self._mark in f.read() and _alive(pid):
                        out.add(pid)
            except OSError:
                continue
        return out

    def _signal_all(self, pids, sig) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, sig)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)

    def kill(self, grace_s: float = 2.0) -> None:
        """End the whole tree: SIGTERM + SIGCONT, ``grace_s`` to exit, then SIGKILL; returns
        when no member is alive. Idempotent; signals are held back while it runs."""
        with deferred_signals():
            pids = self.members()
            if pids:
                self._signal_all(pids, signal.SIGTERM)
                self._signal_all(pids, signal.SIGCONT)
                deadline = time.monotonic() + grace_s
                while pids and time.monotonic() < deadline:
                    time.sleep(0.05)
                    pids = self.members()
            for _ in range(200):  # SIGKILL until nothing is left (at most ~10 s)
                if not pids:
                    break
                self._signal_all(pids, signal.SIGKILL)
                time.sleep(0.05)
                pids = self.members()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            if not pids:  # no member can still be writing there
                self._remove_tmp()
            _live.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        return False


def kill_all(grace_s: float = 1.0) -> None:
    """Kill every tree still alive (the CLI calls this on the way out, whatever happened)."""
    for tree in list(_live):
        tree.kill(grace_s)


def oom_kills() -> int | None:
    """The kernel OOM killer's kill count in this process's memory cgroup (v2 memory.events or v1
    memory.oom_control), or None where it cannot be read: a rise during a run labels a rank
    killed by SIGKILL as out of memory."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    paths = []
    for ln in lines:
        _, ctrl, path = ln.split(":", 2)
        if ctrl == "":
            paths.append(f"/sys/fs/cgroup{path}/memory.events")
        elif "memory" in ctrl.split(","):
            paths += [f"/sys/fs/cgroup/memory{path}/memory.oom_control", "/sys/fs/cgroup/memory/memory.oom_control"]
    for p in paths:
        try:
            with open(p) as f:
                for ln in f:
                    key, _, val = ln.partition(" ")
                    if key == "oom_kill":
                        return int(val)
        except (OSError, ValueError):
            continue
    return None
