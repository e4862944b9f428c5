"""Trial runner, calibration and the trainer's pure helpers (no torchrun here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autoconf.cost.calibration import (
    Calibration,
    calibration_report,
    error_stats,
    fit_calibration,
    load_calibration,
    save_calibration,
)
from autoconf.errors import UserError
from autoconf.launch.plan import LaunchPlan
from autoconf.launch.plan import load as load_plan
from autoconf.runs.trial import TrialResult, collect
from autoconf.space.config import ParallelConfig
from autoconf.specs.model import preset
from autoconf.trainer.data_parallel import partition

TINY = preset("tiny")
DP2 = ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=2, num_micro_batches=2)


def test_import_trial_does_not_import_torch():
    code = "import sys, autoconf, autoconf.runs.trial, autoconf.cost.calibration; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("content,needle", [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"version": 1, "model": TINY.to_dict()}), "'config'"),
    (json.dumps({"version": 7, "model": TINY.to_dict(), "config": DP2.to_dict()}), "version=7"),
    (json.dumps({"model": TINY.to_dict(), "config": {**DP2.to_dict(), "tp": 3, "dp": 1}}), "tp(3)"),
    (json.dumps({"model": TINY.to_dict(), "config": {**DP2.to_dict(), "bogus": 1}}), "bogus"),
    (json.dumps({"model": TINY.to_dict(), "config": DP2.to_dict(), "seed": "x"}), "seed"),
])
def test_bad_documents_raise_user_error(tmp_path, content, needle):
    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=None) as e:
        load_plan(str(path))
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_a_plan_round_trips_through_its_file(tmp_path):
    plan = LaunchPlan(DP2, TINY, seed=3)
    assert load_plan(plan.write(str(tmp_path / "c.json"))) == plan


def _rank(r, ok=True, t=0.1, mem=100, **kw):
    return {"rank": r, "ok": ok, "step_time_s": t, "peak_memory_bytes": mem, "losses": [1.0, 0.9],
            "memory_method": "m", **kw}


def test_collect_takes_slowest_rank_and_largest_peak(tmp_path):
    for r, (t, m) in enumerate([(0.1, 100), (0.3, 50)]):
        (tmp_path / f"rank_{r}.json").write_text(json.dumps(_rank(r, t=t, mem=m)))
    res = collect(str(tmp_path), 2, 0, False, 10, 1.0, DP2)
    assert res.ok and res.step_time_s == 0.3 and res.peak_memory_bytes == 100 and res.losses == [1.0, 0.9]
    assert json.loads(json.dumps(res.to_dict()))["ok"] is True


def test_collect_failures_are_results_not_exceptions(tmp_path):
    (tmp_path / "rank_1.json").write_text(json.dumps(_rank(1, ok=False, reason="out of memory (boom)")))
    res = collect(str(tmp_path), 2, 1, False, 10, 1.0, DP2)
    assert not res.ok and res.reason == "rank 1: out of memory (boom)"
    empty = tmp_path / "empty"
    empty.mkdir()
    res = collect(str(empty), 2, None, True, 7, 7.0, DP2)
    assert not res.ok and "timed out after 7 s" in res.reason
    res = collect(str(empty), 2, 1, False, 7, 1.0, DP2)
    assert not res.ok and "exited with code 1" in res.reason


# -- trainer helpers ----------------------------------------------------------------------------------

def test_partition_balances_and_is_deterministic():
    sizes = [100, 10, 60, 50, 5, 5]
    owner = partition(sizes, 2)
    loads = [sum(s for s, o in zip(sizes, owner) if o == k) for k in range(2)]
    assert max(loads) - min(loads) <= 10 and owner == partition(sizes, 2)


# -- calibration ---------------------------------------------------------------------------------------

def _pairs(true_factors, n=12):
    import random

    rng = random.Random(0)
    pairs = []
    for _ in range(n):
        bd = {"compute": rng.uniform(0.1, 1), "recompute": 0.0, "tp_comm": 0.0, "pp_comm": rng.uniform(0, 0.2),
              "dp_comm": rng.uniform(0, 0.3), "bubble": rng.uniform(0, 0.2), "optimizer": 0.01}
        stage = {"parameters": 10.0, "gradients": 10.0, "optimizer": 20.0, "activations": rng.uniform(20, 80),
                 "other": 10.0}
        stage["total"] = sum(stage.values())
        est = {"step_time_s": sum(bd.values()), "breakdown_s": bd, "peak_memory_bytes": stage["total"],
               "memory_by_stage": [stage]}
        t = sum(true_factors.get(k, 1.0) * v for k, v in bd.items())
        m = 40 + true_factors.get("activations", 1.0) * stage["activations"] + true_factors.get("other", 1.0) * 10
        pairs.append((est, TrialResult(ok=True, step_time_s=t, peak_memory_bytes=int(m))))
    return pairs


def test_fit_recovers_factors_and_keeps_unseen_terms_at_one():
    truth = {"compute": 1.6, "dp_comm": 2.0, "bubble": 1.3, "activations": 1.25}
    pairs = _pairs(truth)
    cal = fit_calibration(pairs, ridge=1e-6, memory_ridge=1e-6)
    assert cal.factor("compute") == pytest.approx(1.6, rel=0.02)
    assert cal.factor("dp_comm") == pytest.approx(2.0, rel=0.05)
    assert cal.factor("activations") == pytest.approx(1.25, rel=0.05)
    assert cal.factor("tp_comm") == 1.0 and cal.factor("recompute") == 1.0  # never exercised
    before, after = error_stats(pairs), error_stats(pairs, cal)
    assert after.time_median < before.time_median / 10
    assert calibration_report(pairs, cal)["after"]["n"] == len(pairs)


def test_fit_is_non_negative_and_skips_failed_trials():
    pairs = _pairs({"compute": 1.0})
    pairs.append((pairs[0][0], TrialResult(ok=False, reason="x")))
    # a measured time below the compute term alone would want a negative factor for the rest
    est, _ = pairs[0]
    pairs.append((est, TrialResult(ok=True, step_time_s=est["breakdown_s"]["compute"] * 0.5, peak_memory_bytes=1)))
    cal = fit_calibration(pairs)
    assert all(v >= 0 for v in cal.factors.values())
    assert cal.num_trials == len(pairs) - 1


def test_calibration_round_trips_through_a_file(tmp_path):
    cal = Calibration(factors={**Calibration().factors, "compute": 1.5}, num_trials=3)
    path = tmp_path / "cal.json"
    save_calibration(cal, str(path))
    assert load_calibration(str(path)) == cal
    path.write_text(json.dumps({"factors": {"warp": 2}}))
    with pytest.raises(UserError, match="warp"):
        load_calibration(str(path))


def test_failed_trial_reports_the_root_cause_not_the_peers_echo(tmp_path):
    # rank 0 sees its connection drop because rank 1 hit the step timeout: report rank 1's reason
    from autoconf.runs.trial import collect
    from autoconf.space.config import ParallelConfig
    (tmp_path / "rank_0.json").write_text(json.dumps({"rank": 0, "ok": False, "reason": "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:3 ... remote worker hanging"}))
    (tmp_path / "rank_1.json").write_text(json.dumps({"rank": 1, "ok": False, "reason": "step 1 exceeded the step timeout (0.05 s)"}))
    result = collect(str(tmp_path), nproc=2, returncode=1, timed_out=False, timeout_s=10.0, wall_s=1.0,
                     config=ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1))
    assert not result.ok and result.reason.startswith("rank 1:") and "step timeout" in result.reason


_REPORT = """autoconf.trainer FAILED
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11)
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 12)
"""


@pytest.mark.parametrize("code,extra,kernel_oom,reason", [
    (-9, "", False, "rank 1: killed by SIGKILL"),
    (-9, "", True, "rank 1: out of memory (killed by SIGKILL)"),
    (-9, "MemoryError\n", False, "rank 1: out of memory (killed by SIGKILL)"),
    (-11, "", False, "rank 1: killed by SIGSEGV"),
    (3, "", False, "rank 1: exited with code 3 without writing a result"),
])
def test_a_dead_rank_is_named_with_its_signal_not_the_peers_echo(tmp_path, code, extra, kernel_oom, reason):
    """rank 1 died without a result; rank 0 only saw its connection close, and torchrun then sent
    it SIGTERM: the reason names rank 1 and how it died."""
    (tmp_path / "rank_0.json").write_text(json.dumps(_rank(0, ok=False, reason="RuntimeError: Connection closed by peer")))
    (tmp_path / "torchrun.log").write_text(extra + _REPORT.format(code=code))
    res = collect(str(tmp_path), 2, 1, False, 10, 1.0, DP2, kernel_oom=kernel_oom)
    assert not res.ok and res.reason == reason


def test_bad_time_limits_are_user_errors():
    from autoconf.runs.trial import check_seconds, run_trial

    for bad in (0, -5, float("nan"), float("inf"), "x"):
        with pytest.raises(UserError):
            check_seconds(bad, "timeout")
    with pytest.raises(UserError, match="timeout"):
        run_trial(LaunchPlan(DP2, TINY), timeout_s=0)


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_cli_rejects_bad_timeouts_in_one_line(tmp_path, value):
    path = tmp_path / "c.json"
    path.write_text(LaunchPlan(DP2, TINY).to_json())
    p = subprocess.run([sys.executable, "-m", "autoconf", "trial", "--config", str(path), "--timeout", value],
                       capture_output=True, text=True)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "--timeout" in p.stderr
    assert "Traceback" not in p.stderr
