"""A profile's measured links override a cluster file's declared ones (pairs it did not measure
keep the declared figures)."""

from autoconf.cost.estimate import estimate
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import cluster_from_mapping
from autoconf.specs.hf import load_model
from autoconf.specs.measured_graph import overlay_measured_links
from autoconf.specs.profile import load_profile
from autoconf.specs.topology import Topology

PROFILE = "examples/profiles/bench-h256-cpu2.json"


def two_hosts():
    return cluster_from_mapping({"name": "two", "node_groups": [{
        "count": 2, "device": "cpu", "gpus_per_node": 2, "intra_node_bandwidth": "9 GB/s", "memory": "4 GiB",
        "nics": {"count": 1, "bandwidth": "1 Gbit/s", "kind": "ethernet"}}],
        "latency": {"intra_node": "80 us", "inter_node": "200 us"}})


def test_measured_pairs_replace_declared_ones_and_only_those():
    profile = load_profile(PROFILE)
    measured = min(l.bandwidth_bytes_per_s for l in profile.links)
    g, n = overlay_measured_links(two_hosts().graph(), profile)
    topo = Topology(g)
    assert n == 1
    assert topo.p2p(0, 1)[0] == measured  # the profiled host's pair: measured (slower direction)
    assert topo.p2p(2, 3)[0] == 9e9  # the other host was not profiled: as declared
    assert topo.p2p(1, 2)[0] == 1e9 / 8  # between hosts: as declared
    assert Topology(two_hosts().graph()).p2p(0, 1)[0] == 9e9  # the cluster's own graph is untouched


def one_host(intra: str):
    return cluster_from_mapping({"name": "one", "node_groups": [{
        "count": 1, "device": "cpu", "gpus_per_node": 2, "intra_node_bandwidth": intra, "memory": "4 GiB",
        "nics": {"count": 1, "bandwidth": "1 Gbit/s", "kind": "loopback"}}],
        "latency": {"intra_node": "80 us", "inter_node": "200 us"}})


def test_estimate_with_cluster_and_profile_uses_the_measured_links():
    profile = load_profile(PROFILE)
    model = load_model("examples/models/bench-h256.yaml")
    c = ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4)
    fast, slow = one_host("4.5 GB/s"), one_host("45 MB/s")
    # declared alone, a 100x slower link shows in the data-parallel time
    assert estimate(c, model, slow).breakdown_s["dp_comm"] > 10 * estimate(c, model, fast).breakdown_s["dp_comm"]
    # with the profile, the measured pair replaces whatever the file declares
    assert estimate(c, model, slow, profile).step_time_s == estimate(c, model, fast, profile).step_time_s


def test_emit_from_a_profile_names_the_hosts_it_measured(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "plan"
    p = subprocess.run([sys.executable, "-m", "autoconf", "search", "--model", "examples/models/bench-h256.yaml",
                        "--profile", PROFILE, "--global-batch", "8", "--storage", "none", "--emit", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    script = (out / "node-0.sh").read_text()
    host = load_profile(PROFILE).ranks[0].host
    assert f"run on host {host}" in script and "torchrun" in script
    assert (out / "config.json").exists()


def test_search_with_cluster_and_profile_says_what_the_profile_replaced(tmp_path):
    import json
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "autoconf", "search", "--model", "examples/models/bench-h256.yaml",
                        "--cluster", "examples/clusters/localhost-cpu.yaml", "--profile", PROFILE, "--global-batch", "8",
                        "--storage", "none", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(p.stdout)
    assert any(n.startswith("links: 1 device pair(s) measured by the profile") for n in doc["notes"]), doc["notes"]
