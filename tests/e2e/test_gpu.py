"""On a CUDA device: the reference trainer with NCCL, its measured peak memory against the cost
model's, and the profiler's timings. Skipped without a GPU (CI has none); run on one with
``pytest -m gpu tests/test_gpu.py``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model():
    from autoconf.specs.hf import load_model

    # GPT-2 medium's block at seq 1024: a few seconds per trial, GiBs of activations
    return dataclasses.replace(load_model("gpt2-medium"), num_layers=8)


def _cluster():
    from autoconf.specs.cluster import cluster_from_mapping
    from autoconf.specs.profile import catalog_kind

    p = torch.cuda.get_device_properties(0)
    kind = catalog_kind(p.name, float(p.total_memory))
    if kind == "cpu" or kind is None:
        pytest.skip(f"{p.name} is not in the device catalog")
    return cluster_from_mapping({"node_groups": [{"count": 1, "device": kind, "gpus_per_node": 1,
                                                  "intra_node_bandwidth": "100 GB/s",
                                                  "nics": {"count": 1, "bandwidth": "100 Gbit/s"}}]})


@pytest.mark.parametrize("mbs,recompute", [(1, "none"), (4, "none"), (4, "full")])
def test_trainer_peak_memory_matches_the_model(mbs, recompute):
    """max_memory_allocated over a step within 10% of the predicted peak less the runtime context
    (which lies outside the caching allocator), and never above the predicted device peak."""
    from autoconf.cost.estimate import estimate
    from autoconf.launch.plan import LaunchPlan
    from autoconf.runs.trial import run_trial
    from autoconf.space.config import ParallelConfig

    model = _model()
    c = ParallelConfig(dp=1, pp=1, tp=1, micro_batch_size=mbs, num_micro_batches=8 // mbs, recompute=recompute)
    res = run_trial(LaunchPlan(c, model), steps=4, warmup=2, timeout_s=300)
    assert res.ok, res.reason
    assert "max_memory_allocated" in res.memory_method
    assert all(math.isfinite(x) for x in res.losses)
    e = estimate(c, model, _cluster())
    context = dict(e.memory_by_stage[0].other_parts).get("runtime context", 0.0)
    allocated = e.peak_memory_bytes - context
    assert abs(allocated - res.peak_memory_bytes) <= 0.10 * res.peak_memory_bytes, (allocated, res.peak_memory_bytes)
    assert res.peak_memory_bytes <= e.peak_memory_bytes


def test_profile_predicts_the_trainer(tmp_path):
    """``autoconf profile`` on one GPU times each pass back to back between CUDA events, as a
    training step issues them (a host-bound block then costs its issue time, not issue time plus
    device time) and chains blocks so one backward call covers several, as in a step: the
    prediction from that profile lands within 30% of the trainer's step. Measured on an H100
    (2026-11-24): +23% (+36% without chaining); host-bound blocks are still over-predicted
    (bench/RESULTS.md)."""
    import yaml

    from autoconf.cost.estimate import estimate
    from autoconf.launch.plan import LaunchPlan
    from autoconf.runs.trial import run_trial
    from autoconf.space.config import ParallelConfig
    from autoconf.specs.profile import load_profile

    model = _model()
    spec, out = tmp_path / "m.yaml", tmp_path / "p.json"
    spec.write_text(yaml.safe_dump(model.to_dict()))
    r = subprocess.run([sys.executable, "-m", "autoconf", "profile", "--model", str(spec), "--nproc-per-node", "1",
                        "--micro-batch-sizes", "4", "--recompute", "none", "--tp", "1", "--skip-links", "--quiet",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    blocks = [e for e in json.loads(out.read_text())["compute"] if e["layer"] == "block"]
    assert blocks and all(0 < e["forward_s"] < e["backward_s"] * 2 for e in blocks)
    c = ParallelConfig(dp=1, pp=1, tp=1, micro_batch_size=4, num_micro_batches=2)
    res = run_trial(LaunchPlan(c, model), steps=6, warmup=2, timeout_s=300)
    assert res.ok, res.reason
    e = estimate(c, model, _cluster(), load_profile(str(out)))
    assert abs(e.step_time_s - res.step_time_s) <= 0.30 * res.step_time_s, (e.step_time_s, res.step_time_s)
