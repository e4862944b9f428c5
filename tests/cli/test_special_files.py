"""Special files as inputs and outputs: refused in one line, never read from, never replaced.

Every input flag given a FIFO, a character device, a socket, a directory or a symlink loop is one
line on stderr and exit 2, at once (a FIFO used to block the command forever: the subprocess
timeouts here are the safety net that turns such a hang into a failure). Every output given a FIFO
or a character device is refused before anything is written, and the special file is left as it
was; a directory output is never ``/`` or a system directory. ``estimate`` refuses a profile of
another device kind than the cluster's, with ``plan``'s message, unless ``--allow-other-devices``.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoconf.cost.calibration import load_calibration
from autoconf.errors import UserError
from autoconf.files import check_dir, check_file, check_input, read_input, write_atomic, write_text
from autoconf.launch.plan import LaunchPlan
from autoconf.launch.plan import load as load_plan
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import load_cluster
from autoconf.specs.hf import load_model
from autoconf.specs.model import preset
from autoconf.specs.profile import check_profile_matches, load_profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EX = os.path.join(ROOT, "examples")
CPU = os.path.join(EX, "clusters/localhost-cpu.yaml")
A100 = os.path.join(EX, "clusters/a100-4x8.yaml")
H256 = os.path.join(EX, "models/bench-h256.yaml")
CPU_PROFILE = os.path.join(EX, "profiles/bench-h256-cpu2.json")
LIMIT_S = 120  # a safety net: a command that blocks on a FIFO fails here instead of hanging the suite


def _cli(*argv, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "autoconf", *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=LIMIT_S)


def _refused(p, *needles) -> str:
    """Exit 2, one line on stderr, no traceback; the line holds every needle."""
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoconf: error: "), p.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _plan_file(d) -> str:
    plan = LaunchPlan(ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=2, num_micro_batches=2), preset("tiny"),
                      load_cluster(CPU)).to_dict()
    path = os.path.join(d, "config.json")
    with open(path, "w") as f:
        json.dump(plan, f)
    return path


def _argv(flag: str, path: str, plan: str) -> list[str]:
    """A command whose ``flag`` (e.g. 'estimate --cluster') reads ``path``; its other inputs are valid."""
    command, opt = flag.split()
    if command == "profile":
        return ["profile", "--model", path, "--out", "p.json"]
    if command == "trial":
        return ["trial", "--config", plan, opt, path] if opt != "--config" else ["trial", "--config", path]
    args = {"--model": H256, "--cluster": CPU}
    args[opt] = path
    given = [a for kv in args.items() for a in kv]
    if command == "plan":
        return ["plan", *given, "--quiet"]
    extra = ["--dp", "2"] if command == "estimate" else ["--storage", "none", "--trials", "5"]
    return [command, *given, "--global-batch", "8", *extra]


INPUT_FLAGS = ["estimate --model", "estimate --cluster", "estimate --profile", "estimate --calibration",
               "search --model", "search --cluster", "search --profile", "search --calibration",
               "plan --model", "plan --cluster", "plan --profile",
               "trial --config", "trial --cluster", "trial --profile", "profile --model"]


@pytest.mark.parametrize("flag", INPUT_FLAGS)
def test_a_fifo_as_any_input_is_refused_at_once(flag, tmp_path):
    fifo = str(tmp_path / "input.yaml")
    os.mkfifo(fifo)
    p = _cli(*_argv(flag, fifo, _plan_file(tmp_path)), cwd=tmp_path)
    _refused(p, "is a FIFO", repr(fifo))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "input.yaml"], "the command wrote a file"


@pytest.mark.parametrize("flag,kind,needle", [
    ("estimate --cluster", "/dev/null", "is a character device"),
    ("trial --config", "/dev/zero", "is a character device"),
    ("plan --profile", "/dev/null", "is a character device"),
    ("profile --model", "/dev/urandom", "is a character device"),
    ("estimate --model", "loop", "is a symlink loop"),
    ("estimate --cluster", "loop", "is a symlink loop"),
    ("trial --config", "loop", "is a symlink loop"),
    ("search --profile", "loop", "is a symlink loop"),
    ("estimate --calibration", "socket", "is a socket"),
    ("plan --cluster", "directory", "is a directory"),
    ("trial --profile", "dangling", "which does not exist"),
])
def test_devices_sockets_directories_and_symlink_loops_are_named(flag, kind, needle, tmp_path):
    if kind.startswith("/dev/"):
        path = kind
    else:
        path = str(tmp_path / f"{kind}.json")
        _make(kind, path)
    p = _cli(*_argv(flag, path, _plan_file(tmp_path)), cwd=tmp_path)
    _refused(p, needle, repr(path))


def _make(kind: str, path: str) -> None:
    """A special file of ``kind`` at ``path``."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        os.symlink(os.path.basename(path), path)
    elif kind == "loop2":
        os.symlink(path + ".b", path)
        os.symlink(path, path + ".b")
    elif kind == "dangling":
        os.symlink(path + ".gone", path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "socket":  # bound where the path is short (AF_UNIX: 107 bytes), then moved
        short = os.path.join(tempfile.mkdtemp(prefix="s", dir="/tmp"), "s")
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(short)
        os.rename(short, path)
        os.rmdir(os.path.dirname(short))
    elif kind.startswith("/dev/"):
        os.symlink(kind, path)
    else:
        raise AssertionError(kind)


# -- a FIFO swapped in after the check -------------------------------------------------------------

def test_a_fifo_swapped_in_after_the_check_is_refused_without_blocking(tmp_path):
    """The input is a regular file when it is checked and a FIFO (without a writer) when it is
    opened: the swap is made by a profile hook on the reader's thread, the moment
    :func:`check_input` returns. The read refuses it at once: opened non-blocking, checked on the
    descriptor. (A blocking open would wait for a writer forever: the thread's join limit fails it.)"""
    path = str(tmp_path / "input.yaml")
    with open(path, "w") as f:
        f.write("text")
    swapped = []

    def swap(frame, event, arg):
        if event == "return" and frame.f_code is check_input.__code__ and not swapped:
            os.unlink(path)
            os.mkfifo(path)
            swapped.append(path)

    def read(p):
        sys.setprofile(swap)
        try:
            return read_input(p, "input", 100)
        finally:
            sys.setprofile(None)
    e = _load_in_thread(read, path)
    assert swapped == [path] and stat.S_ISFIFO(os.lstat(path).st_mode)
    assert isinstance(e, UserError) and f"input {path!r} is a FIFO" in str(e), repr(e)


# -- the loaders, fuzzed over special files and paths ----------------------------------------------

LOADERS = {"model": load_model, "cluster": load_cluster, "profile": load_profile, "calibration": load_calibration,
           "plan": load_plan, "check_input": lambda p: check_input(p, "input"),
           "read_input": lambda p: read_input(p, "input", 1 << 20)}
KIND_WORDS = {"fifo": "is a FIFO", "/dev/null": "is a character device", "/dev/zero": "is a character device",
              "/dev/urandom": "is a character device", "directory": "is a directory", "socket": "is a socket",
              "loop": "is a symlink loop", "loop2": "is a symlink loop", "dangling": "which does not exist"}
NAMES = st.text(st.sampled_from("abcxyz019 _-.é€"), min_size=1, max_size=24).filter(lambda s: s not in (".", ".."))


def _load_in_thread(loader, path) -> BaseException | None:
    """The loader's exception (None if it returned); fails if it is still running after the limit."""
    got: list = []

    def run():
        try:
            loader(path)
            got.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            got.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(LIMIT_S)
    if t.is_alive():  # blocked on a FIFO: give it a writer that closes at once, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"{loader} blocked on {path!r}")
    return got[0]


@settings(max_examples=int(os.environ.get("SPECIAL_EXAMPLES", "120")), deadline=None, derandomize=True,
          database=None, suppress_health_check=list(HealthCheck))
@given(loader=st.sampled_from(sorted(LOADERS)), kind=st.sampled_from(sorted(KIND_WORDS)), name=NAMES,
       suffix=st.sampled_from(["", ".yaml", ".json"]), links=st.integers(0, 3))
def test_every_loader_refuses_every_special_file_in_one_line(loader, kind, name, suffix, links, tmp_path_factory):
    d = tmp_path_factory.mktemp("special")
    target = str(d / (name + suffix))
    _make(kind, target)
    path = target
    for i in range(links):  # reached through a chain of symlinks
        link = str(d / f"link{i}{suffix}")
        os.symlink(path, link)
        path = link
    e = _load_in_thread(LOADERS[loader], path)
    assert isinstance(e, UserError), repr(e)
    msg = str(e)
    assert "\n" not in msg and repr(path) in msg, msg
    # cluster and plan files are checked for existence first (os.path.exists): a loop there reads
    # "does not exist"; the CLI names it a loop before the loader runs (--cluster, --config)
    if not (loader in ("cluster", "plan") and kind in ("loop", "loop2", "dangling")):
        assert KIND_WORDS[kind] in msg, msg
    else:
        assert "does not exist" in msg, msg
    if kind == "fifo":
        assert stat.S_ISFIFO(os.stat(target).st_mode)


# -- outputs ------------------------------------------------------------------------------------------

def _null_device(d) -> str:
    """A character device to write to: a null device made in ``d`` (as root), else a symlink to
    /dev/null. Never /dev/null itself: were the check to regress, os.replace would swap the
    machine's /dev/null for a regular file; here it swaps only the test's own node or link."""
    path = os.path.join(d, "null")
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except OSError:
        os.symlink("/dev/null", path)
    return path


def _still_a_device(path: str) -> None:
    st = os.stat(path)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)


def test_plan_cluster_out_to_a_fifo_or_a_null_device_is_refused_before_any_work(tmp_path):
    fifo = str(tmp_path / "cluster.yaml")
    os.mkfifo(fifo)
    base = ["plan", "--model", "tiny", "--device", "a100-80gb", "--max-gpus", "8", "--quiet"]
    _refused(_cli(*base, "--cluster-out", fifo, cwd=tmp_path), "--cluster-out", "is a FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    null = _null_device(tmp_path)
    _refused(_cli(*base, "--cluster-out", null, cwd=tmp_path), "is a character device")
    _still_a_device(null)
    written = _cli(*base, "--cluster-out", "c.yaml", cwd=tmp_path)  # a regular file: written, and loads
    assert written.returncode == 0, written.stderr[-2000:]
    assert load_cluster(str(tmp_path / "c.yaml")).device_kinds() == ["a100-80gb"]


def test_profile_out_calibrate_and_storage_refuse_special_files(tmp_path):
    fifo = str(tmp_path / "out.json")
    os.mkfifo(fifo)
    null = _null_device(tmp_path)
    _refused(_cli("profile", "--model", "tiny", "--out", fifo, cwd=tmp_path), "--out", "is a FIFO")
    _refused(_cli("profile", "--model", "tiny", "--out", null, cwd=tmp_path), "is a character device")
    _still_a_device(null)
    search = ["search", "--model", "tiny", "--cluster", CPU, "--global-batch", "8", "--trials", "5"]
    _refused(_cli(*search, "--storage", "none", "--verify", "1", "--calibrate", fifo, cwd=tmp_path),
             "--calibrate", "is a FIFO")
    _refused(_cli(*search, "--storage", f"sqlite:///{fifo}", cwd=tmp_path), "--storage", "is a FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["null", "out.json"]


@pytest.mark.parametrize("target", ["/", "/etc", "/usr/../var", "link-to-usr", "a-fifo"])
def test_emit_into_a_system_directory_or_a_non_directory_is_refused(target, tmp_path):
    if target == "link-to-usr":
        os.symlink("/usr", tmp_path / target)
    elif target == "a-fifo":
        os.mkfifo(tmp_path / target)
    p = _cli("search", "--model", "tiny", "--cluster", CPU, "--global-batch", "8", "--storage", "none",
             "--trials", "5", "--emit", target, cwd=tmp_path)
    _refused(p, "--emit", "is a FIFO" if target == "a-fifo" else "is a system directory")


def test_a_fifo_inside_the_emit_directory_is_not_replaced(tmp_path):
    out = tmp_path / "launch"
    out.mkdir()
    os.mkfifo(out / "config.json")
    p = _cli("search", "--model", "tiny", "--cluster", CPU, "--global-batch", "8", "--storage", "none",
             "--trials", "5", "--emit", str(out), cwd=tmp_path)
    _refused(p, "config.json", "is a FIFO")
    assert stat.S_ISFIFO(os.lstat(out / "config.json").st_mode)
    assert [n for n in os.listdir(out) if n.endswith(".tmp")] == []


def test_write_text_refuses_a_fifo_or_a_device_before_writing_and_before_the_rename(tmp_path):
    devices = tmp_path / "dev"
    devices.mkdir()
    null = _null_device(devices)
    with pytest.raises(UserError, match="is a character device"):
        write_text(null, "x")  # refused before its temp file is made beside it
    _still_a_device(null)
    assert os.listdir(devices) == ["null"]
    path = str(tmp_path / "out.txt")
    write_text(path, "old")

    def swap_in_a_fifo(f):  # a FIFO takes the target's place while the new text is written
        os.unlink(path)
        os.mkfifo(path)
        f.write("new")
    with pytest.raises(UserError, match="is a FIFO"):
        write_atomic(path, swap_in_a_fifo)
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["dev", "out.txt"], "the temp file was left behind"
    os.unlink(path)
    os.symlink("/dev/null", path)  # a symlink to a device: its target is checked
    with pytest.raises(UserError, match="is a character device"):
        check_file(path, "--out")
    with pytest.raises(UserError, match="is a system directory"):
        check_dir("//", "--emit")


# -- profile and cluster of other devices ---------------------------------------------------------

def test_estimate_refuses_a_profile_of_other_devices_with_plans_message(tmp_path):
    est = ["estimate", "--model", H256, "--profile", CPU_PROFILE, "--cluster", A100, "--global-batch", "8",
           "--dp", "2"]
    line = _refused(_cli(*est, cwd=tmp_path), "--profile was measured on cpu", "a100-80gb",
                    "--allow-other-devices")
    planned = _refused(_cli("plan", "--model", H256, "--profile", CPU_PROFILE, "--cluster", A100, "--quiet",
                            cwd=tmp_path))
    assert line.startswith(planned), (line, planned)
    ok = _cli(*est, "--allow-other-devices", "--json", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["step_time_s"] > 0
    same = _cli("estimate", "--model", H256, "--profile", CPU_PROFILE, "--cluster", CPU, "--global-batch", "8",
                "--dp", "2", "--json", cwd=tmp_path)
    assert same.returncode == 0, same.stderr[-2000:]


def test_search_refuses_a_profile_of_other_devices_with_the_same_message(tmp_path):
    base = ["--model", H256, "--profile", CPU_PROFILE, "--cluster", A100, "--global-batch", "8"]
    est = _refused(_cli("estimate", *base, "--dp", "2", cwd=tmp_path))
    found = _refused(_cli("search", *base, "--storage", "none", "--quiet", cwd=tmp_path))
    assert found == est, (found, est)
    ok = _cli("search", *base, "--storage", "none", "--quiet", "--json", "--allow-other-devices", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["best"]


def test_a_profile_of_another_shape_with_the_same_name_says_what_differs():
    import dataclasses
    profile = load_profile(CPU_PROFILE)
    wider = dataclasses.replace(profile.model, hidden_size=2 * profile.model.hidden_size)
    with pytest.raises(UserError) as e:
        check_profile_matches(profile, wider)
    msg = str(e.value)
    name = profile.model.name
    assert f"not {name!r}" not in msg
    assert f"another shape of model {name!r} (hidden_size differs)" in msg
    assert f"hidden_size: {profile.model.hidden_size} -> {wider.hidden_size}" in msg
