"""The hierarchical all-reduce (autoconf/trainer/collectives.py): its pure parts, the same sum as
gloo's flat all-reduce under torchrun (4 processes declared as 2 hosts x 2), and the cost model
crediting only the algorithms each runtime runs."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from autoconf.cost import comm
from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig, check
from autoconf.specs.frameworks import FRAMEWORKS, hierarchical_runs
from autoconf.specs.model import preset
from autoconf.specs.topology import GroupLinks
from autoconf.trainer import collectives as C

TINY = preset("tiny")


# -- pure parts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("numel,k,expected", [
    (0, 2, [(0, 0), (0, 0)]), (1, 2, [(0, 1), (1, 1)]), (4, 2, [(0, 2), (2, 4)]), (5, 2, [(0, 3), (3, 5)]),
    (1, 4, [(0, 1), (1, 1), (1, 1), (1, 1)]), (7, 3, [(0, 3), (3, 6), (6, 7)]), (10, 1, [(0, 10)]),
    (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)])])
def test_shard_bounds(numel, k, expected):
    assert C.shard_bounds(numel, k) == expected


def test_shard_bounds_tile_the_buffer_as_padding_would():
    for numel in range(0, 40):
        for k in range(1, 6):
            bounds = C.shard_bounds(numel, k)
            assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in order
            c = -(-numel // k)  # the buffer padded to k * c, cut in k equal shards: the same real elements
            padded = list(range(numel)) + [None] * (k * c - numel)
            parts = [[x for x in padded[j * c:(j + 1) * c] if x is not None] for j in range(k)]
            assert parts == [list(range(a, b)) for a, b in bounds]
    with pytest.raises(ValueError):
        C.shard_bounds(4, 0)


def test_host_layout():
    layout, note = C.host_layout([0, 1, 2, 3], ["a", "a", "b", "b"])
    assert layout.hosts == ((0, 1), (2, 3)) and note == "hierarchical (2 hosts x 2)"
    assert layout.inter(0) == [0, 2] and layout.inter(1) == [1, 3] and layout.intra(1) == [2, 3]
    assert layout.position(3) == (1, 1) and layout.position(7) is None
    # interleaved hosts; the group order does not matter, hosts come in the order of their lowest rank
    layout, _ = C.host_layout([3, 2, 1, 0], {0: "x", 1: "y", 2: "x", 3: "y"})
    assert layout.hosts == ((0, 2), (1, 3))
    # a subgroup of a larger job
    layout, _ = C.host_layout([1, 3, 5, 7], ["h0"] * 4 + ["h1"] * 4)
    assert layout.hosts == ((1, 3), (5, 7))
    for ranks, hosts, why in [([0, 1, 2, 3], "aaab", "different numbers of its ranks (3, 1)"),
                              ([0, 1], "aa", "on one host"),
                              ([0, 1, 2], "abc", "one rank per host")]:
        layout, note = C.host_layout(ranks, list(hosts))
        assert layout is None and why in note, note


def test_host_layout_and_cost_model_agree():
    """The trainer falls back to flat exactly where the cost model stops crediting hierarchical."""
    for n_hosts in range(1, 4):
        for counts in itertools.product(range(1, 4), repeat=n_hosts):
            host_of = [h for h, c in enumerate(counts) for _ in range(c)]
            layout, _ = C.host_layout(list(range(len(host_of))), host_of)
            g = GroupLinks(size=len(host_of), num_hosts=n_hosts, local_size=max(counts),
                           intra_bandwidth_bytes_per_s=1e9, inter_bandwidth_bytes_per_s=1e8,
                           ring_inter_bandwidth_bytes_per_s=1e8, intra_latency_s=1e-6, inter_latency_s=1e-5)
            assert (layout is not None) == hierarchical_runs(g), counts


def _simulate(n: int) -> list[Counter]:
    """Run every rank's schedule round by round on multisets of contributions; check the pairs."""
    schedules = [C.recursive_doubling_schedule(n, i) for i in range(n)]
    data = [Counter({i: 1}) for i in range(n)]
    rounds = sorted({s.round for sched in schedules for s in sched})
    partner_kind = {"send": "recv_add", "recv_add": "send", "exchange_add": "exchange_add",
                    "send_result": "recv_result", "recv_result": "send_result"}
    for r in rounds:
        steps = {i: s for i, sched in enumerate(schedules) for s in sched if s.round == r}
        before = [Counter(d) for d in data]
        for i, s in steps.items():
            other = steps.get(s.peer)
            assert other is not None and other.peer == i and other.kind == partner_kind[s.kind], (n, r, i, s, other)
            if s.kind in ("recv_add", "exchange_add"):
                data[i] = before[i] + before[s.peer]
            elif s.kind == "recv_result":
                data[i] = before[s.peer]
    return data


@pytest.mark.parametrize("n", range(1, 18))
def test_recursive_doubling_sums_every_contribution_once(n):
    everything = Counter(range(n))
    assert all(d == everything for d in _simulate(n)), n
    rounds = {s.round for i in range(n) for s in C.recursive_doubling_schedule(n, i)}
    p = 1 << (n.bit_length() - 1)
    assert len(rounds) == (p.bit_length() - 1) + (2 if p != n else 0)
    assert C.inter_host_steps(n, 1.0, small_bytes=8) == (("recursive_doubling", len(rounds)) if n > 1 else ("none", 0))


def test_recursive_doubling_partners():
    assert [(s.kind, s.peer) for s in C.recursive_doubling_schedule(4, 1)] == [("exchange_add", 0), ("exchange_add", 3)]
    assert [(s.kind, s.peer) for s in C.recursive_doubling_schedule(3, 1)] == [("send", 0), ("recv_result", 0)]
    assert [(s.kind, s.peer) for s in C.recursive_doubling_schedule(3, 0)] == [
        ("recv_add", 1), ("exchange_add", 2), ("send_result", 1)]
    assert C.recursive_doubling_schedule(1, 0) == []
    with pytest.raises(ValueError):
        C.recursive_doubling_schedule(2, 2)


def test_inter_host_steps():
    assert C.inter_host_steps(2, 100, small_bytes=100) == ("recursive_doubling", 1)
    assert C.inter_host_steps(8, 100, small_bytes=100) == ("recursive_doubling", 3)
    assert C.inter_host_steps(6, 100, small_bytes=100) == ("recursive_doubling", 4)
    assert C.inter_host_steps(2, 101, small_bytes=100) == ("ring", 2)
    assert C.inter_host_steps(5, 101, small_bytes=100) == ("ring", 8)
    assert C.inter_host_steps(1, 1) == ("none", 0)


def test_parse_hosts():
    assert C.parse_hosts("a, a,b,b", 4) == ["a", "a", "b", "b"]
    for bad in ("a,a,b", "a,,b,b", ""):
        with pytest.raises(ValueError, match="AUTOCONF_RANK_HOSTS"):
            C.parse_hosts(bad, 4)


# -- configuration and cost model --------------------------------------------------------------------

def test_config_field():
    base = dict(dp=4, pp=1, tp=1, micro_batch_size=1, num_micro_batches=2)
    assert ParallelConfig.from_dict(base).dp_all_reduce == "flat"  # older config files
    c = ParallelConfig.from_dict({**base, "dp_all_reduce": "hierarchical"})
    assert c.dp_all_reduce == "hierarchical" and check(c, TINY) is None and "hier-ar" in c.short()
    with pytest.raises(UserError, match="dp_all_reduce.*'ring'.*flat.*hierarchical"):
        ParallelConfig.from_dict({**base, "dp_all_reduce": "ring"})
    assert "reduces nothing" in check(ParallelConfig(**{**base, "dp": 1}, dp_all_reduce="hierarchical"), TINY)
    assert "ZeRO-0/1" in check(ParallelConfig(**base, zero_stage=2, dp_all_reduce="hierarchical"), TINY)
    assert FRAMEWORKS["reference"].check(c) is None
    for name in ("megatron", "torchtitan", "deepspeed"):
        assert "no dp_all_reduce=hierarchical" in FRAMEWORKS[name].check(c)


def _links(hosts: int, local: int, size: int | None = None) -> GroupLinks:
    return GroupLinks(size=size or hosts * local, num_hosts=hosts, local_size=local,
                      intra_bandwidth_bytes_per_s=100e9, inter_bandwidth_bytes_per_s=10e9,
                      ring_inter_bandwidth_bytes_per_s=20e9, intra_latency_s=2e-6, inter_latency_s=10e-6)


def test_algorithms_each_runtime_runs():
    flat = ParallelConfig(dp=8, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1)
    hier = ParallelConfig(dp=8, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1, dp_all_reduce="hierarchical")
    even, uneven = _links(2, 4), _links(2, 5, size=8)
    ref = FRAMEWORKS["reference"]
    assert ref.dp_all_reduce_algorithms(flat, even, gloo=True) == ("ring",)  # gloo's ring on CPU processes
    assert ref.dp_all_reduce_algorithms(flat, even) == ("ring", "tree")  # NCCL on GPUs
    assert ref.dp_all_reduce_algorithms(hier, even) == ("hierarchical",)
    assert ref.dp_all_reduce_algorithms(hier, uneven, gloo=True) == ("ring",)  # the trainer falls back to flat
    for name in ("megatron", "torchtitan", "deepspeed"):
        assert FRAMEWORKS[name].dp_all_reduce_algorithms(flat, even) == ("ring", "tree")
    s = 64 << 20
    assert comm.all_reduce_s(s, even, algorithms=("ring",)) == comm.ring_all_reduce_s(s, even)
    assert comm.all_reduce_s(s, even, algorithms=("hierarchical",)) == comm.hierarchical_all_reduce_s(s, even)


def _cluster(hosts: int, gpus: int):
    from autoconf.specs.cluster import cluster_from_mapping
    return cluster_from_mapping({
        "name": f"{hosts}x{gpus}", "node_groups": [{
            "count": hosts, "device": "a100-80gb", "gpus_per_node": gpus, "intra_node_bandwidth": "300 GB/s",
            "nics": {"count": 1, "bandwidth": "100 Gbit/s", "kind": "ethernet"}}],
        "latency": {"intra_node": "2 us", "inter_node": "10 us"}})


def test_dp_cost_follows_the_runtime():
    """ZeRO-0's reduction on 2 hosts x 8: the reference trainer's flat (ring) is dearer than its
    hierarchical one; Megatron (NCCL ring or tree) is credited neither the hierarchical time nor
    more than its ring."""
    from autoconf.cost.groups import all_reduce_algorithms, axis_links, collective_s, reduction_collective
    from autoconf.cost.system import System

    model = preset("gpt3-1.3b")
    cluster = _cluster(2, 8)
    c = ParallelConfig(dp=16, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1)
    h = ParallelConfig(dp=16, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1, dp_all_reduce="hierarchical")
    fn = reduction_collective(0)
    s = 2.6e9

    def cost(fw, config):
        system = System(model, cluster, framework=fw)
        links = axis_links(system, config, "dp")
        return collective_s(system, links, fn, 16, s, all_reduce_algorithms(system, config, fn)), links, system

    ring, links, system = cost("reference", c)
    hier, _, _ = cost("reference", h)
    meg, _, msys = cost("megatron", c)
    (g,) = links
    tune = system.collective_tuning
    assert ring == pytest.approx(comm.ring_all_reduce_s(s, g, tune))
    assert hier == pytest.approx(comm.hierarchical_all_reduce_s(s, g, tune)) and hier < ring
    assert meg == pytest.approx(min(comm.ring_all_reduce_s(s, g, msys.collective_tuning),
                                    comm.tree_all_reduce_s(s, g, msys.collective_tuning)))
    assert all_reduce_algorithms(system, c, reduction_collective(1)) is None  # ZeRO-1 reduce-scatters

    from autoconf.cost.estimate import estimate
    e_flat = estimate(c, model, cluster)
    e_hier = estimate(h, model, cluster)
    assert e_hier.breakdown_s["dp_comm"] < e_flat.breakdown_s["dp_comm"]
    assert e_hier.config.dp_all_reduce == "hierarchical"
    assert not any("dp_all_reduce" in n for n in e_hier.notes)
    # dp=8 on one host of 8: the trainer keeps the flat all-reduce, the estimate says so and costs it flat
    one = ParallelConfig(dp=8, pp=1, tp=1, micro_batch_size=1, num_micro_batches=2, dp_all_reduce="hierarchical")
    e_one = estimate(one, model, cluster)
    assert any("lies on one host" in n for n in e_one.notes), e_one.notes
    assert e_one.step_time_s == estimate(dataclasses.replace(one, dp_all_reduce="flat"), model, cluster).step_time_s


def test_search_tries_hierarchical_where_it_can_matter():
    from autoconf.cost.system import System
    from autoconf.study.choices import count_space, dp_hierarchical, framework_inner

    ref = System(TINY, _cluster(2, 4))
    assert dp_hierarchical(ref, 8, 1, 1)       # dp group 2 hosts x 4
    assert dp_hierarchical(ref, 4, 1, 2)       # 2 hosts x 2
    assert not dp_hierarchical(ref, 4, 2, 1)   # each dp group inside one host
    assert not dp_hierarchical(ref, 2, 1, 4)   # one rank per host
    assert not dp_hierarchical(ref, 1, 8, 1)
    assert not dp_hierarchical(System(TINY, _cluster(2, 4), framework="megatron"), 8, 1, 1)
    assert not dp_hierarchical(System(TINY, _cluster(1, 8)), 8, 1, 1)

    fw = ref.framework
    plain = list(framework_inner(fw, 8, 1, 1, 1, "1f1b", 1, False, 8))
    both = list(framework_inner(fw, 8, 1, 1, 1, "1f1b", 1, False, 8, dp_hier=True))
    hier = [c for c in both if c.dp_all_reduce == "hierarchical"]
    assert all(c.dp_all_reduce == "flat" for c in plain)
    assert hier and all(c.zero_stage == 0 and check(c, TINY) is None for c in hier)
    assert len(both) == len(plain) + len(hier) == len(plain) + sum(c.zero_stage == 0 for c in plain)

    _, total, _, _, _ = count_space(TINY, 8, 8, 8, fw)
    _, total_h, _, _, _ = count_space(TINY, 8, 8, 8, fw, lambda dp, pp, tp: dp_hierarchical(ref, dp, pp, tp))
    assert total_h > total


# -- end to end: 4 torchrun processes as 2 hosts x 2 ------------------------------------------------

@pytest.mark.e2e
def test_hierarchical_equals_flat_under_torchrun(tmp_path):
    pytest.importorskip("torch")
    worker = os.path.join(os.path.dirname(__file__), "_allreduce_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           worker, str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(4):
        doc = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert len(doc["checked"]) == 9, doc


def test_model_prices_the_inter_host_phase_as_the_trainer_runs_it():
    """4 hosts x 2: a 64 KiB all-reduce's 32 KiB shards cross hosts by recursive doubling (2
    rounds of the whole shard); a 64 MiB one's by a ring (2(H-1) steps of S/(kH))."""
    g = _links(4, 2)
    inter, lat = 10e9, 10e-6
    local = lambda s: (1 / 2) * s / 100e9 + 1 * 2e-6  # noqa: E731
    s = 64 << 10
    assert comm.hierarchical_all_reduce_s(s, g) == pytest.approx(2 * local(s) + 2 * (s / 2 / inter + lat))
    s = 64 << 20
    assert comm.hierarchical_all_reduce_s(s, g) == pytest.approx(2 * local(s) + 2 * 3 / 4 * s / 2 / inter + 6 * lat)
