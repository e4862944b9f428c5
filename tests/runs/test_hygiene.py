"""Studies that keep every finished evaluation, refuse a second search, outputs checked before any
work, verification refused on the wrong devices or above the memory (no torchrun here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import optuna
import pytest

from autoconf.cli import app as cli
from autoconf.errors import UserError
from autoconf.runs.trial import TrialResult
from autoconf.specs.cluster import load_cluster
from autoconf.specs.model import preset
from autoconf.study.evaluator import Evaluator
from autoconf.study.search import search
from autoconf.study.storage import study_lock

A100 = load_cluster("examples/clusters/a100-4x8.yaml")
CPU_YAML = os.path.abspath("examples/clusters/localhost-cpu.yaml")
GPT = preset("gpt3-1.3b")


def _trials(url, name):
    return optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)


def _keys(trials):
    return [tuple(sorted(t.params.items())) for t in trials if not t.user_attrs.get("verified")]


class _Stop:
    """progress callback that interrupts the search after ``n`` evaluated points of a phase."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __call__(self, done, total):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt


@pytest.mark.parametrize("trials,stop_after", [(10_000, 7), (60, 13)], ids=["brute-force", "sampling"])
def test_an_interrupt_keeps_every_finished_evaluation_and_resume_completes(tmp_path, trials, stop_after):
    url = f"sqlite:///{tmp_path}/s.db"
    with pytest.raises(KeyboardInterrupt) as e:
        search(GPT, A100, 64, gpus=8, storage=url, study_name="s", trials=trials, progress=_Stop(stop_after))
    kept = _trials(url, "s")
    assert len(kept) == stop_after  # every evaluated point, though the batch interval had not passed
    assert "kept in study 's'" in e.value.autoconf_kept
    resumed = search(GPT, A100, 64, gpus=8, storage=url, study_name="s", trials=trials)
    straight = search(GPT, A100, 64, gpus=8, storage=None, trials=trials)
    keys = _keys(_trials(url, "s"))
    assert len(keys) == len(set(keys))  # nothing stored twice
    assert resumed.top[0].config == straight.top[0].config
    assert resumed.trials_total == len(keys)


def test_a_resumed_exhaustive_search_does_not_sample_its_budget_again(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    first = search(GPT, A100, 64, gpus=8, storage=url, study_name="s", trials=30)
    again = search(GPT, A100, 64, gpus=8, storage=url, study_name="s", trials=30)
    assert first.trials_run >= 30 and again.trials_run == 0  # nothing new to sample or store
    assert again.top[0].config == first.top[0].config
    phases = {t.user_attrs.get("phase") for t in _trials(url, "s")}
    assert phases <= {"sampled", "swept"} and "sampled" in phases


def test_a_second_search_on_a_held_study_is_refused_in_one_line(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    with study_lock(url, "held"):
        p = subprocess.run([sys.executable, "-m", "autoconf", "search", "--model", "tiny", "--cluster", CPU_YAML,
                            "--global-batch", "8", "--storage", url, "--study-name", "held"],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
        assert "in use by another search" in p.stderr
        # another study in the same database is not held
        search(preset("tiny"), load_cluster(CPU_YAML), 8, storage=url, study_name="other")


def test_concurrent_searches_on_one_new_sqlite_study_never_fail_nor_duplicate(tmp_path):
    url = f"sqlite:///{tmp_path}/new.db"
    cmd = [sys.executable, "-m", "autoconf", "search", "--model", "gpt3-1.3b", "--cluster",
           os.path.abspath("examples/clusters/a100-4x8.yaml"), "--gpus", "8", "--global-batch", "64",
           "--storage", url, "--study-name", "shared", "--trials", "10000", "--json"]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    outs = [(p.wait(120), *p.communicate()) for p in procs]
    for rc, out, err in outs:  # each either searched or was refused in one line; no other failure
        assert rc == 0 or (rc == 2 and "in use by another search" in err and len(err.strip().splitlines()) == 1), err
    assert any(rc == 0 for rc, _, _ in outs)
    keys = _keys(_trials(url, "shared"))
    assert keys and len(keys) == len(set(keys))
    # then the refused one resumes: nothing is evaluated twice
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    keys = _keys(_trials(url, "shared"))
    assert len(keys) == len(set(keys))


def _search_args(tmp_path, *extra):
    return ["search", "--model", "tiny", "--cluster", CPU_YAML, "--global-batch", "8",
            "--storage", f"sqlite:///{tmp_path}/s.db", "--study-name", "v", *extra]


@pytest.fixture
def fake_trials(monkeypatch):
    """run_trial replaced by canned results: (ok, step time, peak bytes) per call, in order."""
    runs = []

    def fake(plan, steps=6, warmup=2, timeout_s=300.0, **kw):
        ok, t, peak = runs.pop(0)
        return TrialResult(ok=ok, reason="" if ok else "rank 1: killed by SIGKILL", step_time_s=t,
                           peak_memory_bytes=peak, config=plan.config.to_dict())
    monkeypatch.setattr("autoconf.runs.trial.run_trial", fake)
    return runs


def test_verify_refuses_a_winner_measured_above_the_device_memory(tmp_path, fake_trials, capsys):
    # the measured-fastest ran above the 4 GiB per process: it is refused and stored as an OOM trial
    fake_trials += [(True, 0.010, 5 * 2**30), (True, 0.020, 2**20)]
    rc = cli.main(_search_args(tmp_path, "--verify", "2", "--json", "--emit", str(tmp_path / "launch")))
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    first, second = doc["verified"]
    assert first["refused"].startswith("out of memory") and second["refused"] is None
    assert doc["best"]["config"] == second["config"]
    assert json.loads((tmp_path / "launch" / "config.json").read_text())["config"] == second["config"]
    measured = [t for t in _trials(f"sqlite:///{tmp_path}/s.db", "v") if t.user_attrs.get("verified")]
    oom = [t for t in measured if t.user_attrs["oom"]]
    assert len(measured) == 2 and len(oom) == 1 and oom[0].state == optuna.trial.TrialState.FAIL


def test_verify_margin_and_nothing_within_memory(tmp_path, fake_trials, capsys):
    fake_trials += [(True, 0.010, 3.9 * 2**30)]
    rc = cli.main(_search_args(tmp_path, "--verify", "1", "--memory-margin", "0.1"))
    assert rc == 1 and "no verified configuration" in capsys.readouterr().err


def test_verify_against_another_device_kind_is_refused_unless_local(tmp_path, fake_trials, capsys, monkeypatch):
    monkeypatch.setattr("autoconf.runs.trial.local_device_kind", lambda: "cpu")
    args = ["search", "--model", "tiny", "--cluster", os.path.abspath("examples/clusters/a100-4x8.yaml"),
            "--global-batch", "32", "--storage", "none", "--verify", "1"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "--verify-on-local" in err and len(err.strip().splitlines()) == 1
    # allowed here; the calibration records the CPU it was fitted on and refuses the GPU cluster
    fake_trials += [(True, 0.01, 2**20)]
    cal = tmp_path / "cal.json"
    assert cli.main(args + ["--verify-on-local", "--calibrate", str(cal), "--json"]) == 0
    assert json.loads(cal.read_text())["devices"] == ["cpu"]
    capsys.readouterr()
    assert cli.main(["estimate", "--model", "tiny", "--cluster", os.path.abspath("examples/clusters/a100-4x8.yaml"),
                     "--global-batch", "32", "--dp", "32", "--calibration", str(cal)]) == 2
    assert "fitted on cpu" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--emit", "--calibrate", "--storage"])
def test_unwritable_outputs_are_refused_before_any_work(tmp_path, flag, fake_trials, capsys):
    ro = tmp_path / "a-file"  # a path under a regular file cannot be written, even by root
    ro.write_text("")
    value = {"--emit": str(ro / "launch"), "--calibrate": str(ro / "c.json"),
             "--storage": f"sqlite:///{ro}/s.db"}[flag]
    args = _search_args(tmp_path, "--verify", "1", "--calibrate", str(tmp_path / "c.json"))
    if flag == "--emit":
        args += ["--emit", value]
    else:
        args[args.index(flag) + 1] = value
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert flag in err and len(err.strip().splitlines()) == 1 and not fake_trials  # no trial ran


def test_outputs_checked_and_written_atomically(tmp_path, monkeypatch):
    from autoconf import files as outputs

    with pytest.raises(UserError, match="does not exist"):
        outputs.check_file(str(tmp_path / "nope" / "x.json"), "--out")
    with pytest.raises(UserError, match="is a directory"):
        outputs.check_file(str(tmp_path), "--out")
    outputs.check_dir(str(tmp_path / "a" / "b"), "--emit")  # creatable
    target = tmp_path / "config.json"
    target.write_text("old")

    def full(*a):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        outputs.write_text(str(target), "new")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["config.json"]


def test_emitted_launch_files_take_the_master_port(tmp_path):
    from autoconf.launch.shell import Raw, join, torchrun_argv

    multi = join(torchrun_argv(["x.py"], 8, 2, 0, Raw('"$MASTER_ADDR"'), 29611))
    assert "--master-port=29611" in multi and '--master-addr="$MASTER_ADDR"' in multi
    single = join(torchrun_argv(["x.py"], 2, master_port=29611))
    assert "--rdzv-endpoint=localhost:29611" in single and "--standalone" not in single
    assert "--standalone" in torchrun_argv(["x.py"], 2)


@pytest.mark.parametrize("args,needle", [
    (["--verify", "1", "--trial-timeout", "0"], "--trial-timeout"),
    (["--verify", "1", "--trial-timeout", "nan"], "--trial-timeout"),
    (["--master-port", "70000", "--emit", "x"], "--master-port"),
    (["--master-port", "29600"], "needs --emit"),
    (["--memory-margin", "1.5"], "--memory-margin"),
])
def test_bad_verify_settings_are_one_line_exit_2(tmp_path, args, needle):
    p = subprocess.run([sys.executable, "-m", "autoconf", *_search_args(tmp_path, *args)], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()), cwd=tmp_path)
    assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr


def _counting(monkeypatch):
    """Counts the evaluations the search finishes (each becomes one trial of the study)."""
    done = [0]
    real = Evaluator.__call__

    def evaluate(self, *a, **k):
        out = real(self, *a, **k)
        done[0] += 1
        return out
    monkeypatch.setattr(Evaluator, "__call__", evaluate)
    return done


def _interrupt_write(monkeypatch, when):
    """add_trial raises KeyboardInterrupt, before writing, on the first call for which ``when()``."""
    real, fired = optuna.Study.add_trial, []

    def add_trial(self, trial):
        if not fired and when():
            fired.append(1)
            raise KeyboardInterrupt
        return real(self, trial)
    monkeypatch.setattr(optuna.Study, "add_trial", add_trial)
    return fired


def test_an_interrupt_during_the_last_write_still_keeps_everything(tmp_path, monkeypatch):
    """Ctrl-C lands while the final batch is being written (after the last evaluation, however long
    the search took on this machine): the rest is written, nothing twice."""
    url = f"sqlite:///{tmp_path}/s.db"
    fresh = search(GPT, A100, 64, gpus=8, storage=None, trials=10_000)
    done = _counting(monkeypatch)
    fired = _interrupt_write(monkeypatch, lambda: done[0] == fresh.trials_run)
    with pytest.raises(KeyboardInterrupt):
        search(GPT, A100, 64, gpus=8, storage=url, study_name="s", trials=10_000)
    assert fired and done[0] == fresh.trials_run
    keys = _keys(_trials(url, "s"))
    assert len(keys) == len(set(keys)) == fresh.trials_run


def test_an_interrupt_at_any_write_keeps_every_finished_evaluation(tmp_path, monkeypatch):
    """Ctrl-C lands during the fifth write, whenever the search makes it (a batch in the middle on a
    busy machine, the last one on a quiet one): every evaluation finished by then is stored, once."""
    url = f"sqlite:///{tmp_path}/s.db"
    done = _counting(monkeypatch)
    writes = []
    fired = _interrupt_write(monkeypatch, lambda: writes.append(1) or len(writes) == 5)
    with pytest.raises(KeyboardInterrupt):
        search(GPT, A100, 64, gpus=8, storage=url, study_name="s", trials=10_000)
    assert fired
    keys = _keys(_trials(url, "s"))
    assert len(keys) == len(set(keys)) == done[0] > 0
