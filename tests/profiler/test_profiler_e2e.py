"""The profiler end to end: `autoconf profile` on 2 CPU processes (gloo) writes a usable profile."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_merge_rounds_takes_the_median_of_every_sample():
    pytest.importorskip("torch")
    from profiler.compute import merge_rounds

    def row(fwd, bwd, peak):
        return {"layer": "block", "micro_batch_size": 1, "tp": 1, "recompute": "none", "forward_s": 0.0,
                "backward_s": 0.0, "forward_spread_s": 0.0, "backward_spread_s": 0.0, "repeats": len(fwd),
                "step_peak_bytes": peak, "parameter_bytes": (8.0, 2), "forward_samples": fwd, "backward_samples": bwd}

    # a slow round (x1.5) among two normal ones moves the median by one sample, not by 50%
    m = merge_rounds([row([1.0, 1.1], [2.0, 2.2], None), row([1.5, 1.6], [3.0, 3.3], 10.0),
                      row([1.0, 1.05], [2.1, 2.0], 12.0)])
    assert m["forward_s"] == pytest.approx(1.075) and m["backward_s"] == pytest.approx(2.15)
    assert m["repeats"] == 6 and m["step_peak_bytes"] == 12.0 and "forward_samples" not in m
    assert m["parameter_bytes"] == (8.0, 2) and m["forward_spread_s"] > 0


def test_tournament_rounds_pair_everyone_once_without_sharing_a_rank():
    pytest.importorskip("torch")
    from profiler.links import collective_groups, tournament_rounds

    for n in (2, 3, 4, 5, 8):
        rounds = tournament_rounds(n)
        pairs = [p for r in rounds for p in r]
        assert sorted(pairs) == [(a, b) for a in range(n) for b in range(a + 1, n)]
        for r in rounds:
            ranks = [x for p in r for x in p]
            assert len(ranks) == len(set(ranks))
    assert collective_groups(4) == [[0, 1], [2, 3], [0, 1, 2, 3]]
    assert collective_groups(6)[-1] == list(range(6))


@pytest.mark.e2e
def test_autoconf_profile_tiny_two_processes(tmp_path):
    pytest.importorskip("torch")
    from autoconf.cost import measured
    from autoconf.cost.activations import layer_activation_bytes
    from autoconf.specs.profile import check_profile_matches, load_profile

    out = tmp_path / "profile.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "autoconf", "profile", "--model", "tiny", "--nproc-per-node", "2",
                          "--out", str(out), "--quick", "--rounds", "2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "profile written to" in res.stdout

    p = load_profile(str(out))
    assert p.world_size == 2 and p.provenance.backend == "gloo" and p.model.name == "tiny"
    assert {r.device_kind for r in p.ranks} == {"cpu"}
    assert check_profile_matches(p, p.model) == []
    # per-layer times for every layer kind, tp shard, micro-batch size and (block) recompute mode
    keys = {(c.layer, c.micro_batch_size, c.tp, c.recompute) for c in p.compute}
    assert len(keys) == len(p.compute)  # the rounds are merged into one entry per item
    # the pipeline runtime's own cost, per schedule, on ranks 0 and 1
    assert {e.schedule for e in p.pipeline_overhead} == {"gpipe", "1f1b", "interleaved", "breadth_first"}
    assert all(0 < e.per_action_s < 0.05 and e.step_s == pytest.approx(e.per_action_s * 16 * e.virtual_stages)
               for e in p.pipeline_overhead)
    assert {c.repeats for c in p.compute} == {3}  # --quick's 3 repeats, split 2 + 1 over the rounds
    assert "3 in 2 round(s)" in " ".join(p.provenance.notes)
    for mbs in (1, 2):
        for tp in (1, 2):
            assert {("embedding", mbs, tp, "none"), ("head", mbs, tp, "none")} <= keys
            assert {("block", mbs, tp, rc) for rc in ("none", "selective", "full")} <= keys
    assert all(c.forward_s > 0 and c.backward_s > 0 for c in p.compute)
    # saved activations agree with the analytic model of autoconf.trainer.layers's block (CPU: masks at fp32)
    m = p.model
    for a in p.activations:
        if a.layer == "block":
            want = layer_activation_bytes(m, a.micro_batch_size, a.tp, a.sequence_parallel, a.recompute,
                                          m.dtype_bytes)["total"]
            assert a.bytes == pytest.approx(want, rel=0.01), a
    assert any(a.sequence_parallel for a in p.activations)
    assert {(x.layer, x.tp) for x in p.parameters} >= {("block", 1), ("block", 2)}
    assert p.overhead.framework_overhead_bytes > 0
    # a 2x2 link matrix (both directions) and collectives over both ranks
    assert sorted((x.src, x.dst) for x in p.links) == [(0, 1), (1, 0)]
    assert all(x.bandwidth_bytes_per_s > 0 and x.latency_s >= 0 for x in p.links)
    assert {c.op for c in p.collectives} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert p.gemm and all(g.fraction_of_peak > 0 for g in p.gemm)
    # the memory-bound kernel over operand sizes, once per device kind: three operands moved
    from profiler.compute import memory_sizes
    for dt in {p.compute_dtype, "fp32"}:  # the model's dtype and fp32
        curve = [x for x in p.memory if x.dtype == dt]
        assert [x.bytes for x in curve] == [3 * s for s in memory_sizes(False)]
        assert {x.device_kind for x in curve} == {"cpu"} and all(x.time_s > 0 for x in curve)
        assert curve[-1].time_s > curve[1].time_s  # 1,024 times the bytes take longer
        assert measured.memory_time(p, "cpu", dt)(curve[2].bytes) == pytest.approx(curve[2].time_s)
    assert len(p.memory) == len(memory_sizes(False)) * len({p.compute_dtype, "fp32"})

    # the cost model's lookups work on it
    assert measured.block_times(p, m, 2, 1, "none") is not None
    assert measured.block_times(p, m, 3, 2, "full") is not None
    assert measured.head_times(p, m, 4, 1) is not None
    assert measured.activation_bytes(p, m, 4, 2, True, "selective") > 0
    assert measured.collective_efficiency(p, "all_reduce", 2) > 0
    from autoconf.specs.measured_graph import topology_graph
    g = topology_graph(p)
    assert g.edges[0, 1]["kind"] == "measured"
    # measured in place: tp blocks with their real collectives, and the optimizer step
    assert {(e.tp, e.micro_batch_size, e.sequence_parallel) for e in p.tp_blocks} >= {(2, 1, False), (2, 1, True)}
    assert measured.tp_comm_times(p, m, 2, 2, False) is not None
    assert measured.optimizer_seconds_per_param(p) > 0

    # and the search runs on it, the profile standing in for a cluster file
    res = subprocess.run([sys.executable, "-m", "autoconf", "search", "--model", "tiny", "--profile", str(out),
                          "--global-batch", "8", "--storage", "none", "--json"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    import json
    doc = json.loads(res.stdout)
    assert doc["top"] and doc["best"]["fits"]


def test_launch_command_single_and_multi_node(tmp_path):
    import argparse

    from profiler.cli import add_profile_parser, launch_command

    ap = argparse.ArgumentParser()
    add_profile_parser(ap.add_subparsers())
    one = launch_command(ap.parse_args(["profile", "--model", "tiny", "--nproc-per-node", "2", "--quick",
                                        "--out", str(tmp_path / "p.json")]))
    assert one[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in one
    assert one[one.index("-m", 3) + 1] == "profiler" and "--quick" in one
    two = launch_command(ap.parse_args(["profile", "--model", "gpt2", "--nnodes", "2", "--node-rank", "1",
                                        "--master-addr", "head", "--nproc-per-node", "8", "--tp", "1,2,4,8"]))
    assert "--standalone" not in two and "--nnodes=2" in two and "--node-rank=1" in two
    assert "--master-addr=head" in two and two[two.index("--tp") + 1] == "1,2,4,8"
