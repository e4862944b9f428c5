import pytest

from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig, check
from autoconf.space.degrees import axis_groups
from autoconf.space.enumeration import enumerate_space, factorizations
from autoconf.specs.cluster import cluster_from_mapping, load_cluster
from autoconf.specs.model import preset
from autoconf.specs.topology import Topology
from autoconf.specs.units import parse_quantity


@pytest.mark.parametrize("text,kind,value", [("300 GB/s", "bytes_per_s", 300e9), ("200 Gbit/s", "bytes_per_s", 25e9),
                                             ("2 us", "seconds", 2e-6), ("80 GiB", "bytes", 80 * 2**30),
                                             ("989 TFLOP/s", "flop_per_s", 989e12), (5, "bytes", 5.0)])
def test_units(text, kind, value):
    assert parse_quantity(text, kind) == pytest.approx(value)


@pytest.mark.parametrize("text", ["fast", "3 parsecs", "300 GB/s/s", "-1"])
def test_bad_units(text):
    with pytest.raises(UserError):
        parse_quantity(text if text != "-1" else -1, "bytes_per_s", "x")


def test_example_clusters_load():
    for name, n in (("a100-4x8", 32), ("two-kinds", 48), ("localhost-cpu", 2)):
        assert load_cluster(f"examples/clusters/{name}.yaml").num_devices == n


def test_replaced_cluster_builds_its_own_graph():
    import dataclasses

    cl = load_cluster("examples/clusters/localhost-cpu.yaml")
    two = cl.graph()
    g = cl.node_groups[0]
    four = dataclasses.replace(cl, node_groups=(dataclasses.replace(g, gpus_per_node=4),))
    assert Topology(four.graph()).num_devices == 4 and Topology(cl.graph()).num_devices == 2
    assert cl.graph() is two


def test_slow_nic_group_pays_for_it():
    topo = Topology(load_cluster("examples/clusters/two-kinds.yaml").graph())
    fast = topo.group_links((0, 8))      # two A100 hosts, InfiniBand
    slow = topo.group_links((32, 40))    # two H100 hosts, one Ethernet NIC
    cross = topo.group_links((0, 32))    # across groups: capped at 50 Gbit/s
    assert fast.inter_bandwidth_bytes_per_s > slow.inter_bandwidth_bytes_per_s > cross.inter_bandwidth_bytes_per_s


@pytest.mark.parametrize("data,needle", [({"node_groups": []}, "non-empty"),
                                         ({"node_groups": [{"count": 1, "device": "tpu", "gpus_per_node": 8,
                                                            "intra_node_bandwidth": "1 GB/s"}]}, "unknown device 'tpu'"),
                                         ({"node_groups": [{"count": 0, "device": "cpu", "gpus_per_node": 8,
                                                            "intra_node_bandwidth": "1 GB/s"}]}, "count=0"),
                                         ({"nodes": 3}, "unknown key")])
def test_bad_cluster(data, needle):
    with pytest.raises(UserError, match=needle):
        cluster_from_mapping(data)


def test_axis_groups_tp_innermost():
    assert axis_groups(2, 2, 2, "tp-dp-pp", "tp")[0] == (0, 1)
    assert axis_groups(2, 2, 2, "tp-dp-pp", "dp")[0] == (0, 2)
    assert axis_groups(2, 2, 2, "tp-dp-pp", "pp")[0] == (0, 4)
    assert axis_groups(2, 2, 2, "pp-tp-dp", "pp")[0] == (0, 1)


def test_factorizations_cover_world():
    fs = factorizations(16)
    assert all(d * p * t == 16 for d, p, t in fs) and len(set(fs)) == len(fs) == 15


@pytest.mark.parametrize("kw,needle", [
    (dict(tp=3), "does not divide num_attention_heads"),
    (dict(schedule="interleaved", virtual_stages=1, pp=2), "virtual_stages >= 2"),
    (dict(schedule="breadth_first", virtual_stages=2, pp=2), "layered"),
    (dict(sequence_parallel=True), "tp > 1"),
    (dict(zero_stage=2, dp=1), "shards nothing"),
    (dict(pp=8, virtual_stages=1), "exceeds num_layers"),
    (dict(schedule="zigzag"), "valid: gpipe"),
])
def test_invalid_configs_have_reasons(kw, needle):
    base = dict(dp=2, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4)
    base.update(kw)
    reason = check(ParallelConfig(**base), preset("tiny"))
    assert reason and needle in reason


def test_enumeration_every_invalid_has_reason_and_batches_split():
    seen = 0
    for c, reason in enumerate_space(preset("tiny"), 4, 16):
        assert c.global_batch == 16 and c.world_size == 4
        assert reason is None or isinstance(reason, str)
        seen += reason is None
    assert seen > 50


def test_divisors_and_micro_batch_choices_of_a_huge_batch():
    from autoconf.space.enumeration import divisors, micro_batch_choices
    n = 10**11  # 2^11 x 5^11: 144 divisors, found by pairs up to sqrt(n)
    d = divisors(n)
    assert len(d) == 144 and d == sorted(d) and d[0] == 1 and d[-1] == n and all(n % x == 0 for x in d)
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and divisors(1) == [1]
    assert micro_batch_choices(n, 64) == [1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 64]


@pytest.mark.parametrize("cf", [float("nan"), float("inf"), 0.0, -1.0, 65.0, True])
def test_capacity_factor_outside_the_schema_range_is_refused(cf):
    from autoconf.specs.model import preset
    c = ParallelConfig(dp=8, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1, ep=8, moe_capacity_factor=cf)
    assert "moe_capacity_factor" in check(c, preset("mixtral-8x7b"))
