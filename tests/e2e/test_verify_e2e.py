"""`autoconf search --verify K --calibrate`: real torchrun trials re-rank the top K, land in the study,
and fit correction factors that the next search reads."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def run_cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "autoconf", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600)


def test_search_verify_calibrate_emit(tmp_path):
    cluster = os.path.abspath("examples/clusters/localhost-cpu.yaml")
    db = f"sqlite:///{tmp_path}/study.db"
    p = run_cli("search", "--model", "tiny", "--cluster", cluster, "--global-batch", "8", "--storage", db,
                "--verify", "2", "--steps", "4", "--calibrate", str(tmp_path / "cal.json"),
                "--emit", str(tmp_path / "launch"), "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(p.stdout)
    assert len(doc["verified"]) == 2
    ok = [v for v in doc["verified"] if v["trial"]["ok"]]
    assert ok, doc["verified"]
    measured_best = min(ok, key=lambda v: v["trial"]["step_time_s"])
    # the emitted configuration is the measured best, not merely the predicted best
    assert json.loads((tmp_path / "launch" / "config.json").read_text())["config"] == measured_best["config"]
    cal = json.loads((tmp_path / "cal.json").read_text())
    assert "factors" in cal and cal["factors"]
    # prediction error before and after calibration, on the verifying trials
    rep = doc["calibration"]
    assert rep["after"]["time_median"] <= rep["before"]["time_median"] and rep["after"]["n"] == len(ok)

    import optuna
    study = optuna.load_study(study_name=doc["study_name"], storage=db)
    measured = [t for t in study.trials if t.user_attrs.get("verified")]
    assert len(measured) == 2 and all("predicted_step_time_s" in t.user_attrs for t in measured)

    # the next search reads the calibration
    p2 = run_cli("search", "--model", "tiny", "--cluster", cluster, "--global-batch", "8", "--storage", "none",
                 "--calibration", str(tmp_path / "cal.json"), "--json", cwd=tmp_path)
    assert p2.returncode == 0, p2.stderr[-2000:]
    assert json.loads(p2.stdout)["top"]


def test_trial_with_a_profile_reports_the_machines_speed(tmp_path):
    """`autoconf trial --profile`: the prediction uses the profile, and the trial times the
    profile's reference block, so the output says how fast the machine ran against profiling."""
    from autoconf.launch.plan import LaunchPlan
    from autoconf.space.config import ParallelConfig
    from autoconf.specs.cluster import load_cluster
    from autoconf.specs.model import preset

    root = os.getcwd()
    prof = tmp_path / "p.json"
    r = run_cli("profile", "--model", "tiny", "--nproc-per-node", "2", "--quick", "--skip-links",
                "--micro-batch-sizes", "1,2", "--out", str(prof), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    LaunchPlan(ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=2, num_micro_batches=2), preset("tiny"),
               load_cluster(os.path.join(root, "examples/clusters/localhost-cpu.yaml"))).write(str(tmp_path / "c.json"))
    r = run_cli("trial", "--config", "c.json", "--profile", str(prof), "--steps", "4", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["measured"]["ok"] and out["measured"]["speed_probe_s"] > 0
    assert out["predicted"]["step_time_s"] > 0
    # same machine, minutes apart: the same block takes the same time within the VM's drift
    assert 0.2 < out["speed_vs_profile"] < 5
    assert "machine speed" in out["note"]
    # search --verify with a profile records the same drift for every verifying trial
    r = run_cli("search", "--model", "tiny", "--profile", str(prof), "--global-batch", "8", "--storage", "none",
                "--verify", "1", "--steps", "3", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    v = json.loads(r.stdout)["verified"][0]
    assert v["trial"]["ok"] and 0.2 < v["speed_vs_profile"] < 5
    # a profile of another model is refused in one line
    r = run_cli("trial", "--config", "c.json", "--profile",
                os.path.join(root, "examples/profiles/bench-h256-cpu2.json"), cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
