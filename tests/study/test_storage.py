"""The study's storage: one lock per database file however it is spelled, SQLite URL options honoured
or refused, study names bounded, a full disk (a real tmpfs) as one line with nothing finished lost,
and verifying trials kept before the calibration file is tried."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import optuna
import pytest

from autoconf.cli import app as cli
from autoconf.errors import UserError
from autoconf.runs.trial import TrialResult
from autoconf.specs.cluster import load_cluster
from autoconf.specs.model import preset
from autoconf.study.search import search
from autoconf.study.storage import study_lock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_YAML = os.path.join(ROOT, "examples/clusters/localhost-cpu.yaml")
CPU = load_cluster(CPU_YAML)
TINY = preset("tiny")
ENV = dict(os.environ, PYTHONPATH=ROOT)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "autoconf", *args], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=600)


def _search_args(storage, *extra):
    return ["search", "--model", "tiny", "--cluster", CPU_YAML, "--global-batch", "8", "--storage", storage, *extra]


def _one_line_error(p, needle):
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    assert needle in p.stderr, p.stderr


_TRY_LOCK = ("import sys\nfrom autoconf.errors import UserError\nfrom autoconf.study.storage import study_lock\n"
             "try:\n    with study_lock(sys.argv[1], sys.argv[2]):\n        print('took it')\n"
             "except UserError as e:\n    print(e)\n    sys.exit(2)\n")


def _another_process_takes(url: str, name: str, cwd) -> bool:
    p = subprocess.run([sys.executable, "-c", _TRY_LOCK, url, name], capture_output=True, text=True, env=ENV,
                       cwd=cwd, timeout=120)
    assert p.returncode in (0, 2), p.stderr
    assert (p.returncode == 2) == ("in use by another search" in p.stdout), p.stdout
    return p.returncode == 0


# -- 1. one lock per database file ---------------------------------------------------------------

@pytest.mark.parametrize("exists", [True, False], ids=["database", "not-yet-created"])
def test_a_symbolic_link_to_the_database_shares_its_study_lock(tmp_path, exists):
    db = tmp_path / "s.db"
    if exists:
        search(TINY, CPU, 8, storage=f"sqlite:///{db}", study_name="other", trials=5, exhaustive=False)
    (tmp_path / "link.db").symlink_to("s.db")
    with study_lock(f"sqlite:///{db}", "held"):
        # relative, through the link: the same database, so the same study
        assert not _another_process_takes("sqlite:///link.db", "held", cwd=tmp_path)
        assert not _another_process_takes(f"sqlite:///{tmp_path}/./link.db", "held", cwd=tmp_path)
        assert _another_process_takes("sqlite:///link.db", "free", cwd=tmp_path)
    assert _another_process_takes("sqlite:///link.db", "held", cwd=tmp_path)


def test_a_search_through_a_link_beside_one_on_the_database_is_refused(tmp_path):
    (tmp_path / "link.db").symlink_to("s.db")
    with study_lock(f"sqlite:///{tmp_path}/s.db", "held"):
        p = _cli(*_search_args("sqlite:///link.db", "--study-name", "held"), cwd=tmp_path)
    _one_line_error(p, "in use by another search")
    assert not os.path.exists(tmp_path / "s.db")  # refused before the study was created


def test_releasing_one_study_keeps_the_others_of_the_database_held(tmp_path):
    # POSIX record locks belong to the process: closing any fd of the lock file would drop them all
    url, link = f"sqlite:///{tmp_path}/s.db", f"sqlite:///{tmp_path}/link.db"
    (tmp_path / "link.db").symlink_to("s.db")
    with study_lock(url, "a"):
        with study_lock(link, "b"):
            with study_lock(url, "b"):  # held already by this process: entered again
                pass
        with study_lock(url, "c"):
            pass
        assert not _another_process_takes(url, "a", cwd=tmp_path)
        assert _another_process_takes(url, "b", cwd=tmp_path)


# -- 2. SQLite URL options -----------------------------------------------------------------------

@pytest.mark.parametrize("url,needle", [
    ("sqlite:///s.db?mode=ro", "mode=ro is refused (read-only"),
    ("sqlite:///s.db?foo=1", "option 'foo=1' is not supported"),
    ("sqlite:///s.db?timeout=soon", "option 'timeout=soon' is not supported"),
    ("sqlite:///file:s.db?mode=ro&uri=true", "URI filenames are not supported"),
    ("sqlite:///file::memory:?cache=shared", "option 'cache=shared' is not supported"),
    ("sqlite:///", "expected sqlite:///FILE.db"),
    ("sqlite://host/s.db", "expected sqlite:///FILE.db"),
])
def test_sqlite_options_that_cannot_hold_a_search_are_refused_before_any_file(tmp_path, url, needle):
    p = _cli(*_search_args(url), cwd=tmp_path)
    _one_line_error(p, needle)
    assert os.listdir(tmp_path) == []  # no database, no lock file


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///file::memory:"])
def test_in_memory_sqlite_urls_keep_the_study_in_memory(tmp_path, url, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(_search_args(url, "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["storage"] is None and doc["best"]
    assert os.listdir(tmp_path) == []  # "file::memory:" is not a file name


def test_the_timeout_option_is_honoured(tmp_path):
    from autoconf.study.storage import check_storage
    url = f"sqlite:///{tmp_path}/s.db?timeout=7.5"
    assert check_storage(url) == url
    r = search(TINY, CPU, 8, storage=url, study_name="t", trials=5, exhaustive=False)
    assert len(optuna.load_study(study_name="t", storage=url).trials) == r.trials_run > 0
    assert sorted(os.listdir(tmp_path)) == ["s.db", "s.db.lock"]


# -- 3. study names ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,needle", [("x" * 100_000, "(100000 characters)"), ("a\nb", "no control characters"),
                                         ("tab\there", "no control characters"), ("", "expected 1 to 200")])
def test_a_study_name_is_bounded_and_printable(tmp_path, name, needle):
    p = _cli(*_search_args(f"sqlite:///{tmp_path}/s.db", "--study-name", name), cwd=tmp_path)
    _one_line_error(p, "--study-name")
    assert needle in p.stderr and len(p.stderr) < 400
    assert os.listdir(tmp_path) == []
    with pytest.raises(UserError, match="--study-name"):
        search(TINY, CPU, 8, storage=None, study_name=name)


def test_a_study_name_of_200_printable_characters_is_taken(tmp_path):
    name = "é" + "n" * 199
    url = f"sqlite:///{tmp_path}/s.db"
    r = search(TINY, CPU, 8, storage=url, study_name=name, trials=5, exhaustive=False)
    assert r.study_name == name and optuna.load_study(study_name=name, storage=url).trials


# -- 4. a full disk (a real tmpfs) ---------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """``mount(kib)``: a directory on a tmpfs of that size, unmounted after the test (mounting needs
    root; the test is skipped where it cannot mount)."""
    mounted = []

    def mount(kib: int):
        d = tmp_path / f"disk{len(mounted)}"
        d.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command: the full-disk tests mount a small tmpfs")
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(d)], capture_output=True,
                           text=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip()}): the full-disk tests need root")
        mounted.append(d)
        return d

    try:
        yield mount
    finally:
        for d in mounted:  # lazily: a database this process opened may still be open
            subprocess.run(["umount", "-l", str(d)], check=False)


def _fill(d, leave: int = 0) -> None:
    """Fill the file system of ``d`` but ``leave`` bytes, with the file ``d/fill``."""
    st = os.statvfs(d)
    room = st.f_bavail * st.f_frsize - leave
    fd = os.open(d / "fill", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        while room > 0:
            try:
                room -= os.write(fd, b"\0" * min(room, 1 << 16))
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break
    finally:
        os.close(fd)


def test_a_new_study_on_a_full_disk_is_one_line_and_leaves_nothing(small_disk):
    d = small_disk(256)
    _fill(d)
    p = _cli(*_search_args("sqlite:///s.db"), cwd=d)
    _one_line_error(p, "cannot open the study (the disk is full)")
    assert os.listdir(d) == ["fill"]  # no empty database, no lock file


def test_a_full_disk_leaves_a_database_this_run_did_not_create(small_disk):
    d = small_disk(1024)
    url = "sqlite:///s.db"
    assert _cli(*_search_args(url, "--study-name", "a", "--trials", "5", "--sample-only"), cwd=d).returncode == 0
    _fill(d)
    p = _cli(*_search_args(url, "--study-name", "b"), cwd=d)
    _one_line_error(p, "(the disk is full)")
    assert sorted(os.listdir(d)) == ["fill", "s.db", "s.db.lock"]
    assert len(optuna.load_study(study_name="a", storage=f"sqlite:///{d}/s.db").trials) == 5


def _half_stored(d) -> str:
    """A study of 5 sampled trials in ``d/s.db``, then the disk filled but 12 KiB: a search of the
    remaining points (34 in all) fills it mid-search."""
    url = f"sqlite:///{d}/s.db"
    search(TINY, CPU, 8, storage=url, study_name="s", trials=5, exhaustive=False)
    _fill(d, leave=12 * 1024)
    return url


def test_a_disk_that_fills_mid_search_keeps_every_finished_trial(small_disk):
    d = small_disk(1024)
    url = _half_stored(d)
    with pytest.raises(UserError) as e:
        search(TINY, CPU, 8, storage=url, study_name="s", trials=400)
    msg = str(e.value)
    assert "(the disk is full)" in msg and len(msg.splitlines()) == 1 and "stay in it" in msg
    # the whole result, in memory: the same as a search that stores nothing
    straight = search(TINY, CPU, 8, storage=None, trials=400)
    assert [x.config for x in e.value.result.top] == [x.config for x in straight.top]
    # what was written stays: the 5 earlier trials and those this run wrote before the disk filled
    written = int(msg.split("cannot write to study 's' (the disk is full); the ")[1].split()[0])
    stored = optuna.load_study(study_name="s", storage=url).trials
    assert len(stored) == 5 + written
    # with room again, the same search resumes: nothing stored twice, the same answer
    os.unlink(d / "fill")
    again = search(TINY, CPU, 8, storage=url, study_name="s", trials=400)
    keys = [tuple(sorted(t.params.items())) for t in optuna.load_study(study_name="s", storage=url).trials]
    assert len(keys) == len(set(keys)) == again.trials_total
    assert again.earlier_trials == 5 + written and again.top[0].config == straight.top[0].config


def test_the_cli_prints_the_result_of_a_search_whose_disk_filled(small_disk):
    d = small_disk(1024)
    _half_stored(d)
    p = _cli(*_search_args("sqlite:///s.db", "--study-name", "s", "--json", "--no-place"), cwd=d)
    _one_line_error(p, "(the disk is full)")
    doc = json.loads(p.stdout)
    assert doc["best"] and doc["top"] and doc["trials_total"] == 34


# -- 5. verifying trials are kept before the calibration file is tried ---------------------------

@pytest.fixture
def fake_trials(monkeypatch):
    """run_trial replaced by a stand-in: each call runs ``hooks`` (what happens meanwhile), then
    returns (ok, step time, peak bytes) from ``runs``, in order."""
    runs, hooks = [], []

    def fake(plan, steps=6, warmup=2, timeout_s=300.0, **kw):
        for hook in hooks:
            hook()
        ok, t, peak = runs.pop(0)
        return TrialResult(ok=ok, reason="" if ok else "rank 1: killed by SIGKILL", step_time_s=t,
                           peak_memory_bytes=peak, config=plan.config.to_dict())
    monkeypatch.setattr("autoconf.runs.trial.run_trial", fake)
    monkeypatch.setattr("autoconf.runs.trial.local_device_kind", lambda: "cpu")
    return runs, hooks


def _verify_args(storage, cal, *extra):
    return _search_args(storage, "--verify", "2", "--calibrate", str(cal), "--json", *extra)


def test_a_calibration_that_cannot_be_written_keeps_the_measurements_beside_it(tmp_path, fake_trials, capsys):
    runs, hooks = fake_trials
    runs += [(True, 0.011, 2**20), (True, 0.013, 2**20)]
    cal = tmp_path / "cal.json"
    hooks.append(lambda: cal.mkdir(exist_ok=True))  # meanwhile the calibration's name became a directory
    assert cli.main(_verify_args("none", cal)) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and f"--calibrate {str(cal)!r}: cannot write" in err
    fallback = f"{cal}.trials.json"
    assert f"the 2 measured trial(s) are kept in {fallback!r}" in err
    kept = json.loads(open(fallback).read())["verified"]
    assert [v["trial"]["step_time_s"] for v in kept] == [0.011, 0.013]
    doc = json.loads(out)  # and the result is printed, the measurements with it
    assert [v["trial"]["step_time_s"] for v in doc["verified"]] == [0.011, 0.013] and "calibration" not in doc


def test_with_a_study_the_measurements_are_in_it_before_the_calibration(tmp_path, fake_trials, capsys):
    runs, hooks = fake_trials
    runs += [(True, 0.011, 2**20), (True, 0.013, 2**20)]
    cal, url = tmp_path / "cal.json", f"sqlite:///{tmp_path}/s.db"
    hooks.append(lambda: cal.mkdir(exist_ok=True))
    assert cli.main(_verify_args(url, cal, "--study-name", "v")) == 2
    err = capsys.readouterr().err
    assert "kept in study 'v'" in err and not os.path.exists(f"{cal}.trials.json")
    measured = [t for t in optuna.load_study(study_name="v", storage=url).trials if t.user_attrs.get("verified")]
    assert sorted(t.user_attrs["measured_step_time_s"] for t in measured) == [0.011, 0.013]


def test_a_written_calibration_leaves_no_fallback_file(tmp_path, fake_trials, capsys):
    runs, _ = fake_trials
    runs += [(True, 0.011, 2**20), (True, 0.013, 2**20)]
    cal = tmp_path / "cal.json"
    assert cli.main(_verify_args("none", cal)) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] and os.listdir(tmp_path) == ["cal.json"]


def test_a_full_disk_at_calibration_keeps_the_measurements_in_the_output(small_disk, fake_trials, capsys):
    d = small_disk(256)
    runs, hooks = fake_trials
    runs += [(True, 0.011, 2**20), (True, 0.013, 2**20)]
    hooks.append(lambda: os.path.exists(d / "fill") or _fill(d))  # the disk fills while the trials run
    assert cli.main(_verify_args("none", d / "cal.json")) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1
    assert "cannot write (No space left on device)" in err and "kept in the output above" in err
    assert [v["trial"]["step_time_s"] for v in json.loads(out)["verified"]] == [0.011, 0.013]
    assert os.listdir(d) == ["fill"]  # no temp file left
