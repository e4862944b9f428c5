"""Size limits: what is out of range is refused before anything is built from it, and what is in
range (up to MAX_DEVICES devices, any shape) is priced with structures linear in its size.

Before (issue "Hardening, second round"): a Hugging Face config of 16,777,216 layers was refused
after 9-15 s and 0.5-0.8 GB (a per-layer list came before the range check); one estimate on 64
hosts of 1,024 devices took 200 s and 8.8 GB (``ClusterSpec.graph()`` held a device clique per
host, 33.5 million edges, and the cost model read it). The speed itself is measured by
``bench/big_cluster.py``; these tests pin the structure: refusal before building, no clique, the
cost model's topology read from the spec with the same answers as from the graph.
"""

import dataclasses
import glob
import itertools
import json
import random
import time
import tracemalloc

import pytest

from autoconf.cost.estimate import estimate
from autoconf.cost.system import System
from autoconf.errors import UserError
from autoconf.space import degrees
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import MAX_DEVICES, cluster_from_mapping, load_cluster
from autoconf.specs.hf import from_hf_config, load_model
from autoconf.specs.measured_graph import overlay_measured_links, topology_graph
from autoconf.specs.model import LIMITS, preset
from autoconf.specs.profile import HostInfo, RankInfo, load_profile
from autoconf.specs.topology import Topology
from tests.specs.test_profile import _link, make_profile

HF_MAX = 1 << 24
"""The largest integer a config.json key may hold (``hf.HF_KEYS``): 16,777,216."""

BASE = dict(hidden_size=4096, num_attention_heads=32, num_hidden_layers=32, vocab_size=32000,
            intermediate_size=11008, max_position_embeddings=4096)


def refused_cheaply(fn, match: str) -> None:
    """``fn`` raises a one-line UserError matching ``match`` while holding under 8 MB of Python
    memory (reading a file, imports on first use; the per-layer lists of 16,777,216 blocks took
    755 MB under tracemalloc)."""
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match=match) as err:
            fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(err.value)
    assert peak < 8 << 20, f"{peak:,} bytes held before the refusal"


# -- models ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral",
                                        "gpt2", "falcon", "gpt_neox"])
def test_hf_layers_out_of_range_are_refused_before_the_blocks_are_laid_out(model_type):
    cfg = dict(BASE, model_type=model_type, num_hidden_layers=HF_MAX)
    lo, hi = LIMITS["num_layers"]
    refused_cheaply(lambda: from_hf_config(cfg),
                    rf"^model hf: num_layers={HF_MAX} is out of range; expected an integer in \[{lo}, {hi}\]$")


@pytest.mark.parametrize("key,field", [("hidden_size", "hidden_size"), ("num_attention_heads", "num_attention_heads"),
                                       ("intermediate_size", "ffn_hidden_size"),
                                       ("num_key_value_heads", "num_kv_heads")])
def test_hf_shape_out_of_range_is_refused_first(key, field):
    # a qwen2_moe config lays its blocks out one by one: the shape's ranges come before that (the
    # vocabulary's range is the config's own, 1 .. 2^24)
    cfg = dict(BASE, model_type="qwen2_moe", num_hidden_layers=4096, **{key: HF_MAX})
    refused_cheaply(lambda: from_hf_config(cfg), rf"model hf: {field}={HF_MAX} is out of range")


@pytest.mark.parametrize("model_type,key", [("qwen2_moe", "num_experts"), ("qwen3_moe", "num_experts"),
                                            ("deepseek_v3", "n_routed_experts"), ("mixtral", "num_local_experts")])
def test_hf_experts_out_of_range_are_refused_before_the_layout(model_type, key):
    # mlp_only_layers that fit no layout: the expert count's range is what is reported
    cfg = dict(BASE, model_type=model_type, num_hidden_layers=4096, **{key: HF_MAX},
               mlp_only_layers=[1, 2, 5], n_group=1)
    refused_cheaply(lambda: from_hf_config(cfg), rf"model hf: num_experts={HF_MAX} is out of range")


def test_hf_model_file_with_too_many_layers_is_refused_at_once(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(BASE, model_type="deepseek_v3", num_hidden_layers=HF_MAX)))
    refused_cheaply(lambda: load_model(str(path)), rf"model config: num_layers={HF_MAX} is out of range")


def test_hf_models_in_range_still_load():
    for model_type in ("qwen2_moe", "deepseek_v3", "gpt_oss"):
        m = from_hf_config(dict(BASE, model_type=model_type, num_hidden_layers=4096))
        assert m.num_layers == 4096 and m.is_moe


# -- clusters: the graph ----------------------------------------------------------------------------

def h100(count: int, per: int, **kw):
    return {"count": count, "device": "h100-sxm", "gpus_per_node": per, "intra_node_bandwidth": "450 GB/s",
            "nics": {"count": 8, "bandwidth": "400 Gbit/s"}, **kw}


def clusters():
    """Every example cluster, and shapes with NVLink domains, several node groups and a cap."""
    out = [load_cluster(f) for f in sorted(glob.glob("examples/clusters/*.yaml"))]
    out.append(cluster_from_mapping({"name": "mixed", "inter_group_bandwidth": "20 GB/s", "node_groups": [
        h100(2, 8, hosts=["a-1", "a-2"]),
        {"count": 3, "device": "a100-80gb", "gpus_per_node": 4, "intra_node_bandwidth": "300 GB/s",
         "nics": {"count": 2, "bandwidth": "200 Gbit/s", "kind": "ethernet"}},
        h100(4, 4, nvlink_domain=2)]}))
    return out


def test_graph_has_no_device_clique():
    cl = cluster_from_mapping({"name": "two", "node_groups": [h100(2, 1024)]})
    g = cl.graph()
    devices = [n for n in g.nodes if isinstance(n, int)]
    assert len(devices) == 2048
    assert not any(isinstance(u, int) and isinstance(v, int) for u, v in g.edges)  # was 2 x 523,776 edges
    assert g.number_of_edges() == 2048 + 2  # one NIC edge per device, one uplink per host
    assert g.nodes[("host", 1)]["intra_node_bandwidth_bytes_per_s"] == 450e9  # the fabric: the host's


@pytest.mark.parametrize("cluster", clusters(), ids=lambda c: c.name)
def test_same_host_answers_are_the_fabric_as_the_clique_gave(cluster):
    # what each device--device edge of the clique said: the group's fabric and the intra-node latency
    topo = Topology(cluster.graph())
    dev = 0
    for _, grp in cluster.nodes():
        for a, b in itertools.combinations(range(dev, dev + grp.gpus_per_node), 2):
            assert topo.p2p(a, b) == (grp.intra_node_bandwidth_bytes_per_s, cluster.intra_node_latency_s)
        dev += grp.gpus_per_node


@pytest.mark.parametrize("cluster", clusters(), ids=lambda c: c.name)
def test_topology_of_the_spec_is_the_graphs(cluster):
    a, b = vars(Topology(cluster.graph())), vars(Topology.of_cluster(cluster))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k], k
        assert type(a[k]) is type(b[k]), k
        if isinstance(a[k], (list, dict)):  # floats stay floats (a 1e12 read as an int prices the same, but)
            va, vb = (a[k], b[k]) if isinstance(a[k], list) else (list(a[k].values()), [b[k][x] for x in a[k]])
            assert [type(x) for x in va] == [type(x) for x in vb], k


def test_the_cost_model_builds_no_graph_and_no_clique_at_65536_devices():
    cl = cluster_from_mapping({"name": "max", "node_groups": [h100(64, 1024)]})
    assert cl.num_devices == 1 << 16 < MAX_DEVICES
    tracemalloc.start()
    try:
        topo = Topology.of_cluster(cl)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak:,} bytes"  # the graph with its cliques held 8.8 GB
    assert len(topo.host_of) == 1 << 16 and len(topo.host_nic_bw) == 64
    m = preset("llama-3-70b")
    ctx = System(m, cl)
    e = estimate(ParallelConfig(dp=1024, pp=8, tp=8, micro_batch_size=1, num_micro_batches=8), m, ctx=ctx)
    assert e.step_time_s > 0
    assert cl._graph_cache == {}  # System read the spec, not its networkx graph
    # 8,192 tp groups and 64 dp groups, alike on alike hosts: a few cache entries, not one per group
    assert len(ctx.topology._group_cache) <= 8


# -- clusters: the cost model's answers --------------------------------------------------------------

def test_group_links_shared_between_alike_groups_are_the_groups_own():
    """Groups alike on alike hosts share one cache entry (``Topology._group_key``); each answer
    is the one a fresh topology computes for that group alone."""
    rng = random.Random(3)
    for cluster in clusters():
        shared = Topology.of_cluster(cluster)
        n = shared.num_devices
        for _ in range(60):
            members = tuple(rng.sample(range(n), rng.randint(1, min(n, 12))))
            hosts = {shared.host_of[d] for d in members}
            active = {h: rng.randint(1, 16) for h in hosts if rng.random() < 0.5} or None
            assert shared.group_links(members, active) == Topology.of_cluster(cluster).group_links(members, active)


def test_measured_links_read_without_the_graph_are_the_overlays():
    profile = load_profile("examples/profiles/bench-h256-cpu2.json")
    cl = cluster_from_mapping({"name": "two", "node_groups": [{
        "count": 2, "device": "cpu", "gpus_per_node": 2, "intra_node_bandwidth": "9 GB/s", "memory": "4 GiB",
        "nics": {"count": 1, "bandwidth": "1 Gbit/s", "kind": "ethernet"}}]})
    via_graph = vars(Topology(overlay_measured_links(cl.graph(), profile)[0]))
    direct = vars(System(preset("tiny"), cl, profile).topology)
    assert via_graph["measured"] and direct["measured"] == via_graph["measured"]
    assert {k: v for k, v in direct.items() if k != "_group_cache"} == \
        {k: v for k, v in via_graph.items() if k != "_group_cache"}


def reference_groups(dp, pp, tp, order, axes, cp):
    """Ranks that differ only in ``axes``, found by decoding every rank's coordinates."""
    by_key: dict = {}
    for r in range(dp * pp * tp * cp):
        c = degrees.rank_coords(r, dp, pp, tp, order, cp)
        by_key.setdefault(tuple(c[a] for a in degrees.AXES if a not in axes), []).append(r)
    return sorted(tuple(g) for g in by_key.values())


def test_groups_by_arithmetic_are_the_coordinates_groups():
    for dp, pp, tp, cp in itertools.product((1, 2, 3), (1, 2, 4), (1, 2), (1, 3)):
        for order in ("tp-dp-pp", "tp-cp-dp-pp", "dp-tp-pp", "pp-dp-tp", "cp-pp-dp-tp"):
            for axis in degrees.AXES:
                assert degrees.axis_groups(dp, pp, tp, order, axis, cp) == \
                    reference_groups(dp, pp, tp, order, (axis,), cp)
            for axes in itertools.combinations(degrees.AXES, 2):
                assert degrees.merged_groups(dp, pp, tp, order, axes, cp) == \
                    reference_groups(dp, pp, tp, order, axes, cp)


def ring_profile(hosts: int, per_host: int):
    """A profile of hosts x per_host CPU ranks whose measured links form a ring, rank r to r + 1:
    4 GB/s inside a host, 1 GB/s + r across hosts, every host's interface at 0.5 GB/s (so each
    host's NIC, its ranks' fastest link off the host, is known)."""
    n = hosts * per_host
    ranks = tuple(RankInfo(rank=r, host=f"h{r // per_host}", local_rank=r % per_host, device_name="cpu",
                           device_kind="cpu", memory_bytes=4e9) for r in range(n))
    links = tuple(_link(r, (r + 1) % n, 4e9 if r // per_host == (r + 1) % n // per_host else 1e9 + r)
                  for r in range(n))
    p = make_profile(hosts=("h0",), per_host=1)
    nic = ({"name": "eth0", "speed_bytes_per_s": 0.5e9},)
    prov = dataclasses.replace(p.provenance, hosts=tuple(HostInfo(name=f"h{h}", interfaces=nic) for h in range(hosts)))
    return dataclasses.replace(p, ranks=ranks, links=links, provenance=prov)


def test_a_profile_of_16384_ranks_is_read_in_one_pass_over_its_links():
    """topology_graph scanned every link for every rank, and looked each end up by a scan of the
    ranks (Profile.rank): hours at 16,384 ranks. The bound is a generous safety net (it takes
    about a second); the figures are checked exactly."""
    hosts, per = 2048, 8
    p = ring_profile(hosts, per)
    t0 = time.perf_counter()
    g = topology_graph(p)
    assert time.perf_counter() - t0 < 60
    assert sum(isinstance(v, int) for v in g.nodes) == hosts * per
    for h in (1, 2, hosts - 1):  # its fastest link off the host: its last rank's, to the next host
        assert g.nodes[("host", h)]["nic_bandwidth_bytes_per_s"] == 1e9 + h * per + per - 1
        assert g.nodes[("host", h)]["intra_node_bandwidth_bytes_per_s"] == 4e9
    assert g.nodes[("host", 0)]["nic_bandwidth_bytes_per_s"] == 1e9 + hosts * per - 1  # the ring's closing link
    assert g.nodes[0]["node"] == 0 and g.nodes[hosts * per - 1]["node"] == hosts - 1
