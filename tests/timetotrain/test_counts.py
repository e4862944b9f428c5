"""The GPU counts ``plan`` sweeps: up to --max-gpus, or open-ended until more GPUs stop paying,
past the 65,536 a cluster file once bounded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autoconf.errors import UserError
from autoconf.specs.model import preset
from autoconf.timetotrain import planner as T
from autoconf.timetotrain.counts import gpu_grid, space_bound, stops_paying
from autoconf.timetotrain.synthetic import synthetic_cluster


def _row(method, gpus, days, net="ib"):
    return SimpleNamespace(network=net, method=method, gpus=gpus, days=days)


def test_grid_doubles_a_node_and_ends_at_the_bound():
    assert gpu_grid(64, 8) == [8, 16, 32, 64]
    assert gpu_grid(100, 8) == [8, 16, 32, 64, 100]
    assert gpu_grid(64, 8, start=20) == [32, 64]


def test_space_bound_is_a_sequence_per_rank_a_layer_per_stage_a_head_per_tp_rank():
    m = preset("gpt3-1.3b")  # sequence 2048: cp 1
    bud = SimpleNamespace(batches=[96, 384])
    most = 384 * m.num_layers * m.num_attention_heads
    g = space_bound(m, bud, 8)
    assert g <= most < 2 * g and g % 8 == 0 and (g & (g - 1)) == 0
    assert space_bound(m, bud, 8, max_cp=4) == 4 * g


def test_stops_two_doublings_past_every_methods_shortest():
    counts = [8, 16, 32, 64]
    rows = [_row("all", 8, 4.0), _row("all", 16, 2.0), _row("all", 32, 2.5), _row("all", 64, 3.0)]
    assert stops_paying(rows, "ib", counts)  # shortest at 16, then 32 and 64 slower
    assert not stops_paying(rows[:3], "ib", counts[:3])  # one doubling past it only
    late = rows + [_row("no-zero", 64, 5.0), _row("no-zero", 32, 6.0)]
    assert not stops_paying(late, "ib", counts)  # no-zero still improving at 64
    assert not stops_paying(rows, "25gbe", counts)  # nothing on that network yet: go on
    gone = rows[:3]  # 64 swept, nothing there after plans at smaller counts: past the space
    assert stops_paying(gone, "ib", counts)
    # equal days at more GPUs do not pay: the fewest GPUs hold the shortest time
    flat = [_row("all", 8, 1.0), _row("all", 16, 1.0), _row("all", 32, 1.0)]
    assert stops_paying(flat, "ib", [8, 16, 32])


def test_synthetic_clusters_pass_the_cluster_files_bound():
    cl = synthetic_cluster("h100-sxm", 1 << 21, "ib")
    assert cl.num_devices == 1 << 21 and cl.node_groups[0].count == 1 << 18
    with pytest.raises(UserError, match="multiple of 8"):
        synthetic_cluster("h100-sxm", 12, "ib")


def test_open_ended_plan_stops_where_more_gpus_stop_paying():
    m = preset("gpt3-1.3b")
    r = T.plan(m, device="a100-80gb", tokens=2.6e9, batch_law="fixed", global_batch=64, compare_networks=(),
               methods=T.METHODS[:1])
    per = r.per_gpus()
    best = r.shortest()
    counts = [x.gpus for x in per]
    assert counts == sorted(counts) and r.grid[-1] >= 2 * 2 * best.gpus  # two doublings past the shortest
    assert all(x.days >= best.days for x in per if x.gpus > best.gpus)
    assert r.grid[-1] < space_bound(m, SimpleNamespace(batches=[64]), 8)  # stopped well before the bound


def test_a_plan_past_65536_gpus_runs():
    m = preset("gpt3-1.3b")
    r = T.plan(m, device="h100-sxm", max_gpus=1 << 17, tokens=2.6e9, batch_law="fixed", global_batch=1 << 14,
               compare_networks=(), methods=T.METHODS[:1])
    assert r.grid[-1] == 1 << 17 and r.cluster.num_devices == 1 << 17
    assert any(x.gpus == 1 << 17 for x in r.select())
