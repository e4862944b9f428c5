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
