"""`autoconf profile` and `autoconf trial` refuse bad input before they launch anything, keep what
they measured when the output cannot be written or the prediction fails afterwards, and leave no
torchrun directories behind."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types

import pytest

from autoconf import procs
from autoconf.errors import UserError
from autoconf.launch.plan import LaunchPlan
from autoconf.runs.trial import TrialResult
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import load_cluster
from autoconf.specs.model import preset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTERS = os.path.join(ROOT, "examples", "clusters")
TINY = preset("tiny")
DP2 = ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=2, num_micro_batches=2)


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def _one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]


def _left(tmpdir) -> list:
    """What a run left in a temporary directory, less torch's compile cache (one per user, reused by
    every later run: not a leftover)."""
    return sorted(f for f in os.listdir(tmpdir) if not f.startswith("torchinductor_"))


class _NoLaunch:
    """Stands in for procs.ProcessTree where nothing may be launched."""

    def __init__(self, *a, **k):
        raise AssertionError("launched although the input is bad")


# -- 1. profile: every flag checked in the launcher, before torchrun ----------------------------------

def _profile_args(tmp_path, *flags):
    from profiler.cli import add_profile_parser

    ap = argparse.ArgumentParser()
    add_profile_parser(ap.add_subparsers(dest="command"))
    return ap.parse_args(["profile", "--model", "tiny", "--quick", "--out", str(tmp_path / "p.json"), *flags])


@pytest.mark.parametrize("flags,needle", [
    (["--micro-batch-sizes", "x"], "--micro-batch-sizes='x'"),
    (["--micro-batch-sizes", "0,2"], "--micro-batch-sizes='0,2'"),
    (["--tp", "3"], "--tp 3 does not divide"),
    (["--tp", "two"], "--tp='two'"),
    (["--recompute", "foo"], "--recompute 'foo'"),
    (["--recompute", "none,sometimes"], "--recompute 'none,sometimes'"),
    (["--timeout-min", "nan"], "--timeout-min nan"),
    (["--timeout-min", "inf"], "--timeout-min inf"),
    (["--timeout-min", "0"], "--timeout-min 0"),
    (["--repeats", "0"], "--repeats 0"),
    (["--repeats", "-2"], "--repeats -2"),
    (["--warmup", "-1"], "--warmup -1"),
    (["--rounds", "4"], "--rounds 4"),
    (["--rounds", "0"], "--rounds 0"),
    (["--nproc-per-node", "0"], "--nproc-per-node 0"),
    (["--nproc-per-node", "-1"], "--nproc-per-node -1"),
    (["--nnodes", "0"], "--nnodes 0"),
    (["--links-only", "--skip-links"], "nothing to measure"),
])
def test_profile_refuses_bad_flags_before_launching(tmp_path, monkeypatch, flags, needle):
    from profiler.cli import cmd_profile

    monkeypatch.setattr(procs, "ProcessTree", _NoLaunch)
    for var in ("AUTOCONF_NNODES", "AUTOCONF_NODE_RANK", "AUTOCONF_NPROC_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UserError) as e:
        cmd_profile(_profile_args(tmp_path, *flags))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_profile_zero_is_a_value_not_the_default(tmp_path, monkeypatch):
    """--repeats 0 / --nproc-per-node 0 were taken for 'not given' (`or` defaults)."""
    from profiler.cli import launch_command
    from profiler.run import check_measure_args

    args = _profile_args(tmp_path, "--nproc-per-node", "0")
    with pytest.raises(UserError, match="--nproc-per-node 0"):
        launch_command(args)
    monkeypatch.setenv("AUTOCONF_NPROC_PER_NODE", "0")  # the testbed's default, 0 as well
    with pytest.raises(UserError, match="--nproc-per-node 0"):
        launch_command(_profile_args(tmp_path))
    got = check_measure_args(_profile_args(tmp_path, "--warmup", "0", "--repeats", "1"), TINY)
    assert got["warmup"] == 0 and got["repeats"] == 1 and got["rounds"] == 1
    # without --quick the default 3 rounds follow a smaller --repeats instead of failing in the ranks
    args = _profile_args(tmp_path, "--repeats", "2")
    args.quick = False
    assert check_measure_args(args, TINY)["rounds"] == 2
    assert check_measure_args(_profile_args(tmp_path, "--tp", "1,4"), TINY)["tps"] == [1, 4]


def test_profile_cli_bad_flag_is_one_line(tmp_path):
    """Checked in the launcher: one line (from the ranks it was torchrun's ~45-line report, exit 1)."""
    p = subprocess.run([sys.executable, "-m", "autoconf", "profile", "--model", "tiny", "--quick", "--out",
                        str(tmp_path / "p.json"), "--micro-batch-sizes", "x"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    _one_line_error(p, "--micro-batch-sizes='x'")


# -- 2. profile: an unwritable --out keeps the measurements -------------------------------------------

def _failing_writes(monkeypatch, *targets):
    import errno

    from autoconf import files as outputs

    real = outputs.write_atomic
    bad = {os.path.abspath(t) for t in targets}  # none given: every write fails

    def write_atomic(path, *a, **k):
        if not bad or os.path.abspath(path) in bad:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(path, *a, **k)
    monkeypatch.setattr(outputs, "write_atomic", write_atomic)


def _a_profile():
    from autoconf.specs.profile import load_profile

    return load_profile(os.path.join(ROOT, "examples", "profiles", "bench-h256-cpu2.json"))


def test_profile_written_to_a_fallback_when_out_fails(tmp_path, monkeypatch):
    from autoconf.specs.profile import load_profile
    from profiler.run import save_or_fallback

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = str(tmp_path / "sub" / "p.json")
    _failing_writes(monkeypatch, out)
    prof = _a_profile()
    written, failure = save_or_fallback(prof, out)
    assert written is not None and written != out and os.path.dirname(written) == str(tmp_path)
    assert load_profile(written).to_dict() == prof.to_dict()
    assert "\n" not in failure and repr(out) in failure and "No space left on device" in failure
    assert written in failure
    # everything fails: said so in one line, nothing half written left behind
    _failing_writes(monkeypatch)
    written, failure = save_or_fallback(prof, out)
    assert written is None and "lost" in failure and "\n" not in failure
    assert len([f for f in os.listdir(tmp_path) if f.startswith("autoconf-profile-")]) == 1  # the first one only


def test_profile_launcher_turns_rank_zeros_failure_into_one_line(tmp_path, monkeypatch):
    from profiler import cli
    from profiler.run import STATUS_ENV

    class FakeTree:
        def __init__(self, cmd, env=None, **kw):
            assert kw.get("private_tmp") is True
            with open(env[STATUS_ENV], "w") as f:  # what rank 0 does when --out cannot be written
                f.write("cannot write the profile to 'x' (No space left on device); the measurements were "
                        "saved to /tmp/y.json\n")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(procs, "ProcessTree", FakeTree)
    with pytest.raises(UserError) as e:
        cli.cmd_profile(_profile_args(tmp_path, "--nproc-per-node", "1"))
    assert "saved to /tmp/y.json" in str(e.value) and "\n" not in str(e.value)


SITECUSTOMIZE = '''
import os
_target = os.environ.get("TEST_FAIL_WRITE_TO")
if _target:
    import errno
    import autoconf.files as _o
    _real = _o.write_atomic
    def write_atomic(path, *a, **k):
        if os.path.abspath(path) == os.path.abspath(_target):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return _real(path, *a, **k)
    _o.write_atomic = write_atomic
'''


@pytest.mark.e2e
def test_profile_e2e_full_disk_keeps_the_measurements_and_leaves_no_torchrun_dirs(tmp_path):
    pytest.importorskip("torch")
    from autoconf.specs.profile import load_profile

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)  # the ranks' writes to --out fail
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    out = tmp_path / "p.json"
    env = _env(TMPDIR=str(tmpdir), TEST_FAIL_WRITE_TO=str(out), CUDA_VISIBLE_DEVICES="")  # 2 CPU ranks
    env["PYTHONPATH"] = str(tmp_path / "site") + os.pathsep + env["PYTHONPATH"]
    p = subprocess.run([sys.executable, "-m", "autoconf", "profile", "--model", "tiny", "--quick", "--quiet",
                        "--nproc-per-node", "2", "--skip-links", "--micro-batch-sizes", "1", "--recompute", "none",
                        "--tp", "1", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=180)
    _one_line_error(p, repr(str(out)), "No space left on device", "saved to")
    saved = p.stderr.split("saved to ")[1].split()[0]
    assert os.path.dirname(saved) == str(tmpdir)  # the caller's temporary directory, not torchrun's
    assert load_profile(saved).model.name == "tiny" and not out.exists()
    assert _left(tmpdir) == [os.path.basename(saved)]  # no torchelastic_*, no status file


# -- 3. trial: the prediction's inputs are checked before the trial runs ------------------------------

def _trial_args(config, *flags):
    from autoconf.cli.trial import add_trial_parser

    ap = argparse.ArgumentParser()
    add_trial_parser(ap.add_subparsers(dest="command"))
    return ap.parse_args(["trial", "--config", str(config), "--quiet", *flags])


def _plan_file(tmp_path, config=DP2, cluster=None, name="c.json"):
    return LaunchPlan(config, TINY, load_cluster(os.path.join(CLUSTERS, cluster)) if cluster else None).write(
        str(tmp_path / name))


def _no_trial(*a, **k):
    raise AssertionError("the trial ran although its inputs are bad")


@pytest.fixture
def cpu_here(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this machine: CPU processes


def test_trial_bad_cluster_refused_before_running(tmp_path, monkeypatch, cpu_here):
    from autoconf.cli import trial as trial_cli
    from autoconf.runs import trial

    monkeypatch.setattr(trial, "run_trial", _no_trial)
    cfg = _plan_file(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        trial_cli.cmd_trial(_trial_args(cfg, "--cluster", str(tmp_path / "missing.yaml")))
    one = tmp_path / "one.yaml"
    one.write_text(open(os.path.join(CLUSTERS, "localhost-cpu.yaml")).read().replace("gpus_per_node: 2",
                                                                                     "gpus_per_node: 1"))
    with pytest.raises(UserError, match="2 devices, but the cluster has 1"):
        trial_cli.cmd_trial(_trial_args(cfg, "--cluster", str(one)))


def test_trial_cli_bad_cluster_is_one_line(tmp_path):
    cfg = _plan_file(tmp_path)
    p = subprocess.run([sys.executable, "-m", "autoconf", "trial", "--config", cfg, "--cluster", "missing.yaml"],
                       cwd=tmp_path, env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=60)
    _one_line_error(p, "missing.yaml")


def _fake_result():
    return TrialResult(ok=True, step_time_s=0.0123, peak_memory_bytes=5 << 20, losses=[6.2, 6.1], wall_s=3.0,
                       config=DP2.to_dict(), memory_method="m", speed_probe_s=0.001)


def test_trial_measurement_printed_when_the_comparison_fails_afterwards(tmp_path, monkeypatch, capsys, cpu_here):
    from autoconf.cli import trial as trial_cli
    from autoconf.runs import trial
    from autoconf.specs import profile as profile_mod

    cfg = _plan_file(tmp_path, cluster="localhost-cpu.yaml")
    monkeypatch.setattr(profile_mod, "load_profile", lambda path: types.SimpleNamespace(ranks=[]))
    monkeypatch.setattr(profile_mod, "check_profile_matches", lambda p, m: [])
    monkeypatch.setattr(trial_cli, "_predict", lambda plan, cluster, profile: (None, ""))
    monkeypatch.setattr(trial, "run_trial", lambda *a, **k: _fake_result())

    def broken(*a, **k):
        raise UserError("profile has no block row at micro-batch size 1")
    monkeypatch.setattr(trial, "speed_vs_profile", broken)
    with pytest.raises(UserError, match="the trial ran") as e:
        trial_cli.cmd_trial(_trial_args(cfg, "--profile", "p.json", "--json"))
    assert "no block row" in str(e.value)
    doc = json.loads(capsys.readouterr().out)
    assert doc["measured"]["ok"] and doc["measured"]["step_time_s"] == 0.0123


# -- 4. trial: a plan for other devices is refused unless --run-on-local ------------------------------

def test_trial_refuses_a_plan_for_other_devices(tmp_path, monkeypatch, cpu_here):
    from autoconf.cli import trial as trial_cli
    from autoconf.runs import trial

    monkeypatch.setattr(trial, "run_trial", _no_trial)
    gpu32 = ParallelConfig(dp=32, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1)
    cfg = _plan_file(tmp_path, gpu32, "h100-8x8.yaml")
    with pytest.raises(UserError, match="--run-on-local") as e:
        trial_cli.cmd_trial(_trial_args(cfg))
    assert "h100" in str(e.value) and "32 CPU processes" in str(e.value)
    # the same for a --cluster of GPUs, and a plan from a GPU profile (no cluster in it)
    with pytest.raises(UserError, match="--cluster 'h100-8x8'"):
        trial_cli.cmd_trial(_trial_args(_plan_file(tmp_path, name="d.json"), "--cluster",
                                    os.path.join(CLUSTERS, "h100-8x8.yaml")))
    from autoconf.specs import profile as profile_mod
    monkeypatch.setattr(profile_mod, "load_profile", lambda path: types.SimpleNamespace(
        ranks=[types.SimpleNamespace(device_kind="h100-sxm", device_name="NVIDIA H100")]))
    monkeypatch.setattr(profile_mod, "check_profile_matches", lambda p, m: [])
    with pytest.raises(UserError, match="the --profile has h100-sxm"):
        trial_cli.cmd_trial(_trial_args(_plan_file(tmp_path, name="e.json"), "--profile", "p.json"))
    # opted in: it runs (here a stand-in for the run)
    ran = []
    monkeypatch.setattr(trial, "run_trial", lambda plan, **k: ran.append(plan.config.world_size) or _fake_result())
    assert trial_cli.cmd_trial(_trial_args(cfg, "--run-on-local", "--json")) == 0
    assert ran == [32]


def test_trial_refuses_more_ranks_than_gpus_here(tmp_path, monkeypatch):
    from autoconf.cli import trial as trial_cli
    from autoconf.runs import trial

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU here
    monkeypatch.delenv("AUTOCONF_TESTBED", raising=False)
    monkeypatch.setattr(trial, "run_trial", _no_trial)
    cfg = _plan_file(tmp_path, cluster="h100-8x8.yaml")
    with pytest.raises(UserError, match="2 ranks .* 1 GPU"):
        trial_cli.cmd_trial(_trial_args(cfg))
    with pytest.raises(UserError, match=r"\(2 GPUs\), but the plan's cluster 'localhost-cpu' has cpu"):
        trial_cli.cmd_trial(_trial_args(_plan_file(tmp_path, cluster="localhost-cpu.yaml", name="d.json")))
    # --run-on-local: as the user says (a CPU-only torch beside an NVIDIA driver runs CPU processes)
    ran = []
    monkeypatch.setattr(trial, "run_trial", lambda plan, **k: ran.append(plan.config.world_size) or _fake_result())
    assert trial_cli.cmd_trial(_trial_args(_plan_file(tmp_path, cluster="localhost-cpu.yaml", name="e.json"),
                                       "--run-on-local", "--json")) == 0
    assert ran == [2]


def test_trial_cli_other_devices_is_one_line(tmp_path):
    cfg = _plan_file(tmp_path, ParallelConfig(dp=32, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1),
                     "h100-8x8.yaml")
    p = subprocess.run([sys.executable, "-m", "autoconf", "trial", "--config", cfg], cwd=tmp_path,
                       env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=60)
    _one_line_error(p, "--run-on-local", "h100-8x8")


# -- 5. no torchelastic_* (or other temporary) directories left behind --------------------------------

def test_private_tmp_is_the_trees_and_removed_with_it(tmp_path, monkeypatch):
    base, outer = tmp_path / "base", tmp_path / "outer"
    base.mkdir()
    outer.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))  # where this process makes temporary files
    monkeypatch.setenv("TMPDIR", str(outer))
    code = ("import os, tempfile; open(os.path.join(tempfile.gettempdir(), 'torchelastic_x'), 'w').close(); "
            "print(os.environ['TMPDIR']); from autoconf.procs import die_with_parent_if_launched; "
            "die_with_parent_if_launched(); print(tempfile.gettempdir(), os.environ.get('AUTOCONF_OUTER_TMPDIR'))")
    with procs.ProcessTree([sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE,
                           private_tmp=True) as tree:
        private = tree.tmp_dir
        out = tree.proc.stdout.read().decode().split()
        assert tree.wait(30) == 0
    assert out[0] == private and os.path.dirname(private) == str(base)  # torchrun writes there
    assert out[1:] == [str(outer), "None"]  # the ranks get the caller's TMPDIR back
    assert not os.path.exists(private) and os.listdir(base) == [] and os.listdir(outer) == []
    # without it, nothing changes
    with procs.ProcessTree([sys.executable, "-c", "import os; print(os.environ.get('TMPDIR'))"],
                           stdout=subprocess.PIPE) as tree:
        assert tree.proc.stdout.read().decode().strip() == str(outer) and tree.tmp_dir is None


def test_restore_tmpdir_without_an_outer_one():
    env = {"TMPDIR": "/private", procs.OUTER_TMPDIR_ENV: ""}
    procs.restore_tmpdir(env)
    assert env == {}
    env = {"TMPDIR": "/mine"}
    procs.restore_tmpdir(env)
    assert env == {"TMPDIR": "/mine"}


@pytest.mark.e2e
def test_trial_e2e_leaves_no_torchelastic_dirs(tmp_path, monkeypatch, cpu_here):
    pytest.importorskip("torch")
    from autoconf.runs.trial import run_trial

    outer = tmp_path / "tmp"
    outer.mkdir()
    monkeypatch.setenv("TMPDIR", str(outer))
    monkeypatch.setattr(tempfile, "tempdir", None)
    res = run_trial(LaunchPlan(DP2, TINY), steps=3, warmup=1, timeout_s=120)
    assert res.ok, res.reason
    assert _left(outer) == []


def test_a_nested_private_tmp_keeps_the_outermost_callers_tmpdir(tmp_path):
    """A launch inside a launch (autoconf profile under the testbed): the ranks get the outermost
    caller's TMPDIR back, not the enclosing tree's, which goes when that tree does."""
    from autoconf import procs
    env = dict(os.environ, TMPDIR=str(tmp_path / "enclosing"), **{procs.OUTER_TMPDIR_ENV: str(tmp_path)})
    code = "import os; print(os.environ['" + procs.OUTER_TMPDIR_ENV + "'])"
    with procs.ProcessTree([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, private_tmp=True) as tree:
        out, _ = tree.proc.communicate(timeout=60)
    assert out.decode().strip() == str(tmp_path)
