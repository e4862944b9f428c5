"""Collectives across hosts use every rail (NCCL's channels, one per NIC): a flat ring or tree of a
group with k members on each host crosses the hosts at k flows' bandwidth, shared among the axis's
groups on each host's NICs; one NIC per host is one flow. Closed forms with the bare alpha-beta
model (no tuning)."""

from __future__ import annotations

import pytest

from autoconf.cost import comm
from autoconf.specs.cluster import cluster_from_mapping
from autoconf.specs.topology import Topology

GIB = float(2**30)
NIC = 50e9  # 400 Gbit/s
NVLINK = 450e9


def _topo(nics: int, nic_bw: float = NIC, nodes: int = 8) -> Topology:
    return Topology.of_cluster(cluster_from_mapping({"name": "x", "node_groups": [
        {"count": nodes, "gpus_per_node": 8, "device": "h100-sxm", "intra_node_bandwidth": f"{NVLINK / 1e9} GB/s",
         "nics": {"count": nics, "bandwidth": f"{nic_bw * 8 / 1e9} Gbit/s"}}]}))


def _ring_s(n: int, bw: float, lat: float) -> float:
    return 2 * (n - 1) / n * GIB / bw + 2 * (n - 1) * lat


def test_a_ring_with_eight_members_per_host_runs_on_eight_rails():
    t = _topo(nics=8)
    g = t.group_links(tuple(range(64)))
    assert g.ring_inter_bandwidth_bytes_per_s == pytest.approx(8 * NIC)
    assert comm.ring_all_reduce_s(GIB, g) == pytest.approx(_ring_s(64, min(NVLINK, 8 * NIC), t.inter_latency_s))


def test_one_nic_per_host_is_one_flow_however_many_members():
    t = _topo(nics=1, nic_bw=12.5e9)
    g = t.group_links(tuple(range(64)))
    assert g.ring_inter_bandwidth_bytes_per_s == pytest.approx(12.5e9)


def test_one_member_per_host_is_one_rail():
    """tp 8 inside each host, data parallelism across: each dp ring has one member per host."""
    t = _topo(nics=8)
    g = t.group_links(tuple(range(0, 64, 8)))
    assert g.ring_inter_bandwidth_bytes_per_s == pytest.approx(NIC)


def test_the_groups_of_an_axis_share_each_hosts_nics():
    """Two members per host in each of four groups (tp 4 x dp-like rings): each ring gets two rails,
    the four groups' rings use the eight NICs between them."""
    t = _topo(nics=8)
    members = tuple(h * 8 + i for h in range(8) for i in (0, 1))
    alone = t.group_links(members)
    shared = t.group_links(members, {h: 8 for h in range(8)})
    assert alone.ring_inter_bandwidth_bytes_per_s == pytest.approx(2 * NIC)
    assert shared.ring_inter_bandwidth_bytes_per_s == pytest.approx(2 * NIC)
    crowded = t.group_links(tuple(range(64)), {h: 16 for h in range(8)})  # two such groups per host
    assert crowded.ring_inter_bandwidth_bytes_per_s == pytest.approx(8 * NIC / 2)


def test_flat_beats_hierarchical_for_large_messages_on_multi_rail_nodes():
    t = _topo(nics=8)
    g = t.group_links(tuple(range(64)))
    assert comm.ring_all_reduce_s(GIB, g) < comm.hierarchical_all_reduce_s(GIB, g)
