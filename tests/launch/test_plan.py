"""The launch plan (autoconf.launch.plan): one config.json format, its checks, and what a user's script reads from it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from autoconf.cost.estimate import estimate
from autoconf.errors import UserError
from autoconf.launch.plan import PLAN_ENV, Expected, LaunchPlan, load
from autoconf.space.config import ParallelConfig
from autoconf.space.degrees import rank_coords
from autoconf.specs.cluster import load_cluster
from autoconf.specs.model import preset

TINY = preset("tiny")  # 4 layers
CPU = load_cluster("examples/clusters/localhost-cpu.yaml")
A100 = load_cluster("examples/clusters/a100-4x8.yaml")


def test_importing_the_plan_reader_does_not_import_torch(tmp_path):
    code = ("import sys, autoconf.launch.plan; p = autoconf.launch.plan.load(sys.argv[1]); p.coords(0); p.layers(0); "
            "print('torch' in sys.modules)")
    plan = LaunchPlan(ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=1, num_micro_batches=2), TINY, CPU)
    f = plan.write(str(tmp_path / "config.json"))
    out = subprocess.run([sys.executable, "-c", code, f], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_plan_from_an_estimate_round_trips_with_its_prediction(tmp_path):
    c = ParallelConfig(dp=4, pp=2, tp=4, micro_batch_size=1, num_micro_batches=8, schedule="interleaved",
                       virtual_stages=2, zero_stage=1, recompute="selective", sequence_parallel=True)
    model = preset("llama-3-8b")
    e = estimate(c, model, A100, framework="megatron")
    plan = LaunchPlan.of_estimate(e, model, A100, profile="p.json", seed=7)
    assert plan.expected.step_time_s == e.step_time_s and plan.expected.breakdown_s["compute"] > 0
    assert set(plan.expected.memory_bytes) == {"parameters", "gradients", "optimizer", "activations", "other",
                                               "capacity"}
    again = load(plan.write(str(tmp_path / "config.json")))
    assert again == plan and again.framework == "megatron" and again.seed == 7 and again.profile == "p.json"
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["version"] == 2 and set(doc) == {"version", "created_by", "framework", "seed", "model", "config",
                                                "cluster", "profile", "expected"}


def test_load_reads_autoconf_plan_then_config_json(tmp_path, monkeypatch):
    a = LaunchPlan(ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=1, num_micro_batches=2), TINY, seed=1)
    b = LaunchPlan(ParallelConfig(dp=1, pp=2, tp=1, micro_batch_size=1, num_micro_batches=2), TINY, seed=2)
    a.write(str(tmp_path / "config.json"))
    b.write(str(tmp_path / "other.json"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(PLAN_ENV, raising=False)
    assert load() == a
    monkeypatch.setenv(PLAN_ENV, str(tmp_path / "other.json"))
    assert load() == b
    monkeypatch.setenv(PLAN_ENV, str(tmp_path / "gone.json"))
    with pytest.raises(UserError, match=r"gone.json' \(from \$AUTOCONF_PLAN\) does not exist"):
        load()


def test_version_1_documents_still_load_and_others_are_refused(tmp_path):
    c = ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=1, num_micro_batches=2)
    old = {"version": 1, "created_by": "autoconf 0.1.0", "model": TINY.to_dict(), "config": c.to_dict(),
           "framework": "reference", "cluster": None, "profile": None, "estimate": {"step_time_s": 1.0}}
    (tmp_path / "v1.json").write_text(json.dumps(old))
    assert load(str(tmp_path / "v1.json")).config == c
    (tmp_path / "v3.json").write_text(json.dumps({**old, "version": 3}))
    with pytest.raises(UserError, match="version=3; this autoconf reads version 1 or 2"):
        load(str(tmp_path / "v3.json"))
    (tmp_path / "v2.json").write_text(json.dumps({**old, "version": 2}))  # version 2 has no 'estimate'
    with pytest.raises(UserError, match="unknown key 'estimate'"):
        load(str(tmp_path / "v2.json"))


@pytest.mark.parametrize("change,needle", [
    ({"framework": "megatron", "config": {"schedule": "gpipe", "pp": 2, "dp": 1}}, "framework megatron has no gpipe"),
    ({"framework": "torchtitan2"}, "framework"),
    ({"seed": 1.5}, "seed"),
    ({"expected": {"step_time_s": -1, "peak_memory_bytes": 1}}, "expected.step_time_s"),
    ({"config": {"dp": 3}}, "global"),
    ({"profile": 7}, "profile"),
])
def test_bad_plans_are_one_line_user_errors(tmp_path, change, needle):
    doc = LaunchPlan(ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=1, num_micro_batches=2), TINY, CPU).to_dict()
    for k, v in change.items():
        doc[k] = {**doc[k], **v} if isinstance(v, dict) and isinstance(doc.get(k), dict) else v
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    if needle == "global":  # dp 3 is valid alone, but the cluster has 2 devices
        needle = "the cluster has 2 devices"
    with pytest.raises(UserError) as e:
        load(str(path))
    assert needle in str(e.value) and "\n" not in str(e.value) and "config.json" in str(e.value)


def test_mesh_coords_groups_and_layers_follow_the_placement(monkeypatch):
    c = ParallelConfig(dp=2, pp=2, tp=2, micro_batch_size=1, num_micro_batches=4, schedule="interleaved",
                       virtual_stages=2, rank_order="tp-dp-pp", stage_layers=(2, 3, 1, 2),
                       device_order=(7, 6, 5, 4, 3, 2, 1, 0))
    model = dataclasses.replace(preset("gpt2"), num_layers=8)
    plan = LaunchPlan(c, model)
    assert plan.mesh == {"tp": 2, "cp": 1, "dp": 2, "pp": 2} and plan.rank_order == ("tp", "cp", "dp", "pp")
    assert plan.mesh_dim_names == ("pp", "dp", "cp", "tp") and plan.mesh_shape == (2, 2, 1, 2)
    for r in range(8):
        assert plan.coords(r) == rank_coords(r, 2, 2, 2, "tp-dp-pp")
    # the process on device d plays the rank whose device it is
    assert [plan.rank_on(d) for d in range(8)] == [7, 6, 5, 4, 3, 2, 1, 0]
    monkeypatch.setenv("RANK", "0")
    assert plan.coords() == plan.coords(7) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}
    # groups are torchrun ranks: plan ranks 0,1 (tp group) run on devices 7,6
    assert plan.groups("tp")[0] == (7, 6) and plan.groups("pp")[0] == (7, 3)
    assert plan.chunks(0) == [[0, 1], [5]] and plan.layers(1) == [2, 3, 4, 6, 7]
    assert (plan.schedule, plan.virtual_stages, plan.micro_batch_size, plan.num_micro_batches, plan.global_batch,
            plan.zero_stage, plan.recompute) == ("interleaved", 2, 1, 4, 8, 0, "none")
    for bad, call in ((8, plan.coords), (-1, plan.rank_on), (2, plan.layers)):
        with pytest.raises(UserError, match="expected 0.."):
            call(bad)
    with pytest.raises(UserError, match="axis 'ep'"):
        plan.groups("ep")
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(UserError, match="RANK='x'"):
        plan.coords()


def test_expected_is_typed():
    e = Expected(step_time_s=1.0, peak_memory_bytes=2.0)
    assert e.to_dict()["breakdown_s"] == {} and Expected(**e.to_dict()) == e
